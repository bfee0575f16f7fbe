"""Quantized Gaussian and Laplace models with per-symbol mean and scale, plus a uniform mixture.

P(k) is the model mass of [k - 1/2, k + 1/2); the tails beyond [lo, hi] fold into the end
buckets. Parameters map onto a fixed-point grid (mean to 1/256, scale to a
32-steps-per-octave log grid) by exact operations only (IEEE rint, the float's exponent and
mantissa bits, integer comparisons), so the same float inputs give the same integer model on
any machine; from there everything is integer (``_qmath``). Callers that want bit-exactness across devices whose float predictions
may differ should store ``mean_q``/``scale_idx``/``weight_q`` and rebuild with
``QuantizedModel.from_quantized``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import _qmath as q
from . import _tables
from .base import Model, QuantizedFamily, decode_uniform, uniform_steps

_THRESHOLDS = np.array(_tables.SCALE_THRESHOLDS, dtype=np.float64)
_FAMILY_NAMES = {q.GAUSSIAN: "Gaussian", q.LAPLACE: "Laplace"}


def _as_1d(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a 1-D array, got shape {a.shape}")
    return a.reshape(-1)


# thresholds t_k = 2**((k-0.5)/32) all lie in [1, 2): comparing mantissa bits compares the values.
# A 256-bucket table gives the count below each bucket's start; buckets (1/256 wide) are narrower
# than the threshold spacing (2**(1/32) - 1 > 2%), so at most one more threshold can follow.
_THRESHOLD_MANTISSAS = np.ascontiguousarray(_THRESHOLDS).view(np.int64) & ((1 << 52) - 1)
_MANT_START = np.searchsorted(_THRESHOLD_MANTISSAS, np.arange(256, dtype=np.int64) << 44, side="left").astype(np.int64)
_TH_PADDED = np.append(_THRESHOLD_MANTISSAS, np.int64(1) << 53)  # sentinel above every mantissa
assert np.all(np.diff(_THRESHOLD_MANTISSAS) > (1 << 44))
MEAN_CLIP = 2.0**31  # means are clipped to [lo - 2**31, hi + 2**31] symbols


@njit(cache=True, inline="always")
def mean_to_q(v, lo_f, hi_f):
    """One finite mean -> 1/256 units: rint(256 * clip(v, lo_f, hi_f)) (exact scaling, IEEE rint)."""
    v = lo_f if v < lo_f else (hi_f if v > hi_f else v)
    return np.int64(np.rint(v * (1 << q.MEAN_FRAC_BITS)))


@njit(cache=True, inline="always")
def scale_bits_to_idx(b):
    """IEEE bits of one positive finite scale -> round(32*log2(scale)) on the clamped grid, exactly:
    scale = 2**e * (1 + mant/2**52); k = #thresholds <= that mantissa (start table + one
    branch-free comparison). Subnormal scales clamp to the grid's bottom like any tiny one."""
    e = (b >> 52) - 1023
    mant = b & ((1 << 52) - 1)
    k = _MANT_START[mant >> 44]
    k += np.int64(_TH_PADDED[k] <= mant)
    idx = e * _THRESHOLD_MANTISSAS.shape[0] + k
    return np.int64(q.SIDX_MIN if idx < q.SIDX_MIN else (q.SIDX_MAX if idx > q.SIDX_MAX else idx))


@njit(cache=True)
def _all_finite(x):
    for i in range(x.shape[0]):
        if not (x[i] > -np.inf and x[i] < np.inf):  # also catches NaN
            return False
    return True


@njit(cache=True)
def _all_positive_finite(bits):
    for i in range(bits.shape[0]):
        if bits[i] <= 0 or bits[i] >= 0x7FF0000000000000:  # zero, negative, inf or NaN
            return False
    return True


@njit(cache=True)
def _quantize_means(m, lo_f, hi_f, out):
    for i in range(m.shape[0]):
        out[i] = mean_to_q(m[i], lo_f, hi_f)


@njit(cache=True)
def _quantize_scales(bits, out):
    for i in range(bits.shape[0]):
        out[i] = scale_bits_to_idx(bits[i])


def _float_params(mean, scale) -> tuple[np.ndarray, np.ndarray]:
    """Validated contiguous float64 arrays (no copy when already so) and the scales' IEEE bits."""
    m = np.ascontiguousarray(_as_1d(mean, "mean"), dtype=np.float64)
    s = np.ascontiguousarray(_as_1d(scale, "scale"), dtype=np.float64)
    if not _all_finite(m):
        raise ValueError("mean must be finite")
    if not _all_positive_finite(s.view(np.int64)):
        raise ValueError("scale must be finite and > 0")
    return m, s.view(np.int64)


def quantize_mean(mean, lo: int, hi: int) -> np.ndarray:
    """Mean in 1/256 symbol units (int64): rint(256 * clip(mean, lo - 2**31, hi + 2**31))."""
    m, _ = _float_params(mean, 1.0)
    out = np.empty(m.shape[0], dtype=np.int64)
    _quantize_means(m, float(lo) - MEAN_CLIP, float(hi) + MEAN_CLIP, out)
    return out


