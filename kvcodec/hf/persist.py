"""Save / load a CompressedCache as it is held (compressed blocks stay compressed), so a prefix
cache computed once can be reused by another process.

Format: one kvcodec container (``kvcodec.container``) of kind ``kvcodec.hf.cache`` whose meta holds
the cache options and model shape and whose sections are one nested container per layer
(kind ``kvcodec.hf.layer``): sink and window tensors plus each block's key/value state. Every
malformed, truncated or mismatched file (including one saved for another model shape) raises
:class:`kvcodec.CorruptStreamError` (a ``ValueError``), checked before anything of the size the
file declares is allocated; ``max_output_bytes`` caps the cache's decoded size.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvcodec import container, safe_write, validate
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES as CAP
from kvcodec.errors import CorruptStreamError
from kvcodec.hf.storage import Block

CACHE_KIND = "kvcodec.hf.cache"
LAYER_KIND = "kvcodec.hf.layer"
FORMAT_VERSION = 1


def cache_to_bytes(cache) -> bytes:
    """The file of ``cache``; a static cache (``max_cache_len``) writes its eager form: the same bytes."""
    if callable(getattr(cache, "to_eager", None)):
        cache = cache.to_eager()
    spec = cache.spec
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ != "CompressedLayer" or layer.decoded:
            kind = "decoded (its model attends K/V computed from the cache)" if getattr(layer, "decoded", 0) else type(layer).__name__
            raise ValueError(f"saving a cache supports full-attention layers attended on their compressed form; "
                             f"layer {i} is {kind}")
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


def save_cache(cache, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write :func:`cache_to_bytes` to ``path`` through :func:`kvcodec.safe_write.atomic_write`: the
    old file or the whole new one, never a part; WriteRefusedError for a symlink, a hard-linked
    file, or an existing file unless ``overwrite``."""
    safe_write.check_target(path, overwrite=overwrite)  # refuse before the cache is serialized
    with safe_write.atomic_write(path, overwrite=overwrite) as out:
        out.write(cache_to_bytes(cache))


def _layer_to_bytes(layer) -> bytes:
    store = layer.store
    tensors, blocks, meta_side = {}, [], {}
    if store is not None:
        for name in ("sink_k", "sink_v", "win_k", "win_v"):
            t = getattr(store, name)
            if t is not None:
                tensors[name] = t.detach().to("cpu").contiguous()
        for j, b in enumerate(store.blocks):
            km, kt = store.key_encoding.state(b.key)
            vm, vt = store.value_encoding.state(b.value)
            tensors.update({f"b{j}.k.{n}": _cpu(t) for n, t in kt.items()})
            tensors.update({f"b{j}.v.{n}": _cpu(t) for n, t in vt.items()})
            blocks.append({"length": b.length, "key": km, "value": vm})
        for tag, codec in (("kc", store.key_encoding), ("vc", store.value_encoding)):
            side_meta, side = codec.side_state()  # fitted quantizer state (e.g. channel scales)
            tensors.update({f"{tag}.{n}": _cpu(t) for n, t in side.items()})
            meta_side[tag] = side_meta
    meta = {"initialized": store is not None, "blocks": blocks, "codecs": meta_side}
    if store is not None:
        meta["dtype"] = container.torch_dtype_name(layer.dtype)
    return container.dumps(LAYER_KIND, meta, tensors)


def _cpu(t):
    return t.detach().to("cpu").contiguous() if isinstance(t, torch.Tensor) else t


def load_cache(cls, path, config_or_model, device="cpu", max_output_bytes: int | None = CAP):
    data = Path(path).read_bytes()
    return cache_from_bytes(cls, data, config_or_model, device=device, max_output_bytes=max_output_bytes)


# ------------------------------------------------------------------------------------- loading
# A saved cache is untrusted input: every meta field is checked against what cache_to_bytes
# writes and against this model's shape before a cache is built or a block decoded, and the
# decoded size of the cache (batch x heads x tokens x head_dim, keys and values, every layer) is
# checked against ``max_output_bytes`` (kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES unless raised;
# None: no cap).

_KV_DTYPES = ("float16", "bfloat16", "float32", "float64")
_MAX_TOKENS = 1 << 31  # a cache never holds more tokens per layer
_NOT_SAVED = {"self", "config_or_model", "attention", "max_cache_len"}  # constructor args no file carries


def _checked_options(cls, options) -> dict:
    """Constructor options of a saved cache: known names, JSON scalars (or per-layer int lists), bounded ints."""
    import inspect

    known = set(inspect.signature(cls.__init__).parameters) - _NOT_SAVED
    if type(options) is not dict or not set(options) <= known:
        raise CorruptStreamError(f"saved cache options must be an object with keys among {sorted(known)}")
    for k, v in options.items():
        items = v if type(v) is list and len(v) <= 4096 else [v]
        for x in items:
            if type(x) not in (str, int, bool, type(None)) or (type(x) is str and len(x) > 64):
                raise CorruptStreamError(f"saved cache option {k!r} is not a short JSON scalar")
            if type(x) is int:
                validate.require_int(x, 0, (1 << 63) - 1 if k == "seed" else _MAX_TOKENS, f"saved cache option {k!r}")
    return options


