"""Compiled CPU kernels for TurboQuant's per-element steps: centroid search, bit packing, unpacking.

The torch versions of these steps (``torch.bucketize``, ``packing.pack_bits``,
``packing.unpack_values``) materialize several int32/int64 temporaries per coordinate and run on
one core; on a 2-core AMD EPYC they took ~80% of ``TurboQuantMSE.quantize``. These numba kernels
(``nogil``: rows are split over ``torch.get_num_threads()`` threads, or ``workers(n)``) compute the same integers and
table values, so the bytes a quantizer writes and the floats it reads back are identical to the
torch path (tests/test_lmcache_turboquant_fast.py checks that over random inputs with hypothesis).
The float reductions (norms, the rotation, the norm-correction dot) stay in torch, where their
summation order lives. Only CPU tensors take this path; ``disabled()`` forces the torch one.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

_state = threading.local()
MIN_ROWS_PER_THREAD = 256  # below this a second thread costs more than it saves
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def enabled() -> bool:
    return not getattr(_state, "off", False)


@contextlib.contextmanager
def disabled():
    """Run the torch implementations in this thread (to compare against them)."""
    prev = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = prev


@contextlib.contextmanager
def workers(n: int):
    """Split rows over ``n`` threads in this thread's calls (0: every core) instead of
    ``torch.get_num_threads()``: a caller that runs torch on one thread can still spread these."""
    from kvcodec.threads import resolve_threads

    prev = getattr(_state, "workers", None)
    _state.workers = resolve_threads(n)
    try:
        yield
    finally:
        _state.workers = prev


def usable(*tensors: torch.Tensor) -> bool:
    return enabled() and all(t.device.type == "cpu" for t in tensors)


@njit(nogil=True, cache=True, inline="always")
def count_below(row, thr, count):  # pragma: no cover - compiled
    """count[j] = the number of thresholds (ascending) below row[j], 0 for a NaN. Up to 31 thresholds
    (<= 5 bits): a branch-free count the compiler vectorizes; more: binary search."""
    n_thr = thr.shape[0]
    d = row.shape[0]
    if n_thr <= 31:
        for j in range(d):
            count[j] = 0
        for i in range(n_thr):
            t = thr[i]
            for j in range(d):
                count[j] += row[j] > t
    else:
        for j in range(d):
            v = row[j]
            lo, hi = 0, n_thr
            while lo < hi:
                mid = (lo + hi) >> 1
                if thr[mid] < v:
                    lo = mid + 1
                else:
                    hi = mid
            count[j] = lo


@njit(nogil=True, cache=True, inline="always")
def bucketize_row(row, thr, cb, count, idx, vals):  # pragma: no cover - compiled
    """One row: idx = number of thresholds < row (torch.bucketize, right=False; NaN -> len(thr)); vals =
    cb[idx]; ``count`` is scratch of the row's length (:func:`count_below`)."""
    n_thr = thr.shape[0]
    count_below(row, thr, count)
    for j in range(row.shape[0]):
        c = count[j]
        if row[j] != row[j]:  # NaN sorts after every threshold, as in torch.bucketize
            c = n_thr
        idx[j] = c
        vals[j] = cb[c]


@njit(nogil=True, cache=True)
def _bucketize_rows(y, thr, cb, idx, vals):  # pragma: no cover - compiled
    """:func:`bucketize_row` of every row of y."""
    count = np.empty(y.shape[1], np.int64)
    for r in range(y.shape[0]):
        bucketize_row(y[r], thr, cb, count, idx[r], vals[r])


