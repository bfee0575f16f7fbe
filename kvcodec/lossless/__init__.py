"""kvcodec.lossless: bit-exact tensor codecs.

``compress(tensor, prediction=None, codec="auto", threads=0, **opts) -> bytes`` and
``decompress(blob, prediction=None, threads=0) -> tensor`` (in ``kvcodec.lossless.api``) pick a
codec from the registry (``kvcodec.lossless.registry``): ``"planes"`` (byte-plane split +
rANS, any dtype), ``"raw"``, and the KV codecs ``"kvctx"`` / ``"predictive"``.
Files: ``kvcodec.lossless.files`` (safetensors <-> ``.kvc``).
"""

from kvcodec import _numba_cache

_numba_cache.lock_saves()  # before this package's kernels can compile: see kvcodec._numba_cache

from kvcodec.lossless.api import compress, compress_device, decode_blob_chunk, decompress, describe, validate

# The built-in codecs register themselves on import; importing them here (the package runs before
# any submodule) means every stored codec name finds its decoder, whatever was imported first.
from kvcodec.lossless import kv_context, planes, predictive  # noqa: E402,F401  isort: skip
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES  # noqa: E402

__all__ = ["DEFAULT_MAX_OUTPUT_BYTES", "compress", "compress_device", "decode_blob_chunk", "decompress", "describe", "validate"]
