"""kvcodec.lossless: bit-exact tensor codecs.

``compress(tensor, prediction=None, codec="auto", threads=0, **opts) -> bytes`` and
``decompress(blob, prediction=None, threads=0) -> tensor`` (in ``kvcodec.lossless.api``) pick a
codec from the registry (``kvcodec.lossless.registry``): ``"planes"`` (byte-plane split +
rANS, any dtype), ``"raw"``, and the KV codecs ``"kvctx"`` / ``"predictive"`` when installed.
Files: ``kvcodec.lossless.files`` (safetensors <-> ``.kvc``).
"""

from kvcodec.lossless.api import compress, decompress, describe

__all__ = ["compress", "decompress", "describe"]