@njit(nogil=True, cache=True, inline="always")
def pack_row(values, bits, out):  # pragma: no cover - compiled
    """Coordinate j's low ``bits`` bits at stream bits [j*bits, (j+1)*bits), little-endian (tq layout v1);
    whole bytes of 2, 4 or 8 bits at a time where the row fills them."""
    d = values.shape[0]
    mask = (1 << bits) - 1
    if bits == 8:
        for j in range(d):
            out[j] = np.uint8(np.int64(values[j]) & mask)
    elif bits == 4 and d % 2 == 0:
        for b in range(d // 2):
            out[b] = np.uint8((np.int64(values[2 * b]) & mask) | ((np.int64(values[2 * b + 1]) & mask) << 4))
    elif bits == 2 and d % 4 == 0:
        for b in range(d // 4):
            out[b] = np.uint8((np.int64(values[4 * b]) & mask) | ((np.int64(values[4 * b + 1]) & mask) << 2)
                              | ((np.int64(values[4 * b + 2]) & mask) << 4) | ((np.int64(values[4 * b + 3]) & mask) << 6))
    else:
        for b in range(out.shape[0]):
            out[b] = 0
        pos = 0
        for j in range(d):
            v = np.int64(values[j]) & mask
            byte, shift = pos >> 3, pos & 7
            out[byte] |= np.uint8((v << shift) & 0xFF)
            if shift + bits > 8:
                out[byte + 1] |= np.uint8(v >> (8 - shift))
            pos += bits


@njit(nogil=True, cache=True)
def _pack_rows(values, bits, out):  # pragma: no cover - compiled
    """:func:`pack_row` of every row of values."""
    for r in range(values.shape[0]):
        pack_row(values[r], bits, out[r])


@njit(nogil=True, cache=True)
def _unpack_rows(packed, table, group, n, out):  # pragma: no cover - compiled
    """Table lookup per unit (a byte, or a 12-bit half of a 3-byte word), as packing.unpack_values."""
    per = table.shape[1]
    for r in range(packed.shape[0]):
        j = 0
        if group == 1:
            for b in range(packed.shape[1]):
                u = packed[r, b]
                for i in range(per):
                    if j < n:
                        out[r, j] = table[u, i]
                    j += 1
        else:
            for w in range(packed.shape[1] // 3):
                word = (np.int64(packed[r, 3 * w]) | (np.int64(packed[r, 3 * w + 1]) << 8)
                        | (np.int64(packed[r, 3 * w + 2]) << 16))
                for half in range(2):
                    u = (word >> (12 * half)) & 0xFFF
                    for i in range(per):
                        if j < n:
                            out[r, j] = table[u, i]
                        j += 1


def thread_count() -> int:
    """Threads a call in this thread splits its rows over: ``workers(n)``'s, else torch's."""
    return getattr(_state, "workers", None) or torch.get_num_threads()


def split_ranges(run, n_rows: int, align: int = 1) -> None:
    """``run(lo, hi)`` over row ranges on ``thread_count()`` threads (the kernels release the GIL), each
    range starting at a multiple of ``align`` (at least MIN_ROWS_PER_THREAD rows a thread)."""
    units = n_rows // align
    n = max(1, min(thread_count(), n_rows // MIN_ROWS_PER_THREAD, units))
    if n == 1:
        run(0, n_rows)
        return
    bounds = (np.linspace(0, units, n + 1).astype(np.int64) * align).tolist()
    bounds[-1] = n_rows
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(lambda b: run(*b), zip(bounds[:-1], bounds[1:])))


def _split_rows(fn, n_rows: int, *arrays) -> None:
    """Run ``fn(*row_slices)`` over row blocks on ``thread_count()`` threads (GIL released)."""
    split_ranges(lambda lo, hi: fn(*[a[lo:hi] for a in arrays]), n_rows)


def _rows(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor [..., n] as a C-contiguous 2-D numpy view [rows, n] (a copy only if strided)."""
    t = t.detach().contiguous()
    return t.reshape(-1, t.shape[-1] if t.ndim else 1).numpy()


def bucketize(y: torch.Tensor, thr: torch.Tensor, cb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int64, cb[idx] float32) for float32 ``y`` [..., d]: ``torch.bucketize(y, thr)`` and the
    chosen centroids, compiled on the CPU."""
    if not usable(y, thr, cb) or y.dtype != torch.float32 or y.numel() == 0:
        idx = torch.bucketize(y, thr)
        return idx, cb[idx]
    y2 = _rows(y)
    idx = np.empty(y2.shape, np.int64)
    vals = np.empty(y2.shape, np.float32)
    thr_np, cb_np = _rows(thr.float())[0] if thr.numel() else np.empty(0, np.float32), _rows(cb.float())[0]
    _split_rows(lambda a, b, c: _bucketize_rows(a, thr_np, cb_np, b, c), y2.shape[0], y2, idx, vals)
    return torch.from_numpy(idx).reshape(y.shape), torch.from_numpy(vals).reshape(y.shape)


def pack_bits(values: torch.Tensor, bits: int, width: int) -> torch.Tensor | None:
    """``packing.pack_bits`` compiled, or None when this path does not apply (non-CPU, other dtypes)."""
    if not usable(values) or values.dtype not in _INT_DTYPES or values.numel() == 0:
        return None
    v2 = _rows(values)
    out = np.empty((v2.shape[0], width), np.uint8)
    _split_rows(lambda a, b: _pack_rows(a, bits, b), v2.shape[0], v2, out)
    return torch.from_numpy(out).reshape(*values.shape[:-1], width)


def unpack_values(packed: torch.Tensor, table: torch.Tensor, group: int, n: int) -> torch.Tensor | None:
    """``packing.unpack_values`` compiled, or None when this path does not apply."""
    if (not usable(packed, table) or packed.dtype != torch.uint8 or packed.numel() == 0 or n == 0
            or table.dtype != torch.float32):
        return None
    p2 = _rows(packed)
    tab = table.contiguous().numpy()
    out = np.empty((p2.shape[0], n), np.float32)
    _split_rows(lambda a, b: _unpack_rows(a, tab, group, n, b), p2.shape[0], p2, out)
    return torch.from_numpy(out).reshape(*packed.shape[:-1], n)
