"""Write a file so that its path holds the old bytes or all of the new ones, never a part.

:func:`atomic_write` yields a binary file open on a temporary beside the target
(``.<name>.kvcodec-tmp.<host>.<pid>.<random>``: same folder, so same filesystem, and a name that says
whose it is). When the block ends without error the data is flushed and fsync'ed, the temporary is
renamed onto the target (``os.replace``; with ``overwrite=False`` ``os.link``, which fails rather than
replace a file that appeared meanwhile) and the folder is fsync'ed: success is reported only for
bytes and a name that are on disk. On any error (a full disk, Ctrl-C, a failing encoder) the
temporary is removed and the target is untouched. A writer killed before it could clean up
(``kill -9``, power loss) leaves its temporary behind; every write removes the temporaries in its
folder whose writer (a pid on this host) no longer runs.

Refusals raise :class:`kvcodec.errors.WriteRefusedError` before anything is written, and again just
before the rename: the target is one of ``inputs`` (the same inode: writing it would destroy what is
being read), a symbolic link (the rename would replace the link, not write the file it names), a
file with other hard links (they would keep the old bytes), a folder, in a folder that does not
exist, or an existing file without ``overwrite=True``. Only the last component is checked for a
link: a symlinked folder above it is an ordinary path.

Concurrent writers to one path each write their own temporary; with ``overwrite=True`` the last
rename wins with a whole file, with ``overwrite=False`` the first wins and the others are refused.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import secrets
import socket
import stat
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from kvcodec.errors import WriteRefusedError

TAG = ".kvcodec-tmp."
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TEMP_NAME = re.compile(r"\..+\.kvcodec-tmp\.([0-9a-f]{8})\.([0-9]+)\.[0-9a-f]{8}")
# a folder that cannot be fsync'ed (some network and FUSE filesystems) says so with these
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}
# a filesystem without hard links says so with these; the rename then goes through os.replace
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EXDEV, errno.ENOSYS,
            getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}


def temporary_path(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``path`` that :func:`remove_stale_temporaries` recognises."""
    path = Path(path)
    return path.with_name(f".{path.name}{TAG}{_HOST}.{os.getpid()}.{secrets.token_hex(4)}")


def _writer_gone(name: str) -> bool:
    """True when ``name`` is a temporary of this host whose writer process has exited."""
    m = _TEMP_NAME.fullmatch(name)
    if m is None or m.group(1) != _HOST or os.name != "posix":
        return False  # another host's writer may still run; on Windows os.kill(pid, 0) would kill it
    pid = int(m.group(2))
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporaries in ``folder`` left by writers that no longer run; return their paths.
    Best effort: a file that cannot be listed or removed is left as it is."""
    removed = []
    try:
        entries = os.scandir(folder)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            if TAG not in entry.name or not _writer_gone(entry.name):
                continue
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def check_target(path: str | os.PathLike, *, overwrite: bool = False,
                 inputs: Iterable[str | os.PathLike] = ()) -> os.stat_result | None:
    """Raise WriteRefusedError if writing ``path`` breaks a rule of this module; return the
    existing file's stat (None when there is none)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is None:
        if not path.parent.is_dir():
            raise WriteRefusedError(f"cannot write {path}: folder {path.parent} does not exist", path, "no-folder")
        return None
    for src in inputs:  # a symlink or hard link to an input is refused as the input
        if _same_file(path, src):
            raise WriteRefusedError(f"refusing to write {path}: it is the input file {src}; "
                                    "choose another output name", path, "input")
    if stat.S_ISLNK(st.st_mode):
        raise WriteRefusedError(f"refusing to write {path}: it is a symbolic link (the write would replace "
                                "the link, not the file it names); write to the file's own path", path, "symlink")
    if stat.S_ISDIR(st.st_mode):
        raise WriteRefusedError(f"cannot write {path}: it is a folder", path, "folder")
    if st.st_nlink > 1:
        raise WriteRefusedError(f"refusing to write {path}: it has {st.st_nlink} hard links and the others "
                                "would keep the old bytes; remove them first", path, "hardlink")
    if not overwrite:
        raise WriteRefusedError(f"{path} already exists; pass overwrite=True to replace it", path, "exists")
    return st


def _same_file(a, b) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:  # a dangling link or an unreadable input is no input's inode
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _named(exc: OSError, path: Path) -> OSError:
    """The same error naming the user's path, not the temporary."""
    if exc.errno is None or isinstance(exc, WriteRefusedError):
        return exc
    return type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))


class _Output(io.BufferedWriter):
    """The temporary's file object; its I/O errors name the target."""

    def __init__(self, fd: int, target: Path):
        super().__init__(io.FileIO(fd, "wb", closefd=True), buffer_size=1 << 20)
        self.target = target

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            raise _named(exc, self.target) from None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            raise _named(exc, self.target) from None


def _fsync_folder(folder: Path) -> None:
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except PermissionError:  # a write-only folder cannot be opened to fsync; the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename ``tmp`` onto ``path``; without ``overwrite`` never replace a file that exists by now."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # atomic: EEXIST if a file appeared since the check
    except FileExistsError:
        raise WriteRefusedError(f"{path} already exists; pass overwrite=True to replace it", path, "exists") from None
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        check_target(path, overwrite=False)
        os.replace(tmp, path)
        return
    os.unlink(tmp)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, overwrite: bool = False,
                 inputs: Iterable[str | os.PathLike] = ()) -> Iterator[BinaryIO]:
    """Yield a binary file whose bytes appear at ``path`` whole when the block succeeds, never in
    part. ``inputs``: files being read to produce the output, which ``path`` must not be.
    Refusals raise WriteRefusedError; I/O errors are re-raised naming ``path``."""
    path, inputs = Path(path), tuple(inputs)
    st = check_target(path, overwrite=overwrite, inputs=inputs)
    remove_stale_temporaries(path.parent)
    tmp = temporary_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(tmp, flags, 0o666)  # the umask applies, as for any new file
    except OSError as exc:
        raise _named(exc, path) from None
    out = None
    try:
        if st is not None and hasattr(os, "fchmod"):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)  # a replaced file keeps its permissions
        out = _Output(fd, path)
        yield out
        try:
            out.flush()
            os.fsync(out.fileno())
            out.close()
        except OSError as exc:
            raise _named(exc, path) from None
        check_target(path, overwrite=overwrite, inputs=inputs)
        try:
            _publish(tmp, path, overwrite)
            _fsync_folder(path.parent)
        except WriteRefusedError:
            raise
        except OSError as exc:
            raise _named(exc, path) from None
    finally:
        if out is None:
            with contextlib.suppress(OSError):
                os.close(fd)
        elif not out.closed:
            with contextlib.suppress(OSError, ValueError):
                out.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_bytes(path: str | os.PathLike, data, *, overwrite: bool = False,
                inputs: Iterable[str | os.PathLike] = ()) -> int:
    """Write ``data`` to ``path`` through :func:`atomic_write`; returns the bytes written."""
    with atomic_write(path, overwrite=overwrite, inputs=inputs) as out:
        out.write(data)
    return memoryview(data).nbytes
