"""The kvcodec container: one versioned, self-checking blob holding named arrays plus JSON metadata.

Every compressed object in kvcodec (a tensor, a KV block, a file's tensor record) is a container,
so there is exactly one parser to harden. It is safe on untrusted input: no pickle, no eval, a
bounded JSON header holding only JSON types, dtype names from an allow-list, every shape checked
against its section size, a crc32 per section and one over the header, and no allocation larger
than the blob itself implies. Every failure raises :class:`kvcodec.CorruptStreamError`.

Byte layout (all integers little-endian; documented in ``docs/format.md``, "Container")::

    offset  size  field
    0       4     magic  b"KVCC"
    4       2     version (u16, currently 1)
    6       2     flags (u16, must be 0)
    8       4     header_len (u32, <= MAX_HEADER_BYTES)
    12      4     header_crc (u32) = crc32(bytes 0..11 + header)
    16      H     header: UTF-8 JSON object {"kind", "meta", "sections"}
    ...           zero padding to the next multiple of ALIGN (64)
    ...           sections, each starting at a multiple of ALIGN, zero padding between them;
                  the blob ends exactly at the end of the last section (plus no padding)

Each entry of ``sections`` is ``{"name", "type", "dtype", "shape", "offset", "nbytes", "crc32"}``
with ``offset`` relative to the start of the blob; ``type`` is ``"bytes"``, ``"numpy"`` or
``"torch"`` and says what :func:`loads` returns for it.
"""

from __future__ import annotations

import gc
import json
import math
import struct
from typing import Any, Mapping

import numpy as np

from kvcodec import magics, validate
from kvcodec.checksum import crc32
from kvcodec.errors import CorruptStreamError

MAGIC = magics.CONTAINER
VERSION = 1
ALIGN = 64
PREFIX = struct.Struct("<4sHHII")
MAX_HEADER_BYTES = 16 << 20
MAX_SECTIONS = 1 << 16
MAX_NAME_CHARS = 256
MAX_NDIM = 16
#: JSON keys in a header (counted as ":" bytes): every section's 7 fields, and as many meta keys again
MAX_HEADER_KEYS = 8 * MAX_SECTIONS
#: JSON objects, arrays and items in a header (counted as "{", "[" and "," bytes): sections with
#: 16-dim shapes, and a meta of the same size
MAX_HEADER_NODES = 32 * MAX_SECTIONS

_NUMPY_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)
_TORCH_DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)


def _torch():
    import torch

    return torch


_torch_dtype_cache: dict[str, Any] | None = None


def torch_dtypes() -> dict[str, Any]:
    """Allow-listed torch dtypes by name (those this torch build has)."""
    global _torch_dtype_cache
    if _torch_dtype_cache is None:
        torch = _torch()
        _torch_dtype_cache = {
            n: getattr(torch, n) for n in _TORCH_DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
        }
    return _torch_dtype_cache


