"""Checks every decoder runs on untrusted metadata before it allocates or loops.

A checksum is not a signature: anyone can craft a stream whose checksums are right and whose
header asks for 2^40 elements, a list where a number belongs, or a dtype the writer never uses.
These helpers turn every such field into :class:`kvcodec.CorruptStreamError` (never OverflowError,
TypeError, MemoryError or a torch RuntimeError) and enforce the output cap, so each decoder
states its limits in a few lines. A leaf module: it imports nothing from kvcodec but the errors.

``max_output_bytes`` (every public decode entry point takes it): the most bytes one call may
produce, default :data:`DEFAULT_MAX_OUTPUT_BYTES`; callers that trust their input and need more
raise it explicitly (the CLI: ``--max-output``), ``None`` removes the cap.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kvcodec.errors import CorruptStreamError

#: Default output cap of every decode entry point: 4 GiB. Raise it explicitly for bigger outputs.
DEFAULT_MAX_OUTPUT_BYTES = 4 << 30

#: numpy's and torch's own limit: a shape whose element count (zero dimensions counted as 1, which
#: is how strides are computed) times the item size reaches 2^63 cannot exist in memory.
MAX_ADDRESSABLE = (1 << 63) - 1


def resolve_max_output(max_output_bytes: int | None) -> int | None:
    """The cap to enforce (``None``: none); a bad argument raises ValueError (a caller bug)."""
    if max_output_bytes is None:
        return None
    if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes < 0:
        raise ValueError(f"max_output_bytes must be a non-negative integer or None, got {max_output_bytes!r}")
    return max_output_bytes


def check_output(nbytes: int, max_output_bytes: int | None, what: str = "output") -> int:
    """Raise CorruptStreamError if ``nbytes`` (what the input declares) exceeds the cap (``None``:
    no cap); return nbytes."""
    cap = resolve_max_output(max_output_bytes)
    if cap is not None and nbytes > cap:
        raise CorruptStreamError(
            f"{what} declares {nbytes} bytes, over max_output_bytes={cap} "
            "(raise max_output_bytes / --max-output if you trust this input)")
    return nbytes


_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """A byte count such as ``4096``, ``512M``, ``8G`` or ``1T`` (binary units; a trailing ``B``/``iB``
    is allowed): the CLI's ``--max-output``. ValueError for anything else."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SIZE_SUFFIXES else ""
    number = t[: len(t) - len(unit)]
    if not number.isdigit():
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512M, 8G)")
    return int(number) * _SIZE_SUFFIXES[unit]


def is_int(x: Any) -> bool:
    """A JSON integer (Python int, not bool)."""
    return type(x) is int


def require_int(x: Any, lo: int, hi: int, what: str) -> int:
    """An int (not bool, float or str) in [lo, hi], else CorruptStreamError."""
    if type(x) is not int or not lo <= x <= hi:
        raise CorruptStreamError(f"{what} must be an integer in {lo}..{hi}, got {_short(x)}")
    return x


def require_type(x: Any, types, what: str):
    """x of exactly one of ``types`` (bool is not an int here), else CorruptStreamError."""
    types = types if isinstance(types, tuple) else (types,)
    if type(x) not in types:
        raise CorruptStreamError(f"{what} must be {'/'.join(t.__name__ for t in types)}, got {type(x).__name__}")
    return x


def require_keys(d: Any, keys: Iterable[str], what: str, optional: Iterable[str] = ()) -> dict:
    """A dict holding every key of ``keys``, and otherwise only keys of ``optional``."""
    keys, optional = set(keys), set(optional)
    if type(d) is not dict:
        raise CorruptStreamError(f"{what} must be an object, got {type(d).__name__}")
    have = set(d)
    if not keys <= have or not have <= keys | optional:
        raise CorruptStreamError(f"{what} has keys {sorted(map(str, have))[:12]}, expected {sorted(keys | optional)}")
    return d


