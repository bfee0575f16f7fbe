"""Save / load a Hugging Face prefix cache (a ``DynamicCache``, a ``kvcodec.hf.CompressedCache``, or
any cache whose layers hold dense ``.keys`` or a ``.store``) as one transform-coded blob or file.

Only full-attention caches of batch 1 are taken (a prefix cache is one sequence; sliding-window
layers hold a different token range per layer). Keys are stored post-RoPE as the cache holds them;
``positions_start`` says where the cached prefix starts (0 for a prompt prefix). A CompressedCache
is decoded to dense K/V first (its own quantization error stays in what is stored); on load, the
K/V are handed to the cache you pass (``cache.update`` per layer, as a prefill would), so a
CompressedCache re-compresses them with its own options.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvcodec import safe_write
from kvcodec.transform.calibration import Calibration
from kvcodec.transform.codec import decode, encode


def _layer_kv(layer, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    store = getattr(layer, "store", None)
    if store is not None and callable(getattr(store, "materialize", None)):  # kvcodec.hf CompressedLayer
        if getattr(layer, "pending", False):
            layer.finish_step()
        return store.materialize()
    k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.ndim != 4:
        raise ValueError(f"layer {i} holds no keys/values (empty cache?)")
    return k, v


def cache_tensors(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a cache's layers into keys, values [L, H, T, D]; ValueError if it is not one sequence
    with the same length in every layer."""
    if callable(getattr(cache, "to_eager", None)):  # kvcodec's static cache: its eager form holds the same K/V
        cache = cache.to_eager()
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError("expected a transformers cache with .layers (DynamicCache, CompressedCache)")
    ks, vs = [], []
    for i, layer in enumerate(layers):
        if store_is_empty(layer):
            raise ValueError(f"layer {i} holds no keys/values (empty cache?)")
        k, v = _layer_kv(layer, i)
        if k.shape[0] != 1:
            raise ValueError(f"only batch 1 caches are taken, layer {i} has batch {k.shape[0]}")
        ks.append(k[0])
        vs.append(v[0])
    if len({tuple(k.shape) for k in ks}) != 1:
        raise ValueError("every layer must hold the same number of tokens (no sliding-window layers)")
    return torch.stack(ks), torch.stack(vs)


def store_is_empty(layer) -> bool:
    return hasattr(layer, "store") and (layer.store is None or len(layer.store) == 0)


def encode_cache(cache, calib: Calibration, bits: float | None = None, **options) -> bytes:
    """Transform-code every layer of ``cache``; ``options`` as for ``kvcodec.transform.encode``."""
    keys, values = cache_tensors(cache)
    return encode(keys, values, calib, bits, **options)


def decode_cache(blob, calib: Calibration, *, device="cpu", config=None, cache=None, **options):
    """The decoded prefix in ``cache`` (an empty cache to fill: a DynamicCache, a CompressedCache,
    ...; it gets ``cache.update(keys, values, layer)`` per layer) or, by default, a new
    ``transformers.DynamicCache`` (pass the model's ``config`` where the model needs it).
    ``options`` as for ``kvcodec.transform.decode``."""
    keys, values = decode(blob, calib, device=device, **options)
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=config) if config is not None else DynamicCache()
    elif cache.get_seq_length() != 0:
        raise ValueError("decode_cache fills an empty cache; this one already holds tokens")
    if callable(getattr(cache, "fill", None)):  # kvcodec's static cache: filled as a whole
        return cache.fill(keys[:, None], values[:, None])
    for i in range(keys.shape[0]):
        cache.update(keys[i][None], values[i][None], i)
    return cache


def save_cache(cache, path, calib: Calibration, bits: float | None = None, *, overwrite: bool = False,
               **options) -> int:
    """Write ``encode_cache(cache, calib, bits, **options)`` to ``path`` through
    :func:`kvcodec.safe_write.atomic_write` (never a half-written file; WriteRefusedError for an
    existing file unless ``overwrite``); returns the bytes written."""
    safe_write.check_target(path, overwrite=overwrite)  # refuse before the cache is encoded
    return safe_write.write_bytes(path, encode_cache(cache, calib, bits, **options), overwrite=overwrite)


def load_cache(path, calib: Calibration, **options):
    """Read a file written by ``save_cache``; ``options`` as for ``decode_cache``."""
    return decode_cache(Path(path).read_bytes(), calib, **options)
