"""kvcodec.transform: lossy transform coding of stored KV caches (KVTC-class, arXiv 2511.01815).

For caches that are stored or moved, not attended to in place (prefix caches on disk, offload
tiers, prefill -> decode hand-off). Keys lose their RoPE rotation, K and V of groups of layers are
projected together on a PCA basis fitted once per model, in a metric weighted by what each layer's
error costs the model (``sensitivity``), the coefficients are quantized with one
rate-distortion-optimal step (components below the water level get 0 bits) and entropy-coded with
kvcodec's rANS; sinks and the recent window stay exact.

>>> calib = kvcodec.transform.fit(keys, values, rope=RoPE.default(64, 1e5))   # [L, H, T, D]
>>> calib.save("smollm2.kvtc"); calib = kvcodec.transform.Calibration.load("smollm2.kvtc")
>>> blob = kvcodec.transform.encode(keys, values, calib, bits=1.5)             # true bits/value
>>> keys, values = kvcodec.transform.decode(blob, calib, device="cuda")

See docs/transform.md.
"""

from kvcodec import _numba_cache

_numba_cache.lock_saves()  # before this package's kernels can compile: see kvcodec._numba_cache

from kvcodec.transform.calibration import Calibration, fit
from kvcodec.transform.codec import decode, encode, inspect, verify
from kvcodec.transform.hf import decode_cache, encode_cache
from kvcodec.transform.rope import RoPE
from kvcodec.transform import hf, sensitivity  # submodules: T.hf.save_cache, T.sensitivity.fit_model

__all__ = ["Calibration", "RoPE", "decode", "decode_cache", "encode", "encode_cache", "fit", "hf", "inspect",
           "sensitivity", "verify"]
