"""The plane codec ("planes"): split floats into byte planes, rANS-code the ones that pay, keep the rest raw.

Why planes: in a float the exponent byte carries most of the redundancy (bf16 weights: ~2.6 of 8
bits) while sign and low mantissa bits are nearly uniform. Coding the exponent plane with a
static rANS table and copying the near-uniform planes verbatim gets within a fraction of a
percent of the order-0 entropy of the whole value, at memcpy speed for the raw planes and one
table lookup per value for the coded one.

Plane layouts (``layout`` in the meta):

- ``f16`` (bfloat16, float16; a 16-bit word ``u``): plane 0 = ``(u >> 7) & 0xFF`` (bf16: the
  exponent; fp16: the 5 exponent bits + top 3 mantissa bits), plane 1 = sign bit << 7 | the low 7
  bits.
- ``f32`` (float32): planes 0-1 as ``f16`` on the upper 16 bits, planes 2-3 the two low bytes.
- ``bytes`` (fp8, integers, bool, float64, complex...): plane k = byte k of each little-endian element.

Each plane is coded with static frequency tables (12-bit precision, from
``kvcodec.entropy.freq``), stored "const" when it holds one value, or stored raw when coding saves
less than ``min_gain`` (default 2%, so near-uniform mantissa planes cost no decode time). Context:
rows along the last dimension (a weight row, a KV vector) are sorted by their mean symbol (their
scale) and cut into K = 1, 4, 8 or 16 classes, each with its own table; the encoder picks the K
whose estimated size (tables and the one-byte-per-row class map included) is smallest.

The tensor is cut into chunks of ``chunk_bytes`` of input (default 2 MiB); each chunk of a coded
plane is its own 32-lane interleaved rANS stream (:mod:`kvcodec.entropy.rans_lanes`, the GPU
decoder's warp layout; format 1 used 8 lanes and still decodes), so chunks are encoded and decoded in parallel
(numba ``nogil`` kernels on a thread pool) and one chunk can be decoded alone
(:meth:`PlaneCodec.decode_chunk`). For 16-bit floats the exponent decode writes the final 16-bit
values directly (fused with the sign/mantissa plane), so decoding is one pass.

rANS streams: the format of :mod:`kvcodec.entropy.rans_lanes` (states, then 16-bit words in
decode order), element ``e`` of the tensor coded with the table of its row's class
``rowctx[e // D]``; the decoder checks that it consumed exactly the chunk's words and that every
lane ends at 2**16.
"""

from __future__ import annotations

import math
from array import array
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from kvcodec import container
from kvcodec.entropy import rans_lanes
from kvcodec.entropy.freq import quantize_frequencies
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import registry
from kvcodec.lossless.tensor_meta import checked_shape, dtype_from_name, int_list
from kvcodec.threads import resolve_threads

PREC = rans_lanes.PRECISION
M = rans_lanes.M
LANES = 32  # rANS lanes of new streams: one GPU warp (kvcodec.entropy.cuda.rans); format 1 used 8
DEFAULT_CHUNK_BYTES = 2 << 20
DEFAULT_MIN_GAIN = 0.02
FORMAT_VERSION = 3  # 3: chunk stream lengths in a binary section; 2: in the meta; 1: 8 lanes (both still decode)
_LANES_OF_V1 = 8

_F16 = ("bfloat16", "float16")
# sign/low byte -> its bits in place in a 16-bit float: sign to bit 15, low 7 bits stay
_SIGN_LOW = np.array([((b & 0x80) << 8) | (b & 0x7F) for b in range(256)], np.uint16)
# exponent byte -> its bits in place in a 16-bit float
_EXP_HIGH = (np.arange(256, dtype=np.uint16) << 7).astype(np.uint16)


# --------------------------------------------------------------------------- numba kernels
@njit(nogil=True, cache=True)
def _split16(u, p0, p1):
    for i in range(u.size):
        v = np.int64(u[i])
        p0[i] = (v >> 7) & 0xFF
        p1[i] = ((v >> 8) & 0x80) | (v & 0x7F)


@njit(nogil=True, cache=True)
def _merge16(p0, p1, u):
    for i in range(u.size):
        s = np.int64(p1[i])
        u[i] = ((s & 0x80) << 8) | (np.int64(p0[i]) << 7) | (s & 0x7F)


