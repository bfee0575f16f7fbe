"""Packed attention: the fused decode kernel fed from quantizer objects, with their preconditioners.

This is the one path from compressed K/V to ``kvcodec.quant.cuda.decode_attention``: the HF cache
(``kvcodec.hf.attention``) and ``attend`` below both go through ``attend_packed``. The operands come
as :class:`~kvcodec.quant.packed.PackedKV` (``quantizer.packed(c)``), so nothing here reads a
quantizer's private fields. What the raw kernel does not know about is handled around it:

- channel preconditioning (``precondition="center"/"scale"``): the query is multiplied by the key
  channel scales (the kernel then sees x' = (x - center) / scale), so its scores lack the per-query
  constant ``scaling * q.center`` (softmax-invariant; ``PackedConsts`` maps exact keys into the same
  domain, or ``attend`` adds it back to the log-sum-exp); the output is multiplied by the value scales
  and shifted by the value centre;
- prod keys: MSE codes at bits-1 plus QJL sign bits and residual norms (m must equal head_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcodec.quant.cuda import attention, ops
from kvcodec.quant.cuda.decode_kernels import DEFAULT_VARIANT, KernelVariant
from kvcodec.quant.packed import PackedKV


def supported(keys: PackedKV | None, values: PackedKV | None, dim: int) -> bool:
    """Whether the fused kernel takes these operands: TurboQuant keys (MSE or prod with m == head_dim)
    and MSE values (None: a quantizer without a packed layout), 1..4 bits, head_dim a multiple of 32
    in [32, 256]."""
    if keys is None or values is None or values.prod:
        return False
    if not (1 <= keys.bits <= 4 and 1 <= values.bits <= 4) or dim % 32 or not 32 <= dim <= 256:
        return False
    return not keys.prod or tuple(keys.qjl_matrix.shape) == (dim, dim)


def _per_kv_head(side: torch.Tensor | None, hkv: int, device) -> torch.Tensor | None:
    """Side data [B|1, Hkv|1, 1, D] (or fewer leading dims) -> float32 [B|1, Hkv, 1, D] on ``device``."""
    if side is None:
        return None
    s = side.to(device, torch.float32)
    if s.dim() < 4:
        s = s.reshape(*([1] * (4 - s.dim())), *s.shape)
    if s.shape[1] not in (1, hkv):
        raise ValueError("side data does not match the kv heads")
    return s if s.shape[1] == hkv else s.expand(s.shape[0], hkv, *s.shape[2:])


@dataclass(eq=False)
class PackedConsts:
    """Float32 preconditioner constants around the kernel for one pair of compressed K/V, laid out for
    [B, H_kv, ...] views (the HF cache builds them once per compressed block, ``attend`` per call).

    * ``q_scale`` [B|1, Hq, 1, D] (per query head, HF repeat_kv order): kernel query = q * key scale;
    * ``k_mul`` / ``k_add`` [B|1, H_kv, 1, D]: an exact key k maps to k * k_mul + k_add =
      scaling * (k - center) / scale, the kernel's domain, so exact and compressed scores share a softmax;
    * ``k_center`` [B|1, H_kv, 1, D]: the key centre (the scores' missing ``scaling * q.center``);
    * ``v_scale`` / ``v_center`` [B|1, H_kv, 1, D]: output = out' * v_scale + v_center."""

    scaling: float
    q_scale: torch.Tensor | None
    k_mul: torch.Tensor
    k_add: torch.Tensor
    k_center: torch.Tensor | None
    v_scale: torch.Tensor | None
    v_center: torch.Tensor | None

    @classmethod
    def build(cls, keys: PackedKV, values: PackedKV, scaling: float, heads: int, device) -> "PackedConsts":
        hkv, dim = keys.codes.shape[1], keys.rotation.shape[-1]
        k_scale, k_center = _per_kv_head(keys.scale, hkv, device), _per_kv_head(keys.center, hkv, device)
        if k_scale is None:
            k_mul = torch.full((1, hkv, 1, dim), scaling, device=device)
        else:
            k_mul = scaling / k_scale
        k_add = torch.zeros_like(k_mul) if k_center is None else -k_center * k_mul
        q_scale = None if k_scale is None else k_scale.repeat_interleave(heads // hkv, dim=1)
        return cls(scaling, q_scale, k_mul, k_add, k_center,
                   _per_kv_head(values.scale, hkv, device), _per_kv_head(values.center, hkv, device))

    def unfold_values(self, out: torch.Tensor) -> torch.Tensor:
        """Kernel output [B, H_kv, G*Tq, D] (float32) back to the values' own space."""
        if self.v_scale is not None and self.v_center is not None:
            return torch.addcmul(self.v_center, out, self.v_scale)
        if self.v_scale is not None:
            return out * self.v_scale
        if self.v_center is not None:
            return out + self.v_center
        return out


def attend_packed(query: torch.Tensor, keys: PackedKV, values: PackedKV, consts: PackedConsts,
                  seq_lens: torch.Tensor | None = None, variant: KernelVariant = DEFAULT_VARIANT):
    """The fused kernel over compressed keys/values (lead shape (B, H_kv)) for query [B, Hq, Tq, D].

    Returns (q, out, lse) in the GQA layout [B, H_kv, G*Tq, ...] (query head h = kv * G + g): ``q`` the
    queries as the kernel saw them (key scale folded in, float32), ``out`` float32 with the value
    preconditioner undone, ``lse`` [.., 1] the log-sum-exp of the kernel's scores
    ``scaling * q . (k - center) / scale``, i.e. of the true scores minus ``scaling * q . center``.
    ``seq_lens`` [B]: valid compressed tokens per sequence; None: every slot."""
    B, H, Tq, D = query.shape
    Hkv = keys.codes.shape[1]
    G = H // Hkv
    q_in = (query * consts.q_scale if consts.q_scale is not None else query.float()).contiguous()
    # through the custom op (kvcodec.quant.cuda.ops): the same launcher, traceable by torch.compile / CUDA graphs
    out, lse = ops.packed_decode(q_in, keys, values, seq_lens, consts.scaling, variant)
    out = consts.unfold_values(out.reshape(B, Hkv, G * Tq, D))  # float32: the kernel returns the query's dtype
    return q_in.view(B, Hkv, G * Tq, D), out, lse.reshape(B, Hkv, G * Tq, 1)


def _operands(qz, c, what: str) -> PackedKV:
    packed = getattr(qz, "packed", None)
    ops = packed(c) if packed is not None else None
    if ops is None:
        raise ValueError(f"{what}: fused attention takes TurboQuantMSE/TurboQuantProd, got {getattr(qz, 'method', None)!r}")
    if ops.prod and what == "values":
        raise ValueError("values must use TurboQuantMSE (prod is for keys)")
    if ops.prod and tuple(ops.qjl_matrix.shape) != (c.dim, c.dim):
        raise ValueError(f"fused attention needs QJL m == head_dim, got m={ops.qjl_matrix.shape[0]}, dim={c.dim}")
    return ops


def attend(query: torch.Tensor, keys, values, k_quantizer, v_quantizer, seq_lens: torch.Tensor | None = None, *,
           scale: float | None = None, window_k=None, window_v=None, window_lens=None, causal: bool = True,
           variant: KernelVariant = DEFAULT_VARIANT, return_lse: bool = False):
    """Attention of query [B, Hq, q_len, D] over compressed keys/values (+ optional full-precision window).

    keys/values: QuantizedTensor with lead_shape (B, Hkv) and the same number of token slots, made by
    k_quantizer / v_quantizer; seq_lens [B]: valid compressed tokens per sequence (default: all
    slots). Output in query.dtype, in the original value space; lse (return_lse) of the true scores.
    See ``kvcodec.quant.cuda.decode_attention`` for the window arguments.
    """
    b, hq, ql, d = query.shape
    if tuple(keys.lead_shape) != tuple(values.lead_shape) or len(keys.lead_shape) != 2:
        raise ValueError("keys and values must have lead shape (B, Hkv)")
    if keys.lead_shape[0] != b or keys.num_tokens != values.num_tokens or keys.dim != d or values.dim != d:
        raise ValueError("keys, values and query disagree on batch, tokens or head_dim")
    hkv = keys.lead_shape[1]
    kp, vp = _operands(k_quantizer, keys, "keys"), _operands(v_quantizer, values, "values")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if seq_lens is None:
        seq_lens = torch.full((b,), keys.num_tokens, device=query.device, dtype=torch.int32)
    consts = PackedConsts.build(kp, vp, scale, hq, query.device)
    q_in, out, lse = attend_packed(query, kp, vp, consts, seq_lens, variant)
    lse = lse.squeeze(-1)
    if consts.k_center is not None:  # the true scores: add back scale * q.center
        q = query.to(torch.float32).reshape(b, hkv, -1, d)
        lse = lse + scale * (q * consts.k_center).sum(-1)
    if consts.v_center is not None:  # sequences without compressed tokens: nothing to shift
        out = torch.where(torch.isfinite(lse).unsqueeze(-1), out, torch.zeros_like(out))
    out, lse = out.reshape(b, hq, ql, d), lse.reshape(b, hq, ql)
    if window_k is not None:
        out, lse = attention.merge_window(query, out, lse, window_k, window_v, window_lens, scale, causal)
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out
