"""Outlier channel split (TurboQuant paper, section 4.3): k channels at higher bits, the rest lower.

The k channels with the largest RMS (per leading index, from a calibration block) and the other
D-k channels are each quantized by their own TurboQuantMSE (own rotation, codebook and norm).
The paper's "2.5-bit" and "3.5-bit" configurations for head_dim 128 are 32 channels at 3 (4)
bits and 96 at 2 (3) bits: 2.25 (3.25) code bits plus two 16-bit norms = 2.5 (3.5) bits/value.
Side data: ``perm`` int16 [..., 1, D] (outlier channels first, then the rest ascending), and
``center`` (float16) when precondition="center".
"""

from __future__ import annotations

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant import base
from kvcodec.quant.base import KVQuantizer
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.precondition import ChannelPreconditioner
from kvcodec.quant.turboquant import TurboQuantMSE

PAPER_CONFIGS = {"2.5": (3, 2), "3.5": (4, 3)}  # name -> (outlier bits, regular bits), k = dim // 4


class TurboQuantOutlier(KVQuantizer):
    """TurboQuantOutlier(dim, outlier_channels, outlier_bits, bits, seed=0, rotation="auto", precondition="none", norm_correction=False)."""

    method = "turboquant_outlier"

    def __init__(self, dim: int, outlier_channels: int, outlier_bits: int, bits: int, seed: int = 0,
                 rotation: str = "auto", precondition: str = "none", norm_correction: bool = False):
        self.dim = base.check_dim(dim, 8)
        k = outlier_channels
        if isinstance(k, bool) or not isinstance(k, int) or not 4 <= k <= self.dim - 4:
            raise ValueError(f"outlier_channels must be an integer in 4..dim-4, got {k!r}")
        if precondition not in ("none", "center"):
            raise ValueError("precondition for the outlier split must be 'none' or 'center'")
        self.k, self.outlier_bits, self.bits = k, base.check_bits(outlier_bits), base.check_bits(bits)
        self.seed, self.rotation, self.precondition = int(seed), rotation, precondition
        self.norm_correction = bool(norm_correction)
        # each part gets its own rotation ("auto": Hadamard for power-of-two sizes, else QR)
        self.hi = TurboQuantMSE(k, outlier_bits, seed, rotation, "none", self.norm_correction)
        self.lo = TurboQuantMSE(self.dim - k, bits, seed, rotation, "none", self.norm_correction)

    @classmethod
    def paper(cls, dim: int, name: str = "2.5", seed: int = 0, precondition: str = "none",
              norm_correction: bool = False) -> "TurboQuantOutlier":
        """The paper's named configuration ("2.5" or "3.5"): dim // 4 outlier channels."""
        if name not in PAPER_CONFIGS:
            raise ValueError(f"name must be one of {sorted(PAPER_CONFIGS)}")
        hi, lo = PAPER_CONFIGS[name]
        return cls(dim, dim // 4, hi, lo, seed=seed, precondition=precondition, norm_correction=norm_correction)

    def config(self) -> dict:
        return {"method": self.method, "dim": self.dim, "outlier_channels": self.k, "outlier_bits": self.outlier_bits,
                "bits": self.bits, "seed": self.seed, "rotation": self.rotation, "precondition": self.precondition,
                "norm_correction": self.norm_correction}

    def __repr__(self) -> str:
        return f"TurboQuantOutlier(dim={self.dim}, k={self.k}, {self.outlier_bits}/{self.bits} bits)"

    def calibrate(self, x: torch.Tensor, batch_dims: tuple = ()) -> dict:
        """Side data from a calibration block: the channel permutation (and center)."""
        base.check_input(x, self.dim)
        xf = x.float()
        dims = [xf.ndim - 2] + [d + xf.ndim if d < 0 else d for d in batch_dims]
        side = {}
        if self.precondition == "center":
            side["center"] = xf.mean(dim=dims, keepdim=True).to(torch.float16)
            xf = xf - side["center"].float()
        rms = xf.pow(2).mean(dim=dims, keepdim=True)
        top = torch.topk(rms, self.k, dim=-1).indices.sort(dim=-1).values
        is_out = torch.zeros_like(rms, dtype=torch.bool).scatter(-1, top, True)
        rest = torch.argsort(is_out.to(torch.int8), dim=-1, stable=True)[..., : self.dim - self.k]
        side["perm"] = torch.cat([top, rest], dim=-1).to(torch.int16)
        return side

    def _side(self, x, precond) -> dict:
        if precond is None:
            return self.calibrate(x)
        side = precond.side if isinstance(precond, QuantizedTensor) else precond
        if not isinstance(side, dict) or "perm" not in side:
            raise ValueError("precond must be None, calibrate()'s dict or a TurboQuantOutlier QuantizedTensor")
        return {k: v.to(x.device) for k, v in side.items()}

    @staticmethod
    def _gather(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        p = perm.long()
        shape = torch.broadcast_shapes(x.shape[:-2], p.shape[:-2])
        return torch.gather(x.expand(*shape, *x.shape[-2:]), -1, p.expand(*shape, x.shape[-2], p.shape[-1]))

    def _parts(self, c: QuantizedTensor):
        def sub(q, prefix):
            return QuantizedTensor(config=q.config(), lead_shape=c.lead_shape, num_tokens=c.num_tokens, dim=q.dim,
                                   token={"codes": c.token[prefix + "codes"], "norms": c.token[prefix + "norms"]})
        return sub(self.hi, "hi_"), sub(self.lo, "lo_")

    def quantize(self, x: torch.Tensor, precond=None) -> QuantizedTensor:
        base.check_input(x, self.dim)
        side = self._side(x, precond)
        xf = x.float()
        if "center" in side:
            xf = xf - side["center"].float()
        xp = self._gather(xf, side["perm"])
        token = {}
        for q, prefix, part in ((self.hi, "hi_", xp[..., : self.k]), (self.lo, "lo_", xp[..., self.k:])):
            cq = q.quantize(part)
            token[prefix + "codes"], token[prefix + "norms"] = cq.token["codes"], cq.token["norms"]
        return QuantizedTensor(config=self.config(), lead_shape=tuple(x.shape[:-2]), num_tokens=x.shape[-2],
                               dim=self.dim, token=token, side=side)

    def _unpermute(self, yp: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        p = perm.long()
        shape = torch.broadcast_shapes(yp.shape[:-2], p.shape[:-2])
        yp = yp.expand(*shape, *yp.shape[-2:])
        return torch.zeros_like(yp).scatter(-1, p.expand(*shape, yp.shape[-2], self.dim), yp)

    def dequantize(self, c: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._own(c)
        hi, lo = self._parts(c)
        y = self._unpermute(torch.cat([self.hi.dequantize(hi), self.lo.dequantize(lo)], dim=-1), c.side["perm"])
        if "center" in c.side:
            y = y + c.side["center"].float()
        return y.to(dtype)

    def scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        self._own(c)
        q = base.check_queries(c, queries, self.dim)
        qp = self._gather(q, c.side["perm"])
        hi, lo = self._parts(c)
        s = self.hi.scores(hi, qp[..., : self.k]) + self.lo.scores(lo, qp[..., self.k:])
        off = ChannelPreconditioner(center=c.side.get("center")).query_offset(q)
        return s if off is None else s + off

    def weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        self._own(c)
        w = base.check_weights(c, weights)
        hi, lo = self._parts(c)
        yp = torch.cat([self.hi.weighted_sum(hi, w), self.lo.weighted_sum(lo, w)], dim=-1)
        out = self._unpermute(yp, c.side["perm"])
        off = ChannelPreconditioner(center=c.side.get("center")).output_offset(w)
        return out if off is None else out + off

    def validate(self, c: QuantizedTensor) -> None:
        if c.config != self.config() or c.dim != self.dim or c.grouped:
            raise CorruptStreamError("outlier tensor does not match its config")
        want = {"hi_codes", "hi_norms", "lo_codes", "lo_norms"}
        if set(c.token) != want:
            raise CorruptStreamError(f"token fields {sorted(c.token)}, expected {sorted(want)}")
        want_side = {"perm"} | ({"center"} if self.precondition == "center" else set())
        if set(c.side) != want_side:
            raise CorruptStreamError(f"side fields {sorted(c.side)}, expected {sorted(want_side)}")
        perm = base.expect(c, "side", "perm", torch.int16, (1, self.dim))
        if perm.numel() and not torch.equal(perm.long().sort(dim=-1).values,
                                            torch.arange(self.dim, device=perm.device).expand_as(perm)):
            raise CorruptStreamError("perm is not a permutation")
        if "center" in c.side:
            base.expect(c, "side", "center", torch.float16, (1, self.dim))
        hi, lo = self._parts(c)
        self.hi.validate(hi)
        self.lo.validate(lo)
