"""Per-channel key/value preconditioning before the rotation: x' = (x - center) / scale.

Why: real keys have a few channels with large means and variances (SmolLM2: channel RMS
max/median 6-14). A rotation spreads them over every coordinate and the per-vector norm
carries them, so every coordinate pays for the outliers. The transform is exact in attention:
- scores: q . x = (q * scale) . x' + q . center  (the query is scaled once; q . center is a
  per-query constant that softmax ignores, and kvcodec adds it back so scores stay exact);
- outputs: sum_t w_t x_t = scale * (sum_t w_t x'_t) + (sum_t w_t) * center.
Choice of scale (derivation in docs/quant.md): after the rotation the error in x' is isotropic
with variance proportional to ||x'||^2, so the score error is ~ sum_c q_c^2 w_c^2 * sum_c
sigma_c^2 / w_c^2, minimized by w_c = sqrt(sigma_c / rms(q_c)); without query statistics
(values, or keys before any query is seen) the same argument with isotropic q gives
w_c = sqrt(sigma_c). Both are computed once per (layer, head) from a calibration block (the
prefill) and stored as float16 side data, counted in nbytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PRECONDITION_MODES = ("none", "center", "scale")


def check_mode(mode: str) -> str:
    if mode not in PRECONDITION_MODES:
        raise ValueError(f"precondition must be one of {PRECONDITION_MODES}, got {mode!r}")
    return mode


@dataclass
class ChannelPreconditioner:
    """center and scale are float16 [..., 1, D] (leading dims equal to the data's or 1), or None."""

    center: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    def side_fields(self) -> dict:
        out = {}
        if self.center is not None:
            out["center"] = self.center
        if self.scale is not None:
            out["scale"] = self.scale
        return out

    @classmethod
    def from_side(cls, side: dict) -> "ChannelPreconditioner":
        return cls(center=side.get("center"), scale=side.get("scale"))

    def to(self, device) -> "ChannelPreconditioner":
        return ChannelPreconditioner(
            None if self.center is None else self.center.to(device),
            None if self.scale is None else self.scale.to(device))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32) -> x' = (x - center) / scale."""
        if self.center is not None:
            x = x - self.center.float()
        if self.scale is not None:
            x = x / self.scale.float()
        return x

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            y = y * self.scale.float()
        if self.center is not None:
            y = y + self.center.float()
        return y

    def scale_queries(self, q: torch.Tensor) -> torch.Tensor:
        return q * self.scale.float() if self.scale is not None else q

    def query_offset(self, q: torch.Tensor) -> torch.Tensor | None:
        """q . center: [..., Q, 1] (a per-query constant), or None without a center."""
        if self.center is None:
            return None
        return q @ self.center.float().transpose(-1, -2)

    def output_offset(self, w: torch.Tensor) -> torch.Tensor | None:
        """(sum_t w_t) * center: [..., Q, D], or None without a center."""
        if self.center is None:
            return None
        return w.sum(-1, keepdim=True) * self.center.float()


def _reduce_dims(ndim: int, batch_dims) -> list[int]:
    dims = [ndim - 2]
    for d in batch_dims:
        d = d + ndim if d < 0 else d
        if not 0 <= d < ndim - 2:
            raise ValueError(f"batch_dims must name leading dims, got {batch_dims}")
        dims.append(d)
    return dims


def calibrate(x: torch.Tensor, mode: str = "scale", queries: torch.Tensor | None = None,
              batch_dims: tuple = ()) -> ChannelPreconditioner:
    """Channel statistics of x [..., T, D] over tokens (and ``batch_dims``) -> a preconditioner.

    queries (optional) [..., Q, D] with the same leading dims as x (for GQA, fold the group of
    query heads into Q) make the key scale query-aware: w = sqrt(sigma_k / rms(q)).
    """
    check_mode(mode)
    if mode == "none":
        return ChannelPreconditioner()
    x = x.float()
    dims = _reduce_dims(x.ndim, batch_dims)
    center = x.mean(dim=dims, keepdim=True).to(torch.float16)
    if mode == "center":
        return ChannelPreconditioner(center=center)
    sigma = (x - center.float()).pow(2).mean(dim=dims, keepdim=True).sqrt()
    qrms = None
    if queries is not None:
        if queries.shape[:-2] != x.shape[:-2] or queries.shape[-1] != x.shape[-1]:
            raise ValueError(f"queries {tuple(queries.shape)} must match keys {tuple(x.shape)} in leading dims and D")
        qrms = queries.float().pow(2).mean(dim=dims, keepdim=True).sqrt()
    return scaled(center, sigma, qrms)


def scaled(center: torch.Tensor, sigma: torch.Tensor, qrms: torch.Tensor | None = None) -> ChannelPreconditioner:
    """The "scale" preconditioner from its float16 ``center`` and ``sigma`` (float32), each channel's RMS
    about that center (and ``qrms``, the queries' RMS, where known): w = sqrt(sigma [/ rms(q)]) with a
    floor, at geometric mean 1. Callers that measure the statistics their own way share this recipe."""
    if qrms is not None:
        floor = qrms.amax(dim=-1, keepdim=True) * 1e-3 + 1e-30
        sigma = sigma / torch.maximum(qrms, floor)
    floor = sigma.amax(dim=-1, keepdim=True) * 1e-4 + 1e-30
    w = torch.maximum(sigma, floor).sqrt()
    w = w / torch.exp(torch.log(w).mean(dim=-1, keepdim=True))  # geometric mean 1: keeps magnitudes
    return ChannelPreconditioner(center=center, scale=w.to(torch.float16))
