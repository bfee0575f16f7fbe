"""QJL (Zandieh et al. 2024): a 1-bit Johnson-Lindenstrauss sketch of each key plus its norm.

Stores sign(S k) (m bits, packed, field ``qjl``) and ||k|| (field ``norms``). The score
estimate sqrt(pi/2)/m * ||k|| * <S q, sign(S k)> is unbiased for q.k: the query is projected
but never quantized. S is ``qjl_matrix`` (orthogonalized rows by default, see its docstring for
the normalization that keeps the sqrt(pi/2)/m scale exact).
"""

from __future__ import annotations

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant import base
from kvcodec.quant.base import KVQuantizer
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.packing import pack_signs, unpack_signs
from kvcodec.quant.turboquant import SQRT_PI_OVER_2, qjl_matrix


class QJL(KVQuantizer):
    """QJL(dim, m=dim, seed=0, orthogonal=True): m sign bits + one fp16 norm per vector (bits=b: m = b*dim)."""

    method = "qjl"

    def __init__(self, dim: int, m: int | None = None, seed: int = 0, orthogonal: bool = True, bits: int | None = None):
        self.dim = base.check_dim(dim)
        if bits is not None:  # sketch bits per coordinate: m = bits * dim
            if m is not None:
                raise ValueError("give either m or bits, not both")
            m = base.check_bits(bits) * self.dim
        self.m = self.dim if m is None else m
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 8 or self.m % 8:
            raise ValueError(f"m must be a positive multiple of 8, got {m!r}")
        self.seed = int(seed)
        self.orthogonal = bool(orthogonal)
        self.qjl_matrix = qjl_matrix(self.dim, self.m, self.seed, self.orthogonal)
        self._dev = {}

    def config(self) -> dict:
        return {"method": self.method, "dim": self.dim, "m": self.m, "seed": self.seed, "orthogonal": self.orthogonal}

    def __repr__(self) -> str:
        return f"QJL(dim={self.dim}, m={self.m}, seed={self.seed}, orthogonal={self.orthogonal})"

    def _S(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._dev:
            self._dev[key] = self.qjl_matrix.to(device)
        return self._dev[key]

    def quantize(self, x: torch.Tensor, precond=None) -> QuantizedTensor:
        base.check_input(x, self.dim)
        if precond is not None and not (isinstance(precond, QuantizedTensor) and not precond.side):
            raise ValueError("QJL takes no preconditioner")
        xf = x.float()
        norms = base.row_norms(xf)
        token = {"qjl": pack_signs(xf @ self._S(x.device).T), "norms": norms.to(base.storage_dtype(norms))}
        return QuantizedTensor(config=self.config(), lead_shape=tuple(x.shape[:-2]), num_tokens=x.shape[-2],
                               dim=self.dim, token=token)

    def _coef(self, c, t0, t1):
        return c.token["norms"][..., t0:t1].float() * (SQRT_PI_OVER_2 / self.m)

    def dequantize(self, c: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The unbiased reconstruction sqrt(pi/2)/m * ||k|| * S^T sign(S k)."""
        self._own(c)
        signs = unpack_signs(c.token["qjl"], self.m)
        return ((signs @ self._S(c.device)) * self._coef(c, 0, c.num_tokens).unsqueeze(-1)).to(dtype)

    def scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        self._own(c)
        q = base.check_queries(c, queries, self.dim)
        qs = q @ self._S(c.device).T
        step = base.token_chunk(c, self.m)
        parts = []
        for t0 in range(0, c.num_tokens, step):
            t1 = min(t0 + step, c.num_tokens)
            signs = unpack_signs(c.token["qjl"][..., t0:t1, :], self.m)
            parts.append((qs @ signs.transpose(-1, -2)) * self._coef(c, t0, t1).unsqueeze(-2))
        return base.cat_scores(parts, q, c)

    def weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        self._own(c)
        w = base.check_weights(c, weights)
        step = base.token_chunk(c, self.m)
        lead = torch.broadcast_shapes(w.shape[:-2], c.lead_shape)
        acc = w.new_zeros((*lead, w.shape[-2], self.m))
        for t0 in range(0, c.num_tokens, step):
            t1 = min(t0 + step, c.num_tokens)
            signs = unpack_signs(c.token["qjl"][..., t0:t1, :], self.m)
            acc = acc + (w[..., t0:t1] * self._coef(c, t0, t1).unsqueeze(-2)) @ signs
        return acc @ self._S(c.device)

    def validate(self, c: QuantizedTensor) -> None:
        if c.config != self.config() or c.dim != self.dim or c.side or c.grouped:
            raise CorruptStreamError("QJL tensor does not match its config")
        if set(c.token) != {"qjl", "norms"}:
            raise CorruptStreamError(f"QJL token fields {sorted(c.token)}")
        base.expect(c, "token", "qjl", torch.uint8, (c.num_tokens, self.m // 8))
        n = base.expect(c, "token", "norms", (torch.float16, torch.bfloat16), (c.num_tokens,))
        if n.numel() and bool((n < 0).any()):
            raise CorruptStreamError("negative norms")
