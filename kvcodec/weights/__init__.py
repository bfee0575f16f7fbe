"""kvcodec.weights: model weights held compressed in memory, decoded just in time (lossless).

The format is the ``planes`` codec's (``kvcodec.weights.blob``): bf16/fp16 exponent bits rANS-coded
in independent 64 KiB chunks of 32 lanes (one GPU warp each), sign and mantissa bits raw; fp8 one
coded byte. ``compress_model`` / ``decompress_model`` (``runtime``), ``save_model`` / ``load_model``
(``checkpoint``). See docs/weights.md.
"""

from kvcodec import _numba_cache

_numba_cache.lock_saves()  # before this package's kernels can compile: see kvcodec._numba_cache

from kvcodec.weights.blob import HostWeight, encode
from kvcodec.weights.checkpoint import load_model, save_model
from kvcodec.weights.report import WeightReport, WeightRow
from kvcodec.weights.runtime import compress_model, decompress_model, model_report

__all__ = ["HostWeight", "WeightReport", "WeightRow", "compress_model", "decompress_model", "encode", "load_model",
           "model_report", "save_model"]
