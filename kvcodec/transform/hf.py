"""Save / load a Hugging Face prefix cache (``DynamicCache`` or any cache with ``.layers[i].keys``)
as one transform-coded blob.

Only full-attention caches of batch 1 are taken (a prefix cache is one sequence; sliding-window
layers hold a different token range per layer). Keys are stored post-RoPE as the cache holds them;
``positions_start`` says where the cached prefix starts (0 for a prompt prefix).
"""

from __future__ import annotations

import torch

from kvcodec.transform.calibration import Calibration
from kvcodec.transform.codec import decode, encode


def cache_tensors(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a cache's layers into keys, values [L, H, T, D]; ValueError if it is not one sequence
    with the same length in every layer."""
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError("expected a transformers cache with .layers (DynamicCache)")
    ks, vs = [], []
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.ndim != 4:
            raise ValueError(f"layer {i} holds no dense keys/values (compressed or empty cache?)")
        if k.shape[0] != 1:
            raise ValueError(f"only batch 1 caches are taken, layer {i} has batch {k.shape[0]}")
        ks.append(k[0])
        vs.append(v[0])
    if len({tuple(k.shape) for k in ks}) != 1:
        raise ValueError("every layer must hold the same number of tokens (no sliding-window layers)")
    return torch.stack(ks), torch.stack(vs)


def encode_cache(cache, calib: Calibration, bits: float | None = None, **options) -> bytes:
    """Transform-code every layer of ``cache``; ``options`` as for ``kvcodec.transform.encode``."""
    keys, values = cache_tensors(cache)
    return encode(keys, values, calib, bits, **options)


def decode_cache(blob, calib: Calibration, *, device="cpu", config=None, **options):
    """A new ``transformers.DynamicCache`` holding the decoded prefix (pass the model's ``config``
    where the model needs it); ``options`` as for ``kvcodec.transform.decode``."""
    from transformers import DynamicCache

    keys, values = decode(blob, calib, device=device, **options)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i in range(keys.shape[0]):
        cache.update(keys[i][None], values[i][None], i)
    return cache