@njit(nogil=True, cache=True)
def _split32(u, p0, p1, p2, p3):
    for i in range(u.size):
        v = np.int64(u[i])
        p0[i] = (v >> 23) & 0xFF
        p1[i] = ((v >> 24) & 0x80) | ((v >> 16) & 0x7F)
        p2[i] = (v >> 8) & 0xFF
        p3[i] = v & 0xFF


@njit(nogil=True, cache=True)
def _merge32(p0, p1, p2, p3, u):
    for i in range(u.size):
        s = np.int64(p1[i])
        u[i] = ((s & 0x80) << 24) | (np.int64(p0[i]) << 23) | ((s & 0x7F) << 16) | (np.int64(p2[i]) << 8) | np.int64(p3[i])


@njit(nogil=True, cache=True)
def _histogram(sym, counts):
    for i in range(sym.size):
        counts[sym[i]] += 1


@njit(nogil=True, cache=True)
def _row_stat(plane, D, mask):
    """Mean of ``sym & mask`` per row of length D (the row's 'scale' for context classes)."""
    rows = plane.size // D
    out = np.zeros(rows, np.float64)
    for r in range(rows):
        acc = 0
        for i in range(r * D, (r + 1) * D):
            acc += np.int64(plane[i]) & mask
        out[r] = acc / D
    return out


