"""kvcodec.quant: vector quantizers for KV caches, attention on the packed form.

TurboQuantMSE / TurboQuantProd (Zandieh et al. 2025) with exact Lloyd-Max codebooks and
bit-packed codes, QJL (2024), the outlier channel split, and the KIVI baseline. Every quantizer
has quantize -> QuantizedTensor, dequantize, scores (q @ k.T) and weighted_sum (w @ v) without
materializing the whole reconstruction. See docs/quant.md.
"""

from kvcodec import _numba_cache

_numba_cache.lock_saves()  # before this package's kernels can compile: see kvcodec._numba_cache

from kvcodec.quant.codebooks import expected_distortion, lloyd_max_codebook, lloyd_max_thresholds
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.kivi import KIVI
from kvcodec.quant.outliers import TurboQuantOutlier
from kvcodec.quant.packed import PackedKV
from kvcodec.quant.packing import pack_bits, packed_width, unpack_bits
from kvcodec.quant.precondition import ChannelPreconditioner, calibrate
from kvcodec.quant.qjl import QJL
from kvcodec.quant.registry import quantizer_from_config, register
from kvcodec.quant.rotations import rotation_matrix
from kvcodec.quant.turboquant import TurboQuantMSE, TurboQuantProd, qjl_matrix

# every quantizer a QuantizedTensor's config may name (registry.py is a leaf: it imports none of them)
register(TurboQuantMSE, TurboQuantProd, QJL, KIVI, TurboQuantOutlier)

__all__ = [
    "TurboQuantMSE", "TurboQuantProd", "QJL", "KIVI", "TurboQuantOutlier", "QuantizedTensor",
    "ChannelPreconditioner", "calibrate", "lloyd_max_codebook", "lloyd_max_thresholds",
    "expected_distortion", "rotation_matrix", "qjl_matrix", "pack_bits", "unpack_bits", "packed_width",
    "quantizer_from_config", "PackedKV",
]
