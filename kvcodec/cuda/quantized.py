"""Decode attention straight from ``kvcodec.quant`` objects: the entry point for the HF cache.

``attend(query, keys, values, k_quantizer, v_quantizer, seq_lens=None, window_k=..., ...)`` takes the
compressed K and V as ``QuantizedTensor``s (lead shape [B, Hkv], TurboQuantMSE or TurboQuantProd
keys, TurboQuantMSE values) and handles what the raw kernel does not know about:
- channel preconditioning (``precondition="center"/"scale"``): the query is multiplied by the key
  channel scales before rotation; the key centre adds scale * q.center to every score of the
  compressed part (softmax-invariant, but it matters for the lse used to merge the window); the
  output is multiplied by the value scales and shifted by the value centre;
- prod keys: MSE codes at bits-1 plus QJL sign bits and residual norms (m must equal head_dim).
"""

from __future__ import annotations

import math

import torch

from kvcodec.cuda import attention


def _quantizer_parts(qz, what: str) -> dict:
    method = getattr(qz, "method", None)
    if method not in ("turboquant_mse", "turboquant_prod"):
        raise ValueError(f"{what}: fused attention takes TurboQuantMSE/TurboQuantProd, got {method!r}")
    parts = {"rotation": qz.rotation, "codebook": qz.codebook, "bits": qz._mse_bits}
    if method == "turboquant_prod":
        if what == "values":
            raise ValueError("values must use TurboQuantMSE (prod is for keys)")
        if qz.m != qz.dim:
            raise ValueError(f"fused attention needs QJL m == head_dim, got m={qz.m}, dim={qz.dim}")
        parts["qjl_matrix"] = qz.qjl_matrix
    return parts


def _side_per_query_head(side: torch.Tensor | None, b: int, hq: int, hkv: int, d: int, dev) -> torch.Tensor | None:
    """Side data [..., Hkv or 1, 1, D] (leading dims B or 1) -> float32 [B, Hq, 1, D] (or None)."""
    if side is None:
        return None
    s = side.to(dev, torch.float32)
    s = s.reshape(*([1] * max(0, 4 - s.dim())), *s.shape) if s.dim() < 4 else s
    s = s.expand(b, hkv, 1, d) if s.shape[1] in (1, hkv) else None
    if s is None:
        raise ValueError("side data does not match the kv heads")
    return s.repeat_interleave(hq // hkv, dim=1)


def attend(query: torch.Tensor, keys, values, k_quantizer, v_quantizer, seq_lens: torch.Tensor | None = None, *,
           scale: float | None = None, window_k=None, window_v=None, window_lens=None, causal: bool = True,
           variant: attention.KernelVariant = attention.DEFAULT_VARIANT, return_lse: bool = False):
    """Attention of query [B, Hq, q_len, D] over compressed keys/values (+ optional full-precision window).

    keys/values: QuantizedTensor with lead_shape (B, Hkv) and the same number of token slots;
    seq_lens [B]: valid compressed tokens per sequence (default: all slots). Output in query.dtype,
    in the original value space. See ``kvcodec.cuda.decode_attention`` for the window arguments.
    """
    b, hq, ql, d = query.shape
    if tuple(keys.lead_shape) != tuple(values.lead_shape) or len(keys.lead_shape) != 2:
        raise ValueError("keys and values must have lead shape (B, Hkv)")
    if keys.lead_shape[0] != b or keys.num_tokens != values.num_tokens or keys.dim != d or values.dim != d:
        raise ValueError("keys, values and query disagree on batch, tokens or head_dim")
    hkv = keys.lead_shape[1]
    dev = query.device
    kp, vp = _quantizer_parts(k_quantizer, "keys"), _quantizer_parts(v_quantizer, "values")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if seq_lens is None:
        seq_lens = torch.full((b,), keys.num_tokens, device=dev, dtype=torch.int32)

    k_scale = _side_per_query_head(keys.side.get("scale"), b, hq, hkv, d, dev)
    k_center = _side_per_query_head(keys.side.get("center"), b, hq, hkv, d, dev)
    v_scale = _side_per_query_head(values.side.get("scale"), b, hq, hkv, d, dev)
    v_center = _side_per_query_head(values.side.get("center"), b, hq, hkv, d, dev)
    qf = query.to(torch.float32)
    q_used = qf * k_scale if k_scale is not None else qf

    tok_k, tok_v = keys.token, values.token
    out, lse = attention.decode_attention(
        q_used, tok_k["codes"], tok_k["norms"], tok_v["codes"], tok_v["norms"], seq_lens,
        k_rotation=kp["rotation"], v_rotation=vp["rotation"], k_codebook=kp["codebook"],
        v_codebook=vp["codebook"], k_bits=kp["bits"], v_bits=vp["bits"], scale=scale,
        k_qjl=tok_k.get("qjl") if "qjl_matrix" in kp else None,
        k_rnorms=tok_k.get("rnorms") if "qjl_matrix" in kp else None, qjl_matrix=kp.get("qjl_matrix"),
        variant=variant, return_lse=True)
    out = out.to(torch.float32)
    if k_center is not None:  # every compressed score is short of scale * q.center
        lse = lse + scale * (qf * k_center).sum(-1)
    if v_scale is not None:
        out = out * v_scale
    if v_center is not None:
        out = out + v_center * torch.isfinite(lse).unsqueeze(-1)
    if window_k is not None:
        out, lse = attention._merge_window(query, out, lse, window_k, window_v, window_lens, scale, causal)
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out
