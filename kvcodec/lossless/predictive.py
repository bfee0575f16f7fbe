"""Predictor-driven lossless coding of float tensors (codec ``"predictive"``) and its engine.

Why: a KV scalar is far cheaper to code when both sides know roughly where it lies. Each scalar
``x[g, t, d]`` of a tensor laid out ``[..., tokens, channels]`` (``g``: the leading axes
flattened, ``t``: axis -2, ``d``: axis -1) gets a continuous density on the real line::

    base = m[g, d] + c[g, d] * P[g, t, d]                       # P: a prediction, or 0
    mu   = base + a[g, d] * (x[g, t-1, d] - base[g, t-1, d])    # previous-token residual
    x    ~ G((x - mu) / s[g, d])                                # G: a fitted, stored CDF table

and a bit pattern's probability is the mass of its rounding bin on the dtype's float grid under
that density, plus one unit (out of 2**28) for every pattern, so NaN payloads, +-Inf, -0.0,
subnormals and far outliers always round-trip. All parameters are quantised and stored; the
per-symbol CDF is exact integer arithmetic after a few correctly rounded float64 adds and
multiplies (numba without fast-math: nothing fused or reordered), so encoder and decoder build
identical frequencies and the decoder never refits anything.

The symbols are coded with 64-bit rANS (32-bit renormalisation, 28-bit probabilities) in
independent chunks (one leading index x a block of tokens) that are coded in parallel and decode
alone. The project's static rANS and range coder take tables or integer-range models; a CDF over
a float grid's bins is neither, so the coder here is a small numba kernel of its own.

Prediction sources (``P``): an external tensor (a cheaper model's KV, e.g. an fp8-weight copy;
gain c = 1), ``"previous_token"`` (mu = the previous token's value) or ``"neighbour_layer"``
(P = the previous layer's decoded values, axis 0 = layers, per-channel fitted gain c). The kvctx
codec (:mod:`kvcodec.lossless.kv_context`) is the same engine with P = 0 (channel location and
fitted previous-token correlation).

Dtypes: every 8- and 16-bit float (bf16, fp16, the fp8 family) is modelled; float32 codes its
upper 16 bits as bf16 with the model and stores the low 16 bits verbatim; other dtypes are stored
verbatim (these codecs are for float KV caches; use the ``planes`` codec for the rest).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numba
import numpy as np
import torch
from numba import njit, prange

from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.tensor_meta import checked_shape, dtype_from_name
from kvcodec.lossless.threads import resolve_threads

FORMAT_VERSION = 1
PREDICTORS = ("external", "previous_token", "neighbour_layer", "none")

PREC = 28  # probability precision of the coder (bits)
_M = 1 << PREC
_RANS_L = 1 << 31  # rANS state lower bound; 32-bit words are moved in and out
SHAPE_BINS = 256  # the shape CDF G is piecewise linear on [-ZMAX, ZMAX] in SHAPE_BINS steps
ZMAX = 16.0  # (bin width 1/8 of the scale)
S_MIN, S_MAX = 1e-40, 1e30  # stored scales are clipped to this range (bf16 keeps 1e-40 > 0)
_Q = 64  # gain and previous-token coefficients are stored as int8 / 64

_CHUNK_SYMBOLS = 1 << 16  # about this many symbols per independently decodable chunk
_SHARED_PARAMS_BELOW = 64  # fewer tokens: one parameter set per channel, shared over g
_PER_CHANNEL_FROM = 1024  # between the two: whichever of shared / per-(g, d) costs less
_MAX_NUMEL = 1 << 48  # a decoded stream larger than this is taken as forged


# =============================================================================== float grids
@dataclass(frozen=True)
class FloatGrid:
    """Every bit pattern of an 8- or 16-bit float dtype, sorted by value.

    ``k_of_bits[bits]`` is the pattern's rank (NaN patterns last), ``bits_of_k`` the inverse,
    ``edges[k]`` the lower edge of rank k's rounding bin (midpoint with the previous value; -inf /
    +inf at the ends and around infinities, so those patterns get only the floor probability),
    ``valf[k]`` the value (0 where not finite) and ``finite[k]`` whether it is finite.
    """

    n: int
    bits_np: type
    bits_np_signed: type
    bits_torch: torch.dtype
    k_of_bits: np.ndarray
    bits_of_k: np.ndarray
    edges: np.ndarray
    valf: np.ndarray
    finite: np.ndarray
    rank_of_bf16: np.ndarray  # int32[65536]: rank of the bin holding each bf16 value (a decode guess)


@lru_cache(maxsize=None)
def grid_for(dtype: torch.dtype) -> FloatGrid | None:
    """The grid of an 8-/16-bit float dtype, or None for any other dtype."""
    if not dtype.is_floating_point or dtype.itemsize not in (1, 2):
        return None
    n = 1 << (8 * dtype.itemsize)
    bits_np, signed, bits_torch = (
        (np.uint8, np.uint8, torch.uint8) if n == 256 else (np.uint16, np.int16, torch.int16)
    )
    patterns = np.arange(n, dtype=bits_np)
    vals = torch.from_numpy(patterns.view(signed).copy()).view(dtype).to(torch.float64).numpy()
    nan = np.isnan(vals)
    neg = (patterns >> (8 * dtype.itemsize - 1)) & 1 if dtype != torch.float8_e8m0fnu else 0 * patterns
    ok = np.flatnonzero(~nan)
    # by value, -0.0 before +0.0; NaN patterns after everything, in pattern order
    order = np.concatenate([ok[np.lexsort((1 - neg[ok], vals[ok]))], np.flatnonzero(nan)])
    val_k = vals[order]
    n_ok = ok.size
    edges = np.full(n + 1, np.inf)
    edges[0] = -np.inf
    lo, hi = val_k[: n_ok - 1], val_k[1:n_ok]
    mid = np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, np.where(np.isneginf(lo), -np.inf, np.inf))
    edges[1:n_ok] = mid
    finite = np.isfinite(val_k)
    k_of_bits = np.empty(n, np.int32)
    k_of_bits[order] = np.arange(n, dtype=np.int32)
    bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf16_vals = bf16.to(torch.float64).numpy()
    rank_of = np.clip(np.searchsorted(edges, bf16_vals, side="right") - 1, 0, n - 1)
    rank_of_bf16 = np.empty(65536, np.int32)
    rank_of_bf16[np.arange(-32768, 32768) & 0xFFFF] = np.where(np.isnan(bf16_vals), n - 1, rank_of)
    return FloatGrid(
        n=n, bits_np=bits_np, bits_np_signed=signed, bits_torch=bits_torch,
        k_of_bits=k_of_bits, bits_of_k=order.astype(bits_np), edges=edges,
        valf=np.where(finite, val_k, 0.0), finite=finite, rank_of_bf16=rank_of_bf16,
    )


def value_table(grid: FloatGrid) -> np.ndarray:
    """float32 value of every rank (non-finite as 0): what a decoded layer predicts the next with."""
    return grid.valf.astype(np.float32)


# =============================================================================== shape table
def masses_from_counts(counts: np.ndarray) -> np.ndarray:
    """Shape masses (uint16[SHAPE_BINS], summing to 2**16, each >= 1) from a z histogram."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum()
    free = (1 << 16) - SHAPE_BINS
    if total == 0:
        masses = np.full(SHAPE_BINS, 1 << 8, np.int64)
    else:
        masses = 1 + np.floor(counts * (free / total)).astype(np.int64)
        masses[np.argmax(masses)] += (1 << 16) - int(masses.sum())
    return masses.astype(np.uint16)


