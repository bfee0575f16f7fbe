"""fp8 KV caches: the per-(layer, head) scaled cast fp8 caches use, and predictions in its units.

Why: an fp8 cache stores ``q = fp8(x / scale)`` with one scale per leading index (layer, head).
To code ``q`` losslessly against a cheaper model's KV, the prediction must be in the same units
(``prediction / scale``, kept in float32 so no precision is thrown away before coding).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_scales(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """float32 scales [..., 1, 1]: amax over (tokens, channels) of each leading index / fp8 max."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if t.dim() < 2:
        raise ValueError("an fp8 KV tensor needs at least [tokens, channels]")
    amax = t.detach().float().abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(-2, -1), keepdim=True)
    scale = amax / torch.finfo(dtype).max
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def to_fp8_kv(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``q = fp8(t / scale)`` (saturating) with per-(layer, head) scales."""
    if scale is None:
        scale = fp8_scales(t, dtype)
    fmax = torch.finfo(dtype).max
    q = (t.float() / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def from_fp8_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise an fp8 cache: ``q * scale`` in ``dtype``."""
    return (q.float() * scale).to(dtype)


def fp8_prediction(prediction: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A prediction of ``t`` expressed in the units of ``to_fp8_kv(t)``'s q (float32)."""
    return prediction.float() / scale
