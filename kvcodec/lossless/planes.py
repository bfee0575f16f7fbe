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

Every plane is coded over the whole tensor with one static frequency table (12-bit precision,
frequencies from ``kvcodec.entropy.freq``), or stored raw when coding saves less than
``min_gain`` (default 2%, so near-uniform mantissa planes cost no decode time). The tensor is cut
into chunks of ``chunk_bytes`` of input (default 2 MiB); each chunk of a coded plane is its own
4-state interleaved rANS stream, so chunks are encoded and decoded in parallel (numba ``nogil``
kernels on a thread pool) and one chunk can be decoded alone (:func:`decode_chunk`).

rANS stream format (per chunk, a run of little-endian uint16 words): words 0..7 hold the 4 final
encoder states (low half, high half), then the renormalization words in decode order. State
``x`` lives in [2**16, 2**32); symbol ``i`` of the chunk uses state ``i % 4``; decode is
``slot = x & 4095; x = f[s] * (x >> 12) + slot - c[s]; if x < 2**16: x = x << 16 | next word``.
The decoder checks that it consumed exactly the chunk's words and that every state ends at 2**16.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from kvcodec import container
from kvcodec.entropy.freq import quantize_frequencies
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import registry

PREC = 12
M = 1 << PREC
RANS_L = 1 << 16
N_STATES = 4
DEFAULT_CHUNK_BYTES = 2 << 20
DEFAULT_MIN_GAIN = 0.02
FORMAT_VERSION = 1