def quantize_scale(scale) -> np.ndarray:
    """round(32*log2(scale)) computed exactly (IEEE bits + integer comparisons), clamped to [2**-8, 2**24]."""
    _, bits = _float_params(0.0, scale)
    out = np.empty(bits.shape[0], dtype=np.int32)
    _quantize_scales(bits, out)
    return out


def quantize_weight(weight) -> np.ndarray:
    """Uniform-component weight in Q16; any weight > 0 keeps at least 2**-16."""
    w = _as_1d(weight, "wide_weight").astype(np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or np.any(w > 1):
        raise ValueError("wide_weight must be in [0, 1]")
    wq = np.rint(w * q.WEIGHT_ONE).astype(np.int64)
    wq[(w > 0) & (wq == 0)] = 1
    return wq.astype(np.int32)


def _broadcast_size(*arrays: np.ndarray) -> int | None:
    sizes = {a.shape[0] for a in arrays if a.shape[0] != 1}
    if len(sizes) > 1:
        raise ValueError(f"per-symbol parameter arrays differ in length: {sorted(sizes)}")
    return sizes.pop() if sizes else None


class QuantizedModel(Model):
    """Per-symbol quantized Gaussian/Laplace over the integers [lo, hi], optional uniform mixture.

    The model keeps the float parameters (without a copy when they are contiguous float64:
    do not modify them while the model is in use); the numba coder quantizes them per symbol
    inside its loop, and ``mean_q``/``scale_idx`` give the same integers as arrays.
    """

    def __init__(self, family: int, mean, scale, lo: int, hi: int, wide_weight=0.0):
        self._set_bounds(lo, hi)
        mean_f, scale_bits = _float_params(mean, scale)
        self._set(family, mean_f, scale_bits, quantize_weight(wide_weight))

    @classmethod
    def from_quantized(cls, family: int, mean_q, scale_idx, lo: int, hi: int, weight_q=0) -> "QuantizedModel":
        """Rebuild from stored integer parameters (mean in 1/256, scale index, weight in Q16)."""
        self = cls.__new__(cls)
        self._set_bounds(lo, hi)
        mean_q = _as_1d(mean_q, "mean_q").astype(np.int64)
        sidx = _as_1d(scale_idx, "scale_idx").astype(np.int64)
        wq = _as_1d(weight_q, "weight_q").astype(np.int64)
        lim_lo, lim_hi = int((self.lo - MEAN_CLIP) * 256), int((self.hi + MEAN_CLIP) * 256)
        if np.any(mean_q < lim_lo) or np.any(mean_q > lim_hi):
            raise ValueError("mean_q out of range (more than 2**31 symbols outside [lo, hi])")
        if np.any(sidx < q.SIDX_MIN) or np.any(sidx > q.SIDX_MAX):
            raise ValueError(f"scale_idx must be in [{q.SIDX_MIN}, {q.SIDX_MAX}]")
        if np.any(wq < 0) or np.any(wq > q.WEIGHT_ONE):
            raise ValueError("weight_q must be in [0, 65536]")
        # exact float stand-ins: mean_q/256 is exact, 2**(k/32) sits mid-way between the k-th thresholds
        mean_f = mean_q / float(1 << q.MEAN_FRAC_BITS)
        scale_f = 2.0 ** (sidx / float(_tables.SCALE_STEPS))
        self._set(family, mean_f, scale_f.view(np.int64), wq.astype(np.int32))
        if not (np.array_equal(self.mean_q, mean_q) and np.array_equal(self.scale_idx, sidx)):
            raise AssertionError("float stand-ins of the integer parameters do not round-trip")
        return self

    def _set_bounds(self, lo: int, hi: int) -> None:
        lo, hi = int(lo), int(hi)
        if hi < lo:
            raise ValueError(f"need lo <= hi, got [{lo}, {hi}]")
        if hi - lo + 1 > q.MAX_ALPHABET or lo < -(2**31) or hi >= 2**31:
            raise ValueError(f"alphabet [{lo}, {hi}] too large (at most 2**30 symbols within int32)")
        self.lo, self.hi = lo, hi
        self.dtype = np.dtype(np.int32)

    def _set(self, family: int, mean_f: np.ndarray, scale_bits: np.ndarray, wq: np.ndarray) -> None:
        if family not in _FAMILY_NAMES:
            raise ValueError(f"unknown family {family}")
        self.family = family
        self.mean_f, self.scale_bits, self.weight_q = mean_f, scale_bits, wq
        self._mean_q = self._scale_idx = None
        self.size = _broadcast_size(mean_f, scale_bits, wq)

    @property
    def mean_q(self) -> np.ndarray:
        """Means in 1/256 symbol units (int64), as the coders use them."""
        if self._mean_q is None:
            self._mean_q = np.empty(self.mean_f.shape[0], dtype=np.int64)
            _quantize_means(self.mean_f, self.lo - MEAN_CLIP, self.hi + MEAN_CLIP, self._mean_q)
        return self._mean_q

    @property
    def scale_idx(self) -> np.ndarray:
        """round(32*log2(scale)) (int32), as the coders use them."""
        if self._scale_idx is None:
            self._scale_idx = np.empty(self.scale_bits.shape[0], dtype=np.int32)
            _quantize_scales(self.scale_bits, self._scale_idx)
        return self._scale_idx

    @property
    def precision(self) -> int:
        return q.PRECISION

    def __repr__(self) -> str:
        mix = f", wide_weight_q={self.weight_q[:4]}" if np.any(self.weight_q) else ""
        return f"{_FAMILY_NAMES[self.family]}(size={self.size}, lo={self.lo}, hi={self.hi}{mix})"

    def fast_form(self) -> QuantizedFamily:
        return QuantizedFamily(self.mean_f, self.scale_bits, self.weight_q, self.lo, self.hi, self.family, self.dtype)

    def _params(self, i: int) -> tuple[int, int, int]:
        def pick(a):
            return int(a[i if a.shape[0] > 1 else 0])

        return pick(self.mean_q), pick(self.scale_idx), pick(self.weight_q)

    def steps(self, i, x):
        x = int(x)
        if not self.lo <= x <= self.hi:
            raise ValueError(f"symbol {x} at position {i} outside [{self.lo}, {self.hi}]")
        m, s, w = self._params(i)
        fr = q.symbol_frame(self.lo, self.hi, m, s, self.family)
        t, idx, count = q.split_symbol(x, fr, self.lo)
        c0 = q.token_cum(t, fr, self.lo, m, s, w, self.family)
        c1 = q.token_cum(t + 1, fr, self.lo, m, s, w, self.family)
        return [(c0, c1 - c0, 1 << q.PRECISION)] + uniform_steps(idx, count)

    def decode_symbol(self, i, dec):
        m, s, w = self._params(i)
        fr = q.symbol_frame(self.lo, self.hi, m, s, self.family)
        v = dec.target(1 << q.PRECISION)
        t = q.find_token(v, fr, self.lo, m, s, w, self.family)
        c0 = q.token_cum(t, fr, self.lo, m, s, w, self.family)
        c1 = q.token_cum(t + 1, fr, self.lo, m, s, w, self.family)
        dec.consume(c0, c1 - c0, 1 << q.PRECISION)
        x = q.join_symbol(t, decode_uniform(dec, q.raw_count(t, fr)), fr, self.lo)
        if x < self.lo:
            dec.corrupt(f"symbol {i} decodes outside the model's support")
        return x

    def symbol_bits(self, symbols):
        sym = np.asarray(symbols).reshape(-1).astype(np.int64)
        self.check_count(sym.shape[0])
        if sym.size and (sym.min() < self.lo or sym.max() > self.hi):
            raise ValueError(f"symbols outside [{self.lo}, {self.hi}]")
        out = np.empty(sym.shape[0], dtype=np.float64)
        _symbol_bits(sym, self.mean_q, self.scale_idx, self.weight_q, self.lo, self.hi, self.family, out)
        return out


@njit(cache=True)
def _symbol_bits(sym, mean_q, sidx, wq, lo, hi, fam, out):
    for i in range(sym.shape[0]):
        m = mean_q[i if mean_q.shape[0] > 1 else 0]
        s = sidx[i if sidx.shape[0] > 1 else 0]
        w = wq[i if wq.shape[0] > 1 else 0]
        fr = q.symbol_frame(lo, hi, m, s, fam)
        t, idx, count = q.split_symbol(sym[i], fr, lo)
        f = q.token_cum(t + 1, fr, lo, m, s, w, fam) - q.token_cum(t, fr, lo, m, s, w, fam)
        bits = q.PRECISION - math.log2(f)
        if count > 65536:  # two uniform steps, see base.uniform_steps
            high = idx >> 16
            bits += math.log2((count + 65535) >> 16) + math.log2(min(65536, count - (high << 16)))
        elif count > 1:
            bits += math.log2(count)
        out[i] = bits


class Gaussian(QuantizedModel):
    """Gaussian(mean, scale=std) quantized to the integers [lo, hi]; mean/scale scalars or per-symbol arrays."""

    def __init__(self, mean, scale, lo: int, hi: int):
        super().__init__(q.GAUSSIAN, mean, scale, lo, hi)


class Laplace(QuantizedModel):
    """Laplace(mean, scale=b) (density exp(-|x-mean|/b)/2b) quantized to the integers [lo, hi]."""

    def __init__(self, mean, scale, lo: int, hi: int):
        super().__init__(q.LAPLACE, mean, scale, lo, hi)


class Mixture(QuantizedModel):
    """(1 - w) * base + w * Uniform[lo, hi]: keeps outliers cheap (about log2(N) - log2(w) bits)."""

    def __init__(self, base: QuantizedModel, wide_weight=1e-3):
        if not isinstance(base, QuantizedModel):
            raise ValueError("Mixture needs a Gaussian or Laplace base model")
        self._set_bounds(base.lo, base.hi)
        self._set(base.family, base.mean_f, base.scale_bits, quantize_weight(wide_weight))
