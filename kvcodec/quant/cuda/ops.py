"""``torch.library`` custom ops around the TurboQuant kernels, for CUDA graphs and ``torch.compile``.

The CuPy launches are Python code that dynamo cannot trace; registered as custom ops with fake
(meta) implementations they become single opaque nodes of a graph, so a whole decode step that calls
them compiles with ``torch.compile(fullgraph=True)`` and replays from a CUDA graph. Each op has one
implementation for every device: on CUDA tensors the CuPy kernels, on CPU tensors the torch
reference (``tq_quantize`` there reproduces ``kvcodec.quant.TurboQuantMSE``'s bytes exactly).

* ``tq_quantize(x, rotation, codebook, bits, norm_correction, bf16_norms) -> (codes, norms)``: rows
  of already preconditioned ``x`` [..., D] -> packed codes uint8 [..., D*bits/8] and norms.
* ``tq_quantize_into(x, rotation, codebook, bits, norm_correction, codes, norms, dest)``: the same
  rows [B, H, n, D] written straight into compressed slots ``dest`` [B, n] of the buffers ``codes``
  [B, H, N, D*bits/8] and ``norms`` [B, H, N] (a static cache's append). Declared as mutating them,
  so a compiled step writes the n slots in place; a scatter in the graph would make inductor copy
  the whole buffer twice per call.
* ``tq_attention(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_rotation, v_rotation,
  k_codebook, v_codebook, k_bits, v_bits, scale, k_qjl=None, k_rnorms=None, qjl_matrix=None) -> (out,
  lse)``: ``kvcodec.quant.cuda.decode_attention`` with ``return_lse=True`` (prod keys with the three QJL
  tensors); ``out`` float32 [B, Hq, q_len, D], ``lse`` float32 [B, Hq, q_len].

``packed_decode`` is how ``kvcodec.quant.cuda.quantized.attend_packed`` (the one packed-attention path of
the eager and the static HF caches) reaches the kernel: through ``tq_attention``, so the same call
traces into a compiled or captured step; a non-default kernel variant (benchmarks) calls the launcher
directly.

With torch older than 2.4 (no ``torch.library.custom_op``) the same names are plain functions: the
results are the same, only compiling through them is not possible (``HAVE_CUSTOM_OPS`` says which).
"""

from __future__ import annotations

from typing import Optional

import torch

HAVE_CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")