def shape_cdf(masses: np.ndarray) -> np.ndarray:
    """int64[SHAPE_BINS + 1] CDF in units of 2**-32 from stored masses (validated)."""
    masses = np.asarray(masses)
    if masses.shape != (SHAPE_BINS,) or int(masses.astype(np.int64).sum()) != 1 << 16:
        raise CorruptStreamError("predictive stream has a bad shape table")
    return np.concatenate([[0], np.cumsum(masses.astype(np.int64))]) << 16


# =============================================================================== kernels
@njit(inline="always", cache=True)
def _shape_at(z, cdf):
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
def _cum(k, mu, rs, edges, cdf, a_mass):
    """Cumulative frequency of rank k: floor(A * G) + k, strictly increasing, 0 at 0, M at n."""
    z = (edges[k] - mu) * rs
    return ((a_mass * _shape_at(z, cdf)) >> 32) + k


@njit(inline="always", cache=True)
def _location(m, c, p, a, dev):
    base = m + c * p
    return base, base + a * dev


@njit(parallel=True, cache=True)
def _encode_kernel(kx, pred, has_pred, m, c, a, rs, shared, cdf, edges, valf, finite,
                   tb, caps, out, out_start):
    g_n, t_n, d_n = kx.shape
    n_tb = (t_n + tb - 1) // tb
    a_mass = np.int64(_M - edges.size + 1)
    for ci in prange(g_n * n_tb):
        g = ci // n_tb
        t0 = (ci % n_tb) * tb
        t1 = min(t_n, t0 + tb)
        gp = 0 if shared else g
        n = (t1 - t0) * d_n
        starts = np.empty(n, np.int64)
        freqs = np.empty(n, np.int64)
        dev = np.zeros(d_n, np.float64)
        i = 0
        for t in range(t0, t1):
            for d in range(d_n):
                p = 0.0
                if has_pred:
                    p = np.float64(pred[g, t, d])
                    if not np.isfinite(p):
                        p = 0.0
                base, mu = _location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
                k = kx[g, t, d]
                lo = _cum(k, mu, rs[gp, d], edges, cdf, a_mass)
                hi = _cum(k + 1, mu, rs[gp, d], edges, cdf, a_mass)
                starts[i] = lo
                freqs[i] = hi - lo
                i += 1
                dev[d] = valf[k] - base if finite[k] else 0.0
        x = np.int64(_RANS_L)
        pos = caps[ci + 1]
        for j in range(n - 1, -1, -1):
            f = freqs[j]
            if x >= ((np.int64(_RANS_L) >> PREC) << 32) * f:
                pos -= 1
                out[pos] = x & 0xFFFFFFFF
                x >>= 32
            x = ((x // f) << PREC) + (x % f) + starts[j]
        pos -= 1
        out[pos] = x & 0xFFFFFFFF
        pos -= 1
        out[pos] = x >> 32
        out_start[ci] = pos


@njit(inline="always", cache=True)
def _guess_rank(slot, mu, scale, cdf, inv_cdf, inv_w, inv_a, rank_of, fbuf, ibuf):
    """A rank near the symbol whose interval holds ``slot``: invert the shape table (``inv_cdf``
    indexes it by the top 12 bits of G), then map the value to a rank through its bf16 pattern.
    Only a starting point (float, not exact): _find_symbol verifies with the exact CDF."""
    target = np.int64(slot * inv_a)  # G value in 2**-32 units, ignoring the +k floor term
    if target >= (np.int64(1) << 32):
        return -1
    lo = inv_cdf[target >> 20]
    while cdf[lo + 1] <= target:
        lo += 1
    z = -ZMAX + (lo + (target - cdf[lo]) * inv_w[lo]) * (2.0 * ZMAX / SHAPE_BINS)
    return rank_of[_bf16_pattern(mu + z * scale, fbuf, ibuf)]


def inverse_shape_index(cdf: np.ndarray) -> np.ndarray:
    """int64[4097]: for each top-12-bit value j of G, the shape bin holding j * 2**20."""
    return np.clip(np.searchsorted(cdf, np.arange(4097, dtype=np.int64) << 20, side="right") - 1,
                   0, SHAPE_BINS - 1).astype(np.int64)


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
def _find_symbol(slot, mu, rs, scale, edges, cdf, a_mass, inv_cdf, inv_w, inv_a, rank_of, fbuf, ibuf):
    """(k, cum(k), cum(k+1)) with cum(k) <= slot < cum(k+1), by exact search from a guess."""
    n_sym = edges.size - 1
    k = _guess_rank(slot, mu, scale, cdf, inv_cdf, inv_w, inv_a, rank_of, fbuf, ibuf)
    if k < 0 or k >= n_sym:
        k = n_sym - 1
    ck = _cum(k, mu, rs, edges, cdf, a_mass)
    if ck <= slot:  # gallop up: cum(lo) <= slot < cum(hi)
        lo, c_lo = k, ck
        step = 1
        while True:
            hi = lo + step
            if hi >= n_sym:
                hi = n_sym
                c_hi = np.int64(_M)
                break
            c_hi = _cum(hi, mu, rs, edges, cdf, a_mass)
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
            c_lo = _cum(lo, mu, rs, edges, cdf, a_mass)
            if c_lo <= slot:
                break
            hi, c_hi = lo, c_lo
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        cm = _cum(mid, mu, rs, edges, cdf, a_mass)
        if cm <= slot:
            lo, c_lo = mid, cm
        else:
            hi, c_hi = mid, cm
    return lo, c_lo, c_hi


@njit(parallel=True, cache=True)
def _decode_kernel(words, wstart, wlen, chunk_g, chunk_b, pred, has_pred, pred_t0, m, c, a, rs, shared,
                   cdf, edges, valf, finite, rank_of, scale, inv_cdf, inv_w, tb, t_total, g0, out_t0, out_k, err):
    """Decode the listed chunks (local group chunk_g[i], token block chunk_b[i]) into out_k, whose
    token 0 is token out_t0; pred's token 0 is token pred_t0; params of group g0 + chunk_g[i]."""
    d_n = out_k.shape[2]
    n_sym = edges.size - 1
    a_mass = np.int64(_M - n_sym)
    mask = np.int64(_M - 1)
    inv_a = 4294967296.0 / a_mass
    for ci in prange(wstart.size):
        gl = chunk_g[ci]
        gp = 0 if shared else g0 + gl
        t0 = chunk_b[ci] * tb
        t1 = min(t_total, t0 + tb)
        ptr = wstart[ci]
        end = ptr + wlen[ci]
        if wlen[ci] < 2:
            err[ci] = 1
            continue
        x = (np.int64(words[ptr]) << 32) | np.int64(words[ptr + 1])
        ptr += 2
        if x < _RANS_L:
            err[ci] = 2
            continue
        dev = np.zeros(d_n, np.float64)
        fbuf = np.zeros(1, np.float64)
        ibuf = fbuf.view(np.int64)
        bad = False
        for t in range(t0, t1):
            for d in range(d_n):
                p = 0.0
                if has_pred:
                    p = np.float64(pred[gl, t - pred_t0, d])
                    if not np.isfinite(p):
                        p = 0.0
                base, mu = _location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
                rsd = rs[gp, d]
                slot = x & mask
                lo, c_lo, c_hi = _find_symbol(slot, mu, rsd, scale[gp, d], edges, cdf, a_mass, inv_cdf,
                                              inv_w, inv_a, rank_of, fbuf, ibuf)
                x = (c_hi - c_lo) * (x >> PREC) + slot - c_lo
                if x < _RANS_L:
                    if ptr >= end:
                        bad = True
                        break
                    x = (x << 32) | np.int64(words[ptr])
                    ptr += 1
                out_k[gl, t - out_t0, d] = lo
                dev[d] = valf[lo] - base if finite[lo] else 0.0
            if bad:
                break
        if bad:
            err[ci] = 3
        elif x != _RANS_L or ptr != end:
            err[ci] = 4


# =============================================================================== model
def to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """Round float values to bf16 (nearest) and return the uint16 bit patterns (how m, s are stored)."""
    return torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _stored_fields(source: str) -> tuple[str, ...]:
    """The per-channel parameters a stream of this source stores (the rest are fixed)."""
    return {"previous_token": ("s",), "neighbour_layer": ("m", "s", "c", "a")}.get(source, ("m", "s", "a"))


@dataclass
class Model:
    """Per-channel parameters ([Gp, D], Gp = 1 when shared) and the shape table.

    Stored: m and s as bf16, c and a as int8 (value / 64); fields fixed by the source
    (``_stored_fields``) are not stored. ``m``/``s`` here are float64 copies of the stored values.
    """

    m: np.ndarray
    s: np.ndarray
    c: np.ndarray
    a: np.ndarray
    masses: np.ndarray
    shared: bool

    def kernel_args(self):
        if not np.all(np.isfinite(self.s)) or np.any(self.s <= 0) or not np.all(np.isfinite(self.m)):
            raise CorruptStreamError("predictive stream has a bad location or scale")
        return (self.m, self.c.astype(np.float64) / _Q, self.a.astype(np.float64) / _Q,
                1.0 / self.s, self.shared, shape_cdf(self.masses))

    def pack(self, source: str) -> np.ndarray:
        parts = []
        for f in _stored_fields(source):
            v = getattr(self, f)
            parts.append(to_bf16_bits(v).reshape(-1).view(np.uint8) if f in ("m", "s") else v.reshape(-1).view(np.uint8))
        parts.append(self.masses.view(np.uint8))
        return np.concatenate(parts)

    @staticmethod
    def packed_size(source: str, gp: int, d: int) -> int:
        return sum(2 if f in ("m", "s") else 1 for f in _stored_fields(source)) * gp * d + 2 * SHAPE_BINS

    @classmethod
    def unpack(cls, blob: np.ndarray, source: str, gp: int, d: int, shared: bool) -> "Model":
        if blob.size != cls.packed_size(source, gp, d):
            raise CorruptStreamError("predictive stream model section has the wrong size")
        n = gp * d
        vals = {"m": np.zeros((gp, d)), "c": np.full((gp, d), _Q if source == "external" else 0, np.int8),
                "a": np.full((gp, d), _Q, np.int8)}
        pos = 0
        for f in _stored_fields(source):
            if f in ("m", "s"):
                vals[f] = from_bf16_bits(blob[pos:pos + 2 * n].copy().view(np.uint16)).reshape(gp, d)
                pos += 2 * n
            else:
                vals[f] = blob[pos:pos + n].copy().view(np.int8).reshape(gp, d)
                pos += n
        masses = blob[pos:].copy().view(np.uint16)
        return cls(masses=masses, shared=shared, **vals)


@njit(cache=True)
def _fit_moments(kx, pred, has_pred, valf, finite, log_width, out):
    """Per (g, d): out[g, d] = [n, sum x, sum p, sum x*p, sum p*p, n_w, sum log2 width] over finite x.
    (The fit passes are a few ns per value: serial, to keep JIT compile time down.)"""
    g_n, t_n, d_n = kx.shape
    for g in range(g_n):
        for t in range(t_n):
            for d in range(d_n):
                k = kx[g, t, d]
                lw = log_width[k]
                if lw == lw:
                    out[g, d, 5] += 1.0
                    out[g, d, 6] += lw
                if not finite[k]:
                    continue
                x = valf[k]
                p = 0.0
                if has_pred:
                    p = np.float64(pred[g, t, d])
                    if not np.isfinite(p):
                        p = 0.0
                out[g, d, 0] += 1.0
                out[g, d, 1] += x
                out[g, d, 2] += p
                out[g, d, 3] += x * p
                out[g, d, 4] += p * p


@njit(cache=True)
def _fit_residuals(kx, pred, has_pred, m, c, a, shared, valf, finite, tb, rs, out, hist):
    """Per (g, d): out[g, d] = [sum dev*dev_prev, sum dev_prev**2, sum r**2] with the coder's
    location (r = x - mu); when rs[0, 0] > 0 also the histogram of z = r * rs into hist[g]."""
    g_n, t_n, d_n = kx.shape
    do_hist = rs[0, 0] > 0
    for g in range(g_n):
        gp = 0 if shared else g
        dev = np.zeros(d_n, np.float64)
        for t in range(t_n):
            if t % tb == 0:
                dev[:] = 0.0
            for d in range(d_n):
                p = 0.0
                if has_pred:
                    p = np.float64(pred[g, t, d])
                    if not np.isfinite(p):
                        p = 0.0
                base, mu = _location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
                k = kx[g, t, d]
                if finite[k]:
                    x = valf[k]
                    r = x - mu
                    out[g, d, 0] += (x - base) * dev[d]
                    out[g, d, 1] += dev[d] * dev[d]
                    out[g, d, 2] += r * r
                    if do_hist:
                        z = r * rs[gp, d]
                        j = int((min(max(z, -ZMAX), ZMAX) + ZMAX) * (SHAPE_BINS / (2.0 * ZMAX)))
                        hist[g, min(j, SHAPE_BINS - 1)] += 1
                    dev[d] = x - base
                else:
                    dev[d] = 0.0


def fit_model(kx, pred, grid: FloatGrid, tb: int, gain: str, prev_coef: str, shared: bool) -> Model:
    """Fit the parameters on every value (encoder only), quantised exactly as stored.

    ``kx``: symbol ranks [G, T, D]; ``pred``: float32 prediction [G, T, D] or None; ``gain``:
    "zero" | "one" | "fit" (c); ``prev_coef``: "fit" | "one" (a). The scale is floored at a
    quarter of the channel's typical bin width (geometric mean), so a residual far below one step
    of the grid (a constant channel) still puts its mass in one bin.
    """
    g, _, d = kx.shape
    has_pred = pred is not None
    p = pred if has_pred else np.zeros((1, 1, 1), np.float32)
    with np.errstate(all="ignore"):
        width = np.diff(grid.edges)
        log_width = np.where(np.isfinite(width) & (width > 0), np.log2(width), np.nan)
    mom = np.zeros((g, d, 7))
    _fit_moments(kx, p, has_pred, grid.valf, grid.finite, log_width, mom)
    if shared:
        mom = mom.sum(axis=0, keepdims=True)
    n = mom[..., 0]
    safe_n = np.maximum(n, 1)
    if gain == "zero":
        c = np.zeros(n.shape)
    elif gain == "one":
        c = np.ones(n.shape)
    else:
        with np.errstate(all="ignore"):  # sums of huge values overflow: the gain is then 0
            cov = mom[..., 3] - mom[..., 1] * mom[..., 2] / safe_n
            var = mom[..., 4] - mom[..., 2] ** 2 / safe_n
            c = np.where(var > 1e-300, cov / np.where(var > 1e-300, var, 1.0), 0.0)
    c_q = np.clip(np.round(np.nan_to_num(c) * _Q), -127, 127).astype(np.int8)
    c = c_q.astype(np.float64) / _Q
    if prev_coef == "one":
        m = np.zeros(n.shape)
    else:
        with np.errstate(all="ignore"):
            mean = np.where(n > 0, (mom[..., 1] - c * mom[..., 2]) / safe_n, 0.0)
        m = from_bf16_bits(to_bf16_bits(np.clip(np.nan_to_num(mean), -3e38, 3e38)))
    a_q = np.full(n.shape, _Q if prev_coef == "one" else 0, np.int8)
    hist = np.zeros((g, SHAPE_BINS), np.int64)
    no_hist = np.zeros((1, 1))

    def residuals(a_q, rs):
        out = np.zeros((g, d, 3))
        _fit_residuals(kx, p, has_pred, m, c, a_q.astype(np.float64) / _Q, shared, grid.valf, grid.finite,
                       tb, rs, out, hist)
        return out.sum(axis=0, keepdims=True) if shared else out

    if prev_coef != "one":
        res = residuals(a_q, no_hist)
        with np.errstate(all="ignore"):
            a = np.where(res[..., 1] > 0, res[..., 0] / np.where(res[..., 1] > 0, res[..., 1], 1.0), 0.0)
        a_q = np.clip(np.round(np.nan_to_num(a) * _Q), -_Q, _Q).astype(np.int8)
    res = residuals(a_q, no_hist)
    with np.errstate(all="ignore"):
        s = np.sqrt(res[..., 2] / safe_n)
        floor = np.where(mom[..., 5] > 0, np.exp2(mom[..., 6] / np.maximum(mom[..., 5], 1)) / 4, 0.0)
        s = np.maximum(np.where(np.isfinite(s), s, S_MAX), np.nan_to_num(floor))
    s = from_bf16_bits(to_bf16_bits(np.clip(s, S_MIN, S_MAX)))
    residuals(a_q, 1.0 / s)
    return Model(m=m, s=s, c=c_q, a=a_q, masses=masses_from_counts(hist.sum(axis=0)), shared=shared)


def estimated_bits(model: Model, kx, pred, grid: FloatGrid, tb: int, source: str) -> float:
    """Gaussian estimate of payload + parameter bits of coding ``kx`` with ``model`` (differences
    between models are what count): chooses shared or per-(g, d) parameters for short caches."""
    g, _, d = kx.shape
    out = np.zeros((g, d, 3))
    p = pred if pred is not None else np.zeros((1, 1, 1), np.float32)
    _fit_residuals(kx, p, pred is not None, model.m, model.c.astype(np.float64) / _Q,
                   model.a.astype(np.float64) / _Q, model.shared, grid.valf, grid.finite, tb,
                   np.zeros((1, 1)), out, np.zeros((1, SHAPE_BINS), np.int64))
    n = grid.finite[kx].sum(axis=1)
    s = np.broadcast_to(model.s, (g, d))
    with np.errstate(all="ignore"):
        bits = float(np.nan_to_num((n * np.log2(s) + out[..., 2] / (2 * s * s * np.log(2))).sum(), nan=np.inf))
    return bits + 8 * Model.packed_size(source, model.s.shape[0], d)


# =============================================================================== layout
def kv_layout(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(G, T, D): leading axes flattened, tokens (axis -2), channels (axis -1); 0-/1-d handled."""
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return 1, int(shape[0]), 1
    return math.prod(int(n) for n in shape[:-2]), int(shape[-2]), int(shape[-1])


def token_block(t: int, d: int) -> int:
    """Tokens per chunk: about ``_CHUNK_SYMBOLS`` symbols, at least one token."""
    return max(1, min(max(t, 1), _CHUNK_SYMBOLS // max(d, 1)))


class _Threads:
    """Run numba kernels on ``threads`` workers (0 = all), restoring the previous count after."""

    def __init__(self, threads: int):
        self.n = min(resolve_threads(threads), numba.config.NUMBA_NUM_THREADS)

    def __enter__(self):
        self.old = numba.get_num_threads()
        numba.set_num_threads(self.n)

    def __exit__(self, *exc):
        numba.set_num_threads(self.old)


def _prediction_f32(prediction: torch.Tensor, g: int, t: int, d: int) -> np.ndarray:
    """The prediction as float32 [G, T, D]: what the kernels use and the checksum covers."""
    if not isinstance(prediction, torch.Tensor):
        raise ValueError("a prediction must be a torch.Tensor")
    if prediction.dtype.is_complex:
        raise ValueError("a prediction must be real-valued")
    p = prediction.detach().to("cpu", torch.float32).contiguous()
    return p.numpy().reshape(g, t, d)


# =============================================================================== encode/decode
def encode_tensor(t: torch.Tensor, prediction, source: str, threads: int = 0) -> tuple[dict, dict]:
    """Encode ``t`` (any dtype and shape); ``source`` is one of PREDICTORS."""
    if source not in PREDICTORS:
        raise ValueError(f"predictor must be one of {PREDICTORS}, got {source!r}")
    if (source == "external") != (prediction is not None):
        raise ValueError("a prediction tensor goes with source 'external' and only with it")
    t = t.detach().to("cpu").contiguous()
    shape = tuple(t.shape)
    g, tt, d = kv_layout(shape)
    meta = {"v": FORMAT_VERSION, "source": source, "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(shape)}
    if prediction is not None and tuple(prediction.shape) != shape:
        raise ValueError("prediction must have the same shape as the tensor")
    if source == "neighbour_layer" and len(shape) < 3:
        raise ValueError("predictor='neighbour_layer' needs a [layers, ..., tokens, channels] tensor")
    grid = grid_for(t.dtype)
    if t.numel() == 0 or (grid is None and t.dtype != torch.float32):
        meta["mode"] = "raw"
        raw = t.reshape(-1).view(torch.uint8).numpy().copy() if t.numel() else np.zeros(0, np.uint8)
        return meta, {"raw": raw}
    sections: dict = {}
    if grid is None:  # float32: the upper half is a bf16 pattern; keep the lower half verbatim
        grid = grid_for(torch.bfloat16)
        b32 = t.reshape(-1).view(torch.int32).numpy().view(np.uint32)
        sym_bits = (b32 >> 16).astype(np.uint16)
        sections["lo16"] = (b32 & 0xFFFF).astype(np.uint16)
        meta["mode"] = "f32split"
    else:
        sym_bits = t.reshape(-1).view(grid.bits_torch).numpy().view(grid.bits_np)
        meta["mode"] = "grid"
    kx = grid.k_of_bits[sym_bits].reshape(g, tt, d)
    tb = token_block(tt, d)
    if source == "external":
        with np.errstate(invalid="ignore"):
            pred = _prediction_f32(prediction, g, tt, d)
        meta["pred_crc"] = zlib.crc32(pred.reshape(-1).view(np.uint8))
    elif source == "neighbour_layer":
        per_layer = g // shape[0]
        pred = np.zeros((g, tt, d), np.float32)
        pred[per_layer:] = value_table(grid)[kx[:-per_layer]] if per_layer < g else 0.0
    else:
        pred = None

    gain = {"external": "one", "neighbour_layer": "fit"}.get(source, "zero")
    prev_coef = "one" if source == "previous_token" else "fit"
    if tt < _SHARED_PARAMS_BELOW:
        choices = (True,)
    elif tt < _PER_CHANNEL_FROM:
        choices = (False, True)
    else:
        choices = (False,)
    models = [fit_model(kx, pred, grid, tb, gain, prev_coef, sh) for sh in choices]
    model = min(models, key=lambda mdl: estimated_bits(mdl, kx, pred, grid, tb, source))
    shared = model.shared
    n_tb = -(-tt // tb)
    sizes = np.full(g * n_tb, tb * d + 2, np.int64)
    sizes[n_tb - 1::n_tb] = (tt - (n_tb - 1) * tb) * d + 2
    caps = np.concatenate([[0], np.cumsum(sizes)])
    out = np.empty(int(caps[-1]), np.uint32)
    out_start = np.empty(g * n_tb, np.int64)
    with _Threads(threads):
        _encode_kernel(kx, pred if pred is not None else np.zeros((1, 1, 1), np.float32), pred is not None,
                       *model.kernel_args(), grid.edges, grid.valf, grid.finite, tb, caps, out, out_start)
    lengths = caps[1:] - out_start
    payload = np.concatenate([out[s0:s1] for s0, s1 in zip(out_start, caps[1:])])
    meta.update(tb=tb, shared=shared)
    sections.update(model=np.concatenate([model.pack(source), lengths.astype("<u4").view(np.uint8)]),
                    payload=payload)
    return meta, sections


def _section(sections, name, dtype, n=None) -> np.ndarray:
    if not isinstance(sections, dict) or name not in sections:
        raise CorruptStreamError(f"predictive stream lacks section {name!r}")
    v = sections[name]
    if isinstance(v, (bytes, bytearray, memoryview)):
        v = np.frombuffer(v, np.uint8)
    elif isinstance(v, torch.Tensor):
        v = v.numpy()
    if not isinstance(v, np.ndarray) or v.dtype != np.dtype(dtype) or v.ndim != 1 or (n is not None and v.size != n):
        raise CorruptStreamError(f"predictive stream section {name!r} has the wrong type or size")
    return v


def _meta_dtype_shape(meta) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(meta, dict) or meta.get("v") != FORMAT_VERSION:
        raise CorruptStreamError("predictive stream has an unknown format version")
    dtype = dtype_from_name(meta.get("dtype"), "predictive stream")
    shape = checked_shape(meta.get("shape"), "predictive stream")
    if math.prod(shape) > _MAX_NUMEL:
        raise CorruptStreamError("predictive stream claims an implausibly large tensor")
    return dtype, tuple(shape)


def _token_range(tokens, tt: int) -> tuple[int, int]:
    if tokens is None:
        return 0, tt
    try:
        start, stop = (int(v) for v in tokens)
    except (TypeError, ValueError):
        raise ValueError("tokens must be a (start, stop) pair of ints") from None
    if not 0 <= start <= stop <= tt:
        raise ValueError(f"tokens ({start}, {stop}) out of range for {tt} tokens")
    return start, stop


def _out_shape(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return shape
    if len(shape) == 1:
        return (stop - start,)
    return (*shape[:-2], stop - start, shape[-1])


def decode_tensor(meta: dict, sections: dict, prediction=None, threads: int = 0,
                  tokens: tuple[int, int] | None = None) -> torch.Tensor:
    """Invert :func:`encode_tensor`; every inconsistency raises CorruptStreamError.

    ``tokens=(start, stop)`` decodes only that range of axis -2 (axis 0 of a 1-d tensor): only the
    chunks holding it are decoded, since every chunk decodes alone.
    """
    dtype, shape = _meta_dtype_shape(meta)
    source = meta.get("source")
    if source not in PREDICTORS:
        raise CorruptStreamError("predictive stream names an unknown predictor")
    g, tt, d = kv_layout(shape)
    start, stop = _token_range(tokens, tt)
    out_shape = _out_shape(shape, start, stop)
    numel = math.prod(shape)
    mode = meta.get("mode")
    if mode == "raw":
        raw = _section(sections, "raw", np.uint8, numel * dtype.itemsize)
        out = torch.from_numpy(raw.copy()) if numel else torch.empty(0, dtype=torch.uint8)
        out = out.view(dtype).reshape(shape)
        if (start, stop) == (0, tt) or not numel:
            return out if (start, stop) == (0, tt) else torch.empty(out_shape, dtype=dtype)
        return out.reshape(g, tt, d)[:, start:stop].reshape(out_shape).clone()
    grid = grid_for(dtype) if mode == "grid" else None
    if mode == "f32split" and dtype == torch.float32:
        grid = grid_for(torch.bfloat16)
    if grid is None or numel == 0:
        raise CorruptStreamError("predictive stream has a mode that does not fit its dtype")
    tb, shared = meta.get("tb"), meta.get("shared")
    if tb != token_block(tt, d) or not isinstance(shared, bool):
        raise CorruptStreamError("predictive stream has a bad chunking or sharing field")
    gp = 1 if shared else g
    n_tb = -(-tt // tb)
    n_model = Model.packed_size(source, gp, d)
    blob = _section(sections, "model", np.uint8, n_model + 4 * g * n_tb)
    margs = Model.unpack(blob[:n_model], source, gp, d, shared).kernel_args()
    lengths = blob[n_model:].copy().view("<u4").astype(np.int64)
    words = _section(sections, "payload", np.uint32)
    if int(lengths.sum()) != words.size:
        raise CorruptStreamError("predictive stream chunk sizes do not add up to its payload")
    wstart = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    pred = None
    if source == "external":
        if prediction is None:
            raise ValueError("this stream was coded with a prediction: pass the same prediction to decode")
        if tuple(prediction.shape) != shape:
            raise ValueError(f"prediction must have shape {shape}")
        with np.errstate(invalid="ignore"):
            pred = _prediction_f32(prediction, g, tt, d)
        if zlib.crc32(pred.reshape(-1).view(np.uint8)) != meta.get("pred_crc"):
            raise CorruptStreamError("the prediction differs from the one this stream was coded with")
    elif prediction is not None:
        raise ValueError("this stream was coded without a prediction tensor")
    if start == stop:
        return torch.empty(out_shape, dtype=dtype)

    b0, b1 = start // tb, -(-stop // tb)
    out_t0 = b0 * tb
    kx = np.empty((g, min(tt, b1 * tb) - out_t0, d), np.int32)
    err = np.zeros(g * (b1 - b0), np.int32)
    tail = (grid.edges, grid.valf, grid.finite, grid.rank_of_bf16, 1.0 / margs[3],
            inverse_shape_index(margs[5]), 1.0 / np.diff(margs[5]).astype(np.float64), tb, tt)
    blocks = np.arange(b0, b1, dtype=np.int64)

    def run(g_first: int, n_groups: int, p, has_p: bool, p_t0: int, e):
        cg = np.repeat(np.arange(n_groups, dtype=np.int64), b1 - b0)
        cb = np.tile(blocks, n_groups)
        ci = (g_first + cg) * n_tb + cb
        _decode_kernel(words, wstart[ci], lengths[ci], cg, cb, p, has_p, p_t0, *margs, *tail, g_first, out_t0,
                       kx[g_first:g_first + n_groups], e)

    with _Threads(threads):
        if source == "neighbour_layer":
            if len(shape) < 3:
                raise CorruptStreamError("neighbour-layer stream needs a [layers, ..., tokens, channels] shape")
            per_layer = g // shape[0]
            values = value_table(grid)
            p_layer = np.zeros((per_layer, kx.shape[1], d), np.float32)
            for layer in range(shape[0]):
                e = err[layer * per_layer * (b1 - b0):(layer + 1) * per_layer * (b1 - b0)]
                run(layer * per_layer, per_layer, p_layer, True, out_t0, e)
                if e.any():
                    break
                p_layer = values[kx[layer * per_layer:(layer + 1) * per_layer]]
        else:
            run(0, g, pred if pred is not None else np.zeros((1, 1, 1), np.float32), pred is not None, 0, err)
    if err.any():
        raise CorruptStreamError("predictive stream payload is corrupted (rANS state check failed)")
    kx = kx[:, start - out_t0:stop - out_t0]
    sym_bits = grid.bits_of_k[kx.reshape(-1)]
    if mode == "f32split":
        lo = _section(sections, "lo16", np.uint16, numel).reshape(g, tt, d)[:, start:stop].reshape(-1)
        out = (sym_bits.astype(np.uint32) << 16) | lo.astype(np.uint32)
        return torch.from_numpy(out.view(np.int32)).view(torch.float32).reshape(out_shape)
    return torch.from_numpy(sym_bits.view(grid.bits_np_signed)).view(dtype).reshape(out_shape)


# =============================================================================== the codec
class PredictiveCodec:
    """Codec ``"predictive"``: code a tensor given a prediction both sides have.

    ``encode(t, prediction, threads, predictor=None)``: with a prediction tensor the model is
    centred on it; without one, ``predictor`` names a built-in source, ``"previous_token"`` or
    ``"neighbour_layer"``, and decoding needs no prediction either.
    """

    name = "predictive"

    def encode(self, t, prediction, threads: int = 0, predictor: str | None = None, **opts):
        if opts:
            raise ValueError(f"unknown option(s) for the predictive codec: {', '.join(sorted(opts))}")
        if prediction is not None:
            if predictor not in (None, "external"):
                raise ValueError("pass a prediction tensor or a built-in predictor name, not both")
            return encode_tensor(t, prediction, "external", threads)
        if predictor not in ("previous_token", "neighbour_layer"):
            raise ValueError("the predictive codec needs a prediction tensor or "
                             "predictor='previous_token' / 'neighbour_layer'")
        return encode_tensor(t, None, predictor, threads)

    def decode(self, meta, sections, prediction, threads: int = 0):
        return decode_tensor(meta, sections, prediction, threads)


def _register() -> None:
    from kvcodec.lossless.registry import register

    register(PredictiveCodec(), replace=True)


_register()
