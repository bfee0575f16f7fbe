"""Fused CUDA kernels for TurboQuant-compressed KV caches (tq layout v1), compiled with CuPy.

- ``decode_attention``: attention of new queries over packed codes + norms (+ QJL bits), flash-
  decoding with tensor cores; CPU tensors use the float64 torch reference.
- ``quantize_pack``: quantize + bit-pack rows straight into the layout.
- ``reference``: the torch oracle (packing, quantize, dequantize-then-attend).
Importing needs only torch and numpy; CuPy is loaded on the first CUDA launch.
"""

from kvcodec.cuda.attention import decode_attention
from kvcodec.cuda.decode_kernels import KernelVariant, key_permutation
from kvcodec.cuda.pack import quantize_pack


def is_available() -> bool:
    """True when a CUDA device and CuPy are both usable (the fused kernels can run)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


__all__ = ["decode_attention", "KernelVariant", "quantize_pack", "key_permutation", "is_available"]
