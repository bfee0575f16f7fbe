"""kvcodec: compress LLM KV caches and weights.

Subpackages: ``entropy`` (lossless coders), ``quant`` (vector quantizers for KV and their fused
attention kernels), ``lossless`` (bit-exact tensor codecs), ``transform`` (the stored-cache codec),
``weights`` (compressed model weights), ``hf`` (Hugging Face cache plug-in), ``integrations``
(LMCache), ``device`` (the GPU runtime every kernel owner shares). ``kvcodec.compress`` / ``kvcodec.decompress`` are the lossless front door.
"""

from kvcodec import _numba_cache

_numba_cache.configure()  # before any submodule imports numba: see kvcodec._numba_cache

from kvcodec.errors import CorruptStreamError, PlanBuiltInCaptureError, WriteRefusedError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["CorruptStreamError", "PlanBuiltInCaptureError", "WriteRefusedError", "compress", "decompress", "__version__"]


def compress(tensor, prediction=None, **options):
    """Losslessly compress a torch tensor to bytes (see ``kvcodec.lossless.api.compress``)."""
    from kvcodec.lossless.api import compress as _compress

    return _compress(tensor, prediction=prediction, **options)


def decompress(blob, prediction=None, **options):
    """Restore the exact tensor (dtype, shape, bits) from ``compress``'s bytes."""
    from kvcodec.lossless.api import decompress as _decompress

    return _decompress(blob, prediction=prediction, **options)
