"""Give numba a writable cache folder when the installed package is read-only.

``@njit(cache=True)`` raises "cannot cache function ...: no locator available" at import when
neither the package's ``__pycache__`` nor ``~/.cache`` is writable (a system-wide install used by
another user, a read-only container image). Unless ``NUMBA_CACHE_DIR`` is set, a read-only package
gets ``$XDG_CACHE_HOME/kvcodec/numba`` (default ``~/.cache/kvcodec/numba``) or, when that cannot
be created, a private folder in the temporary directory. Never raises: the worst case is numba's
own behaviour.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _writable_folder(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _private_temp_folder() -> Path:
    """``<tmp>/kvcodec-numba-<uid>``, only if it is ours and closed to others (the cache holds
    pickled code another user could otherwise plant); else a fresh folder."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(tempfile.gettempdir()) / f"kvcodec-numba-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022 and os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="kvcodec-numba-"))


def user_cache_dir() -> Path:
    """The per-user folder numba's cache goes to when the package folder is read-only."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "kvcodec" / "numba"
    return folder if os.path.isabs(base) and _writable_folder(folder) else _private_temp_folder()


def configure() -> str | None:
    """Set NUMBA_CACHE_DIR if needed (see module doc); return the folder chosen, or None."""
    try:
        if os.environ.get("NUMBA_CACHE_DIR") or os.access(PACKAGE_DIR, os.W_OK):
            return None
        folder = str(user_cache_dir())
        os.environ["NUMBA_CACHE_DIR"] = folder
        config = sys.modules.get("numba.core.config")  # numba imported first: it read the environment already
        if config is not None:
            config.CACHE_DIR = folder
        return folder
    except Exception:  # never fail the import over a cache folder
        return None
