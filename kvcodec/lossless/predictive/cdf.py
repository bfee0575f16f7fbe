"""The predictive model's per-symbol CDF, in numba (a model knows probabilities).

For a symbol with location ``mu`` and inverse scale ``rs``, rank ``k`` of the float grid starts at
``cum(k) = floor(A * G((edges[k] - mu) * rs)) + k`` (A = M - n_symbols: every pattern keeps one
unit, so NaN payloads, infinities and far outliers always code). This is exact integer
arithmetic after a few correctly rounded float64 operations (numba without fast-math), so encoder
and decoder agree bit for bit. ``find_symbol`` inverts it for the decoder: a float guess from the
inverse shape table, then an exact galloping search. The coder (``kvcodec.entropy.rans64_fast``)
only ever sees the resulting intervals.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcodec.entropy.rans64 import M
from kvcodec.lossless.predictive.grid import SHAPE_BINS, ZMAX


@njit(inline="always", cache=True)
def shape_at(z, cdf):
    """G(z) in units of 2**-32: integer interpolation in the stored table."""
    if z <= -ZMAX:
        return np.int64(0)
    if z >= ZMAX:
        return np.int64(1) << 32
    q = np.int64((z * 8.0 + 128.0) * 65536.0)
    j = q >> 16
    if j >= SHAPE_BINS:
        return np.int64(1) << 32
    lo = cdf[j]
    return lo + (((cdf[j + 1] - lo) * (q & 0xFFFF)) >> 16)


@njit(inline="always", cache=True)
def cum(k, mu, rs, edges, cdf, a_mass):
    """Cumulative frequency of rank k: floor(A * G) + k, strictly increasing, 0 at 0, M at n."""
    z = (edges[k] - mu) * rs
    return ((a_mass * shape_at(z, cdf)) >> 32) + k


@njit(inline="always", cache=True)
def prediction_at(pred, has_pred, g, t, d):
    """The prediction of one scalar as float64: 0 where there is none or it is not finite."""
    if not has_pred:
        return 0.0
    p = np.float64(pred[g, t, d])
    return p if np.isfinite(p) else 0.0


@njit(inline="always", cache=True)
def location(m, c, p, a, dev):
    base = m + c * p
    return base, base + a * dev


@njit(inline="always", cache=True)
def _guess_rank(slot, mu, scale, cdf, inv_cdf, inv_w, inv_a, rank_of, fbuf, ibuf):
    """A rank near the symbol whose interval holds ``slot``: invert the shape table (``inv_cdf``
    indexes it by the top 12 bits of G), then map the value to a rank through its bf16 pattern.
    Only a starting point (float, not exact): find_symbol verifies with the exact CDF."""
    target = np.int64(slot * inv_a)  # G value in 2**-32 units, ignoring the +k floor term
    if target >= (np.int64(1) << 32):
        return -1
    lo = inv_cdf[target >> 20]
    while cdf[lo + 1] <= target:
        lo += 1
    z = -ZMAX + (lo + (target - cdf[lo]) * inv_w[lo]) * (2.0 * ZMAX / SHAPE_BINS)
    return rank_of[_bf16_pattern(mu + z * scale, fbuf, ibuf)]


@njit(inline="always", cache=True)
def _bf16_pattern(v, fbuf, ibuf):
    """The bf16 bit pattern nearest ``v`` (NaN -> a NaN pattern): an index for a rank guess.
    ``fbuf``/``ibuf``: a 1-element float64 array and its int64 view (a bit cast)."""
    if v != v:
        return 0x7FC0
    fbuf[0] = v
    bits = ibuf[0]
    sign = 0x8000 if bits < 0 else 0
    e = ((bits >> 52) & 0x7FF) - 896  # the bf16 exponent field
    if e >= 255:
        return sign | 0x7F80
    if e <= 0:  # bf16 subnormal or zero: a / 2**-133 is the mantissa
        return sign | int(abs(v) * 1.0889035741470031e40 + 0.5)
    return sign | min((e << 7) + (((bits & 0xFFFFFFFFFFFFF) + (1 << 44)) >> 45), 0x7F80)


@njit(inline="always", cache=True)
def find_symbol(slot, mu, rs, scale, edges, cdf, a_mass, inv_cdf, inv_w, inv_a, rank_of, fbuf, ibuf):
    """(k, cum(k), cum(k+1)) with cum(k) <= slot < cum(k+1), by exact search from a guess."""
    n_sym = edges.size - 1
    k = _guess_rank(slot, mu, scale, cdf, inv_cdf, inv_w, inv_a, rank_of, fbuf, ibuf)
    if k < 0 or k >= n_sym:
        k = n_sym - 1
    ck = cum(k, mu, rs, edges, cdf, a_mass)
    if ck <= slot:  # gallop up: cum(lo) <= slot < cum(hi)
        lo, c_lo = k, ck
        step = 1
        while True:
            hi = lo + step
            if hi >= n_sym:
                hi = n_sym
                c_hi = np.int64(M)
                break
            c_hi = cum(hi, mu, rs, edges, cdf, a_mass)
            if c_hi > slot:
                break
            lo, c_lo = hi, c_hi
            step *= 2
    else:  # gallop down
        hi, c_hi = k, ck
        step = 1
        while True:
            lo = hi - step
            if lo <= 0:
                lo = 0
                c_lo = np.int64(0)
                break
            c_lo = cum(lo, mu, rs, edges, cdf, a_mass)
            if c_lo <= slot:
                break
            hi, c_hi = lo, c_lo
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        cm = cum(mid, mu, rs, edges, cdf, a_mass)
        if cm <= slot:
            lo, c_lo = mid, cm
        else:
            hi, c_hi = mid, cm
    return lo, c_lo, c_hi


