"""Give numba a writable cache folder when the installed package is read-only.

``@njit(cache=True)`` raises "cannot cache function ...: no locator available" at import when
neither the package's ``__pycache__`` nor ``~/.cache`` is writable (a system-wide install used by
another user, a read-only container image). Unless ``NUMBA_CACHE_DIR`` is set, a read-only package
gets ``$XDG_CACHE_HOME/kvcodec/numba`` (default ``~/.cache/kvcodec/numba``) or, when that cannot
be created, a private folder in the temporary directory. Never raises: the worst case is numba's
own behaviour.

:func:`stable_closure_cache` makes a kernel built by a factory, whose closure holds another jitted
function, find its disk cache in a new process: numba keys a cached closure on the pickle of its
cells, and a dispatcher's pickle carries a random per-process id, so such a kernel missed the cache
and wrote one more cache file in every process.

:func:`lock_saves` serialises numba's cache writes between processes. Numba saves an entry by reading
the function's index, picking the first free data-file number and writing the index, then the data
file; two processes saving different signatures of one function at the same moment can both pick
number 1, and the index can end up naming one signature's data file for the other's. A later process
then loads the wrong machine code: a kernel compiled for float64 arrays ran on int64 ones and returned
3e-323 for 6 (tests/test_numba_cache_lock.py forces that interleaving). Several processes starting
on a fresh cache (a server's workers, a server and the CLI) are the case.
"""

from __future__ import annotations

import hashlib
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


def _cell_key(value) -> bytes:
    """Bytes that describe a closure cell the same way in every process: a jitted function by its
    module, name, bytecode and (recursively) its own cells; anything else by numba's pickle."""
    from numba.core.dispatcher import Dispatcher
    from numba.core.serialize import dumps

    if isinstance(value, Dispatcher):
        fn = value.py_func
        cells = tuple(_cell_key(c.cell_contents) for c in fn.__closure__ or ())
        return repr((fn.__module__, fn.__qualname__, fn.__code__.co_code, cells)).encode()
    return dumps(value)


def stable_closure_cache(dispatcher):
    """Give ``dispatcher`` (``@njit(cache=True)``, not compiled yet) a disk cache whose index key
    describes closure cells that are jitted functions by their code (:func:`_cell_key`) rather than
    by numba's pickle of them, which differs in every process. Returns ``dispatcher``. Numba keeps
    invalidating the cache when the source file changes (its index stores the file's stamp)."""
    try:
        from numba.core.caching import FunctionCache

        class _StableClosureCache(FunctionCache):
            def _index_key(self, sig, codegen):
                cells = tuple(_cell_key(c.cell_contents) for c in self._py_func.__closure__ or ())
                digest = hashlib.sha256(repr(cells).encode()).hexdigest()
                return (sig, codegen.magic_tuple(), (hashlib.sha256(self._py_func.__code__.co_code).hexdigest(),
                                                     digest))

        if getattr(dispatcher, "_cache", None) is not None and type(dispatcher._cache) is FunctionCache:
            dispatcher._cache = _StableClosureCache(dispatcher.py_func)
    except Exception:  # numba's internals moved: its own (per-process) cache key, still correct
        pass
    return dispatcher


def lock_saves() -> bool:
    """Make numba's cache ``save`` (every function's, in this process) hold an exclusive ``flock`` on
    ``<index file>.lock`` while it reads the index, picks a data file and writes both, so concurrent
    processes each see the others' entries (module doc). Loads need no lock: the index and data files
    are replaced whole. Returns whether saves are locked (False where ``fcntl`` or numba's cache class
    is missing: numba's own behaviour)."""
    try:
        import fcntl

        from numba.core.caching import IndexDataCacheFile
    except ImportError:
        return False
    save = IndexDataCacheFile.save
    if getattr(save, "kvcodec_locked", False):
        return True

    def locked_save(self, key, data):
        try:
            fd = os.open(self._index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # numba's own save raises or warns as it would
            return save(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)  # releases the lock

    locked_save.kvcodec_locked = True
    IndexDataCacheFile.save = locked_save
    return True
