"""The predictive model's fitted parameters: what they are, how they are stored and fitted.

:class:`ChannelParams` holds, per leading index and channel (``[Gp, D]``; Gp = 1 when shared over
the leading axes), a location ``m``, a prediction gain ``c``, a previous-token coefficient ``a`` and
a scale ``s``, plus the shape table's masses. ``fit_params`` fits them on every value (encoder
only), quantised exactly as stored, so the decoder never refits anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive.cdf import location, prediction_at
from kvcodec.lossless.predictive.grid import SHAPE_BINS, ZMAX, FloatGrid, masses_from_counts, shape_cdf

S_MIN, S_MAX = 1e-40, 1e30  # stored scales are clipped to this range (bf16 keeps 1e-40 > 0)
Q = 64  # gain and previous-token coefficients are stored as int8 / 64


def to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """Round float values to bf16 (nearest) and return the uint16 bit patterns (how m, s are stored)."""
    return torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def stored_fields(source: str) -> tuple[str, ...]:
    """The per-channel parameters a stream of this source stores (the rest are fixed)."""
    return {"previous_token": ("s",), "neighbour_layer": ("m", "s", "c", "a")}.get(source, ("m", "s", "a"))


@dataclass
class ChannelParams:
    """Per-channel parameters ([Gp, D], Gp = 1 when shared) and the shape table (not a probability
    model of ``kvcodec.entropy.models``: the CDF these parameters define is in ``cdf``).

    Stored: m and s as bf16, c and a as int8 (value / 64); fields fixed by the source
    (``_stored_fields``) are not stored. ``m``/``s`` here are float64 copies of the stored values.
    """

    m: np.ndarray
    s: np.ndarray
    c: np.ndarray
    a: np.ndarray
    masses: np.ndarray
    shared: bool
    fit_n: np.ndarray | None = None  # encoder only: finite values and sum of squared residuals per
    fit_r2: np.ndarray | None = None  # [Gp, D] under the fitted location (for estimated_bits)

    def kernel_args(self):
        if not np.all(np.isfinite(self.s)) or np.any(self.s <= 0) or not np.all(np.isfinite(self.m)):
            raise CorruptStreamError("predictive stream has a bad location or scale")
        return (self.m, self.c.astype(np.float64) / Q, self.a.astype(np.float64) / Q,
                1.0 / self.s, self.shared, shape_cdf(self.masses))

    def pack(self, source: str) -> np.ndarray:
        parts = []
        for f in stored_fields(source):
            v = getattr(self, f)
            parts.append(to_bf16_bits(v).reshape(-1).view(np.uint8) if f in ("m", "s") else v.reshape(-1).view(np.uint8))
        parts.append(self.masses.view(np.uint8))
        return np.concatenate(parts)

    @staticmethod
    def packed_size(source: str, gp: int, d: int) -> int:
        return sum(2 if f in ("m", "s") else 1 for f in stored_fields(source)) * gp * d + 2 * SHAPE_BINS

    @classmethod
    def unpack(cls, blob: np.ndarray, source: str, gp: int, d: int, shared: bool) -> "ChannelParams":
        if blob.size != cls.packed_size(source, gp, d):
            raise CorruptStreamError("predictive stream model section has the wrong size")
        n = gp * d
        vals = {"m": np.zeros((gp, d)), "c": np.full((gp, d), Q if source == "external" else 0, np.int8),
                "a": np.full((gp, d), Q, np.int8)}
        pos = 0
        for f in stored_fields(source):
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
                p = prediction_at(pred, has_pred, g, t, d)
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
                p = prediction_at(pred, has_pred, g, t, d)
                base, mu = location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
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


def fit_params(kx, pred, grid: FloatGrid, tb: int, gain: str, prev_coef: str, shared: bool,
               shape: bool = True) -> ChannelParams:
    """Fit the parameters on every value (encoder only), quantised exactly as stored; ``shape``:
    also the shape table (format 1 only: one more pass).

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
    c_q = np.clip(np.round(np.nan_to_num(c) * Q), -127, 127).astype(np.int8)
    c = c_q.astype(np.float64) / Q
    if prev_coef == "one":
        m = np.zeros(n.shape)
    else:
        with np.errstate(all="ignore"):
            mean = np.where(n > 0, (mom[..., 1] - c * mom[..., 2]) / safe_n, 0.0)
        m = from_bf16_bits(to_bf16_bits(np.clip(np.nan_to_num(mean), -3e38, 3e38)))
    a_q = np.full(n.shape, Q if prev_coef == "one" else 0, np.int8)
    hist = np.zeros((g, SHAPE_BINS), np.int64)
    no_hist = np.zeros((1, 1))

    def residuals(a_q, rs):
        out = np.zeros((g, d, 3))
        _fit_residuals(kx, p, has_pred, m, c, a_q.astype(np.float64) / Q, shared, grid.valf, grid.finite,
                       tb, rs, out, hist)
        return out.sum(axis=0, keepdims=True) if shared else out

    if prev_coef != "one":
        res = residuals(a_q, no_hist)
        with np.errstate(all="ignore"):
            a = np.where(res[..., 1] > 0, res[..., 0] / np.where(res[..., 1] > 0, res[..., 1], 1.0), 0.0)
        a_q = np.clip(np.round(np.nan_to_num(a) * Q), -Q, Q).astype(np.int8)
    res = residuals(a_q, no_hist)
    with np.errstate(all="ignore"):
        s = np.sqrt(res[..., 2] / safe_n)
        floor = np.where(mom[..., 5] > 0, np.exp2(mom[..., 6] / np.maximum(mom[..., 5], 1)) / 4, 0.0)
        s = np.maximum(np.where(np.isfinite(s), s, S_MAX), np.nan_to_num(floor))
    s = from_bf16_bits(to_bf16_bits(np.clip(s, S_MIN, S_MAX)))
    if shape:
        residuals(a_q, 1.0 / s)
    return ChannelParams(m=m, s=s, c=c_q, a=a_q, masses=masses_from_counts(hist.sum(axis=0)), shared=shared,
                         fit_n=n, fit_r2=res[..., 2])


def estimated_bits(model: ChannelParams, source: str, param_bits: float | None = None) -> float:
    """Gaussian estimate of payload + parameter bits of coding the values ``model`` was fitted on
    (differences between models are what count): chooses shared or per-(g, d) parameters for
    short caches. ``param_bits``: the parameters' cost (default: format 1's stored size)."""
    s = model.s
    with np.errstate(all="ignore"):
        bits = float(np.nan_to_num((model.fit_n * np.log2(s) + model.fit_r2 / (2 * s * s * np.log(2))).sum(),
                                   nan=np.inf))
    if param_bits is None:
        param_bits = 8 * ChannelParams.packed_size(source, s.shape[0], s.shape[1])
    return bits + param_bits


