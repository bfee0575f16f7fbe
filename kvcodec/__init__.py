"""kvcodec: compress LLM KV caches and weights.

Subpackages: ``entropy`` (lossless coders), ``quant`` (vector quantizers for KV),
``lossless`` (bit-exact tensor codecs), ``cuda`` (fused GPU kernels), ``hf``
(Hugging Face cache plug-in).
"""

from kvcodec.errors import CorruptStreamError

__version__ = "0.1.0"
__all__ = ["CorruptStreamError", "__version__"]
