"""safetensors <-> ``.kvc`` files: lossless, streaming, every tensor individually addressable.

``compress_file(src, dst)`` reads a ``.safetensors`` file one tensor at a time, compresses each with
:func:`kvcodec.lossless.api.compress` and writes a ``.kvc`` file; ``decompress_file(dst, out)``
restores the SAME bytes (header, metadata, tensor order, padding and all). ``read_tensor(path,
name)`` decodes one tensor without touching the others; ``inspect_file`` lists per-tensor ratios.
Memory stays near one tensor (plus its compressed copy) in both directions.

Reading is safe on untrusted files: the footer, index and every entry are checked against the
file's real size before anything is read or allocated, the index's zstd section is decoded with
a bounded streaming decoder, and ``max_output_bytes`` (default
``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES``, 4 GiB) caps what one call produces: the restored
file for :func:`decompress_file`, one tensor for :func:`read_tensor` (``None``: no cap). Every failure raises
:class:`kvcodec.CorruptStreamError`.

File layout (integers little-endian; see ``docs/format.md``, "Container" / ``.kvc`` files)::

    0      8   b"KVCF" + version u16 (1) + flags u16 (0)
    8      ...  records, back to back: one per segment of the safetensors data buffer
                (a ``kvcodec.tensor`` container for a tensor, the raw bytes of an unclaimed
                gap or of a tensor that does not compress, or nothing for a small tensor
                coded in a group), then one record per group (version 2)
    I      L   index: a container of kind "kvcodec.file-index" (meta: entries, sizes, crc32 of
               the whole source file; section "header": the source's header bytes, zstd)
    end-24 24  footer: b"KVCE" + u32 0 + index offset I (u64) + index length L (u64)

Small tensors (under 4 KiB: norms, biases, scales) cost more in a container header than they
save alone, so version 2 concatenates all small tensors of one dtype, in file order, into a
*group* coded as one 1-D tensor; each member's entry says where its bytes start in the group.
Version 1 files (no groups) still read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvcodec import checksum, container, magics, safe_write, validate
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES as CAP
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import api, registry
from kvcodec.lossless.planes import DEFAULT_CHUNK_BYTES

FILE_MAGIC = magics.FILE
FOOTER_MAGIC = magics.FILE_FOOTER  # the same bytes as an entropy stream's magic: see kvcodec.magics
FILE_VERSION = 2  # 2: small tensors coded in groups (index "groups"); 1 (no groups) still reads
_READ_VERSIONS = (1, 2)
_HEAD = struct.Struct("<4sHH")
_FOOTER = struct.Struct("<4sIQQ")
INDEX_KIND = "kvcodec.file-index"
SMALL_TENSOR_BYTES = 4096  # below this, a tensor alone would cost more in container header than it saves
MAX_GROUP_BYTES = 16 << 20  # one group of small tensors is decoded whole: this bounds that memory
MAX_ST_HEADER = 100 << 20  # the safetensors format's own limit

# safetensors dtype code -> torch dtype name (kvcodec.container allow-list)
ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}


# --------------------------------------------------------------------------- safetensors parsing
def _read_safetensors_header(f, file_size: int) -> tuple[bytes, dict]:
    """Return (the exact 8-byte length + JSON header bytes, parsed JSON)."""
    first = f.read(8)
    if len(first) < 8:
        raise CorruptStreamError("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", first)
    if n < 2 or n > MAX_ST_HEADER or 8 + n > file_size:
        raise CorruptStreamError("not a safetensors file: bad header length")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptStreamError("not a safetensors file: header is not JSON") from None
    if not isinstance(header, dict):
        raise CorruptStreamError("not a safetensors file: header is not an object")
    return first + raw, header


def _segments(header: dict, data_len: int) -> list[dict]:
    """Cover the data buffer [0, data_len) with tensor segments and raw gap segments, in order."""
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CorruptStreamError(f"safetensors entry {name!r} is malformed") from None
        if (not isinstance(dtype, str) or not isinstance(shape, list)
                or any(type(d) is not int or d < 0 for d in shape)
                or type(a) is not int or type(b) is not int or not 0 <= a <= b <= data_len):
            raise CorruptStreamError(f"safetensors entry {name!r} has bad dtype/shape/offsets")
        tensors.append({"name": name, "st_dtype": dtype, "shape": shape, "start": a, "end": b})
    tensors.sort(key=lambda e: (e["start"], e["end"]))
    out, pos = [], 0
    for e in tensors:
        if e["start"] < pos:  # overlapping tensors: not valid safetensors; keep bytes exact as raw
            e = {**e, "st_dtype": None}
            if e["end"] <= pos:
                continue
            e["start"] = pos
        if e["start"] > pos:
            out.append({"name": None, "st_dtype": None, "shape": None, "start": pos, "end": e["start"]})
        out.append(e)
        pos = e["end"]
    if pos < data_len:
        out.append({"name": None, "st_dtype": None, "shape": None, "start": pos, "end": data_len})
    return out


def _tensor_dtype(seg: dict):
    """The torch dtype to compress a segment as, or None to store it raw."""
    name = ST_DTYPES.get(seg["st_dtype"]) if seg["st_dtype"] else None
    dtype = container.torch_dtypes().get(name) if name else None
    if dtype is None or math.prod(seg["shape"]) * dtype.itemsize != seg["end"] - seg["start"]:
        return None
    return dtype


def _progress(total: int, enabled: bool, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled or total < (64 << 20))


# --------------------------------------------------------------------------- compress
class _OrderedPipeline:
    """Code small segments on a thread pool (one thread each) while keeping file order; big
    segments (several chunks) run alone with every thread on their chunks. At most 2 x threads
    small segments are in flight, so memory stays bounded."""

    def __init__(self, threads: int):
        self.threads = registry.resolve_threads(threads)
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.pending: deque = deque()

    def submit(self, key, big: bool, job, emit) -> None:
        if self.pool is None or big:
            self.drain(emit)
            emit(key, job(self.threads))
            return
        self.pending.append((key, self.pool.submit(job, 1)))
        if len(self.pending) >= 2 * self.threads:
            key0, fut = self.pending.popleft()
            emit(key0, fut.result())

    def drain(self, emit) -> None:
        while self.pending:
            key, fut = self.pending.popleft()
            emit(key, fut.result())

    def close(self) -> None:
        for _, fut in self.pending:
            fut.cancel()
        self.pending.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def _plan_groups(segs: list[dict]) -> list[dict]:
    """Assign small tensor segments to groups: one per dtype (split at MAX_GROUP_BYTES), in file
    order, when the dtype's small tensors together reach SMALL_TENSOR_BYTES. Marks each member
    segment with ``group`` / ``group_start``; returns the groups (st_dtype, bytes)."""
    by_dtype: dict[str, list[dict]] = {}
    for seg in segs:
        n = seg["end"] - seg["start"]
        if seg["name"] is not None and 0 < n < SMALL_TENSOR_BYTES and _tensor_dtype(seg) is not None:
            by_dtype.setdefault(seg["st_dtype"], []).append(seg)
    groups: list[dict] = []
    for st_dtype, members in by_dtype.items():
        if sum(m["end"] - m["start"] for m in members) < SMALL_TENSOR_BYTES:
            continue
        group = None
        for m in members:
            n = m["end"] - m["start"]
            if group is None or group["bytes"] + n > MAX_GROUP_BYTES:
                group = {"st_dtype": st_dtype, "bytes": 0}
                groups.append(group)
            m["group"], m["group_start"] = len(groups) - 1, group["bytes"]
            group["bytes"] += n
    return groups


def _compress_group(st_dtype: str, data: bytearray, codec: str, threads: int, opts: dict) -> tuple[bytes, str]:
    """(record, mode) for a group: its concatenation as one 1-D tensor blob, or raw when that is not
    smaller (or when ``codec``/``opts`` do not apply to a 1-D tensor, e.g. ``layout="kv"``)."""
    dtype = container.torch_dtypes()[ST_DTYPES[st_dtype]]
    t = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    try:
        record = api.compress(t, codec=codec, threads=threads, **opts)
    except ValueError:
        return bytes(data), "raw"
    return (record, "tensor") if len(record) < len(data) else (bytes(data), "raw")


def _compress_segment(seg: dict, buf: bytearray, codec: str, threads: int, opts: dict) -> tuple[bytes, str]:
    """(record, mode) for one segment: a tensor blob, or the raw bytes when that is not smaller."""
    n = len(buf)
    dtype = _tensor_dtype(seg)
    if dtype is not None and n >= SMALL_TENSOR_BYTES:
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(seg["shape"])
        record = api.compress(t, codec=codec, threads=threads, **opts)
        if len(record) < n:
            return record, "tensor"
    return bytes(buf), "raw"


def compress_file(src: str | os.PathLike, dst: str | os.PathLike, *, threads: int = 0, progress: bool = True,
                  codec: str = "auto", overwrite: bool = False, **opts) -> dict:
    """Compress a ``.safetensors`` file to ``dst`` (a ``.kvc`` file); returns a size summary.

    Raises CorruptStreamError if ``src`` is not a valid safetensors file. ``codec`` and ``opts``
    go to :func:`kvcodec.lossless.api.compress` for every tensor. ``dst`` is written through
    :func:`kvcodec.safe_write.atomic_write`: the old file or the whole new one, never a part;
    WriteRefusedError if ``dst`` is ``src``, a symlink, a hard-linked file, or exists and
    ``overwrite`` is False.
    """
    src, dst = Path(src), Path(dst)
    size = src.stat().st_size
    entries = []
    with safe_write.atomic_write(dst, overwrite=overwrite, inputs=(src,)) as out:
        total = _compress_to(src, out, size, entries, threads, progress, codec, opts)
    return {"source_bytes": size, "compressed_bytes": total, "ratio": size / total if total else 0.0,
            "tensors": sum(e["name"] is not None for e in entries)}


def _compress_to(src: Path, out, size: int, entries: list, threads: int, progress: bool, codec: str,
                 opts: dict) -> int:
    import zstandard

    with open(src, "rb") as f:
        st_header, header = _read_safetensors_header(f, size)
        data_start = len(st_header)
        segs = _segments(header, size - data_start)
        groups = _plan_groups(segs)
        group_data = [bytearray() for _ in groups]
        running_crc = checksum.crc32(st_header)
        out.write(_HEAD.pack(FILE_MAGIC, FILE_VERSION, 0))
        pos = _HEAD.size
        bar = _progress(size, progress, f"compress {src.name}")
        pipe = _OrderedPipeline(threads)

        def emit(seg, result):
            nonlocal pos
            record, mode = result
            out.write(record)
            entry = {"name": seg["name"], "st_dtype": seg["st_dtype"], "shape": seg["shape"],
                     "start": seg["start"], "end": seg["end"], "mode": mode, "offset": pos,
                     "length": len(record), "crc32": checksum.crc32(record)}
            if mode == "grouped":
                entry["group"], entry["group_start"] = seg["group"], seg["group_start"]
            entries.append(entry)
            pos += len(record)
            if bar is not None:
                bar.update(seg["end"] - seg["start"])

        try:
            for seg in segs:
                n = seg["end"] - seg["start"]
                buf = bytearray(n)
                f.seek(data_start + seg["start"])
                if f.readinto(buf) != n:
                    raise CorruptStreamError("safetensors file is truncated")
                running_crc = checksum.crc32(buf, running_crc)
                if "group" in seg:  # its bytes go into the group's record, written after the entries
                    group_data[seg["group"]] += buf
                    pipe.submit(seg, False, lambda th: (b"", "grouped"), emit)
                    continue
                big = n >= 2 * opts.get("chunk_bytes", DEFAULT_CHUNK_BYTES)
                pipe.submit(seg, big, lambda th, seg=seg, buf=buf: _compress_segment(seg, buf, codec, th, opts), emit)
            pipe.drain(emit)
        finally:
            pipe.close()
        for group, data in zip(groups, group_data):
            record, mode = _compress_group(group["st_dtype"], data, codec, threads, opts)
            out.write(record)
            group.update(mode=mode, offset=pos, length=len(record), crc32=checksum.crc32(record))
            pos += len(record)
        if bar is not None:
            bar.close()
        meta = {"format": "safetensors", "source_bytes": size, "source_crc32": running_crc,
                "header_bytes": len(st_header), "entries": entries, "groups": groups}
        index = container.dumps(INDEX_KIND, meta, {"header": zstandard.ZstdCompressor(level=19).compress(st_header)})
        out.write(index)
        out.write(_FOOTER.pack(FOOTER_MAGIC, 0, pos, len(index)))
        return pos + len(index) + _FOOTER.size


# --------------------------------------------------------------------------- reading
def _decode_record(e: dict, blob: bytes, threads: int) -> torch.Tensor:
    """A tensor record's tensor, after checking its header says what the index entry says
    (compress_file writes the entry's dtype and shape, and never a prediction)."""
    info = api.describe(blob)
    if info["uses_prediction"] or info["shape"] != tuple(e["shape"]) or info["dtype"] != ST_DTYPES[e["st_dtype"]]:
        raise CorruptStreamError(f"record of {e['name']!r} does not match its index entry")
    return api.decompress(blob, threads=threads, device="cpu", max_output_bytes=e["end"] - e["start"])


def _segment_from_record(e: dict, blob: bytes, threads: int, max_output_bytes: int | None = CAP) -> memoryview | bytes:
    validate.check_output(e["end"] - e["start"], max_output_bytes, f"segment of {e['name'] or 'a gap'}")
    if e["mode"] == "raw":
        return blob
    t = _decode_record(e, blob, threads)
    raw = api.tensor_bytes(t)
    if raw.size != e["end"] - e["start"]:
        raise CorruptStreamError(f"tensor {e['name']!r} decodes to the wrong size")
    return memoryview(raw)


_ENTRY_KEYS = ("name", "st_dtype", "shape", "start", "end", "mode", "offset", "length", "crc32")


def _check_entry(e, version: int) -> None:
    """One index entry: the field types and ranges compress_file writes (positions checked by the caller).

    A "tensor" or "grouped" record always has a name, a safetensors dtype torch has and a shape
    whose size is the segment's; an unnamed gap is raw with no dtype or shape; a "grouped" entry
    (version 2) has an empty record and names its group and where its bytes start there.
    """
    grouped = version >= 2 and type(e) is dict and e.get("mode") == "grouped"
    validate.require_keys(e, _ENTRY_KEYS + (("group", "group_start") if grouped else ()), "kvcodec file index entry")
    for k in ("start", "end", "offset", "length"):
        validate.require_int(e[k], 0, validate.MAX_ADDRESSABLE, f"kvcodec file entry {k}")
    validate.require_int(e["crc32"], 0, 0xFFFFFFFF, "kvcodec file entry crc32")
    if e["end"] < e["start"] or e["mode"] not in ("tensor", "raw", "grouped"):
        raise CorruptStreamError("kvcodec file index: malformed entry")
    if e["name"] is None:
        if e["mode"] != "raw" or e["st_dtype"] is not None or e["shape"] is not None:
            raise CorruptStreamError("kvcodec file index: an unnamed gap must be raw, without dtype or shape")
    else:
        if type(e["name"]) is not str or not (e["st_dtype"] is None or type(e["st_dtype"]) is str):
            raise CorruptStreamError("kvcodec file index: bad tensor name or dtype")
        validate.check_shape(e["shape"], f"kvcodec file entry {e['name'][:80]!r}", max_ndim=64)
    if e["mode"] == "raw" and e["length"] != e["end"] - e["start"]:
        raise CorruptStreamError("kvcodec file index: raw entry has the wrong length")
    if e["mode"] in ("tensor", "grouped") and _tensor_dtype(e) is None:
        raise CorruptStreamError("kvcodec file index: tensor entry's dtype/shape do not match its segment")
    if grouped:
        validate.require_int(e["group"], 0, validate.MAX_ADDRESSABLE, "kvcodec file entry group")
        validate.require_int(e["group_start"], 0, MAX_GROUP_BYTES, "kvcodec file entry group_start")
        if e["length"] != 0 or e["crc32"] != 0:
            raise CorruptStreamError("kvcodec file index: a grouped entry has a record of its own")


_GROUP_KEYS = ("st_dtype", "bytes", "mode", "offset", "length", "crc32")


def _check_groups(groups, entries: list, rec_pos: int) -> int:
    """The groups' fields, their records back to back from ``rec_pos``, and their members tiling
    each group exactly in entry order; returns the end of the last group's record."""
    groups = validate.require_type(groups, list, "kvcodec file index groups")
    filled = [0] * len(groups)
    for g in groups:
        validate.require_keys(g, _GROUP_KEYS, "kvcodec file group")
        if type(g["st_dtype"]) is not str or g["st_dtype"] not in ST_DTYPES \
                or container.torch_dtypes().get(ST_DTYPES[g["st_dtype"]]) is None:  # a list: TypeError in the lookup
            raise CorruptStreamError("kvcodec file group: bad dtype")
        validate.require_int(g["bytes"], 1, MAX_GROUP_BYTES, "kvcodec file group bytes")
        validate.require_int(g["length"], 0, validate.MAX_ADDRESSABLE, "kvcodec file group length")
        validate.require_int(g["crc32"], 0, 0xFFFFFFFF, "kvcodec file group crc32")
        if g["mode"] not in ("tensor", "raw") or g["offset"] != rec_pos or (g["mode"] == "raw" and g["length"] != g["bytes"]):
            raise CorruptStreamError("kvcodec file group: bad mode, offset or length")
        rec_pos += g["length"]
    for e in entries:
        if e["mode"] != "grouped":
            continue
        if e["group"] >= len(groups):
            raise CorruptStreamError("kvcodec file index: entry names a missing group")
        g = groups[e["group"]]
        if g["st_dtype"] != e["st_dtype"] or e["group_start"] != filled[e["group"]]:
            raise CorruptStreamError("kvcodec file index: grouped entry does not match its group")
        filled[e["group"]] += e["end"] - e["start"]
    if filled != [g["bytes"] for g in groups]:
        raise CorruptStreamError("kvcodec file index: a group's members do not fill it")
    return rec_pos


class KvcFile:
    """An open ``.kvc`` file: the validated index, and record access by entry."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        try:
            self._load_index()
        except BaseException:
            self._f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _load_index(self) -> None:
        f = self._f
        size = os.fstat(f.fileno()).st_size
        if size < _HEAD.size + _FOOTER.size:
            raise CorruptStreamError("not a kvcodec file: too short")
        magic, version, flags = _HEAD.unpack(f.read(_HEAD.size))
        if magic != FILE_MAGIC:
            raise CorruptStreamError("not a kvcodec .kvc file (bad magic)")
        if version not in _READ_VERSIONS or flags != 0:
            raise CorruptStreamError(f"unsupported .kvc version {version} / flags {flags}")
        f.seek(size - _FOOTER.size)
        fmagic, _, ioff, ilen = _FOOTER.unpack(f.read(_FOOTER.size))
        if fmagic != FOOTER_MAGIC or ioff < _HEAD.size or ioff + ilen != size - _FOOTER.size:
            raise CorruptStreamError("kvcodec file footer is corrupt (or the file is truncated)")
        f.seek(ioff)
        _, meta, sections = container.loads(validate.read_exact(f, ilen, "kvcodec file index"), expect_kind=INDEX_KIND)
        if set(sections) != {"header"} or not isinstance(sections["header"], memoryview):
            raise CorruptStreamError("kvcodec file index: expected one bytes section 'header'")
        st_header = validate.zstd_decompress(sections["header"], MAX_ST_HEADER + 8, "kvcodec file index header")
        self.meta = self._check_meta(meta, ioff, len(st_header), version)
        self.st_header = st_header
        self.entries = self.meta["entries"]
        self.groups = self.meta.get("groups", [])
        self._group_cache: dict[int, memoryview] = {}
        self.by_name = {e["name"]: e for e in self.entries if e["name"] is not None}

    @staticmethod
    def _check_meta(meta: dict, records_end: int, header_len: int, version: int) -> dict:
        """Every index field checked against what compress_file writes and the file's real size."""
        keys = ("format", "source_bytes", "source_crc32", "header_bytes", "entries") + (("groups",) if version >= 2 else ())
        validate.require_keys(meta, keys, "kvcodec file index meta")
        if meta["format"] != "safetensors" or meta["header_bytes"] != header_len:
            raise CorruptStreamError("kvcodec file index: bad meta")
        validate.require_int(meta["source_bytes"], 0, validate.MAX_ADDRESSABLE, "kvcodec file source_bytes")
        validate.require_int(meta["source_crc32"], 0, 0xFFFFFFFF, "kvcodec file source_crc32")
        entries = validate.require_type(meta["entries"], list, "kvcodec file index entries")
        data_pos, rec_pos, names = 0, _HEAD.size, set()
        for e in entries:
            _check_entry(e, version)
            if e["start"] != data_pos or e["offset"] != rec_pos:
                raise CorruptStreamError("kvcodec file index: entries are not contiguous")
            if e["name"] is not None:
                if e["name"] in names:
                    raise CorruptStreamError("kvcodec file index: duplicate tensor name")
                names.add(e["name"])
            data_pos, rec_pos = e["end"], e["offset"] + e["length"]
            if rec_pos > records_end:
                raise CorruptStreamError("kvcodec file index: a record runs past the index")
        if version >= 2:
            rec_pos = _check_groups(meta["groups"], entries, rec_pos)
        if rec_pos != records_end or header_len + data_pos != meta["source_bytes"]:
            raise CorruptStreamError("kvcodec file index: sizes do not add up")
        return meta

    def record(self, e: dict) -> bytes:
        self._f.seek(e["offset"])
        blob = self._f.read(e["length"])
        if len(blob) != e["length"] or checksum.crc32(blob) != e["crc32"]:
            raise CorruptStreamError(f"record of {e.get('name', 'a group') or 'a gap'} is corrupt")
        return blob

    def group_bytes(self, index: int, threads: int = 0) -> memoryview:
        """The decoded bytes of one group of small tensors (decoded once, then cached)."""
        data = self._group_cache.get(index)
        if data is None:
            g = self.groups[index]
            blob = self.record(g)
            if g["mode"] == "raw":
                data = memoryview(blob)
            else:
                itemsize = container.torch_dtypes()[ST_DTYPES[g["st_dtype"]]].itemsize
                member = {"name": f"group {index}", "st_dtype": g["st_dtype"], "shape": [g["bytes"] // itemsize],
                          "start": 0, "end": g["bytes"]}
                raw = api.tensor_bytes(_decode_record(member, blob, threads))
                if raw.size != g["bytes"]:
                    raise CorruptStreamError(f"group {index} decodes to the wrong size")
                data = memoryview(raw).cast("B")
            self._group_cache[index] = data
        return data

    def record_codec(self, e: dict) -> str:
        """The codec name of a tensor record, reading only its container header."""
        self._f.seek(e["offset"])
        prefix = self._f.read(container.PREFIX.size)
        if len(prefix) < container.PREFIX.size:
            raise CorruptStreamError("kvcodec file: record truncated")
        hlen = container.PREFIX.unpack(prefix)[3]
        if container.PREFIX.size + hlen > e["length"]:
            raise CorruptStreamError("kvcodec file: record header overruns the record")
        header, _ = container.read_header(prefix + self._f.read(hlen))
        codec = header["meta"].get("codec")
        return codec if isinstance(codec, str) else "?"

    def segment_bytes(self, e: dict, threads: int = 0, max_output_bytes: int | None = CAP) -> memoryview | bytes:
        """The original bytes of one entry's segment of the safetensors data buffer (capped, default 4 GiB)."""
        validate.check_output(e["end"] - e["start"], max_output_bytes, f"segment of {e['name'] or 'a gap'}")
        if e["mode"] == "grouped":
            return self.group_bytes(e["group"], threads)[e["group_start"]:e["group_start"] + e["end"] - e["start"]]
        return _segment_from_record(e, self.record(e), threads, max_output_bytes)

    def tensor(self, name: str, threads: int = 0, max_output_bytes: int | None = CAP) -> torch.Tensor:
        e = self.by_name.get(name)
        if e is None:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        validate.check_output(e["end"] - e["start"], max_output_bytes, f"tensor {name[:80]!r}")
        if e["mode"] == "tensor":
            return _decode_record(e, self.record(e), threads)
        dtype = _tensor_dtype(e)
        raw = bytearray(self.segment_bytes(e, threads) if e["mode"] == "grouped" else self.record(e))
        if dtype is None:  # a dtype torch lacks (or an inconsistent entry): the raw bytes
            return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        if not raw:
            return torch.empty(e["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(e["shape"])


def read_tensor(path: str | os.PathLike, name: str, threads: int = 0,
                max_output_bytes: int | None = CAP) -> torch.Tensor:
    """Decode one tensor of a ``.kvc`` file by name (KeyError if absent). Dtypes torch lacks come back as uint8 bytes.

    ``max_output_bytes``: refuse (CorruptStreamError) a tensor bigger than this (default 4 GiB).
    """
    with KvcFile(path) as kf:
        return kf.tensor(name, threads=threads, max_output_bytes=max_output_bytes)


def iter_tensors(path: str | os.PathLike, threads: int = 0,
                 max_output_bytes: int | None = CAP) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order, one at a time (each capped by ``max_output_bytes``)."""
    with KvcFile(path) as kf:
        for e in kf.entries:
            if e["name"] is not None:
                yield e["name"], kf.tensor(e["name"], threads=threads, max_output_bytes=max_output_bytes)


def decompress_file(src: str | os.PathLike, dst: str | os.PathLike, *, threads: int = 0, progress: bool = True,
                    max_output_bytes: int | None = CAP, overwrite: bool = False) -> dict:
    """Restore the original safetensors file from a ``.kvc`` file, byte for byte (crc32-checked).

    ``max_output_bytes``: refuse (CorruptStreamError, before ``dst`` is touched) a file that would
    restore to more bytes than this; default ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES`` (4 GiB).
    Raise it for bigger model files you trust (CLI: ``--max-output``). ``dst`` is written as by
    :func:`compress_file` (``overwrite``, WriteRefusedError).
    """
    src, dst = Path(src), Path(dst)
    with KvcFile(src) as kf:
        total = validate.check_output(kf.meta["source_bytes"], max_output_bytes, f"{src.name}")
        with safe_write.atomic_write(dst, overwrite=overwrite, inputs=(src,)) as out:
            bar = _progress(total, progress, f"decompress {src.name}")
            try:
                out.write(kf.st_header)
                crc = checksum.crc32(kf.st_header)
                pipe = _OrderedPipeline(threads)

                def emit(e, data):
                    nonlocal crc
                    crc = checksum.crc32(data, crc)
                    out.write(data)
                    if bar is not None:
                        bar.update(e["end"] - e["start"])

                try:
                    for e in kf.entries:
                        if e["mode"] == "grouped":  # its group is decoded here once, in file order
                            data = kf.segment_bytes(e, threads, total)
                            pipe.submit(e, False, lambda th, data=data: data, emit)
                            continue
                        blob = kf.record(e)
                        big = e["end"] - e["start"] >= 2 * DEFAULT_CHUNK_BYTES
                        pipe.submit(e, big, lambda th, e=e, blob=blob: _segment_from_record(e, blob, th, total), emit)
                    pipe.drain(emit)
                finally:
                    pipe.close()
                if crc != kf.meta["source_crc32"]:
                    raise CorruptStreamError("restored file fails the source checksum")
            finally:
                if bar is not None:
                    bar.close()
    return {"bytes": total}


# --------------------------------------------------------------------------- inspect
def inspect_file(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Per-tensor rows: name, dtype, shape, raw_bytes, compressed_bytes, ratio, codec (no decoding)."""
    rows = []
    with KvcFile(path) as kf:
        for e in kf.entries:
            if e["name"] is None:
                continue
            raw = e["end"] - e["start"]
            codec, length = "stored", e["length"]
            if e["mode"] == "tensor":
                codec = kf.record_codec(e)
            elif e["mode"] == "grouped":  # its share of the group's record, by bytes
                g = kf.groups[e["group"]]
                codec = "group " + (kf.record_codec(g) if g["mode"] == "tensor" else "stored")
                length = raw * g["length"] / g["bytes"]
            rows.append({"name": e["name"], "dtype": e["st_dtype"], "shape": tuple(e["shape"] or ()),
                         "raw_bytes": raw, "compressed_bytes": length,
                         "ratio": raw / length if length else float("inf") if raw else 1.0,
                         "codec": codec})
    return rows


def format_inspect_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`inspect_file` rows with a total line."""
    cols = ["name", "dtype", "shape", "raw_bytes", "compressed_bytes", "ratio", "codec"]
    cells = [[str(r["name"]), str(r["dtype"]), "x".join(map(str, r["shape"])) or "scalar", str(r["raw_bytes"]),
              str(round(r["compressed_bytes"])), f"{r['ratio']:.3f}", str(r["codec"])] for r in rows]
    raw = sum(r["raw_bytes"] for r in rows)
    comp = sum(r["compressed_bytes"] for r in rows)
    cells.append(["TOTAL", "", f"{len(rows)} tensors", str(raw), str(round(comp)), f"{raw / comp:.3f}" if comp else "-", ""])
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    right = {3, 4, 5}

    def fmt(row):
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()

    lines = [fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells]
    return "\n".join(lines)
