"""Static <-> eager compressed cache: the same tokens and the same bytes, in either form.

For the same tokens the static buffers hold exactly the eager store's parts (the sink, one compressed
block per layer with the layer's preconditioner, the window), only laid out differently (a ring for
the window, slots for ``max_cache_len`` tokens). ``to_eager`` copies them out in token order into an
eager :class:`~kvcodec.hf.CompressedCache`, ``from_eager`` copies an eager cache's parts into fresh
static buffers. Saving and loading a static cache go through the eager cache's file
(``kvcodec.hf.persist``), so a file written by either cache loads as either.
"""

from __future__ import annotations

import torch

from kvcodec.hf.storage import Block
from kvcodec.quant import QuantizedTensor


def to_eager(static):
    """An eager CompressedCache (built from the model's config: the model's attention is left as it is)
    holding the static cache's tokens: the same sink and window values and the same compressed bytes."""
    from kvcodec.hf.cache import CompressedCache

    static.compact()  # the compaction a static step defers to the next one: the eager store has done it
    eager = CompressedCache(static.config, **static.spec.options())
    L = static.lengths
    for ls, le in zip(static.layers, eager.layers):
        if not ls.is_initialized:
            continue
        n, c, S = int(L.seen), int(L.comp), ls.sink
        le.lazy_initialization(torch.empty(0, dtype=ls.dtype, device=ls.device), None)
        store = le.store
        store.dtype = ls.dtype
        sink, window = min(S, n), L.slot_of(torch.arange(S + c, n, device=ls.device))  # window: in token order
        exact = {}
        for name, buf in (("k", ls.exact_k), ("v", ls.exact_v)):
            exact["sink_" + name] = buf[:, :, :sink].to(ls.dtype) if sink else None
            exact["win_" + name] = buf.index_select(2, window).to(ls.dtype) if window.numel() else None
        store.set_exact(**exact)
        if c:
            parts = []
            for side, enc in (("k", store.key_encoding), ("v", store.value_encoding)):
                qt = QuantizedTensor(
                    config=enc.q_config(), lead_shape=(ls.batch_size, ls.num_heads), num_tokens=c, dim=ls.head_dim,
                    token={"codes": getattr(ls, side + "_codes")[:, :, :c],
                           "norms": getattr(ls, side + "_norms")[:, :, :c]},
                    side={name.split("_", 1)[1]: t for name, t in ls.pre.items() if name.startswith(side + "_")})
                parts.append(enc.restore(*enc.state(qt.clone())))  # restore: the encoding keeps the side data
            store.blocks = [Block(parts[0], parts[1], c)]
    return eager


def from_eager(eager, static):
    """Fill ``static``, a fresh static cache built with ``eager``'s options, with an eager CompressedCache's
    tokens (same bytes) and return it. ValueError when the static mode cannot hold them (too many tokens,
    fewer tokens than the sink, a window longer than the eager store ever leaves)."""
    if not static.all_compressed:
        raise ValueError("a static cache with sliding-window layers is not filled from an eager cache")
    if static.growable:  # room for what the eager cache holds
        static.make_room(max((len(layer.store) for layer in eager.layers if layer.store is not None), default=0))
    max_cache_len = static.first_layer.max_cache_len
    spec = static.spec
    for le, ls in zip(eager.layers, static.layers):
        store = le.store
        if store is None or len(store) == 0:
            continue
        n, c, w = len(store), store.compressed_len, store.window_len
        if n > max_cache_len:
            raise ValueError(f"the cache holds {n} tokens > max_cache_len={max_cache_len}")
        if n < spec.sink:
            raise ValueError(f"a static cache holds at least sink={spec.sink} tokens, this one {n}")
        if w >= spec.residual + spec.block_size:
            raise ValueError(f"window of {w} tokens: the eager store compacts at residual + block_size = "
                             f"{spec.residual + spec.block_size}")
        blocks = store.blocks
        while len(blocks) > 1:  # (a file may hold several blocks; the static buffers are one)
            a, b, *rest = blocks
            blocks = [Block(store.key_encoding.cat(a.key, b.key), store.value_encoding.cat(a.value, b.value),
                            a.length + b.length), *rest]
        packed = None
        if c:
            b = blocks[0]
            packed = (store.key_encoding.packed(b.key), store.value_encoding.packed(b.value))
            batch = packed[0].codes.shape[0]
        else:
            batch = store.batch_size
        H, D, S = spec.num_kv_heads, spec.head_dim, spec.sink
        empty = torch.empty(batch, H, 0, D, dtype=le.dtype, device=le.device)
        ls.lazy_initialization(empty, empty)
        part = lambda t: empty if t is None else t  # noqa: E731
        ls.install(part(store.sink_k)[:, :, :S], part(store.sink_v)[:, :, :S], packed, c, part(store.win_k),
                   part(store.win_v))
    return static