def torch_dtype_name(dtype) -> str:
    """The allow-list name of a torch dtype ('bfloat16', 'float8_e4m3fn', ...); ValueError if not allowed."""
    name = str(dtype).removeprefix("torch.")
    if name not in torch_dtypes():
        raise ValueError(f"torch dtype {dtype} is not supported by the kvcodec container")
    return name


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _section_payload(name: str, value) -> tuple[dict, memoryview]:
    """Describe one value and return its raw little-endian bytes (no copy where possible)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value)
        if not mv.c_contiguous:
            raise ValueError(f"section {name!r}: memoryview must be contiguous")
        mv = mv.cast("B")
        return {"type": "bytes", "dtype": "uint8", "shape": [mv.nbytes]}, mv
    if isinstance(value, np.ndarray):
        dt = value.dtype
        if dt.name not in _NUMPY_DTYPES:
            raise ValueError(f"section {name!r}: numpy dtype {dt} is not supported by the container")
        arr = np.ascontiguousarray(value, dtype=dt.newbyteorder("<"))
        return {"type": "numpy", "dtype": dt.name, "shape": list(arr.shape)}, memoryview(arr.reshape(-1).view(np.uint8))
    torch = _torch()
    if isinstance(value, torch.Tensor):
        dname = torch_dtype_name(value.dtype)
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        shape = list(t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return {"type": "torch", "dtype": dname, "shape": shape}, memoryview(raw)
    raise ValueError(f"section {name!r}: unsupported value type {type(value).__name__}")


def dumps(kind: str, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> bytes:
    """Serialize ``tensors`` (name -> torch.Tensor | np.ndarray | bytes) and JSON ``meta`` under ``kind``.

    Raises ValueError for arguments that cannot be stored (non-JSON meta, NaN in meta, unsupported
    dtype, bad names). Big-endian numpy arrays are stored little-endian.
    """
    if not isinstance(kind, str) or not kind or len(kind) > MAX_NAME_CHARS:
        raise ValueError("kind must be a non-empty string of at most 256 characters")
    if not isinstance(meta, Mapping):
        raise ValueError("meta must be a dict")
    if len(tensors) > MAX_SECTIONS:
        raise ValueError(f"at most {MAX_SECTIONS} sections per container")
    entries, payloads = [], []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"section name {name!r} must be a non-empty string of at most 256 characters")
        desc, payload = _section_payload(name, value)
        if len(desc["shape"]) > MAX_NDIM:
            raise ValueError(f"section {name!r}: at most {MAX_NDIM} dimensions")
        desc = {"name": name, **desc, "nbytes": payload.nbytes, "crc32": crc32(payload)}
        entries.append(desc)
        payloads.append(payload)

    head = header_bytes(kind, meta, entries)
    total = entries[-1]["offset"] + entries[-1]["nbytes"] if entries else len(head)
    out = bytearray(total)
    out[: len(head)] = head
    for desc, payload in zip(entries, payloads):
        out[desc["offset"] : desc["offset"] + desc["nbytes"]] = payload
    return bytes(out)


def header_bytes(kind: str, meta: Mapping[str, Any], entries: list[dict]) -> bytes:
    """The prefix and JSON header of a container whose sections are described by ``entries``
    (dicts with name, type, dtype, shape, nbytes, crc32, in storage order); sets each entry's
    ``"offset"``. Shared by :func:`dumps` and writers that place the payloads themselves (the GPU
    encoder in ``kvcodec.lossless.device_container``)."""
    def dumps_json(v) -> str:
        try:
            return json.dumps(v, allow_nan=False, separators=(",", ":"), ensure_ascii=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta is not plain JSON (dict/list/str/int/finite float/bool/None): {exc}") from None

    # the JSON of {"kind", "meta", "sections"}, with kind and meta (often long) serialized once
    head = '{"kind":' + dumps_json(kind) + ',"meta":' + dumps_json(meta) + ',"sections":'
    # Offsets depend on the header length, which depends on the offsets' digits: iterate to a fixpoint.
    header = b""
    for _ in range(8):
        pos = _align(PREFIX.size + len(header))
        for desc in entries:
            desc["offset"] = pos
            pos = _align(pos + desc["nbytes"])
        new_header = (head + dumps_json(entries) + "}").encode("ascii")
        if len(new_header) == len(header):
            break
        header = new_header
    header = new_header
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError("container header too large")
    too_many = _header_counts_error(header)
    if too_many is not None:
        raise ValueError(f"container header too large: {too_many}")
    prefix = PREFIX.pack(MAGIC, VERSION, 0, len(header), 0)
    hcrc = crc32(header, crc32(prefix[:12]))
    return PREFIX.pack(MAGIC, VERSION, 0, len(header), hcrc) + header


def _reject_constant(name: str):
    raise CorruptStreamError(f"container header contains non-JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf; dumps never writes it (allow_nan=False)
        raise CorruptStreamError(f"container header holds a non-finite number {text[:40]}")
    return value


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise CorruptStreamError(f"container header has duplicate key {k!r}")
            seen.add(k)
    return d


def _header_counts_error(raw: bytes) -> str | None:
    """Why a JSON header holds too many keys or nodes to parse (:data:`MAX_HEADER_KEYS`,
    :data:`MAX_HEADER_NODES`), else None. Counts bytes (also inside strings: an upper bound), in C:
    a few ms for the largest header, before the parser builds one Python object (a 15.7 MB header
    of 1.3 M keys took seconds and hundreds of MB to parse)."""
    keys = raw.count(b":")
    if keys > MAX_HEADER_KEYS:
        return f"{keys} keys (at most {MAX_HEADER_KEYS})"
    nodes = raw.count(b",") + raw.count(b"{") + raw.count(b"[")
    if nodes > MAX_HEADER_NODES:
        return f"{nodes} JSON nodes (at most {MAX_HEADER_NODES})"
    return None


def _as_bytes_view(blob) -> memoryview:
    try:
        mv = memoryview(blob)
    except TypeError:
        raise CorruptStreamError(f"expected a bytes-like container, got {type(blob).__name__}") from None
    if not mv.c_contiguous:
        raise CorruptStreamError("container buffer is not contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def read_header(blob) -> tuple[dict, memoryview]:
    """Parse and verify the prefix and JSON header; return (header dict, byte view of the blob)."""
    mv = _as_bytes_view(blob)
    n = mv.nbytes
    if n < PREFIX.size:
        raise CorruptStreamError(f"container truncated: {n} bytes, need at least {PREFIX.size}")
    magic, version, flags, hlen, hcrc = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptStreamError(f"not a kvcodec container (magic {bytes(magic)!r})")
    if version != VERSION:
        raise CorruptStreamError(f"unsupported container version {version} (this build reads {VERSION})")
    if flags != 0:
        raise CorruptStreamError(f"unknown container flags {flags:#x}")
    if hlen > MAX_HEADER_BYTES or PREFIX.size + hlen > n:
        raise CorruptStreamError("container truncated or header length corrupt")
    raw_header = mv[PREFIX.size : PREFIX.size + hlen]
    if crc32(raw_header, crc32(mv[:12])) != hcrc:
        raise CorruptStreamError("container header checksum mismatch")
    raw_header = bytes(raw_header)
    too_many = _header_counts_error(raw_header)
    if too_many is not None:
        raise CorruptStreamError(f"container header holds {too_many}")
    # no garbage collection while the parser builds up to MAX_HEADER_NODES containers: collections in
    # between rescan them (a header of 1 M empty lists: 0.44 s to parse with them, 0.12 s without)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        header = json.loads(
            raw_header.decode("utf-8"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_no_duplicates,
        )
    except CorruptStreamError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptStreamError(f"container header is not valid JSON: {exc}") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    if not isinstance(header, dict) or set(header) != {"kind", "meta", "sections"}:
        raise CorruptStreamError("container header must be an object with kind, meta, sections")
    if not isinstance(header["kind"], str) or not isinstance(header["meta"], dict):
        raise CorruptStreamError("container kind must be a string and meta an object")
    if not isinstance(header["sections"], list) or len(header["sections"]) > MAX_SECTIONS:
        raise CorruptStreamError("container sections must be a list")
    return header, mv


def _check_section(desc, pos: int, n: int) -> tuple[str, str, str, tuple[int, ...], int, int, int]:
    if not isinstance(desc, dict) or set(desc) != {"name", "type", "dtype", "shape", "offset", "nbytes", "crc32"}:
        raise CorruptStreamError("malformed section descriptor")
    name, typ, dtype, shape = desc["name"], desc["type"], desc["dtype"], desc["shape"]
    offset, nbytes, crc = desc["offset"], desc["nbytes"], desc["crc32"]
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise CorruptStreamError("bad section name")
    for v in (offset, nbytes):
        if type(v) is not int or v < 0:
            raise CorruptStreamError(f"section {name!r}: offset/nbytes must be non-negative integers")
    validate.require_int(crc, 0, 0xFFFFFFFF, f"section {name!r}: crc32")
    if type(shape) is not list:
        raise CorruptStreamError(f"section {name!r}: bad shape")
    if typ == "bytes":
        if dtype != "uint8" or len(shape) != 1:
            raise CorruptStreamError(f"section {name!r}: bytes section must be 1-d uint8")
        itemsize = 1
    elif typ == "numpy":
        if dtype not in _NUMPY_DTYPES:
            raise CorruptStreamError(f"section {name!r}: dtype {dtype!r} not allowed")
        itemsize = np.dtype(dtype).itemsize
    elif typ == "torch":
        tdt = torch_dtypes().get(dtype) if isinstance(dtype, str) else None
        if tdt is None:
            raise CorruptStreamError(f"section {name!r}: torch dtype {dtype!r} not allowed")
        itemsize = tdt.itemsize
    else:
        raise CorruptStreamError(f"section {name!r}: unknown type {typ!r}")
    shape = validate.check_shape(shape, f"section {name!r}", itemsize, MAX_NDIM)
    if validate.numel(shape) * itemsize != nbytes:
        raise CorruptStreamError(f"section {name!r}: shape {shape} does not match {nbytes} bytes")
    if offset != _align(pos) or offset + nbytes > n:
        raise CorruptStreamError(f"section {name!r}: offset/size out of bounds (container truncated?)")
    return name, typ, dtype, shape, offset, nbytes, crc


def loads(blob, expect_kind: str | None = None) -> tuple[str, dict, dict[str, Any]]:
    """Parse a container; return ``(kind, meta, tensors)``.

    ``bytes`` sections come back as ``memoryview`` slices of ``blob`` (no copy), ``numpy`` sections as
    read-only arrays viewing ``blob`` when it is immutable, ``torch`` sections as new tensors.
    Raises CorruptStreamError on any malformed, truncated or corrupted input, or when
    ``expect_kind`` is given and differs.
    """
    header, mv = read_header(blob)
    n = mv.nbytes
    kind = header["kind"]
    if expect_kind is not None and kind != expect_kind:
        raise CorruptStreamError(f"expected a {expect_kind!r} container, got {kind!r}")
    pos = PREFIX.size + PREFIX.unpack_from(mv, 0)[3]
    tensors: dict[str, Any] = {}
    for desc in header["sections"]:
        name, typ, dtype, shape, offset, nbytes, crc = _check_section(desc, pos, n)
        if name in tensors:
            raise CorruptStreamError(f"duplicate section name {name!r}")
        if any(mv[pos:offset]):
            raise CorruptStreamError("nonzero padding in container")
        payload = mv[offset : offset + nbytes]
        if crc32(payload) != crc:
            raise CorruptStreamError(f"section {name!r}: checksum mismatch")
        tensors[name] = _materialize(typ, dtype, shape, payload)
        pos = offset + nbytes
    if pos != n:
        raise CorruptStreamError(f"container has {n - pos} trailing bytes")
    return kind, header["meta"], tensors


def _materialize(typ: str, dtype: str, shape: tuple[int, ...], payload: memoryview):
    if dtype == "bool" and payload.nbytes and np.frombuffer(payload, np.uint8).max() > 1:
        raise CorruptStreamError("bool section holds bytes other than 0 and 1")
    if typ == "bytes":
        return payload
    if typ == "numpy":
        return np.frombuffer(payload, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    torch = _torch()
    tdt = torch_dtypes()[dtype]
    if payload.nbytes == 0:
        return torch.empty(shape, dtype=tdt)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(tdt).reshape(shape)