def quantize_rows_torch(x: torch.Tensor, rotation: torch.Tensor, codebook: torch.Tensor, bits: int,
                        norm_correction: bool, norm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant-MSE of preconditioned float rows, with the exact operations of
    ``TurboQuantMSE._encode_mse`` (overflow-safe norms, ``bucketize`` on the centroid midpoints, norm
    correction) and ``pack_bits``, so the bytes equal the eager cache's for the same tokens."""
    from kvcodec.quant import base
    from kvcodec.quant.packing import pack_bits

    xp = x.float()
    norms = base.row_norms(xp)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    cb = codebook.to(xp.device, torch.float32)
    y = (xp / safe.unsqueeze(-1)) @ rotation.to(xp.device).T
    idx = torch.bucketize(y, (cb[1:] + cb[:-1]) / 2)
    scale = norms
    if norm_correction:
        dot = (y * cb[idx]).sum(-1)
        scale = torch.where(dot > 0, norms / torch.where(dot > 0, dot, torch.ones_like(dot)), norms)
    return pack_bits(idx, bits), scale.to(norm_dtype)


def _quantize(x: torch.Tensor, rotation: torch.Tensor, codebook: torch.Tensor, bits: int, norm_correction: bool,
              bf16_norms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    norm_dtype = torch.bfloat16 if bf16_norms else torch.float16
    if x.is_cuda:
        from kvcodec.quant.cuda.pack import quantize_pack

        codes, norms = quantize_pack(x, rotation, codebook, bits, norm_dtype, norm_correction)
        return codes.contiguous(), norms.contiguous()
    return quantize_rows_torch(x, rotation, codebook, bits, norm_correction, norm_dtype)


def _quantize_into(x: torch.Tensor, rotation: torch.Tensor, codebook: torch.Tensor, bits: int,
                   norm_correction: bool, codes: torch.Tensor, norms: torch.Tensor, dest: torch.Tensor) -> None:
    c, n = _quantize(x, rotation, codebook, bits, norm_correction, norms.dtype == torch.bfloat16)
    B, H, m = n.shape
    idx = dest[:, None, :].expand(B, H, m)
    codes.scatter_(2, idx[..., None].expand_as(c), c)
    norms.scatter_(2, idx, n)


def _attention(query: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor, v_codes: torch.Tensor,
               v_norms: torch.Tensor, seq_lens: Optional[torch.Tensor], k_rotation: torch.Tensor,
               v_rotation: torch.Tensor,
               k_codebook: torch.Tensor, v_codebook: torch.Tensor, k_bits: int, v_bits: int, scale: float,
               k_qjl: Optional[torch.Tensor] = None, k_rnorms: Optional[torch.Tensor] = None,
               qjl_matrix: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    from kvcodec.quant.cuda import attention  # the module's launcher, looked up per call

    out, lse = attention.decode_attention(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_rotation=k_rotation,
                                          v_rotation=v_rotation, k_codebook=k_codebook, v_codebook=v_codebook,
                                          k_bits=k_bits, v_bits=v_bits, scale=scale, k_qjl=k_qjl,
                                          k_rnorms=k_rnorms, qjl_matrix=qjl_matrix, return_lse=True)
    return out.to(torch.float32), lse.to(torch.float32)


if HAVE_CUSTOM_OPS:
    tq_quantize = torch.library.custom_op("kvcodec::tq_quantize", mutates_args=())(_quantize)
    tq_quantize_into = torch.library.custom_op("kvcodec::tq_quantize_into",
                                               mutates_args=("codes", "norms"))(_quantize_into)
    tq_attention = torch.library.custom_op("kvcodec::tq_attention", mutates_args=())(_attention)

    @tq_quantize.register_fake
    def _quantize_fake(x, rotation, codebook, bits, norm_correction, bf16_norms):
        lead = x.shape[:-1]
        codes = x.new_empty((*lead, (x.shape[-1] * bits + 7) // 8), dtype=torch.uint8)
        return codes, x.new_empty(lead, dtype=torch.bfloat16 if bf16_norms else torch.float16)

    @tq_attention.register_fake
    def _attention_fake(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_rotation, v_rotation, k_codebook,
                        v_codebook, k_bits, v_bits, scale, k_qjl=None, k_rnorms=None, qjl_matrix=None):
        return query.new_empty(query.shape, dtype=torch.float32), query.new_empty(query.shape[:-1], dtype=torch.float32)
else:  # torch < 2.4: same results, no compile support
    tq_quantize = _quantize
    tq_quantize_into = _quantize_into
    tq_attention = _attention


def packed_decode(query: torch.Tensor, keys, values, seq_lens: torch.Tensor | None, scale: float, variant=None):
    """The fused kernel over :class:`~kvcodec.quant.packed.PackedKV` keys/values for the prepared query
    [B, Hq, q_len, D] (key scale folded in): (out, lse) float32 as ``tq_attention``. ``variant``: None or
    the default goes through the custom op; another :class:`~kvcodec.quant.cuda.KernelVariant` (kernel
    benchmarks) calls the launcher directly (not traceable)."""
    from kvcodec.quant.cuda.decode_kernels import DEFAULT_VARIANT

    extra = (keys.qjl, keys.rnorms, keys.qjl_matrix) if keys.prod else (None, None, None)
    args = (query, keys.codes, keys.norms, values.codes, values.norms, seq_lens, keys.rotation, values.rotation,
            keys.codebook, values.codebook, keys.bits, values.bits, float(scale), *extra)
    if variant is None or variant is DEFAULT_VARIANT or variant == DEFAULT_VARIANT:
        return tq_attention(*args)
    from kvcodec.quant.cuda.attention import decode_attention

    out, lse = decode_attention(*args[:6], k_rotation=keys.rotation, v_rotation=values.rotation,
                                k_codebook=keys.codebook, v_codebook=values.codebook, k_bits=keys.bits,
                                v_bits=values.bits, scale=float(scale), k_qjl=extra[0], k_rnorms=extra[1],
                                qjl_matrix=extra[2], variant=variant, return_lse=True)
    return out.to(torch.float32), lse.to(torch.float32)