def cache_from_bytes(cls, data: bytes, config_or_model, device="cpu", max_output_bytes: int | None = CAP):
    """Rebuild a cache from :func:`cache_to_bytes` output. CorruptStreamError (a ValueError) for a
    malformed file, one saved for another model shape, or one whose decoded KV exceeds
    ``max_output_bytes`` (default 4 GiB; ``None``: no cap)."""
    cap = validate.resolve_max_output(max_output_bytes)
    _, meta, sections = container.loads(data, expect_kind=CACHE_KIND)
    validate.require_keys(meta, ("version", "options", "shape"), "saved cache meta")
    if meta["version"] != FORMAT_VERSION or type(meta["version"]) is not int:
        raise CorruptStreamError(f"unsupported saved-cache version {str(meta['version'])[:40]}")
    options = _checked_options(cls, meta["options"])
    try:
        cache = cls(config_or_model, **options)
    except (TypeError, ValueError) as exc:
        raise CorruptStreamError(f"saved cache options are malformed: {str(exc)[:200]}") from exc
    spec = cache.spec
    if spec.options() != options:  # cache_to_bytes writes every option: a missing one is not a default
        raise CorruptStreamError("saved cache options are not the complete set this cache writes")
    shape = meta["shape"]
    want = {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim}
    if shape != want or any(type(v) is not int for v in shape.values()):
        raise CorruptStreamError(f"saved cache is for a model shaped {str(shape)[:200]}, this model is {want}")
    if list(sections) != [f"layer{i}" for i in range(spec.num_layers)]:
        raise CorruptStreamError("saved cache sections are not exactly one per layer, in order")
    budget, batches = [cap], set()
    for i, layer in enumerate(cache.layers):
        blob = sections[f"layer{i}"]
        if not isinstance(blob, memoryview):
            raise CorruptStreamError(f"saved cache layer {i} is not a bytes section")
        batches |= _restore_layer(layer, bytes(blob), spec, torch.device(device), budget)
    lengths = {layer.get_seq_length() for layer in cache.layers}
    if len(lengths) > 1:
        raise CorruptStreamError(f"saved layers disagree on the sequence length: {sorted(lengths)}")
    if len(batches) > 1:
        raise CorruptStreamError(f"saved layers disagree on the batch size: {sorted(batches)}")
    return cache


def _spend(budget: list, shape, itemsize: int, what: str) -> None:
    """Charge a block's decoded size (shape [B, H, T, D]) to the cache's output budget (None: no cap)."""
    if budget[0] is None:
        return
    n = validate.numel(shape) * itemsize
    if n > budget[0]:
        raise CorruptStreamError(f"{what}: the saved cache decodes past max_output_bytes "
                                 "(raise it if you trust this file)")
    budget[0] -= n


def _lossless_rows(tensors: dict, bm: dict, kv_shape: tuple, dtype_name: str, what: str) -> None:
    """Each row blob of a lossless block must declare [1, H, length, D] in the layer dtype, before it is decoded."""
    from kvcodec.lossless import api

    state = validate.require_type(bm, dict, what)
    rows = validate.require_int(state.get("rows"), 1, _MAX_TOKENS, f"{what} rows")
    # the count first: a hostile ``rows`` can be 2^31, too many names to build
    if len(tensors) != rows or set(tensors) != {f"row{r}" for r in range(rows)}:
        raise CorruptStreamError(f"{what}: sections do not match its {rows} rows")
    for r in range(rows):
        blob = tensors[f"row{r}"]
        if not isinstance(blob, memoryview):
            raise CorruptStreamError(f"{what}: row {r} is not a bytes section")
        info = api.describe(blob)
        if info["shape"] != (1, *kv_shape) or info["dtype"] != dtype_name:
            raise CorruptStreamError(f"{what}: row {r} declares {info['dtype']} {info['shape']}, "
                                     f"expected {dtype_name} {(1, *kv_shape)}")


def _block_shape(blk) -> tuple:
    """[B, H, T, D] of a restored block of any codec."""
    if isinstance(blk, torch.Tensor):
        return tuple(blk.shape)
    if hasattr(blk, "lead_shape"):  # QuantizedTensor
        return (*blk.lead_shape, blk.num_tokens, blk.dim)
    return (len(blk.blobs), None, blk.length, None)  # LosslessBlock: rows checked by _lossless_rows


