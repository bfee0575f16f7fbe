"""64-bit rANS, numba fast path: the steps of ``rans64`` (the spec) as inline kernels.

A model whose probabilities are computed per symbol inside a numba kernel (the predictive codec)
calls these steps from its own loop, so the model and the coder stay separate and the loop stays
in one compiled function: ``put`` (encode one interval), ``flush`` (write the final state),
``start`` / ``advance`` / ``refill`` (decode). ``encode_intervals`` and ``decode_table`` are the
array forms (a list of intervals; a static CDF table), tested word for word against the reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcodec.entropy.rans64 import M, PRECISION, RANS_L

_RENORM = (RANS_L >> PRECISION) << 32


@njit(inline="always", cache=True)
def put(x, start, freq, out, pos):
    """Encode one symbol (interval ``[start, start + freq)``); words go to ``out[pos - 1]``,
    ``out[pos - 2]``, ... Returns (x, pos)."""
    if x >= np.int64(_RENORM) * freq:
        pos -= 1
        out[pos] = x & 0xFFFFFFFF
        x >>= 32
    return ((x // freq) << PRECISION) + (x % freq) + start, pos


@njit(inline="always", cache=True)
def flush(x, out, pos):
    """Write the final state in front of the words; returns the stream's first index."""
    out[pos - 1] = x & 0xFFFFFFFF
    out[pos - 2] = x >> 32
    return pos - 2


@njit(inline="always", cache=True)
def start(words, ptr):
    """The initial decoder state from ``words[ptr], words[ptr + 1]`` (caller checks the length)."""
    return (np.int64(words[ptr]) << 32) | np.int64(words[ptr + 1])


@njit(inline="always", cache=True)
def advance(x, slot, start_, freq):
    """The state after decoding the symbol with interval ``(start_, freq)`` that holds ``slot``."""
    return freq * (x >> PRECISION) + slot - start_


@njit(inline="always", cache=True)
def refill(x, words, ptr, end):
    """Renormalise after ``advance``: (x, ptr, ok); ok is False if a word is needed past ``end``."""
    if x < RANS_L:
        if ptr >= end:
            return x, ptr, False
        x = (x << 32) | np.int64(words[ptr])
        ptr += 1
    return x, ptr, True


@njit(cache=True, nogil=True)
def encode_intervals(starts, freqs, out):
    """Encode intervals (int64 arrays) into ``out`` (uint32, room for n + 2 words, filled from the
    end); returns the index where the stream starts."""
    x = np.int64(RANS_L)
    pos = out.size
    for i in range(starts.size - 1, -1, -1):
        x, pos = put(x, starts[i], freqs[i], out, pos)
    return flush(x, out, pos)


@njit(cache=True, nogil=True)
def decode_table(words, cum, out):
    """Decode ``out.size`` symbols with one static CDF table ``cum`` (int64[n_symbols + 1], 0 .. M,
    strictly increasing). Returns 0, or 1 if the stream is malformed."""
    end = words.size
    if end < 2:
        return 1
    x = start(words, 0)
    if x < RANS_L:
        return 1
    ptr = 2
    n_sym = cum.size - 1
    for i in range(out.size):
        slot = x & (M - 1)
        lo, hi = 0, n_sym
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if cum[mid] <= slot:
                lo = mid
            else:
                hi = mid
        x = advance(x, slot, cum[lo], cum[lo + 1] - cum[lo])
        x, ptr, ok = refill(x, words, ptr, end)
        if not ok:
            return 1
        out[i] = lo
    return 0 if (x == RANS_L and ptr == end) else 1
