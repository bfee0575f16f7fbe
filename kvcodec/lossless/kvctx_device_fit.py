"""The predictive model's per-channel parameters fitted on a CUDA device (step 1 of the GPU encoder,
``kvcodec.lossless.kvctx_device_encode``).

Why: a KV cache of ~0.5 M (leading index, channel) pairs costs ~50 ms of numpy on one host core for the
fit formulas and the bin parameters, ten times the GPU encode of the whole tensor; here they are a few
torch launches on the [Gp, D] sums of the per-column kernels (``kvcodec.cuda.kvctx_encode.fit_*``).

Device forms of ``params.fit_params`` (format 2: no shape table), ``params.estimated_bits`` and
``format2.BinParams.from_channel`` / ``kernel_args``: the same formulas and quantisation (bf16 rounding,
int8 / 64, quarter-octave levels from frexp and exact thresholds, exact powers of two), so the stored
fields mean what the decoders read; the sums come in another order, so a parameter may differ from the
CPU encoder's in a last bit (it is stored: the stream stays exact). The tests check these against the
host functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.lossless.predictive.bins import EP_MAX, BinGrid
from kvcodec.lossless.predictive.format2 import _LEVEL_HI, _LEVEL_LO, _MQ_MAX, BinParams
from kvcodec.lossless.predictive.params import Q, S_MAX, S_MIN

# bins.scale_levels' quarter-octave thresholds: 2**0.25, 2**0.5, 2**0.75
_QUARTERS = (1.189207115002721, 1.4142135623730951, 1.6817928305074290)


@dataclass
class DeviceModel:
    """params.ChannelParams' fields on the device ([Gp, D]): m, s float64, c, a int8 (value * 64), and the
    fit statistics n (finite values) and r2 (sum of squared residuals) for :func:`cost`."""

    m: torch.Tensor
    s: torch.Tensor
    c: torch.Tensor
    a: torch.Tensor
    n: torch.Tensor
    r2: torch.Tensor
    shared: bool


def _bf16(v: torch.Tensor) -> torch.Tensor:
    """Rounded to bf16 (nearest even, through float32) and back: params.to_bf16_bits / from_bf16_bits."""
    return v.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 2**e of integers -1022 <= e <= 1023 (the exponent bits set directly)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def fit(mom: torch.Tensor, residuals, gain: str, prev_coef: str, shared: bool) -> DeviceModel:
    """params.fit_params' formulas on ``mom`` [G, D, 7] (params._fit_moments' fields); ``gain``: "zero",
    "one" or "fit" (c); ``residuals(m, c, a, shared)`` returns the [Gp, D, 3] residual sums under a location."""
    if shared:
        mom = mom.sum(dim=0, keepdim=True)
    n = mom[..., 0]
    safe_n = n.clamp(min=1)
    if gain == "fit":  # sums of huge values overflow: the gain is then 0
        cov = mom[..., 3] - mom[..., 1] * mom[..., 2] / safe_n
        var = mom[..., 4] - mom[..., 2] ** 2 / safe_n
        big = var > 1e-300
        c = torch.where(big, cov / torch.where(big, var, torch.ones_like(var)), torch.zeros_like(var))
        c_q = torch.round(torch.nan_to_num(c) * Q).clamp(-127, 127).to(torch.int8)
    else:
        c_q = torch.full(n.shape, Q if gain == "one" else 0, dtype=torch.int8, device=n.device)
    c = c_q.double() / Q
    if prev_coef == "one":
        m = torch.zeros_like(n)
    else:
        mean = torch.where(n > 0, (mom[..., 1] - c * mom[..., 2]) / safe_n, torch.zeros_like(n))
        m = _bf16(torch.nan_to_num(mean).clamp(-3e38, 3e38))
    a_q = torch.full(n.shape, Q if prev_coef == "one" else 0, dtype=torch.int8, device=n.device)
    if prev_coef != "one":
        res = residuals(m, c, a_q.double() / Q, shared)
        pos = res[..., 1] > 0
        a = torch.where(pos, res[..., 0] / torch.where(pos, res[..., 1], torch.ones_like(n)), torch.zeros_like(n))
        a_q = torch.round(torch.nan_to_num(a) * Q).clamp(-Q, Q).to(torch.int8)
    res = residuals(m, c, a_q.double() / Q, shared)
    s = torch.sqrt(res[..., 2] / safe_n)
    floor = torch.where(mom[..., 5] > 0, torch.exp2(mom[..., 6] / mom[..., 5].clamp(min=1)) / 4, torch.zeros_like(n))
    s = torch.maximum(torch.where(torch.isfinite(s), s, torch.full_like(s, S_MAX)), torch.nan_to_num(floor))
    s = _bf16(s.clamp(S_MIN, S_MAX))
    return DeviceModel(m=m, s=s, c=c_q, a=a_q, n=n, r2=res[..., 2], shared=shared)


def cost(model: DeviceModel) -> float:
    """params.estimated_bits with format 2's parameter cost (16 bits a channel): chooses shared or
    per-(g, d) parameters as the CPU encoder does."""
    s = model.s
    bits = (model.n * torch.log2(s) + model.r2 / (2 * s * s * math.log(2))).sum()
    return float(torch.nan_to_num(bits, nan=math.inf)) + 16.0 * s.numel()


def bin_params(model: DeviceModel, grid: BinGrid) -> tuple[BinParams, list[torch.Tensor]]:
    """(format2.BinParams.from_channel(model) on the host: its fields are stored; the kernel's
    per-channel arguments on the device: m, c, a float64 [Gp * D] and (es, level) int32 [Gp * D, 2],
    BinParams.kernel_args exactly)."""
    s_v = model.s * 2.0 ** -grid.eoff  # exact: a power of two
    mant, ex = torch.frexp(s_v)
    m2 = 2.0 * mant
    quarter = sum((m2 >= q).to(torch.int64) for q in _QUARTERS)
    level = (4 * (ex.to(torch.int64) - 1) + quarter).clamp(_LEVEL_LO, _LEVEL_HI)
    es = (torch.div(level, 4, rounding_mode="floor") - 3).clamp(0, EP_MAX)
    step = pow2(es + grid.eoff)
    mq = torch.nan_to_num(torch.round(model.m / step)).clamp(-_MQ_MAX, _MQ_MAX).to(torch.int64)
    margs = [(mq.double() * step).reshape(-1), (model.c.double() / Q).reshape(-1), (model.a.double() / Q).reshape(-1),
             torch.stack([es, level], -1).reshape(-1, 2).to(torch.int32)]
    small = torch.stack([level, mq]).to(torch.int16).cpu().numpy().astype(np.int64)
    ca = torch.stack([model.c, model.a]).cpu().numpy()
    bp = BinParams(level=small[0], mq=small[1], c=ca[0], a=ca[1], shared=model.shared)
    return bp, margs
