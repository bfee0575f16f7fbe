"""The library's error classes.

Every malformed, truncated or corrupted input anywhere in kvcodec raises
CorruptStreamError; callers catch one class (or ValueError) and never see a crash,
a hang or silently wrong data.
"""


class CorruptStreamError(ValueError):
    """A stream, container or compressed tensor is malformed, truncated or corrupted."""