_F16 = ("bfloat16", "float16")
_EMPTY8 = np.zeros(0, np.uint8)


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
def _rans_encode(sym, freq, cum, words):
    """Encode ``sym`` (uint8) into ``words`` (uint16, filled from the end); returns the start index."""
    n = sym.size
    wp = words.size
    x0 = np.int64(RANS_L)
    x1 = np.int64(RANS_L)
    x2 = np.int64(RANS_L)
    x3 = np.int64(RANS_L)
    for i in range(n - 1, -1, -1):
        s = sym[i]
        f = np.int64(freq[s])
        c = np.int64(cum[s])
        lim = f << 20
        j = i & 3
        if j == 0:
            x = x0
        elif j == 1:
            x = x1
        elif j == 2:
            x = x2
        else:
            x = x3
        if x >= lim:
            wp -= 1
            words[wp] = x & 0xFFFF
            x >>= 16
        x = ((x // f) << PREC) + (x % f) + c
        if j == 0:
            x0 = x
        elif j == 1:
            x1 = x
        elif j == 2:
            x2 = x
        else:
            x3 = x
    wp -= 8
    words[wp] = x0 & 0xFFFF
    words[wp + 1] = x0 >> 16
    words[wp + 2] = x1 & 0xFFFF
    words[wp + 3] = x1 >> 16
    words[wp + 4] = x2 & 0xFFFF
    words[wp + 5] = x2 >> 16
    words[wp + 6] = x3 & 0xFFFF
    words[wp + 7] = x3 >> 16
    return wp


@njit(nogil=True, cache=True, inline="always")
def _step(x, tab, words, pos):
    d = np.int64(tab[x & (M - 1)])
    x = (((d >> 12) & 0xFFF) + 1) * (x >> PREC) + (d & 0xFFF)
    need = np.int64(x < RANS_L)
    x = (x << (need << 4)) | (np.int64(words[pos]) & (-need))
    return x, pos + need, d >> 24


@njit(nogil=True, cache=True)
def _rans_decode(words, tab, out, p1, u16):
    """Decode ``out.size`` symbols. With ``u16.size > 0`` write the merged 16-bit values (``p1`` the
    sign/low plane) instead of ``out``. Returns 0, or 1 if the stream is malformed."""
    nw = words.size
    n = out.size if u16.size == 0 else u16.size
    if nw < 8:
        return 1
    x0 = np.int64(words[0]) | (np.int64(words[1]) << 16)
    x1 = np.int64(words[2]) | (np.int64(words[3]) << 16)
    x2 = np.int64(words[4]) | (np.int64(words[5]) << 16)
    x3 = np.int64(words[6]) | (np.int64(words[7]) << 16)
    if x0 < RANS_L or x1 < RANS_L or x2 < RANS_L or x3 < RANS_L:
        return 1
    pos = 8
    merge = u16.size > 0
    i = 0
    # Fast loop: 4 symbols read at most 4 words; reading words[pos] is in bounds while pos < nw.
    while i + 4 <= n and pos + 4 < nw:
        x0, pos, s0 = _step(x0, tab, words, pos)
        x1, pos, s1 = _step(x1, tab, words, pos)
        x2, pos, s2 = _step(x2, tab, words, pos)
        x3, pos, s3 = _step(x3, tab, words, pos)
        if merge:
            for k in range(4):
                s = s0 if k == 0 else (s1 if k == 1 else (s2 if k == 2 else s3))
                b = np.int64(p1[i + k])
                u16[i + k] = ((b & 0x80) << 8) | (s << 7) | (b & 0x7F)
        else:
            out[i] = s0
            out[i + 1] = s1
            out[i + 2] = s2
            out[i + 3] = s3
        i += 4
    # Careful tail: bounds-checked reads.
    while i < n:
        j = i & 3
        x = x0 if j == 0 else (x1 if j == 1 else (x2 if j == 2 else x3))
        d = np.int64(tab[x & (M - 1)])
        x = (((d >> 12) & 0xFFF) + 1) * (x >> PREC) + (d & 0xFFF)
        if x < RANS_L:
            if pos >= nw:
                return 1
            x = (x << 16) | np.int64(words[pos])
            pos += 1
        s = d >> 24
        if merge:
            b = np.int64(p1[i])
            u16[i] = ((b & 0x80) << 8) | (s << 7) | (b & 0x7F)
        else:
            out[i] = s
        if j == 0:
            x0 = x
        elif j == 1:
            x1 = x
        elif j == 2:
            x2 = x
        else:
            x3 = x
        i += 1
    if pos != nw or x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L:
        return 1
    return 0


# --------------------------------------------------------------------------- tables
def _cum(freq: np.ndarray) -> np.ndarray:
    c = np.zeros(256, np.int64)
    c[1:] = np.cumsum(freq[:-1], dtype=np.int64)
    return c


def _decode_table(freq: np.ndarray) -> np.ndarray:
    """uint32[4096]: symbol << 24 | (freq - 1) << 12 | (slot - cum) for every slot."""
    sym = np.repeat(np.arange(256, dtype=np.uint32), freq.astype(np.int64))
    cum = _cum(freq)
    slot = np.arange(M, dtype=np.int64)
    f = freq.astype(np.int64)[sym]
    return ((sym.astype(np.int64) << 24) | ((f - 1) << 12) | (slot - cum[sym])).astype(np.uint32)


def _pack_table(freq: np.ndarray) -> np.ndarray:
    used = np.flatnonzero(freq)
    out = np.empty(2 * used.size, np.uint16)
    out[0::2] = used
    out[1::2] = freq[used]
    return out


def _unpack_table(packed) -> np.ndarray:
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint16 or packed.ndim != 1 or packed.size % 2:
        raise CorruptStreamError("planes: bad frequency table section")
    sym, f = packed[0::2].astype(np.int64), packed[1::2].astype(np.int64)
    if sym.size == 0 or sym.max() > 255 or np.any(np.diff(sym) <= 0) or f.min() < 1 or f.sum() != M:
        raise CorruptStreamError("planes: invalid frequency table")
    freq = np.zeros(256, np.int64)
    freq[sym] = f
    return freq


def _coded_bits(counts: np.ndarray, freq: np.ndarray) -> float:
    m = counts > 0
    return float(np.sum(counts[m] * (PREC - np.log2(freq[m]))))


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


def split_planes(raw: np.ndarray, layout: str, itemsize: int) -> list[np.ndarray]:
    """Byte planes (uint8 arrays of n elements) of the little-endian element bytes ``raw``."""
    n = raw.size // itemsize
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
    workers = min(registry.resolve_threads(threads), len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


class PlaneCodec:
    """Byte-plane split + static rANS per plane (see the module docstring)."""

    name = "planes"

    def encode(self, t: torch.Tensor, prediction, threads: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               min_gain: float = DEFAULT_MIN_GAIN):
        if not isinstance(chunk_bytes, int) or chunk_bytes < 64:
            raise ValueError("chunk_bytes must be an integer >= 64")
        if not 0.0 <= float(min_gain) < 1.0:
            raise ValueError("min_gain must be in [0, 1)")
        itemsize = t.element_size()
        layout = layout_of(t.dtype)
        n = t.numel()
        raw = t.reshape(-1).view(torch.uint8).numpy() if n else np.zeros(0, np.uint8)
        chunk = max(1, chunk_bytes // itemsize)
        bounds = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
        planes = _pool_map(lambda ab: split_planes(raw[ab[0] * itemsize : ab[1] * itemsize], layout, itemsize),
                           bounds, threads)
        n_planes = _n_planes(layout, itemsize)
        meta = {"v": FORMAT_VERSION, "dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape),
                "layout": layout, "chunk": chunk, "modes": []}
        sections: dict[str, np.ndarray] = {}
        for k in range(n_planes):
            parts = [p[k] for p in planes]
            counts = np.zeros(256, np.int64)
            for part in parts:
                _histogram(part, counts)
            mode = "raw"
            if n:
                freq = quantize_frequencies(counts, PREC).astype(np.int64)
                est_bytes = _coded_bits(counts, freq) / 8 + 16 * len(parts) + 2 * np.count_nonzero(freq)
                if est_bytes < (1.0 - float(min_gain)) * n:
                    mode = "rans"
            meta["modes"].append(mode)
            if mode == "raw":
                sections[f"p{k}"] = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
                continue
            cum = _cum(freq)

            def enc(part, freq=freq, cum=cum):
                words = np.empty(part.size + 8 + 8, np.uint16)  # worst case: one word per symbol + states
                start = _rans_encode(part, freq, cum, words)
                return words[start:]

            streams = _pool_map(enc, parts, threads)
            offsets = np.zeros(len(streams) + 1, np.int64)
            offsets[1:] = np.cumsum([s.size for s in streams])
            sections[f"p{k}"] = np.concatenate(streams)
            sections[f"p{k}.off"] = offsets
            sections[f"p{k}.tab"] = _pack_table(freq)
        return meta, sections

    # ---- decoding
    def _prepare(self, meta, sections, dtype: torch.dtype, n: int):
        """Validate meta/sections against the expected tensor; returns per-plane decode info."""
        if set(meta) != {"v", "dtype", "shape", "layout", "chunk", "modes"} or meta["v"] != FORMAT_VERSION:
            raise CorruptStreamError("planes: bad codec meta")
        itemsize = dtype.itemsize
        layout, chunk, modes = meta["layout"], meta["chunk"], meta["modes"]
        if layout != layout_of(dtype):
            raise CorruptStreamError("planes: layout does not match the dtype")
        if type(chunk) is not int or chunk < 1:
            raise CorruptStreamError("planes: bad chunk size")
        n_planes = _n_planes(layout, itemsize)
        if not isinstance(modes, list) or len(modes) != n_planes or any(m not in ("raw", "rans") for m in modes):
            raise CorruptStreamError("planes: bad plane modes")
        n_chunks = -(-n // chunk)
        expected = set()
        info = []
        for k, mode in enumerate(modes):
            data = sections.get(f"p{k}")
            expected.add(f"p{k}")
            if mode == "raw":
                if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (n,):
                    raise CorruptStreamError(f"planes: raw plane {k} has the wrong size")
                info.append(("raw", data, None, None))
                continue
            expected.update({f"p{k}.off", f"p{k}.tab"})
            off = sections.get(f"p{k}.off")
            if not isinstance(data, np.ndarray) or data.dtype != np.uint16 or data.ndim != 1:
                raise CorruptStreamError(f"planes: coded plane {k} is not a uint16 stream")
            if (not isinstance(off, np.ndarray) or off.dtype != np.int64 or off.shape != (n_chunks + 1,)
                    or off[0] != 0 or off[-1] != data.size or np.any(np.diff(off) < 8)):
                raise CorruptStreamError(f"planes: bad chunk offsets for plane {k}")
            freq = _unpack_table(sections.get(f"p{k}.tab"))
            info.append(("rans", data, off, _decode_table(freq)))
        if set(sections) != expected:
            raise CorruptStreamError("planes: unexpected or missing sections")
        return layout, itemsize, chunk, n_chunks, info

    def _decode_range(self, layout, itemsize, chunk, info, c: int, n: int, out: np.ndarray) -> None:
        """Decode chunk ``c`` into ``out`` (the uint8 bytes of that chunk's elements)."""
        a, b = c * chunk, min(n, (c + 1) * chunk)
        m = b - a
        empty16 = np.zeros(0, np.uint16)
        if layout == "f16" and info[0][0] == "rans":
            p1 = self._plane(info[1], c, a, b, empty16)
            words = info[0][1][info[0][2][c] : info[0][2][c + 1]]
            if _rans_decode(words, info[0][3], np.zeros(0, np.uint8), p1, out.view(np.uint16)):
                raise CorruptStreamError(f"planes: rANS stream of chunk {c} is corrupt")
            return
        planes = [self._plane(p, c, a, b, empty16) for p in info]
        merge_planes(planes, layout, itemsize, out)

    @staticmethod
    def _plane(p, c, a, b, empty16) -> np.ndarray:
        mode, data, off, tab = p
        if mode == "raw":
            return data[a:b]
        out = np.empty(b - a, np.uint8)
        if _rans_decode(data[off[c] : off[c + 1]], tab, out, _EMPTY8, empty16):
            raise CorruptStreamError(f"planes: rANS stream of chunk {c} is corrupt")
        return out

    def decode(self, meta, sections, prediction, threads: int) -> torch.Tensor:
        dtype, shape = _dtype_shape(meta)
        n = math.prod(shape)
        layout, itemsize, chunk, n_chunks, info = self._prepare(meta, sections, dtype, n)
        out = np.empty(n * itemsize, np.uint8)

        def run(c):
            a, b = c * chunk, min(n, (c + 1) * chunk)
            self._decode_range(layout, itemsize, chunk, info, c, n, out[a * itemsize : b * itemsize])

        _pool_map(run, range(n_chunks), threads)
        return torch.from_numpy(out).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)

    def decode_chunk(self, meta, sections, c: int) -> torch.Tensor:
        """Decode chunk ``c`` alone: the flat elements ``[c * chunk, (c + 1) * chunk)`` of the tensor."""
        dtype, shape = _dtype_shape(meta)
        n = math.prod(shape)
        layout, itemsize, chunk, n_chunks, info = self._prepare(meta, sections, dtype, n)
        if not 0 <= c < n_chunks:
            raise ValueError(f"chunk index {c} out of range (the tensor has {n_chunks} chunks)")
        a, b = c * chunk, min(n, (c + 1) * chunk)
        out = np.empty((b - a) * itemsize, np.uint8)
        self._decode_range(layout, itemsize, chunk, info, c, n, out)
        return torch.from_numpy(out).view(dtype)


def _dtype_shape(meta) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(meta, dict):
        raise CorruptStreamError("codec meta is not an object")
    dtype = container.torch_dtypes().get(meta.get("dtype")) if isinstance(meta.get("dtype"), str) else None
    shape = meta.get("shape")
    if dtype is None or not isinstance(shape, list) or len(shape) > container.MAX_NDIM or any(
        type(d) is not int or d < 0 for d in shape
    ):
        raise CorruptStreamError("codec meta has a bad dtype or shape")
    return dtype, tuple(shape)


class RawCodec:
    """Stores the tensor bytes verbatim (the baseline, and the fallback for incompressible data)."""

    name = "raw"

    def encode(self, t: torch.Tensor, prediction, threads: int):
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return {"dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape)}, {"data": raw}

    def decode(self, meta, sections, prediction, threads: int) -> torch.Tensor:
        dtype, shape = _dtype_shape(meta)
        data = sections.get("data")
        n = math.prod(shape)
        if set(meta) != {"dtype", "shape"} or set(sections) != {"data"} or not isinstance(data, np.ndarray) \
                or data.dtype != np.uint8 or data.size != n * dtype.itemsize:
            raise CorruptStreamError("raw codec: section does not match dtype and shape")
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(data.copy()).view(dtype).reshape(shape)


registry.register(PlaneCodec())
registry.register(RawCodec())