@njit(nogil=True, cache=True)
def _class_hist(plane, D, cls, K):
    counts = np.zeros((K, 256), np.int64)
    for r in range(plane.size // D):
        k = cls[r]
        for i in range(r * D, (r + 1) * D):
            counts[k, plane[i]] += 1
    return counts


# --------------------------------------------------------------------------- tables
MAX_CLASSES = 16
MAX_CHUNK_ELEMS = 1 << 24


def _table_json(freq: np.ndarray) -> list[int]:
    used = np.flatnonzero(freq)
    out = np.empty(2 * used.size, np.int64)
    out[0::2] = used
    out[1::2] = freq[used]
    return out.tolist()


def _table_from_json(flat) -> np.ndarray:
    """A stored table ([symbol, frequency, ...], symbols rising, frequencies >= 1 summing to M) as
    frequencies [256] int64; checked on the Python list (a few hundred ints: cheaper than numpy
    calls, and a GPU first decode waits for it)."""
    if not isinstance(flat, list) or not flat or len(flat) % 2 or len(flat) > 512 or not set(map(type, flat)) <= {int}:
        raise CorruptStreamError("planes: bad frequency table")
    sym, f = flat[0::2], flat[1::2]
    if sym[0] < 0 or sym[-1] > 255 or min(f) < 1 or sum(f) != M or sorted(set(sym)) != sym:
        raise CorruptStreamError("planes: invalid frequency table")
    freq = np.zeros(256, np.int64)
    freq[np.frombuffer(array("q", sym), np.int64)] = np.frombuffer(array("q", f), np.int64)  # in range: checked
    return freq


def _coded_bits(counts: np.ndarray, freq: np.ndarray) -> float:
    m = counts > 0
    return float(np.sum(counts[m] * (PREC - np.log2(freq[m]))))


def _row_length(shape) -> int:
    """Context rows run along the last dimension (a weight row, a KV head-dim vector)."""
    return shape[-1] if len(shape) >= 1 and shape[-1] > 0 else 1


def model_plane(plane: np.ndarray, D: int, symbol_mask: int, max_classes: int = MAX_CLASSES):
    """Choose the cheapest model for a byte plane: one table, or K tables by row class.

    Rows are sorted by their mean (masked) symbol, i.e. by scale, and cut into K equal groups;
    each group gets its own table. Returns (est_bytes, class_of_row uint8 or None, freqs [K, 256]).
    """
    counts = np.zeros(256, np.int64)
    _histogram(plane, counts)
    est, freqs = one_table(counts)
    best = (est, None, freqs)
    rows = plane.size // D
    if D < 16 or rows < 64 or max_classes < 2 or best[0] > 0.9 * plane.size:
        return best  # too few rows, or a near-uniform plane (mantissa bits) that contexts cannot help
    order = np.argsort(_row_stat(plane, D, symbol_mask), kind="stable")
    for K in (4, 8, 16):
        if K > max_classes or rows < 16 * K:
            break
        cls = np.empty(rows, np.uint8)
        cls[order] = (np.arange(rows) * K // rows).astype(np.uint8)
        counts = _class_hist(plane, D, cls, K)
        freqs = np.stack([quantize_frequencies(c, PREC).astype(np.int64) if c.any() else _uniform() for c in counts])
        est = sum(_coded_bits(c, f) for c, f in zip(counts, freqs)) / 8 + 8 * np.count_nonzero(freqs) + rows
        if est < best[0]:
            best = (est, cls, freqs)
    return best


def one_table(counts: np.ndarray) -> tuple[float, np.ndarray]:
    """(estimated coded bytes, freqs [1, 256]) of a plane with histogram ``counts`` under one table
    (the GPU encoder calls this too, on the histogram it computed: the same table, the same bytes)."""
    freqs = quantize_frequencies(counts, PREC).astype(np.int64)[None, :]
    return _coded_bits(counts, freqs[0]) / 8 + 8 * np.count_nonzero(freqs), freqs


def pays_to_code(est_bytes: float, n: int, n_chunks: int, min_gain: float) -> bool:
    """Whether coding a plane of n bytes in n_chunks streams saves ``min_gain`` of it (each stream
    costs its 32 states and an offset: ~24 bytes counted per chunk)."""
    return est_bytes + 24 * n_chunks < (1.0 - float(min_gain)) * n


def _array_like(x) -> bool:
    """A section the checks can read: a numpy array, or a device section (dtype, shape, size)."""
    return isinstance(x, np.ndarray) or all(hasattr(x, a) for a in ("dtype", "shape", "size", "device_section"))


def _uniform() -> np.ndarray:
    return np.full(256, M // 256, np.int64)


# --------------------------------------------------------------------------- plane split / merge
def layout_of(dtype: torch.dtype) -> str:
    name = container.torch_dtype_name(dtype)
    if name in _F16:
        return "f16"
    if name == "float32":
        return "f32"
    return "bytes"


def _n_planes(layout: str, itemsize: int) -> int:
    return {"f16": 2, "f32": 4}.get(layout, itemsize)


def _symbol_mask(layout: str, itemsize: int, k: int) -> int:
    """Bits of plane k's symbol that track the value's scale (fp8 byte: all but the sign)."""
    return 0x7F if layout == "bytes" and itemsize == 1 else 0xFF


def split_planes(raw: np.ndarray, layout: str, itemsize: int, planes: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Byte planes (uint8 arrays of n elements) of the little-endian element bytes ``raw``."""
    n = raw.size // itemsize
    if planes is None:
        planes = [np.empty(n, np.uint8) for _ in range(_n_planes(layout, itemsize))]
    if layout == "f16":
        _split16(raw.view(np.uint16), *planes)
    elif layout == "f32":
        _split32(raw.view(np.uint32), *planes)
    else:
        grid = raw.reshape(n, itemsize)
        for k in range(itemsize):
            planes[k][:] = grid[:, k]
    return planes


def merge_planes(planes: list[np.ndarray], layout: str, itemsize: int, out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`, writing into the uint8 array ``out``."""
    if layout == "f16":
        _merge16(planes[0], planes[1], out.view(np.uint16))
    elif layout == "f32":
        _merge32(*planes, out.view(np.uint32))
    else:
        grid = out.reshape(-1, itemsize)
        for k in range(itemsize):
            grid[:, k] = planes[k]


# --------------------------------------------------------------------------- the codec
def _pool_map(fn, items, threads: int):
    items = list(items)
    workers = min(resolve_threads(threads), len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


def check_options(chunk_bytes, min_gain, max_classes) -> None:
    """ValueError for encoder options out of range (the CPU and GPU encoders take the same)."""
    if not isinstance(chunk_bytes, int) or chunk_bytes < 64:
        raise ValueError("chunk_bytes must be an integer >= 64")
    if not 0.0 <= float(min_gain) < 1.0:
        raise ValueError("min_gain must be in [0, 1)")
    if not isinstance(max_classes, int) or not 1 <= max_classes <= MAX_CLASSES:
        raise ValueError(f"max_classes must be an integer in [1, {MAX_CLASSES}]")


class PlaneCodec:
    """Byte-plane split + static rANS per plane with optional row-class contexts (module docstring)."""

    name = "planes"

    def encode(self, t: torch.Tensor, prediction, threads: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               min_gain: float = DEFAULT_MIN_GAIN, max_classes: int = MAX_CLASSES):
        """``chunk_bytes``: input bytes per independently decodable chunk; ``min_gain``: code a plane
        only if that saves at least this fraction of it; ``max_classes``: row-context tables (1 = off)."""
        check_options(chunk_bytes, min_gain, max_classes)
        itemsize = t.element_size()
        layout = layout_of(t.dtype)
        n = t.numel()
        D = _row_length(tuple(t.shape))
        raw = t.reshape(-1).view(torch.uint8).numpy() if n else np.zeros(0, np.uint8)
        chunk = min(MAX_CHUNK_ELEMS, max(1, chunk_bytes // itemsize))
        bounds = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
        n_planes = _n_planes(layout, itemsize)
        planes = [np.empty(n, np.uint8) for _ in range(n_planes)]
        _pool_map(lambda ab: split_planes(raw[ab[0] * itemsize : ab[1] * itemsize], layout, itemsize,
                                          [p[ab[0] : ab[1]] for p in planes]), bounds, threads)
        meta = {"v": FORMAT_VERSION, "dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape),
                "layout": layout, "chunk": chunk, "lanes": LANES, "planes": []}
        sections: dict[str, np.ndarray] = {}
        for k, plane in enumerate(planes):
            if n and not (plane != plane[0]).any():
                meta["planes"].append({"mode": "const", "value": int(plane[0])})
                continue
            mode = "raw"
            if n:
                est, cls, freqs = model_plane(plane, D, _symbol_mask(layout, itemsize, k), max_classes)
                if pays_to_code(est, n, len(bounds), min_gain):
                    mode = "rans"
            if mode == "raw":
                meta["planes"].append({"mode": "raw"})
                sections[f"p{k}"] = plane
                continue
            # one table: the whole tensor is one "row" (no row edges to handle)
            rowctx, Dp = (cls, D) if cls is not None else (np.zeros(1, np.uint8), max(n, 1))
            cums = rans_lanes.cumulative(freqs)

            def enc(ab, plane=plane, rowctx=rowctx, Dp=Dp, freqs=freqs, cums=cums):
                part = plane[ab[0] : ab[1]]
                words = np.empty(part.size + 2 * LANES, np.uint16)  # worst case: one word per symbol + states
                start = rans_lanes.encode(part, ab[0], Dp, rowctx, freqs, cums, LANES, words)
                return words[start:]

            streams = _pool_map(enc, bounds, threads)
            meta["planes"].append({"mode": "rans", "tables": [_table_json(f) for f in freqs]})
            sections[f"p{k}"] = np.concatenate(streams)
            sections[f"p{k}.len"] = np.array([s.size for s in streams], np.uint32)
            if cls is not None:
                sections[f"p{k}.ctx"] = cls
        return meta, sections

    # ---- decoding
    def _prepare(self, meta, sections, dtype: torch.dtype, shape, device: bool = False):
        """Validate meta/sections against dtype and shape; returns what the chunk decoder needs.
        ``device``: for the GPU decoder (``planes_device``): a coded plane's entry holds its
        frequency tables (not the CPU's decode tables) and, in format 3, its chunk-length section
        as it is (the GPU checks the lengths while it turns them into stream offsets)."""
        keys = {"v", "dtype", "shape", "layout", "chunk", "planes"}
        version = meta.get("v")
        if version == 1 and set(meta) == keys:
            lanes = _LANES_OF_V1
        elif version in (2, FORMAT_VERSION) and type(version) is int and set(meta) == keys | {"lanes"}:
            lanes = meta["lanes"]
            if type(lanes) is not int or lanes not in rans_lanes.LANES:
                raise CorruptStreamError("planes: bad lane count")
        else:
            raise CorruptStreamError("planes: bad codec meta")
        n = math.prod(shape)
        itemsize = dtype.itemsize
        layout, chunk, pmeta = meta["layout"], meta["chunk"], meta["planes"]
        if layout != layout_of(dtype):
            raise CorruptStreamError("planes: layout does not match the dtype")
        if type(chunk) is not int or not 1 <= chunk <= MAX_CHUNK_ELEMS:
            raise CorruptStreamError("planes: bad chunk size")
        n_planes = _n_planes(layout, itemsize)
        if not isinstance(pmeta, list) or len(pmeta) != n_planes or not all(isinstance(p, dict) for p in pmeta):
            raise CorruptStreamError("planes: bad plane list")
        n_chunks = -(-n // chunk)
        D = _row_length(shape)
        rows = n // D
        expected, info = set(), []
        for k, p in enumerate(pmeta):
            mode = p.get("mode")
            if mode == "const":
                if set(p) != {"mode", "value"} or type(p["value"]) is not int or not 0 <= p["value"] <= 255:
                    raise CorruptStreamError(f"planes: bad const plane {k}")
                info.append(("const", p["value"], None, None, None, None))
                continue
            data = sections.get(f"p{k}")
            expected.add(f"p{k}")
            if mode == "raw":
                if set(p) != {"mode"} or not _array_like(data) or data.dtype != np.uint8 or data.shape != (n,):
                    raise CorruptStreamError(f"planes: raw plane {k} has the wrong size")
                info.append(("raw", data, None, None, None, None))
                continue
            if mode != "rans" or set(p) != ({"mode", "tables"} if version == FORMAT_VERSION else
                                             {"mode", "tables", "offsets"}):
                raise CorruptStreamError(f"planes: bad plane {k}")
            if not _array_like(data) or data.dtype != np.uint16 or len(data.shape) != 1:
                raise CorruptStreamError(f"planes: coded plane {k} is not a uint16 stream")
            if version == FORMAT_VERSION:
                expected.add(f"p{k}.len")
                off = _chunk_offsets(sections.get(f"p{k}.len"), n_chunks, data.shape[0], lanes, k, device)
            else:
                off = p["offsets"]
                if not isinstance(off, list) or len(off) != n_chunks + 1:
                    raise CorruptStreamError(f"planes: bad chunk offsets for plane {k}")
                off = int_list(off, 0, 1 << 62, f"planes: chunk offsets of plane {k}")
                if off[0] != 0 or off[-1] != data.shape[0] or np.any(np.diff(off) < 2 * lanes):
                    raise CorruptStreamError(f"planes: bad chunk offsets for plane {k}")
            tables = p["tables"]
            if not isinstance(tables, list) or not 1 <= len(tables) <= MAX_CLASSES:
                raise CorruptStreamError(f"planes: bad table list for plane {k}")
            tabs = np.stack([_table_from_json(tb) for tb in tables])
            if not device:
                tabs = rans_lanes.decode_tables(tabs)
            if len(tables) > 1:
                expected.add(f"p{k}.ctx")
                ctx = sections.get(f"p{k}.ctx")
                if (not _array_like(ctx) or ctx.dtype != np.uint8 or ctx.shape != (rows,)
                        or (rows and int(ctx.max()) >= len(tables))):
                    raise CorruptStreamError(f"planes: bad row contexts for plane {k}")
                info.append(("rans", data, off, tabs, ctx, D))
            else:
                info.append(("rans", data, off, tabs, np.zeros(1, np.uint8), max(n, 1)))
        if set(sections) != expected:
            raise CorruptStreamError("planes: unexpected or missing sections")
        return layout, itemsize, chunk, n_chunks, info, lanes

    def _decode_range(self, prep, c: int, n: int, out: np.ndarray) -> None:
        """Decode chunk ``c`` into ``out`` (the uint8 bytes of that chunk's elements)."""
        layout, itemsize, chunk, _, info, lanes = prep
        a, b = c * chunk, min(n, (c + 1) * chunk)
        if layout == "f16" and info[0][0] == "rans":
            p1 = self._plane(info[1], c, a, b, lanes)
            _, data, off, tabs, ctx, D = info[0]
            if rans_lanes.decode_merged(data[off[c] : off[c + 1]], a, D, ctx, tabs, lanes, p1, _EXP_HIGH,
                                        _SIGN_LOW, out.view(np.uint16)):
                raise CorruptStreamError(f"planes: rANS stream of chunk {c} is corrupt")
            return
        planes = [self._plane(p, c, a, b, lanes) for p in info]
        merge_planes(planes, layout, itemsize, out)

    @staticmethod
    def _plane(p, c, a, b, lanes) -> np.ndarray:
        mode, data, off, tabs, ctx, D = p
        if mode == "raw":
            return data[a:b]
        if mode == "const":
            return np.full(b - a, data, np.uint8)
        out = np.empty(b - a, np.uint8)
        if rans_lanes.decode(data[off[c] : off[c + 1]], a, D, ctx, tabs, lanes, out):
            raise CorruptStreamError(f"planes: rANS stream of chunk {c} is corrupt")
        return out

    def validate(self, meta, sections) -> None:
        """Check meta and sections against each other (CorruptStreamError) without decoding."""
        dtype, shape = _dtype_shape(meta)
        self._prepare(meta, sections, dtype, shape)

    def decode(self, meta, sections, prediction, threads: int) -> torch.Tensor:
        dtype, shape = _dtype_shape(meta)
        n = math.prod(shape)
        prep = self._prepare(meta, sections, dtype, shape)
        itemsize = dtype.itemsize
        chunk = prep[2]
        out = np.empty(n * itemsize, np.uint8)

        def run(c):
            a, b = c * chunk, min(n, (c + 1) * chunk)
            self._decode_range(prep, c, n, out[a * itemsize : b * itemsize])

        _pool_map(run, range(prep[3]), threads)
        return torch.from_numpy(out).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)

    def decode_chunk(self, meta, sections, c: int) -> torch.Tensor:
        """Decode chunk ``c`` alone: the flat elements ``[c * chunk, (c + 1) * chunk)`` of the tensor."""
        dtype, shape = _dtype_shape(meta)
        n = math.prod(shape)
        prep = self._prepare(meta, sections, dtype, shape)
        chunk, n_chunks = prep[2], prep[3]
        if not isinstance(c, int) or not 0 <= c < n_chunks:
            raise ValueError(f"chunk index {c} out of range (the tensor has {n_chunks} chunks)")
        a, b = c * chunk, min(n, (c + 1) * chunk)
        out = np.empty((b - a) * dtype.itemsize, np.uint8)
        self._decode_range(prep, c, n, out)
        return torch.from_numpy(out).view(dtype)


def _chunk_offsets(lens, n_chunks: int, words: int, lanes: int, k: int, device: bool):
    """Format 3: the chunk streams' word offsets [n_chunks + 1] from plane k's length section (uint32,
    one per chunk, each >= 2 * lanes, summing to the stream section's ``words``); ``device``: the
    section itself once its type and size are checked (the GPU checks the values)."""
    if not _array_like(lens) or lens.dtype != np.uint32 or lens.shape != (n_chunks,):
        raise CorruptStreamError(f"planes: bad chunk lengths for plane {k}")
    if device:
        return lens
    off = np.zeros(n_chunks + 1, np.int64)
    np.cumsum(lens, dtype=np.int64, out=off[1:])
    if (n_chunks and int(lens.min()) < 2 * lanes) or off[-1] != words:
        raise CorruptStreamError(f"planes: bad chunk lengths for plane {k}")
    return off


def format2_blob(blob) -> bytes:
    """A ``planes`` tensor blob (bytes-like) rewritten in format 2, as kvcodec before format 3 wrote it:
    each coded plane's chunk offsets in its meta entry instead of a length section. For compatibility
    tests and same-run A/B benchmarks of the two formats; both decode to the same tensor."""
    kind, meta, sections = container.loads(blob)
    cm = meta["codec_meta"]
    cm["v"] = 2
    sections = {k: np.array(v) for k, v in sections.items()}
    for k, p in enumerate(cm["planes"]):
        if p["mode"] == "rans":
            p["offsets"] = [0, *np.cumsum(sections.pop(f"p{k}.len"), dtype=np.int64).tolist()]
    return container.dumps(kind, meta, sections)


def _dtype_shape(meta) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(meta, dict):
        raise CorruptStreamError("codec meta is not an object")
    return dtype_from_name(meta.get("dtype"), "codec meta"), checked_shape(meta.get("shape"), "codec meta")


class RawCodec:
    """Stores the tensor bytes verbatim (the baseline, and the fallback for incompressible data)."""

    name = "raw"

    def encode(self, t: torch.Tensor, prediction, threads: int):
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return {"dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape)}, {"data": raw}

    def validate(self, meta, sections):
        """(dtype, shape, data) once the section is checked against the meta; CorruptStreamError."""
        dtype, shape = _dtype_shape(meta)
        data = sections.get("data")
        if set(meta) != {"dtype", "shape"} or set(sections) != {"data"} or not isinstance(data, np.ndarray) \
                or data.dtype != np.uint8 or data.size != math.prod(shape) * dtype.itemsize:
            raise CorruptStreamError("raw codec: section does not match dtype and shape")
        return dtype, shape, data

    def decode(self, meta, sections, prediction, threads: int) -> torch.Tensor:
        dtype, shape, data = self.validate(meta, sections)
        if data.size == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(data.copy()).view(dtype).reshape(shape)


registry.register(PlaneCodec())
registry.register(RawCodec())
