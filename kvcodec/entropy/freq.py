"""Frequency quantization: symbol counts -> integer frequencies summing to 2**precision.

Static ANS and range coders need every symbol's probability as ``freq / 2**precision``.
Rounding the empirical distribution to that grid costs bits; this module picks the integer
frequencies that cost the fewest, so the coders stay within a fraction of a percent of the
empirical entropy.

How (all exact and deterministic for a given input):

1. Proportional start: ``f_s = max(1, floor(count_s * M / total))`` for every symbol with a
   nonzero count (``M = 2**precision``). Every used symbol keeps ``f_s >= 1`` so it stays
   codable; unused symbols get 0.
2. Fix the sum: the code length of the data is ``L(f) = sum_s count_s * log2(M / f_s)``, a
   separable convex function of the ``f_s``. While ``sum(f) < M`` add one unit to the symbol
   whose cost drops most (``count_s * log2((f_s+1)/f_s)``); while ``sum(f) > M`` take one unit
   from the symbol (with ``f_s > 1``) whose cost rises least (``count_s * log2(f_s/(f_s-1))``).
   Both use a heap (numba-compiled).
3. Polish: while moving one unit from the cheapest donor to the best receiver still lowers
   ``L(f)``, move it. For a separable convex objective
   under a sum constraint, a point where no single-unit move helps is the global integer
   optimum, so the result minimizes the code length penalty exactly (up to float ties).
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from numba import njit

MIN_PRECISION = 1
MAX_PRECISION = 16


def quantize_frequencies(counts, precision: int) -> np.ndarray:
    """Integer frequencies (np.uint32, same length as ``counts``) summing to ``2**precision``.

    ``counts``: non-negative integers, one per symbol of the alphabet. Symbols with a zero count
    get frequency 0, all others at least 1. Raises ValueError if there are no symbols or more
    distinct symbols than ``2**precision`` slots.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1:
        raise ValueError("counts must be a 1-D array")
    if counts.size and (counts.dtype.kind not in "iu" or counts.min() < 0):
        raise ValueError("counts must be non-negative integers")
    if not (MIN_PRECISION <= int(precision) <= 30):
        raise ValueError(f"precision must be in [1, 30], got {precision}")
    precision = int(precision)
    total_slots = 1 << precision
    counts = counts.astype(np.int64)
    used = np.flatnonzero(counts)
    if used.size == 0:
        raise ValueError("no symbol has a nonzero count")
    if used.size > total_slots:
        raise ValueError(
            f"{used.size} distinct symbols do not fit in 2**{precision} frequency slots"
        )
    c = counts[used]
    total = int(c.sum())
    # Step 1: proportional rounding with floor 1 (integer arithmetic, no float rounding).
    f = np.maximum(1, (c * total_slots) // total) if integer_rounding(total, precision) else np.maximum(
        1, np.floor(c.astype(np.float64) * (total_slots / total)).astype(np.int64)
    )
    f = f.astype(np.int64)
    _fix_sum_and_polish(f, c.astype(np.float64), total_slots)
    out = np.zeros(counts.size, dtype=np.uint32)
    out[used] = f.astype(np.uint32)
    return out


@njit(cache=True)
def _gain(c, f):
    """Bits saved by raising f to f+1."""
    return c * math.log2((f + 1) / f)


@njit(cache=True)
def _loss(c, f):
    """Bits lost by lowering f to f-1 (infinite when f == 1: the symbol must stay codable)."""
    return c * math.log2(f / (f - 1)) if f > 1 else math.inf


def integer_rounding(total: int, precision: int) -> bool:
    """Whether :func:`quantize_frequencies` rounds counts summing to ``total`` in integers (exactly):
    below ``2**62 >> precision``; above it, in floats."""
    return total < (1 << 62) >> precision


