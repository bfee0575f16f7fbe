"""Save / load a CompressedCache as it is held (compressed blocks stay compressed), so a prefix
cache computed once can be reused by another process.

Format: one kvcodec container (``kvcodec.container``) of kind ``kvcodec.hf.cache`` whose meta holds
the cache options and model shape and whose sections are one nested container per layer
(kind ``kvcodec.hf.layer``): sink and window tensors plus each block's key/value state. Every
malformed, truncated or mismatched file raises :class:`kvcodec.CorruptStreamError`; a file saved
for another model shape raises ``ValueError``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvcodec import container
from kvcodec.errors import CorruptStreamError
from kvcodec.hf.storage import Block

CACHE_KIND = "kvcodec.hf.cache"
LAYER_KIND = "kvcodec.hf.layer"
FORMAT_VERSION = 1


def cache_to_bytes(cache) -> bytes:
    spec = cache.spec
    layer_blobs = {}
    for i, layer in enumerate(cache.layers):
        if layer.pending:
            layer.finish_step()
        layer_blobs[f"layer{i}"] = _layer_to_bytes(layer)
    meta = {
        "version": FORMAT_VERSION,
        "options": spec.options(),
        "shape": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
    }
    return container.dumps(CACHE_KIND, meta, layer_blobs)


def save_cache(cache, path: str | os.PathLike) -> None:
    data = cache_to_bytes(cache)
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _layer_to_bytes(layer) -> bytes:
    store = layer.store
    tensors, blocks, meta_side = {}, [], {}
    if store is not None:
        for name in ("sink_k", "sink_v", "win_k", "win_v"):
            t = getattr(store, name)
            if t is not None:
                tensors[name] = t.detach().to("cpu").contiguous()
        for j, b in enumerate(store.blocks):
            km, kt = store.key_codec.state(b.key)
            vm, vt = store.value_codec.state(b.value)
            tensors.update({f"b{j}.k.{n}": _cpu(t) for n, t in kt.items()})
            tensors.update({f"b{j}.v.{n}": _cpu(t) for n, t in vt.items()})
            blocks.append({"length": b.length, "key": km, "value": vm})
        for tag, codec in (("kc", store.key_codec), ("vc", store.value_codec)):
            side_meta, side = codec.side_state()  # fitted quantizer state (e.g. channel scales)
            tensors.update({f"{tag}.{n}": _cpu(t) for n, t in side.items()})
            meta_side[tag] = side_meta
    meta = {"initialized": store is not None, "blocks": blocks, "codecs": meta_side}
    if store is not None:
        meta["dtype"] = container.torch_dtype_name(layer.dtype)
    return container.dumps(LAYER_KIND, meta, tensors)


def _cpu(t):
    return t.detach().to("cpu").contiguous() if isinstance(t, torch.Tensor) else t


def load_cache(cls, path, config_or_model, device="cpu"):
    data = Path(path).read_bytes()
    return cache_from_bytes(cls, data, config_or_model, device=device)


def cache_from_bytes(cls, data: bytes, config_or_model, device="cpu"):
    kind, meta, sections = container.loads(data)
    if kind != CACHE_KIND:
        raise CorruptStreamError(f"not a saved kvcodec cache (container kind {kind!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise CorruptStreamError(f"unsupported saved-cache version {meta.get('version')!r}")
    options = meta.get("options")
    if not isinstance(options, dict):
        raise CorruptStreamError("saved cache lacks its options")
    try:
        cache = cls(config_or_model, **options)
    except TypeError as exc:
        raise CorruptStreamError(f"saved cache options are malformed: {exc}") from exc
    spec = cache.spec
    shape = meta.get("shape")
    want = {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim}
    if shape != want:
        raise ValueError(f"saved cache is for a model shaped {shape}, this model is {want}")
    for i, layer in enumerate(cache.layers):
        blob = sections.get(f"layer{i}")
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise CorruptStreamError(f"saved cache lacks layer {i}")
        _restore_layer(layer, bytes(blob), spec, torch.device(device))
    lengths = {layer.get_seq_length() for layer in cache.layers}
    if len(lengths) > 1:
        raise CorruptStreamError(f"saved layers disagree on the sequence length: {sorted(lengths)}")
    return cache


def _restore_layer(layer, blob: bytes, spec, device) -> None:
    kind, meta, tensors = container.loads(blob)
    if kind != LAYER_KIND or not isinstance(meta.get("blocks"), list):
        raise CorruptStreamError("malformed saved cache layer")
    if not meta.get("initialized"):
        return
    dtype = container.torch_dtypes().get(meta.get("dtype"))
    if dtype is None or not dtype.is_floating_point:
        raise CorruptStreamError(f"saved cache layer has a bad dtype {meta.get('dtype')!r}")
    layer.lazy_initialization(torch.empty(0, dtype=dtype, device=device), None)
    store = layer.store
    exact = {}
    for a, b in (("sink_k", "sink_v"), ("win_k", "win_v")):
        k, v = tensors.get(a), tensors.get(b)
        if (k is None) != (v is None):
            raise CorruptStreamError(f"saved cache layer has {a} without {b} or the reverse")
        if k is None:
            continue
        for t in (k, v):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.ndim != 4:
                raise CorruptStreamError(f"saved {a}/{b} must be 4-D {dtype} tensors")
            if t.shape[1:] != (spec.num_kv_heads, k.shape[2], spec.head_dim) or t.shape[0] != k.shape[0]:
                raise CorruptStreamError(f"saved {a}/{b} tensors have the wrong shape {tuple(t.shape)}")
        exact[a], exact[b] = k.to(device), v.to(device)
    if len({t.shape[0] for t in exact.values()}) > 1:
        raise CorruptStreamError("saved sink and window differ in batch size")
    store.set_exact(**exact)
    codec_meta = _dict(meta.get("codecs", {}))
    for tag, codec in (("kc", store.key_codec), ("vc", store.value_codec)):
        side = {n.split(".", 1)[1]: t for n, t in tensors.items() if n.startswith(f"{tag}.")}
        codec.load_side_state(_dict(codec_meta.get(tag, {})), _to(side, device))
    for j, bm in enumerate(meta["blocks"]):
        if not isinstance(bm, dict) or not isinstance(bm.get("length"), int) or bm["length"] <= 0:
            raise CorruptStreamError(f"saved block {j} is malformed")
        kt = {n.split(".", 2)[2]: t for n, t in tensors.items() if n.startswith(f"b{j}.k.")}
        vt = {n.split(".", 2)[2]: t for n, t in tensors.items() if n.startswith(f"b{j}.v.")}
        key = store.key_codec.restore(_dict(bm.get("key")), _to(kt, device))
        value = store.value_codec.restore(_dict(bm.get("value")), _to(vt, device))
        for codec, blk in ((store.key_codec, key), (store.value_codec, value)):
            if codec.length(blk) != bm["length"]:
                raise CorruptStreamError(f"saved block {j} holds {codec.length(blk)} tokens, meta says {bm['length']}")
        store.blocks.append(Block(key, value, bm["length"]))
    if store.sink_len and (store.blocks or store.window_len) and store.sink_len != spec.sink:
        raise CorruptStreamError("saved sink is shorter than the cache's sink but tokens follow it")


def _dict(x) -> dict:
    if not isinstance(x, dict):
        raise CorruptStreamError("saved block state is not a dict")
    return x


def _to(tensors: dict, device) -> dict:
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in tensors.items()}
