"""The library's error classes.

Every malformed, truncated or corrupted input anywhere in kvcodec raises
CorruptStreamError; callers catch one class (or ValueError) and never see a crash,
a hang or silently wrong data.
"""


class CorruptStreamError(ValueError):
    """A stream, container or compressed tensor is malformed, truncated or corrupted."""


class WriteRefusedError(OSError):
    """A write was refused before any byte reached the target (``kvcodec.safe_write`` rules): the
    target is an input file, a symbolic link, a file with other hard links, a folder, in a missing
    folder, or an existing file without ``overwrite=True``. ``filename`` is the target; ``reason``
    one of "input", "symlink", "hardlink", "folder", "no-folder", "exists"."""

    def __init__(self, message: str, path=None, reason: str = ""):
        super().__init__(message)
        self.filename = None if path is None else str(path)
        self.reason = reason

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return type(self), (self.args[0], self.filename, self.reason)


class PlanBuiltInCaptureError(RuntimeError):
    """A kernel launch plan would have been built inside a CUDA graph capture, where its device tensors
    would outlive the graph (``kvcodec.device.plans``): run the step once outside the capture first."""
