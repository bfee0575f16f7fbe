"""Rate-distortion allocation: the global quantizer step that meets a rate or distortion target.

With one step per (layer, K/V) pair scaled by the calibration's weights (``quantize``), the whole
bit allocation reduces to one number: every component then gets the rate its own spread earns at
that step (reverse water-filling), and components below the water level get 0 bits. This module
finds that number on a token subsample: for a rate target it predicts the coded size from the
empirical entropy of every code class (what the static rANS tables reach to within ~0.3%) plus the
per-stream overhead; for a distortion target it measures the squared error directly. The codec
then corrects the step with a few real encodes (true bytes, everything counted).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvcodec.transform import quantize as qz

STREAM_OVERHEAD = 14 + 8 + 4 * 32  # entropy stream header, CRCs and 32 final rANS states
TABLE_BYTES_PER_SYMBOL = 1.3  # frequency table (runs + Rice codes), per distinct symbol
MAX_SUBSAMPLE = 1 << 19


class StepModel:
    """Predicts coded bytes and squared error of the coefficient rows [R, M] as functions of the
    global step, from a subsample of the token columns."""

    def __init__(self, coef_rows: torch.Tensor, unit_steps: torch.Tensor, chunk: int, rounding: float):
        R, M = coef_rows.shape
        every = max(1, math.ceil(R * M / MAX_SUBSAMPLE))
        self.sub = coef_rows[:, ::every].contiguous()
        self.scale = M / max(1, self.sub.shape[1])
        self.unit = unit_steps
        self.M, self.chunk, self.rounding = M, chunk, rounding

    def stream_bytes(self, step: float) -> float:
        """Predicted bytes of all coefficient streams at this step."""
        if not hasattr(self, "_np"):
            self._np = (self.sub.cpu().numpy(), self.unit.cpu().numpy().astype(np.float32))
        sub, unit = self._np
        return _predict_bytes(sub, unit * np.float32(step), self.rounding, self.scale, self.M, self.chunk,
                              STREAM_OVERHEAD, TABLE_BYTES_PER_SYMBOL)

    def squared_error(self, step: float) -> float:
        """Predicted total squared error of all coefficients at this step."""
        steps = self.unit * step
        q = qz.quantize(self.sub, steps, self.rounding)
        return float((qz.dequantize(q, steps) - self.sub).double().pow(2).sum()) * self.scale


def solve_step(fn, target: float, start: float, increasing: bool, rel_tol: float = 1e-3, max_iter: int = 60) -> float:
    """The step where the monotone function ``fn`` crosses ``target`` (geometric bisection)."""
    lo = hi = start
    sign = 1 if increasing else -1

    def above(s):
        return sign * (fn(s) - target) > 0

    if above(start):
        while above(lo) and lo > 1e-30:
            hi, lo = lo, lo / 4
    else:
        while not above(hi) and hi < 1e30:
            lo, hi = hi, hi * 4
    for _ in range(max_iter):
        if hi / lo < 1 + rel_tol:
            break
        mid = math.sqrt(lo * hi)
        if above(mid):
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


@numba.njit(cache=True, nogil=True)
def _predict_bytes(sub, steps, rounding, scale, M, chunk, overhead, table_bytes):
    """``quantize`` + ``classes`` + per-class empirical entropy in one pass (the same arithmetic
    as those torch functions, fused so a rate search costs milliseconds)."""
    R, m = sub.shape
    q = np.empty((R, m), dtype=np.int32)
    cls = np.zeros(R, dtype=np.int64)
    lo = np.full(256, 1 << 30, dtype=np.int64)
    hi = np.full(256, -(1 << 30), dtype=np.int64)
    rows_in = np.zeros(256, dtype=np.int64)
    for r in range(R):
        ss = 0.0
        mx = 0
        for j in range(m):
            a = np.floor(np.float32(abs(sub[r, j]) / steps[r]) + np.float32(0.5 - rounding))
            v = int(min(a, qz_QMAX))
            if sub[r, j] < 0:
                v = -v
            q[r, j] = v
            ss += float(v) * float(v)
            mx = max(mx, abs(v))
        if mx == 0:
            continue
        b = math.floor(4 * math.log2(math.sqrt(ss / m))) + 1 + qz_BIAS
        c = int(min(max(b, 1), 255))
        cls[r] = c
        rows_in[c] += 1
        for j in range(m):
            lo[c] = min(lo[c], q[r, j])
            hi[c] = max(hi[c], q[r, j])
    total = 0.0
    for c in range(1, 256):
        if rows_in[c] == 0:
            continue
        hist = np.zeros(hi[c] - lo[c] + 1, dtype=np.int64)
        for r in range(R):
            if cls[r] == c:
                for j in range(m):
                    hist[q[r, j] - lo[c]] += 1
        n = rows_in[c] * m
        bits = 0.0
        used = 0
        for k in range(hist.size):
            if hist[k]:
                used += 1
                bits -= hist[k] * math.log2(hist[k] / n)
        n_streams = max(1, -(-(rows_in[c] * M) // chunk))
        total += bits * scale / 8 + n_streams * (overhead + table_bytes * used)
    return total


qz_QMAX = qz.QMAX
qz_BIAS = qz.CLASS_BIAS