@njit(cache=True, nogil=True)
def quantize_rows(counts, rows, precision, out):
    """``out[k] = quantize_frequencies(counts[k], precision)`` for each k of ``rows``, compiled and
    without the GIL (many tables at once, e.g. on a thread pool): its integer step 1 and
    :func:`_fix_sum_and_polish`. Each row must be used, fit its slots and round in integers
    (:func:`integer_rounding`); unchecked here."""
    slots = 1 << precision
    for k in rows:
        used = np.flatnonzero(counts[k])
        c = counts[k][used]
        f = np.maximum(1, (c * slots) // c.sum())
        _fix_sum_and_polish(f, c.astype(np.float64), slots)
        for j in range(used.size):
            out[k, used[j]] = f[j]


@njit(cache=True)
def _fix_sum_and_polish(f, c, total_slots):
    """Steps 2 and 3 of the module docstring, with heaps (stale entries dropped lazily)."""
    n = f.size
    excess = f.sum() - total_slots
    if excess < 0:
        heap = [(-_gain(c[i], f[i]), i) for i in range(n)]
        heapq.heapify(heap)
        for _ in range(-excess):
            i = heapq.heappop(heap)[1]
            f[i] += 1
            heapq.heappush(heap, (-_gain(c[i], f[i]), i))
    elif excess > 0:
        heap = [(_loss(c[i], f[i]), i) for i in range(n)]
        heapq.heapify(heap)
        for _ in range(excess):  # sum(f) > M >= n: a donor with f > 1 (finite loss) exists
            i = heapq.heappop(heap)[1]
            f[i] -= 1
            heapq.heappush(heap, (_loss(c[i], f[i]), i))
    if n < 2:
        return
    gains = [(-_gain(c[i], f[i]), i) for i in range(n)]
    losses = [(_loss(c[i], f[i]), i) for i in range(n)]
    heapq.heapify(gains)
    heapq.heapify(losses)
    while True:
        # A fresh entry is pushed whenever f changes, so the current value is always present.
        while -gains[0][0] != _gain(c[gains[0][1]], f[gains[0][1]]):
            heapq.heappop(gains)
        while losses[0][0] != _loss(c[losses[0][1]], f[losses[0][1]]):
            heapq.heappop(losses)
        g, i = -gains[0][0], gains[0][1]
        lo, j = losses[0]
        # If i == j no move helps: by convexity gain(i) < loss(i) <= every other loss, and
        # every other gain <= gain(i). Otherwise move only on a strict (non-rounding) gain.
        if lo == math.inf or i == j or not g - lo > 1e-12 * (g + lo):
            return
        f[i] += 1
        f[j] -= 1
        heapq.heappush(gains, (-_gain(c[i], f[i]), i))
        heapq.heappush(gains, (-_gain(c[j], f[j]), j))
        heapq.heappush(losses, (_loss(c[i], f[i]), i))
        heapq.heappush(losses, (_loss(c[j], f[j]), j))


def count_symbols(symbols) -> np.ndarray:
    """Histogram of a 1-D uint8/uint16 array over its whole alphabet (int64, 256 or 65536).

    Several times faster than ``np.bincount`` (which first widens the input to intp): four
    interleaved sub-histograms keep consecutive equal symbols from serialising on one counter.
    """
    x = np.asarray(symbols)
    if x.ndim != 1 or x.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("symbols must be a 1-D uint8 or uint16 array")
    return _histogram(np.ascontiguousarray(x), 256 if x.dtype == np.uint8 else 65536)


@njit(cache=True, nogil=True)
def _histogram(x, alphabet):
    h = np.zeros((4, alphabet), dtype=np.int64)
    n4 = x.size - x.size % 4
    for i in range(0, n4, 4):
        h[0, x[i]] += 1
        h[1, x[i + 1]] += 1
        h[2, x[i + 2]] += 1
        h[3, x[i + 3]] += 1
    for i in range(n4, x.size):
        h[0, x[i]] += 1
    return h[0] + h[1] + h[2] + h[3]


def code_length_bits(counts, freqs, precision: int) -> float:
    """Ideal code length (bits) of data with these counts under frequencies ``freqs / 2**precision``."""
    counts = np.asarray(counts, dtype=np.float64)
    freqs = np.asarray(freqs, dtype=np.float64)
    m = counts > 0
    if np.any(freqs[m] == 0):
        return math.inf
    return float(np.sum(counts[m] * (precision - np.log2(freqs[m]))))


def entropy_bits(counts) -> float:
    """Empirical (order-0) entropy of data with these counts, in bits per symbol."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def choose_precision(n_distinct: int, max_precision: int = MAX_PRECISION) -> int:
    """Default probability precision (bits) for an alphabet with ``n_distinct`` used symbols.

    More precision means a smaller rounding penalty for rare symbols but a bigger decode table
    (``2**precision`` entries, ideally cache-resident). Small alphabets get 12-14 bits; big ones
    need ``2**precision >= n_distinct`` plus headroom, capped at ``max_precision``.
    """
    if n_distinct < 1:
        raise ValueError("n_distinct must be >= 1")
    need = max(1, (n_distinct - 1).bit_length())
    p = max(12, need + 6)
    p = min(p, max_precision)
    if (1 << p) < n_distinct:
        raise ValueError(f"{n_distinct} distinct symbols need more than {max_precision} bits of precision")
    return p
