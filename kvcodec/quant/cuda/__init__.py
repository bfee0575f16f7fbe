"""Fused CUDA kernels for TurboQuant-compressed KV caches (tq layout v1), compiled with CuPy.

- ``decode_attention``: attention of new queries over packed codes + norms (+ QJL bits), flash-
  decoding with tensor cores; CPU tensors use the float64 torch fallback.
- ``quantize_pack``: quantize + bit-pack rows straight into the layout.
- ``fallback``: the torch path of both where the kernels do not run (packing, quantize,
  dequantize-then-attend); the kernels are tested against it.
Importing needs only torch and numpy; CuPy is loaded on the first CUDA launch. Compiling and caching
the kernels is ``kvcodec.device``'s (``is_available`` is its check, kept importable from here).
"""

from kvcodec.device import is_available
from kvcodec.quant.cuda.attention import decode_attention
from kvcodec.quant.cuda.decode_kernels import KernelVariant, key_permutation
from kvcodec.quant.cuda.pack import quantize_pack

__all__ = ["decode_attention", "KernelVariant", "quantize_pack", "key_permutation", "is_available"]
