"""KIVI (Liu et al. 2024) baseline: asymmetric min/max integer quantization in groups.

axis="channel" (keys): each channel is quantized over groups of ``group_size`` tokens, one
(scale, min) pair per (group, channel), fields ``grouped.scale/min`` [..., G, D].
axis="token" (values): each token is quantized over groups of ``group_size`` channels, fields
``token.scale/min`` [..., T, ceil(D/group_size)].
Codes are b-bit and bit-packed per token row (same bit order as TurboQuant); scale and min are
float16 (bfloat16 when the data leave float16's range). The full-precision window of recent
tokens is the cache's job, as for every quantizer here.
"""

from __future__ import annotations

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant import base
from kvcodec.quant.base import KVQuantizer
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.packing import pack_bits, packed_width, unpack_bits


class KIVI(KVQuantizer):
    """KIVI(bits, group_size=32, axis="channel" | "token", dim=None); dim=None takes any head_dim."""

    method = "kivi"

    def __init__(self, bits: int, group_size: int = 32, axis: str = "channel", dim: int | None = None):
        self.bits = base.check_bits(bits)
        self.dim = None if dim is None else base.check_dim(dim, 1)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        if axis not in ("channel", "token"):
            raise ValueError(f"axis must be 'channel' (keys) or 'token' (values), got {axis!r}")
        self.group_size, self.axis = group_size, axis
        self.levels = (1 << bits) - 1

    def config(self) -> dict:
        return {"method": self.method, "bits": self.bits, "group_size": self.group_size, "axis": self.axis, "dim": self.dim}

    def __repr__(self) -> str:
        return f"KIVI(bits={self.bits}, group_size={self.group_size}, axis={self.axis!r})"

    def quantize(self, x: torch.Tensor, precond=None) -> QuantizedTensor:
        if not isinstance(x, torch.Tensor) or x.ndim < 2:
            raise ValueError("x must be a tensor [..., N, D]")
        base.check_input(x, x.shape[-1] if self.dim is None else self.dim)
        if precond is not None and not (isinstance(precond, QuantizedTensor) and not precond.side):
            raise ValueError("KIVI takes no preconditioner")
        xf = x.float()
        T, D, g = x.shape[-2], x.shape[-1], self.group_size
        lead = tuple(x.shape[:-2])
        if self.axis == "channel":
            G = -(-T // g)
            pad = G * g - T
            xg = torch.cat([xf, xf[..., -1:, :].expand(*lead, pad, D)], dim=-2) if pad and T else xf
            xg = xg.reshape(*lead, G, g, D)
            mn, mx = xg.amin(dim=-2), xg.amax(dim=-2)  # [..., G, D]
        else:
            G = -(-D // g)
            pad = G * g - D
            xg = torch.cat([xf, xf[..., -1:].expand(*lead, T, pad)], dim=-1) if pad else xf
            xg = xg.reshape(*lead, T, G, g)
            mn, mx = xg.amin(dim=-1), xg.amax(dim=-1)  # [..., T, G]
        dt = base.storage_dtype(mn.abs(), mx.abs(), mx - mn)
        mn_s = mn.to(dt)
        scale_s = ((mx - mn_s.float()) / self.levels).to(dt)
        mn_f, scale_f = self._expand(mn_s.float(), scale_s.float(), T, D)
        safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
        codes = torch.clamp(torch.round((xf - mn_f) / safe), 0, self.levels).to(torch.int32)
        token = {"codes": pack_bits(codes, self.bits)}
        grouped = {}
        if self.axis == "channel":
            grouped = {"scale": scale_s, "min": mn_s}
        else:
            token.update(scale=scale_s, min=mn_s)
        return QuantizedTensor(config=self.config(), lead_shape=lead, num_tokens=T, dim=D, token=token,
                               grouped=grouped, group_size=g if self.axis == "channel" else 0)

    def _expand(self, mn: torch.Tensor, scale: torch.Tensor, T: int, D: int, t0: int = 0):
        """Per-group (min, scale) -> per-element [..., T, D] for tokens [t0, t0+T)."""
        g = self.group_size
        if self.axis == "channel":
            idx = (torch.arange(t0, t0 + T, device=mn.device) // g) - t0 // g
            return mn.index_select(-2, idx), scale.index_select(-2, idx)
        idx = torch.arange(D, device=mn.device) // g
        return mn.index_select(-1, idx), scale.index_select(-1, idx)

    def _chunk(self, c: QuantizedTensor, t0: int, t1: int) -> torch.Tensor:
        codes = unpack_bits(c.token["codes"][..., t0:t1, :], self.bits, c.dim).float()
        if self.axis == "channel":
            g0, g1 = t0 // self.group_size, -(-t1 // self.group_size)
            mn, sc = c.grouped["min"][..., g0:g1, :], c.grouped["scale"][..., g0:g1, :]
        else:
            mn, sc = c.token["min"][..., t0:t1, :], c.token["scale"][..., t0:t1, :]
        mn_f, sc_f = self._expand(mn.float(), sc.float(), t1 - t0, c.dim, t0)
        return codes * sc_f + mn_f

    def dequantize(self, c: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._own(c)
        return self._chunk(c, 0, c.num_tokens).to(dtype)

    def _step(self, c: QuantizedTensor) -> int:
        return base.token_chunk(c, c.dim, multiple=self.group_size if self.axis == "channel" else 1)

    def scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        self._own(c)
        q = base.check_queries(c, queries, c.dim)
        step = self._step(c)
        parts = [q @ self._chunk(c, t0, min(t0 + step, c.num_tokens)).transpose(-1, -2)
                 for t0 in range(0, c.num_tokens, step)]
        return base.cat_scores(parts, q, c)

    def weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        self._own(c)
        w = base.check_weights(c, weights)
        step = self._step(c)
        lead = torch.broadcast_shapes(w.shape[:-2], c.lead_shape)
        acc = w.new_zeros((*lead, w.shape[-2], c.dim))
        for t0 in range(0, c.num_tokens, step):
            t1 = min(t0 + step, c.num_tokens)
            acc = acc + w[..., t0:t1] @ self._chunk(c, t0, t1)
        return acc

    def validate(self, c: QuantizedTensor) -> None:
        if c.config != self.config() or c.side or (self.dim is not None and c.dim != self.dim):
            raise CorruptStreamError("KIVI tensor does not match its config")
        T, D, g = c.num_tokens, c.dim, self.group_size
        base.expect(c, "token", "codes", torch.uint8, (T, packed_width(D, self.bits)))
        fp = (torch.float16, torch.bfloat16)
        if self.axis == "channel":
            if c.group_size != g or set(c.grouped) != {"scale", "min"} or set(c.token) != {"codes"}:
                raise CorruptStreamError("KIVI channel tensor fields do not match")
            G = -(-T // g)
            base.expect(c, "grouped", "scale", fp, (G, D))
            base.expect(c, "grouped", "min", fp, (G, D))
        else:
            if c.grouped or set(c.token) != {"codes", "scale", "min"}:
                raise CorruptStreamError("KIVI token tensor fields do not match")
            base.expect(c, "token", "scale", fp, (T, -(-D // g)))
            base.expect(c, "token", "min", fp, (T, -(-D // g)))