def _restore_layer(layer, blob: bytes, spec, device, budget: list) -> set:
    """Restore one layer; return the batch sizes it holds (one, or none if empty)."""
    _, meta, tensors = container.loads(blob, expect_kind=LAYER_KIND)
    validate.require_keys(meta, ("initialized", "blocks", "codecs"), "saved cache layer meta", optional=("dtype",))
    validate.require_type(meta["blocks"], list, "saved cache layer blocks")
    if validate.require_type(meta["initialized"], bool, "saved cache layer 'initialized'") is False:
        if tensors or meta["blocks"] or "dtype" in meta:
            raise CorruptStreamError("an uninitialized saved cache layer holds data")
        return set()
    dtype_name = meta.get("dtype")
    dtype = validate.lookup(dtype_name, {n: getattr(torch, n) for n in _KV_DTYPES}, "saved cache layer dtype")
    itemsize = dtype.itemsize
    H, D = spec.num_kv_heads, spec.head_dim
    layer.lazy_initialization(torch.empty(0, dtype=dtype, device=device), None)
    store = layer.store
    exact, batch = {}, set()
    for a, b in (("sink_k", "sink_v"), ("win_k", "win_v")):
        k, v = tensors.get(a), tensors.get(b)
        if (k is None) != (v is None):
            raise CorruptStreamError(f"saved cache layer has {a} without {b} or the reverse")
        if k is None:
            continue
        for t in (k, v):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.ndim != 4:
                raise CorruptStreamError(f"saved {a}/{b} must be 4-D {dtype} tensors")
            if t.shape[1:] != (H, k.shape[2], D) or t.shape[0] != k.shape[0]:
                raise CorruptStreamError(f"saved {a}/{b} tensors have the wrong shape {tuple(t.shape)}")
            _spend(budget, t.shape, itemsize, f"saved {a}")
        exact[a], exact[b] = k.to(device), v.to(device)
        batch.add(k.shape[0])
    store.set_exact(**exact)
    codec_meta = validate.require_type(meta["codecs"], dict, "saved cache codec side state")
    if not set(codec_meta) <= {"kc", "vc"}:
        raise CorruptStreamError("saved cache codec side state has unknown entries")
    per_block = _block_sections(tensors, len(meta["blocks"]))
    for tag, codec in (("kc", store.key_encoding), ("vc", store.value_encoding)):
        side = {n.split(".", 1)[1]: t for n, t in tensors.items() if n.startswith(f"{tag}.")}
        codec.load_side_state(_dict(codec_meta.get(tag, {})), _to(side, device))
    for j, bm in enumerate(meta["blocks"]):
        validate.require_keys(bm, ("length", "key", "value"), f"saved block {j}")
        length = validate.require_int(bm["length"], 1, _MAX_TOKENS, f"saved block {j} length")
        restored = []
        for tag, codec in (("k", store.key_encoding), ("v", store.value_encoding)):
            state = _dict(bm["key" if tag == "k" else "value"])
            part = per_block.get((j, tag), {})
            what = f"saved block {j} ({'key' if tag == 'k' else 'value'})"
            if codec.name == "lossless":
                _lossless_rows(part, state, (H, length, D), dtype_name, what)
                _spend(budget, (state["rows"], H, length, D), itemsize, what)
            try:
                blk = codec.restore(state, _to(part, device))
            except CorruptStreamError:
                raise
            except (ValueError, TypeError, KeyError, RuntimeError, IndexError, OverflowError) as exc:
                raise CorruptStreamError(f"{what} does not restore: {str(exc)[:200]}") from exc
            shape = _block_shape(blk)
            if len(shape) != 4:
                raise CorruptStreamError(f"{what} has {len(shape)} dimensions, expected [B, {H}, {length}, {D}]")
            B, h, T, d = shape
            if (h not in (None, H) or d not in (None, D) or T != length or codec.length(blk) != length
                    or (isinstance(blk, torch.Tensor) and blk.dtype != dtype)):
                raise CorruptStreamError(f"{what} has shape {(B, h, T, d)}, expected [B, {H}, {length}, {D}]")
            if codec.name != "lossless":
                _spend(budget, (B, H, length, D), itemsize, what)
            batch.add(B)
            restored.append(blk)
        store.blocks.append(Block(restored[0], restored[1], length))
    if len(batch) > 1:
        raise CorruptStreamError(f"saved cache layer mixes batch sizes {sorted(batch)}")
    if store.sink_len and (store.blocks or store.window_len) and store.sink_len != spec.sink:
        raise CorruptStreamError("saved sink is shorter than the cache's sink but tokens follow it")
    return batch


def _block_sections(tensors: dict, n_blocks: int) -> dict:
    """Block sections grouped in one pass: (j, "k"|"v") -> {field: tensor} for ``b<j>.k.<field>`` /
    ``b<j>.v.<field>``, j < n_blocks; any other name but the sink, window and side state is refused.
    (One pass, so a layer with many blocks and many sections costs linear time, not their product.)"""
    groups: dict = {}
    for n, t in tensors.items():
        if n in ("sink_k", "sink_v", "win_k", "win_v") or n.startswith(("kc.", "vc.")):
            continue
        head, _, rest = n.partition(".")
        j, tag, field = head[1:], rest[:1], rest[2:]
        if head[:1] != "b" or not (j.isascii() and j.isdigit()) or str(int(j)) != j or int(j) >= n_blocks \
                or rest[1:2] != "." or tag not in ("k", "v") or not field:
            raise CorruptStreamError(f"saved cache layer has an unexpected section {n[:80]!r}")
        groups.setdefault((int(j), tag), {})[field] = t
    return groups


def _dict(x) -> dict:
    if not isinstance(x, dict):
        raise CorruptStreamError("saved block state is not a dict")
    return x


def _to(tensors: dict, device) -> dict:
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in tensors.items()}
