"""32-bit rANS over N interleaved lanes with per-row context tables (numba): the byte-plane coder.

The format is the one :mod:`kvcodec.entropy.rans` specifies (its ``encode_ctx`` is the
pure-Python reference, and tests check these kernels against it byte for byte), specialised for
what tensor codecs need and fast:

- byte symbols, 12-bit probabilities (``PRECISION``), tables of 256 frequencies;
- ``lanes`` interleaved states (8, or 32 = one warp of the GPU decoder in ``kvcodec.entropy.cuda.rans``):
  symbol ``i`` of a stream uses lane ``i % lanes``;
- contexts by *row*: the stream holds elements ``a .. a+n`` of a longer array cut into rows of
  ``D`` elements, and element ``e`` is coded with table ``rowctx[e // D]`` (one table: ``D`` >= the
  whole array, ``rowctx = [0]``).

A stream is a run of little-endian uint16 words: the ``lanes`` final encoder states (low half,
high half; i.e. the spec's uint32 states), then the renormalisation words in decode order. Decoding
``slot = x & 4095; x = f[s] * (x >> 12) + slot - c[s]; if x < 2**16: x = x << 16 | next word``; the
decoder checks that it used exactly the stream's words and that every lane ends at 2**16.

The decode table of a context is ``uint32[4096]``: ``symbol << 24 | (freq - 1) << 12 | (slot - cum)``
(one load per symbol). ``decode_merged`` fuses the decode with a second byte plane into 16-bit
words (``out = hi[symbol] | lo[side byte]``), so a float16/bfloat16 tensor is rebuilt in one pass.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcodec.kernel_inputs import readonly

PRECISION = 12
M = 1 << PRECISION
RANS_L = 1 << 16
LANES = (8, 32)  # lane counts with compiled decoders (multiples of 8; 32 = the GPU warp layout)


# --------------------------------------------------------------------------- tables (the model side)
def cumulative(freq: np.ndarray) -> np.ndarray:
    """int64 cumulative frequencies (exclusive) along the last axis."""
    c = np.zeros(freq.shape, np.int64)
    c[..., 1:] = np.cumsum(freq[..., :-1], axis=-1, dtype=np.int64)
    return c


def decode_table(freq: np.ndarray) -> np.ndarray:
    """uint32[4096] for one table of 256 frequencies summing to 4096 (format above)."""
    return decode_tables(np.asarray(freq).reshape(1, 256))


def decode_tables(freqs: np.ndarray) -> np.ndarray:
    """The decode tables of K contexts back to back (uint32[K * 4096])."""
    f = np.ascontiguousarray(np.asarray(freqs).reshape(-1, 256), np.int64)
    if f.size and (f.min() < 0 or np.any(f.sum(axis=1) != M)):
        raise ValueError("every decode table needs 256 non-negative frequencies summing to 4096")
    out = np.empty(f.shape[0] * M, np.uint32)
    _fill_decode_tables(f, out)
    return out


@njit(nogil=True, cache=True)
def _fill_decode_tables(freqs, out):
    for k in range(freqs.shape[0]):
        slot = k * M
        for s in range(256):
            f = freqs[k, s]
            for r in range(f):
                out[slot] = (s << 24) | ((f - 1) << 12) | r
                slot += 1


# --------------------------------------------------------------------------- encoder
@njit(nogil=True, cache=True)
def encode(sym, a, D, rowctx, freq, cum, lanes, words):
    """Encode ``sym`` (uint8, elements ``a .. a+n``) into ``words`` (uint16, filled from the end;
    room for ``n + 2 * lanes`` words); element ``e`` uses table ``rowctx[e // D]`` of ``freq`` /
    ``cum`` ([K, 256], int64) and lane ``(e - a) % lanes``. Returns the stream's first index."""
    n = sym.size
    wp = words.size
    xs = np.full(lanes, RANS_L, np.int64)
    r = (a + n - 1) // D
    lo = r * D - a  # stream-relative index where row r starts
    k = np.int64(rowctx[r]) if n > 0 else 0
    for i in range(n - 1, -1, -1):
        while i < lo:
            r -= 1
            lo -= D
            k = np.int64(rowctx[r])
        s = sym[i]
        f = freq[k, s]
        j = i % lanes
        x = xs[j]
        if x >= (f << (32 - PRECISION)):
            wp -= 1
            words[wp] = x & 0xFFFF
            x >>= 16
        q = np.int64(np.float64(x) / np.float64(f))  # exact: x < 2**32, so x/f is >= 1/f from the next integer
        xs[j] = (q << PRECISION) + (x - q * f) + cum[k, s]
    for j in range(lanes - 1, -1, -1):
        wp -= 2
        words[wp] = xs[j] & 0xFFFF
        words[wp + 1] = xs[j] >> 16
    return wp


# --------------------------------------------------------------------------- decoders
@njit(nogil=True, cache=True, inline="always")
def _step(x, tabs, base, words, pos):
    """One decode step with a bounds-free read (the caller guarantees ``pos < words.size``)."""
    d = np.int64(tabs[base + (x & (M - 1))])
    x = (((d >> 12) & 0xFFF) + 1) * (x >> PRECISION) + (d & 0xFFF)
    need = np.int64(x < RANS_L)
    x = (x << (need << 4)) | (np.int64(words[pos]) & (-need))
    return x, pos + need, d >> 24


@njit(nogil=True, cache=True, inline="always")
def decode_step(x, tabs, base, words, pos, end):
    """One decode step of a lane state ``x`` with the table at ``tabs[base:base + 4096]``:
    (x, pos, symbol). Branch-free renormalisation: the word read is ``words[min(pos, end - 1)]``
    (``end >= 1``), so a truncated stream never reads past ``end``; it shows as ``pos > end``,
    which the caller checks once at the end. For decoders whose table is known only after the
    previous symbols (a model in the loop)."""
    d = np.int64(tabs[base + (x & (M - 1))])
    x = (((d >> 12) & 0xFFF) + 1) * (x >> PRECISION) + (d & 0xFFF)
    need = np.int64(x < RANS_L)
    x = (x << (need << 4)) | (np.int64(words[min(pos, end - 1)]) & (-need))
    return x, pos + need, d >> 24


@njit(nogil=True, cache=True, inline="always")
def start_states(words, start, lanes, xs):
    """Read the ``lanes`` initial states of the stream at ``words[start:]`` into ``xs``; False if
    one is out of range (the caller checks that ``2 * lanes`` words exist)."""
    for j in range(lanes):
        xs[j] = np.int64(words[start + 2 * j]) | (np.int64(words[start + 2 * j + 1]) << 16)
        if xs[j] < RANS_L:
            return False
    return True


def _make_decoder(lanes: int, merge: bool):
    """The stream decoder for ``lanes`` lanes; ``merge`` writes 16-bit words (both compile-time)."""

    @njit(nogil=True, cache=True)
    def decode(words, a, D, rowctx, tabs, out, side, hi, lo):
        """Decode the stream of elements ``a .. a+n`` (table ``rowctx[e // D]`` of ``tabs`` for
        element ``e``) into ``out`` (uint8 symbols, or uint16 ``hi[s] | lo[side[i]]`` when merging).
        Returns 0, or 1 if the stream is malformed. Never reads or writes out of bounds."""
        nw = words.size
        n = out.size
        if nw < 2 * lanes:
            return 1
        xs = np.empty(lanes, np.int64)
        if not start_states(words, 0, lanes, xs):
            return 1
        pos = 2 * lanes
        r = a // D
        nxt = (r + 1) * D - a  # stream-relative index where the next row starts
        base = np.int64(rowctx[r]) * M if n > 0 else 0
        i = 0
        while i < n:
            if i == nxt:
                r += 1
                nxt += D
                base = np.int64(rowctx[r]) * M
            end = min(nxt, n)
            if i % lanes == 0:
                # fast path: one symbol per lane, all in one row, reading at most `lanes` words
                while i + lanes <= end and pos + lanes < nw:
                    for g in range(0, lanes, 8):  # 8 lanes at a time in registers
                        x0, pos, s0 = _step(xs[g], tabs, base, words, pos)
                        x1, pos, s1 = _step(xs[g + 1], tabs, base, words, pos)
                        x2, pos, s2 = _step(xs[g + 2], tabs, base, words, pos)
                        x3, pos, s3 = _step(xs[g + 3], tabs, base, words, pos)
                        x4, pos, s4 = _step(xs[g + 4], tabs, base, words, pos)
                        x5, pos, s5 = _step(xs[g + 5], tabs, base, words, pos)
                        x6, pos, s6 = _step(xs[g + 6], tabs, base, words, pos)
                        x7, pos, s7 = _step(xs[g + 7], tabs, base, words, pos)
                        xs[g], xs[g + 1], xs[g + 2], xs[g + 3] = x0, x1, x2, x3
                        xs[g + 4], xs[g + 5], xs[g + 6], xs[g + 7] = x4, x5, x6, x7
                        o = i + g
                        if merge:
                            out[o], out[o + 1] = hi[s0] | lo[side[o]], hi[s1] | lo[side[o + 1]]
                            out[o + 2], out[o + 3] = hi[s2] | lo[side[o + 2]], hi[s3] | lo[side[o + 3]]
                            out[o + 4], out[o + 5] = hi[s4] | lo[side[o + 4]], hi[s5] | lo[side[o + 5]]
                            out[o + 6], out[o + 7] = hi[s6] | lo[side[o + 6]], hi[s7] | lo[side[o + 7]]
                        else:
                            out[o], out[o + 1], out[o + 2], out[o + 3] = s0, s1, s2, s3
                            out[o + 4], out[o + 5], out[o + 6], out[o + 7] = s4, s5, s6, s7
                    i += lanes
                if i >= end:
                    continue
            # careful path (row edges, stream tail): one symbol, bounds-checked read
            j = i % lanes
            xs[j], pos, s = decode_step(xs[j], tabs, base, words, pos, nw)
            if pos > nw:
                return 1
            if merge:
                out[i] = hi[s] | lo[side[i]]
            else:
                out[i] = s
            i += 1
        if pos != nw:
            return 1
        for j in range(lanes):
            if xs[j] != RANS_L:
                return 1
        return 0

    return decode


_DECODERS = {(lanes, merge): _make_decoder(lanes, merge) for lanes in LANES for merge in (False, True)}
_NO_SIDE = readonly(np.zeros(0, np.uint8))
_NO_LUT = readonly(np.zeros(1, np.uint16))


def decode(words, a, D, rowctx, tabs, lanes, out) -> int:
    """Decode a stream into the uint8 symbols ``out``; 0, or 1 if the stream is malformed. Every input
    array goes in read-only (one compile whether it came from a blob's bytes or was built here)."""
    return _DECODERS[lanes, False](readonly(words), a, D, readonly(rowctx), readonly(tabs), out, _NO_SIDE,
                                   _NO_LUT, _NO_LUT)


def decode_merged(words, a, D, rowctx, tabs, lanes, side, hi, lo, out16) -> int:
    """Decode a stream straight into 16-bit words ``out16[i] = hi[symbol] | lo[side[i]]``."""
    return _DECODERS[lanes, True](readonly(words), a, D, readonly(rowctx), readonly(tabs), out16, readonly(side),
                                  readonly(hi), readonly(lo))


def row_contexts(a: int, n: int, D: int, rowctx: np.ndarray) -> np.ndarray:
    """The per-symbol context array of a stream (what the reference ``rans.encode_ctx`` takes)."""
    return np.asarray(rowctx, np.int64)[(a + np.arange(n, dtype=np.int64)) // D]
