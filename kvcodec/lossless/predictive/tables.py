"""Per-class symbol frequency tables of the fast (format 2) predictive coder: fitted, stored, read.

Each of the ``N_CLASSES`` classes of :mod:`bins` has its own table of 256 frequencies summing to
``2**12`` (the 32-lane rANS of :mod:`kvcodec.entropy.rans_lanes`), fitted per tensor on the exact
symbol counts (so every symbol that occurs has a frequency; an unused class has none). Stored
compactly: per class the range of nonzero frequencies below ESC, the frequencies in it and ESC's,
as bytes (a value >= 255 as 255 and two bytes), which the stream codes with the parameters in one
rANS stream (``format2.lanes_model``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcodec.entropy import rans_lanes
from kvcodec.entropy.freq import integer_rounding, quantize_frequencies, quantize_rows
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive.bins import ESC, N_CLASSES

TOTAL = rans_lanes.M


def fit_tables(counts: np.ndarray, pool=None) -> np.ndarray:
    """int64 frequencies of each row of ``counts`` ([rows, 256]): ``quantize_frequencies`` at 2**-12 of
    every used row (summing to 2**12), zeros for an unused one. The rows are polished in one compiled
    pass, split over ``pool`` (an executor) when there is enough of it: the GPU encoder fits them on
    its critical path (the device idles meanwhile)."""
    freq = np.zeros(counts.shape, np.int64)
    sums = counts.sum(axis=1)
    rows = np.flatnonzero(sums)
    if rows.size and not integer_rounding(int(sums.max()), rans_lanes.PRECISION):
        for k in rows:
            freq[k] = quantize_frequencies(counts[k], rans_lanes.PRECISION)
        return freq
    widths = (counts[rows] > 0).sum(axis=1)
    if pool is None or widths.sum() < _POOL_FROM_SYMBOLS:  # little work: hand-offs would cost more (~0.1 ms each)
        quantize_rows(counts, rows, rans_lanes.PRECISION, freq)
        return freq
    order = rows[np.argsort(-widths, kind="stable")]  # the widest rows first
    groups = [order[k::_TABLE_TASKS] for k in range(min(_TABLE_TASKS, order.size))]
    list(pool.map(lambda r: quantize_rows(counts, r, rans_lanes.PRECISION, freq), groups))
    return freq


_TABLE_TASKS = 8
_POOL_FROM_SYMBOLS = 4096  # used (row, symbol) pairs; ~0.1 us of polish each (a kvctx stream's ~5 rows: ~800)


def table_bytes(freq: np.ndarray) -> np.ndarray:
    """The tables as bytes (uint8; the caller entropy-codes them): per class ``n`` (0 = unused),
    then ``lo``, ``n`` frequencies of symbols lo .. lo+n-1 and ESC's frequency. Compiled: the GPU
    encoder writes them on its critical path (0.25-0.45 ms of Python per call on the H200 host)."""
    return _to_bytes(_table_values(np.ascontiguousarray(freq, np.int64)))


@njit(cache=True, nogil=True)
def _table_values(freq):
    """:func:`table_bytes`' values before :func:`_to_bytes`: per row [0] (unused), [0xFFFF, esc] (only
    ESC) or [hi - lo, lo, freq[lo:hi]..., esc] (lo, hi: the nonzero range below ESC)."""
    out = np.empty(freq.shape[0] * (ESC + 3), np.int64)
    k = 0
    for r in range(freq.shape[0]):
        lo, hi = ESC, 0
        for s in range(ESC):
            if freq[r, s] != 0:
                lo, hi = min(lo, s), s + 1
        if hi == 0:
            if not freq[r].any():
                out[k] = 0
                k += 1
            else:
                out[k], out[k + 1] = 0xFFFF, freq[r, ESC]
                k += 2
            continue
        out[k], out[k + 1] = hi - lo, lo
        k += 2
        for s in range(lo, hi):
            out[k] = freq[r, s]
            k += 1
        out[k] = freq[r, ESC]
        k += 1
    return out[:k]


def tables_from_bytes(raw: np.ndarray) -> np.ndarray:
    """Inverse of :func:`table_bytes`; CorruptStreamError unless every used row sums to 2**12."""
    flat = _from_bytes(np.ascontiguousarray(raw, np.uint8))
    if flat is None:
        raise CorruptStreamError("predictive stream frequency tables end early")
    freq = np.zeros((N_CLASSES, 256), np.int64)
    if not _rows_from_flat(flat, freq):
        raise CorruptStreamError("predictive stream has malformed frequency tables")
    return freq


def row_decode_table(raw: np.ndarray) -> np.ndarray:
    """uint32 [4096]: the ``rans_lanes`` decode table of one row stored as :func:`table_bytes` writes
    it (CorruptStreamError unless well formed and used): the model stream's table, in one compiled call
    (the four calls of reading and building it separately were ~5 us of a small tensor's decode)."""
    tabs = _row_decode_table(np.ascontiguousarray(raw, np.uint8))
    if tabs.size == 0:
        raise CorruptStreamError("predictive stream has a malformed model table")
    return tabs


@njit(cache=True, nogil=True)
def _row_decode_table(raw):
    """:func:`row_decode_table`; an empty array if malformed."""
    flat = _from_bytes(raw)
    freq = np.zeros((1, 256), np.int64)
    tabs = np.empty(TOTAL, np.uint32)
    if flat is None or not _rows_from_flat(flat, freq) or freq.sum() == 0 \
            or not _fill_tables(freq, tabs, np.empty(0, np.uint8)):
        return np.empty(0, np.uint32)
    return tabs


@njit(cache=True)
def _rows_from_flat(flat, freq):
    """Fill ``freq`` from :func:`pack_tables`' values; False unless every row is well formed and
    every used row sums to 2**12."""
    pos = 0
    for k in range(freq.shape[0]):
        if pos >= flat.size:
            return False
        n = flat[pos]
        pos += 1
        if n == 0:
            continue
        lo = 0
        if n == 0xFFFF:  # only ESC
            n = 0
        else:
            if pos >= flat.size:
                return False
            lo = flat[pos]
            pos += 1
        if lo + n > ESC or pos + n + 1 > flat.size:
            return False
        total = 0
        for s in range(n):
            freq[k, lo + s] = flat[pos + s]
            total += flat[pos + s]
        freq[k, ESC] = flat[pos + n]
        total += flat[pos + n]
        pos += n + 1
        if total != TOTAL:
            return False
    return pos == flat.size


@njit(cache=True)
def _to_bytes(values):
    """uint16 values as bytes: v < 255 as one byte, else 255 and two bytes (little-endian)."""
    out = np.empty(3 * values.size, np.uint8)
    k = 0
    for v in values:
        if v < 255:
            out[k] = v
            k += 1
        else:
            out[k], out[k + 1], out[k + 2] = 255, v & 0xFF, v >> 8
            k += 3
    return out[:k]


@njit(cache=True)
def _from_bytes(raw):
    """Inverse of :func:`_to_bytes`; None if the bytes end inside a two-byte value."""
    out = np.empty(raw.size, np.int64)
    i = k = 0
    while i < raw.size:
        if raw[i] < 255:
            out[k] = raw[i]
            i += 1
        elif i + 2 < raw.size:
            out[k] = np.int64(raw[i + 1]) | (np.int64(raw[i + 2]) << 8)
            i += 3
        else:
            return None
        k += 1
    return out[:k]


_BAD_ROWS = "decode tables need rows of 256 non-negative frequencies summing to 4096 (or 0)"


def _built(freq: np.ndarray, full: bool) -> np.ndarray:
    """:func:`decode_tables` (``full``) or :func:`compact_tables` of int64 [C, 256] frequency rows
    (ValueError unless every row is non-negative and sums to 4096 or 0: checked by
    :func:`_fill_tables`, in the same compiled pass that builds the tables)."""
    f = np.ascontiguousarray(freq, np.int64)
    if f.ndim != 2 or f.shape[1] != 256:
        raise ValueError(_BAD_ROWS)
    tabs = np.empty(f.shape[0] * TOTAL if full else 0, np.uint32)
    compact = np.empty(0 if full else f.shape[0] * COMPACT_STRIDE, np.uint8)
    if not _fill_tables(f, tabs, compact):
        raise ValueError(_BAD_ROWS)
    return tabs if full else compact


def decode_tables(freq: np.ndarray) -> np.ndarray:
    """uint32 [N_CLASSES * 4096] rANS decode tables (``rans_lanes``' layout; an unused class decodes
    everything as ESC): what the GPU kernel reads."""
    return _built(freq, full=True)


COMPACT_STRIDE = TOTAL + 4 * 256  # bytes a class takes in the two-level form


def compact_tables(freq: np.ndarray) -> np.ndarray:
    """The two-level form of :func:`decode_tables` (what the CPU decoder reads): per class
    ``COMPACT_STRIDE`` bytes, the symbol of each of the 4096 slots (one byte), then per symbol
    ``freq | cum << 16`` (little-endian uint32): 5 KiB a class instead of 16, so the classes a
    predictive or fp8 stream uses stay in cache, and one base offset finds both levels."""
    return _built(freq, full=False)


@njit(nogil=True, cache=True)
def _fill_tables(freq, tabs, compact):
    """:func:`decode_tables` into ``tabs`` and :func:`compact_tables` into ``compact`` in one pass
    (an empty array: that form not built; a row of zeros: ESC in every slot). False (nothing
    written) unless every row is non-negative and sums to 4096 or 0."""
    for k in range(freq.shape[0]):
        total = 0
        for s in range(256):
            if freq[k, s] < 0 or freq[k, s] > TOTAL:  # (no int64 wrap-around in the sum)
                return False
            total += freq[k, s]
        if total != 0 and total != TOTAL:
            return False
    full, two_level = tabs.size > 0, compact.size > 0
    for k in range(freq.shape[0]):
        t0, c0 = k * TOTAL, k * COMPACT_STRIDE
        used = False
        for s in range(256):
            used |= freq[k, s] != 0
        fc = compact[c0 + TOTAL:c0 + COMPACT_STRIDE].view(np.uint32)  # freq | cum << 16 per symbol (or empty)
        fc[:] = 0
        if not used:
            for slot in range(TOTAL if full else 0):
                tabs[t0 + slot] = (ESC << 24) | ((TOTAL - 1) << 12) | slot
            if two_level:
                compact[c0:c0 + TOTAL] = ESC
                fc[ESC] = TOTAL
            continue
        cum = 0
        for s in range(256):
            f = freq[k, s]
            if f == 0:
                continue
            head = (s << 24) | ((f - 1) << 12)
            for r in range(f if full else 0):
                tabs[t0 + cum + r] = head | r
            if two_level:
                compact[c0 + cum:c0 + cum + f] = s
                fc[s] = f | (cum << 16)
            cum += f
    return True
