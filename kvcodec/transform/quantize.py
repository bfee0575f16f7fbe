"""Coefficients <-> integer symbols: a uniform dead-zone quantizer and per-component code classes.

Every component uses the same step (the calibration's metric already weights layers, K/V and
channels): with an entropy coder behind it, one step for all components is the reverse
water-filling solution of the rate-distortion problem (each component pays min(variance, step^2/12) distortion); components
whose spread is below the step quantize to all zeros and cost 0 bits. ``rounding`` > 0 widens the
zero bin (encoder only, the decoder always reconstructs ``q * step``): fewer bits for the same
step, the usual rate-distortion-optimized rounding for peaked (Laplacian-like) coefficients.

Components are grouped into *classes* by the RMS of their symbols (quarter-octave bins): each
class gets one entropy-coder table, so table overhead stays small while similar components
share statistics. Class 0 marks an all-zero component (nothing is stored for it).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvcodec.transform.calibration import Calibration

QMAX = 32767  # symbols stay within int16, so every class fits a uint16 alphabet
N_CLASSES = 256
CLASS_BIAS = 48  # class = 1 + floor(4 * log2(rms)) + bias, clipped to 1..255


def row_steps(calib: Calibration, step: float, device) -> torch.Tensor:
    """Step per coefficient row [2*L*H*D] float32 (rows ordered as ``coef.reshape(-1, M)``): one
    step for all, the same on encoder and decoder."""
    n_rows = 2 * calib.n_layers * calib.n_kv_heads * calib.head_dim
    return torch.full((n_rows,), float(step), dtype=torch.float32, device=device)


def quantize(coef_rows: torch.Tensor, steps: torch.Tensor, rounding: float = 0.0) -> torch.Tensor:
    """coef_rows [R, M] float32, steps [R] -> int32 symbols [R, M], |q| <= QMAX."""
    a = coef_rows.abs() / steps[:, None]
    q = torch.floor(a + (0.5 - rounding)).clamp_(max=QMAX)
    return (q * torch.sign(coef_rows)).to(torch.int32)


def dequantize(q_rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """int symbols [R, M] -> coefficients [R, M] float32."""
    return q_rows.float() * steps[:, None]


@numba.njit(cache=True, nogil=True)
def dequantize_into(sym, offset, rows, start, M, steps, out):
    """CPU decode's fused ``dequantize`` + scatter: element i of a class's symbol chunk (starting at
    element ``start`` of the class, whose component rows are ``rows``) becomes
    ``out[rows[e // M], e % M] = (sym[i] + offset) * steps[row]`` with e = start + i."""
    r = start // M
    t = start - r * M
    for i in range(sym.size):
        row = rows[r]
        out[row, t] = np.float32(sym[i] + offset) * steps[row]
        t += 1
        if t == M:
            t = 0
            r += 1


def classes(q_rows: torch.Tensor) -> torch.Tensor:
    """Code class per row [R] uint8: 0 = all zero, else a quarter-octave bin of the row's RMS."""
    qf = q_rows.float()
    rms = qf.pow(2).mean(dim=1).sqrt()
    nonzero = qf.abs().amax(dim=1) > 0 if q_rows.shape[1] else torch.zeros_like(rms, dtype=torch.bool)
    b = torch.floor(4 * torch.log2(rms.clamp_min(1e-30))) + (1 + CLASS_BIAS)
    b = b.clamp(1, N_CLASSES - 1).to(torch.uint8)
    return torch.where(nonzero, b, torch.zeros_like(b))
