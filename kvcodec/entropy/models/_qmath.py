"""Bit-exact integer CDF of the quantized Gaussian/Laplace(+uniform) models.

Encoder and decoder (the pure-Python reference and the numba coder alike) call these
same functions, so the frequencies that decide the bits are integers computed the same
way on every machine. Everything is int64 arithmetic; bounds are noted where a product
could grow (no intermediate exceeds 2**62).

Fixed-point grid (``quantized.mean_to_q`` / ``scale_bits_to_idx`` map floats onto it exactly):
  * mean in 1/256 symbol units (``mean_q``),
  * scale on a log grid: ``sidx = round(32*log2(scale))``, scale = 2**(sidx/32),
    sidx in [SIDX_MIN, SIDX_MAX] (scale 2**-8 .. 2**24),
  * probabilities in Q31 (``ONE = 2**31``), coded frequencies in Q16 (``PRECISION``).

Coding layout of one symbol x in [lo, hi] (see docs/range_coder.md):
  * buckets of 2**j symbols, j = max(0, floor(log2 scale) - 3), so a bucket is at most
    1/8 of the scale and the in-bucket distribution is nearly flat;
  * a window of buckets around the mean (K scales each side) is coded directly, one
    token per bucket, every token frequency >= 1; the symbols left (right) of the window
    share one escape token carrying that tail's mass;
  * then the index inside the bucket (or among that escape's symbols) is coded uniformly
    with its exact count (``raw_count``), so nothing is lost on partial buckets.
So the alphabet can be 2**30 symbols while no table is alphabet-sized and a token search
touches at most ~390 tokens.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import _tables

PRECISION = 16  # token frequencies sum to 2**16
ONE = 1 << _tables.ONE_BITS  # Q31 probability one
MEAN_FRAC_BITS = 8
SIDX_MIN = -8 * _tables.SCALE_STEPS
SIDX_MAX = 24 * _tables.SCALE_STEPS
Z_BITS = 16  # standardized distance |x - mean| / scale in Q16
MAX_ABS_D = 1 << 41  # |x - mean| in 1/256 units is clamped here (z would be off the tables anyway)
WEIGHT_ONE = 1 << 16  # mixture weight of the uniform component in Q16
MAX_ALPHABET = 1 << 30

GAUSSIAN = 0
LAPLACE = 1
WINDOW_SCALES = (8, 12)  # window half-width in scales: Gaussian tail 6e-16, Laplace 3e-6

_GAUSS = np.array(_tables.GAUSS_TAIL, dtype=np.int64)
_LAPLACE = np.array(_tables.LAPLACE_TAIL, dtype=np.int64)
_INV_MANT = np.array(_tables.INV_MANTISSA, dtype=np.int64)
_INTERP_BITS = Z_BITS - _tables.STEP_BITS
_INTERP_MASK = (1 << _INTERP_BITS) - 1
_GAUSS_K, _LAPLACE_K = WINDOW_SCALES


@njit(cache=True, inline="always")
def tail_q31(fam, zq):
    """Upper-tail mass P(Z > z) in Q31 for z = zq / 2**16 >= 0, by integer interpolation."""
    tab = _GAUSS if fam == GAUSSIAN else _LAPLACE
    i = zq >> _INTERP_BITS
    if i >= tab.shape[0] - 1:
        return 0
    a = tab[i]
    return a - (((a - tab[i + 1]) * (zq & _INTERP_MASK)) >> _INTERP_BITS)


@njit(cache=True, inline="always")
def cdf_q31(d, sidx, fam):
    """P(X < mean + d/256) in Q31: non-decreasing in d, exactly symmetric about the mean."""
    e = sidx >> 5
    ad = -d if d < 0 else d
    if ad > MAX_ABS_D:
        ad = MAX_ABS_D
    zq = (ad * _INV_MANT[sidx & 31]) >> (MEAN_FRAC_BITS + e)  # e >= -8: shift >= 0; product < 2**58
    t = tail_q31(fam, zq)
    return t if d < 0 else ONE - t


@njit(cache=True, inline="always")
def bucket_mass(b, lo, j, nsym, nb, mean_q, sidx, wq, fam):
    """Model mass (Q31) of all symbols below bucket b; tails beyond [lo, hi] fold into the end buckets."""
    if b <= 0:
        return 0
    if b >= nb:
        return ONE
    cnt = b << j  # symbols below bucket b (< nsym <= 2**30)
    g = cdf_q31(((lo + cnt) << MEAN_FRAC_BITS) - (1 << (MEAN_FRAC_BITS - 1)) - mean_q, sidx, fam)
    if wq != 0:
        u = (cnt * ONE) // nsym  # uniform component, < 2**61
        g = ((WEIGHT_ONE - wq) * g + wq * u) >> 16
    return g


@njit(cache=True)
def symbol_frame(lo, hi, mean_q, sidx, fam):
    """Per-symbol layout (j, nsym, nb, wl, wh, el, er, ntok): integer only, no CDF evaluation.

    Buckets of 2**j symbols; window buckets [wl, wh] around the mean; el/er = 1 when a left/
    right escape token exists (symbols below/above the window). Tokens in order: left escape,
    window buckets, right escape.
    """
    nsym = hi - lo + 1
    e = sidx >> 5
    j = e - 3 if e > 3 else 0
    nb = ((nsym - 1) >> j) + 1
    c = (mean_q + (1 << (MEAN_FRAC_BITS - 1))) >> MEAN_FRAC_BITS
    if c < lo:
        c = lo
    elif c > hi:
        c = hi
    cb = (c - lo) >> j
    sh = e + 1
    if sh < 0:
        sh = 0
    elif sh > 4:
        sh = 4
    h = ((_GAUSS_K if fam == GAUSSIAN else _LAPLACE_K) << sh) + 1
    wl = cb - h if cb > h else 0
    wh = cb + h if cb + h < nb - 1 else nb - 1
    el = 1 if wl > 0 else 0
    er = 1 if wh < nb - 1 else 0
    return (j, nsym, nb, wl, wh, el, er, el + wh - wl + 1 + er)


@njit(cache=True, inline="always")
def token_cum(t, fr, lo, mean_q, sidx, wq, fam):
    """Cumulative frequency (Q16) below token t in [0, ntok]; every token gets >= 1.

    cum(t) = t + floor(A(t) * (2**16 - ntok) / 2**31) with A(t) the model mass below token t.
    """
    j, nsym, nb, wl, wh, el, er, ntok = fr
    if t <= 0:
        return 0
    if t >= ntok:
        return 1 << PRECISION
    a = bucket_mass(wl + t - el, lo, j, nsym, nb, mean_q, sidx, wq, fam)
    return t + ((a * ((1 << PRECISION) - ntok)) >> _tables.ONE_BITS)


@njit(cache=True)
def raw_count(t, fr):
    """How many values the uniform index after token t ranges over (1: nothing to code).

    A window bucket holds 2**j symbols (the last one may hold fewer); an escape token is
    followed by the index among the symbols outside the window on its side.
    """
    j, nsym, nb, wl, wh, el, er, ntok = fr
    if el and t == 0:
        return wl << j
    if er and t == ntok - 1:
        return nsym - ((wh + 1) << j)
    base = (wl + t - el) << j
    return (1 << j) if base + (1 << j) <= nsym else nsym - base


@njit(cache=True)
def split_symbol(x, fr, lo):
    """x -> (token, index inside the token, raw_count of the token)."""
    j, nsym, nb, wl, wh, el, er, ntok = fr
    off = x - lo
    b = off >> j
    if b < wl:
        return 0, off, wl << j
    if b > wh:
        top = (wh + 1) << j
        return ntok - 1, off - top, nsym - top
    base = b << j
    return el + b - wl, off - base, (1 << j) if base + (1 << j) <= nsym else nsym - base


@njit(cache=True)
def join_symbol(t, raw, fr, lo):
    """(token, raw value) -> x, or lo - 1 when the pair lies outside the model's support."""
    j, nsym, nb, wl, wh, el, er, ntok = fr
    if el and t == 0:
        return lo + raw if raw < (wl << j) else lo - 1
    if er and t == ntok - 1:
        top = (wh + 1) << j
        return lo + top + raw if raw < nsym - top else lo - 1
    off = ((wl + t - el) << j) + raw
    return lo + off if off < nsym else lo - 1


@njit(cache=True)
def find_token(v, fr, lo, mean_q, sidx, wq, fam):
    """Largest token t with token_cum(t) <= v (v < 2**16): the reference binary search."""
    a, b = 0, fr[7]  # token_cum(a) <= v < token_cum(b)
    while b - a > 1:
        m = (a + b) >> 1
        if token_cum(m, fr, lo, mean_q, sidx, wq, fam) <= v:
            a = m
        else:
            b = m
    return a
