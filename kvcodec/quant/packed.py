"""PackedKV: what an attention kernel reads of one TurboQuant-compressed K or V tensor.

The quantizer that made a ``QuantizedTensor`` describes it for kernels (``TurboQuantMSE.packed``);
the HF cache's codecs pass that on (``QuantEncoding.packed``) and ``kvcodec.quant.cuda.quantized`` feeds it
to the fused decode kernel. So neither the cache nor the kernel wrappers read a quantizer's private
fields or a QuantizedTensor's field names, and a quantizer without such a layout simply returns None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PackedKV:
    """The packed form of a [*lead, T, D] tensor in kvcodec.quant.cuda's layout (docs/cuda.md, tq layout v1).

    ``codes`` uint8 [*lead, T, D*bits/8] (b-bit Lloyd-Max indices of the rotated unit vectors) and
    ``norms`` fp16/bf16 [*lead, T]; ``rotation`` [D, D] (y = x @ rotation.T) and ``codebook``
    [2^bits] float32; ``scale`` / ``center`` the per-channel preconditioner (side data, [*lead|1, 1, D])
    or None; prod keys add ``qjl`` sign bits [*lead, T, m/8], residual norms ``rnorms`` [*lead, T] and
    the sketch ``qjl_matrix`` [m, D]. The tensors are the quantizer's and the block's own (no copies)."""

    codes: torch.Tensor
    norms: torch.Tensor
    bits: int
    rotation: torch.Tensor
    codebook: torch.Tensor
    scale: torch.Tensor | None = None
    center: torch.Tensor | None = None
    qjl: torch.Tensor | None = None
    rnorms: torch.Tensor | None = None
    qjl_matrix: torch.Tensor | None = None

    @property
    def prod(self) -> bool:
        """Keys with a QJL residual sketch (TurboQuantProd)."""
        return self.qjl is not None