def lookup(name: Any, allowed: Mapping[str, Any], what: str):
    """``allowed[name]`` for a string name on the allow-list, else CorruptStreamError (never KeyError/TypeError)."""
    if type(name) is not str or name not in allowed:
        raise CorruptStreamError(f"{what} {_short(name)} is not one of {sorted(allowed)[:24]}")
    return allowed[name]


def check_shape(shape: Any, what: str, itemsize: int = 1, max_ndim: int = 16) -> tuple[int, ...]:
    """A list of non-negative ints that can exist in memory; returns it as a tuple.

    The product is computed in Python integers (no overflow) with zero dimensions counted as 1,
    the way numpy and torch compute strides, so ``[0, 2**62, 4]`` is refused here instead of
    raising "Stride calculation overflowed" (torch) or "array is too big" (numpy) later.
    """
    if type(shape) not in (list, tuple) or len(shape) > max_ndim:
        raise CorruptStreamError(f"{what}: shape must be a list of at most {max_ndim} integers")
    span = itemsize
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptStreamError(f"{what}: shape {_short(shape)} has a non-integer or negative dimension")
        span *= max(d, 1)
        if span > MAX_ADDRESSABLE:
            raise CorruptStreamError(f"{what}: shape {_short(shape)} is too large to exist in memory")
    return tuple(shape)


def numel(shape: Iterable[int]) -> int:
    """Element count of an already checked shape (Python integers: no overflow)."""
    n = 1
    for d in shape:
        n *= d
    return n


def checked_nbytes(shape: Any, itemsize: int, what: str,
                   max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> int:
    """Bytes of a tensor of ``shape`` after :func:`check_shape`, checked against the output cap."""
    shape = check_shape(shape, what, itemsize)
    return check_output(numel(shape) * itemsize, max_output_bytes, what)


def read_exact(f, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes from a binary file (``n`` already checked against the file size)."""
    data = f.read(n)
    if len(data) != n:
        raise CorruptStreamError(f"{what}: file truncated ({len(data)} of {n} bytes)")
    return data


def zstd_decompress(data, max_output_bytes: int, what: str) -> bytes:
    """One zstd frame, decompressed without trusting its declared content size.

    python-zstandard's one-shot ``decompress`` allocates whatever size the frame header declares
    (2^40 -> MemoryError); here a declared size over the cap is refused first, then the frame is
    fed to a streaming decoder 256 bytes at a time (at most a few MiB of output each), stopping
    once the output passes the cap. Exactly one frame, no trailing bytes, and the declared size
    (when present) must match the output.
    """
    import zstandard

    data = bytes(data)
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as exc:
        raise CorruptStreamError(f"{what}: not a zstd frame ({exc})") from None
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > max_output_bytes:
        raise CorruptStreamError(f"{what}: zstd frame declares {declared} bytes, over the limit of {max_output_bytes}")
    dec = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    pos = 0
    try:
        while pos < len(data) and not dec.eof:
            out += dec.decompress(data[pos : pos + 256])
            pos += 256
            if len(out) > max_output_bytes:
                raise CorruptStreamError(f"{what}: zstd frame decodes past the limit of {max_output_bytes} bytes")
    except zstandard.ZstdError as exc:
        raise CorruptStreamError(f"{what}: corrupt zstd frame ({exc})") from None
    if not dec.eof:
        raise CorruptStreamError(f"{what}: zstd frame is truncated")
    if dec.unused_data or pos < len(data):
        raise CorruptStreamError(f"{what}: bytes after the zstd frame")
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != len(out):
        raise CorruptStreamError(f"{what}: zstd frame declares {declared} bytes but holds {len(out)}")
    return bytes(out)


def _short(x: Any, limit: int = 80) -> str:
    """repr(x) cut to ``limit`` characters (a hostile field can be megabytes long)."""
    try:
        r = repr(x)
    except ValueError:  # an int over Python's 4300-digit str limit
        r = f"<{type(x).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."
