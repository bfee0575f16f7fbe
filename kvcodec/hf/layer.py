"""CompressedLayer: one attention layer of a :class:`~kvcodec.hf.cache.CompressedCache`.

It holds the layer's :class:`~kvcodec.hf.storage.LayerStore` and hands freshly appended tokens to
the kvcodec attention function (``kvcodec.hf.attention``) while its cache is bound to a forward
(``kvcodec.hf.binding``). A module of its own so the attention function and the cache can both import it.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcodec.hf.methods import CacheSpec
from kvcodec.hf.storage import LayerStore

log = logging.getLogger(__name__)
_warned_fallback = False


class CompressedLayer(CacheLayerMixin):
    """One attention layer's cache: a :class:`LayerStore` plus the hand-off to the attention function.

    ``bound`` is set while the cache is bound to a model's forward (``kvcodec.hf.binding``): ``update``
    then returns only the new exact K/V (unless ``decoded``) and leaves ``pending`` tokens for the kvcodec attention
    function, which reads the store and compacts it afterwards (so the prompt is attended exactly, then
    compressed). Unbound (a cache built from a config alone), ``update`` returns the whole history
    decoded, for any attention implementation."""

    is_sliding = False
    is_croppable = True
    is_compileable = False
    compressed = True  # what kvcodec.hf.cache tells apart from transformers' own layers by

    def __init__(self, spec: CacheSpec, layer_idx: int, attention_options=None):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.attention_options = attention_options  # kvcodec.hf.attention.AttentionOptions; None: defaults
        self.store: LayerStore | None = None
        self.bound = False
        self.pending = 0
        self.fused_consts = None  # the attention function's constants for the store's block (fused path)
        self.sink = spec.sink
        # True when the model's attention does not read what update returns (MLA's latent cache in
        # transformers >= 5.24 is expanded after update; some modules bypass the attention interface):
        # update then returns the whole history decoded (kvcodec.hf.cache.KvcodecCache.check_attended)
        self.decoded = False
        self.handed = (None, None)
        self.handed_whole = False

    # ------------------------------------------------------------------ contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        dims = {} if value_states is None else {"key_dim": key_states.shape[-1], "value_dim": value_states.shape[-1]}
        key_encoding, value_encoding = self.spec.make_encodings(self.layer_idx, **dims)
        self.store = LayerStore(
            key_encoding, value_encoding, residual=self.spec.residual, block_size=self.spec.block_size, sink=self.sink
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending:  # the previous tokens were never attended by kvcodec: compress them now
            self.finish_step()
        self.store.append(key_states, value_states)
        if self.bound and not self.decoded:
            self.pending = key_states.shape[-2]
            # the attention function checks it receives these; KV-sharing layers reuse them (kept to forward end)
            self.handed = (key_states, value_states)
            self.handed_whole = len(self.store) == key_states.shape[-2]  # the new tokens are the whole history
            return key_states, value_states
        if not self.bound:
            _warn_fallback()
        keys, values = self.store.materialize(key_states.dtype)
        skip = self.hidden(key_states.shape[-2])
        self.store.compact()
        self.forget()
        return keys[..., skip:, :], values[..., skip:, :]

    def hidden(self, query_length: int) -> int:
        """How many of the oldest held tokens the step's queries may not see (and its mask does not
        cover): none for full attention."""
        return 0

    def forget(self) -> None:
        """Drop what no later query can reach (sliding-window layers)."""

    def finish_step(self) -> None:
        """Called by the attention function once it has read this step's tokens."""
        self.pending = 0
        self.store.compact()
        self.forget()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position instead
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.store is None else len(self.store)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the abstract name of get_max_length in early transformers 5.x
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.clear()
        self.pending = 0
        self.fused_consts = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.store.select_batch(beam_idx.to(torch.long))

    def crop(self, max_length: int) -> None:
        """Negative: remove that many tokens (transformers >= 5.18); positive: keep that many (5.17)."""
        if self.store is None or max_length == 0:
            return
        n = len(self.store)
        keep = n + max_length if max_length < 0 else max_length
        self.store.truncate(max(keep, 0))
        self.pending = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        b = self.store.batch_size if self.store is not None else None
        if b:
            self.store.select_batch(torch.arange(b).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() == 0:
            return
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.store.select_batch(indices.to(torch.long).cpu())

    def offload(self):  # offloading a compressed cache is not supported: it is already small
        pass

    def prefetch(self):
        pass

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict:
        if self.store is None:
            return {"tokens": 0, "sink": 0, "window": 0, "compressed_keys": 0, "compressed_values": 0, "side": 0, "total": 0}
        rep = {"tokens": len(self.store), **self.store.memory()}
        rep["total"] = sum(v for k, v in rep.items() if k != "tokens")
        return rep


class SlidingCompressedLayer(CompressedLayer):
    """A sliding-window (or chunked) attention layer, compressed like a full one, whose queries see
    what transformers' ``DynamicSlidingWindowLayer`` shows them: the last ``sliding_window - 1`` past
    tokens and the new ones (``get_mask_sizes`` reports that range, so masks and decoded K/V are the
    same as with transformers' own layer). Older tokens are forgotten a block at a time (a step
    re-copies the compressed part once per block, not once per token), so the layer holds less than
    one block beyond the window. It holds no sink: the held tokens are one contiguous run."""

    is_sliding = True

    def __init__(self, spec: CacheSpec, layer_idx: int, attention_options=None, *, sliding_window: int):
        super().__init__(spec, layer_idx, attention_options)
        self.sliding_window = int(sliding_window)
        self.sink = 0
        self.offset = 0  # tokens forgotten

    def _past(self, held: int) -> int:
        return min(held, self.sliding_window - 1)

    def hidden(self, query_length: int) -> int:
        held = len(self.store) - query_length
        return held - self._past(held)

    def forget(self) -> None:
        excess = len(self.store) - (self.sliding_window - 1)
        if excess >= self.spec.block_size:
            self.offset += self.store.drop_front(excess)
            self.fused_consts = None

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        held = 0 if self.store is None else len(self.store)
        return self._past(held) + query_length, self.offset + held - self._past(held)

    def get_seq_length(self) -> int:
        return self.offset + (0 if self.store is None else len(self.store))

    def reset(self) -> None:
        super().reset()
        self.offset = 0

    def crop(self, max_length: int) -> None:
        if self.store is None or max_length == 0:
            return
        n = self.get_seq_length()
        keep = max(n + max_length if max_length < 0 else max_length, 0)
        if keep < self.offset:
            raise RuntimeError(f"cannot crop a sliding-window layer to {keep} tokens: it forgot the first {self.offset}")
        self.store.truncate(keep - self.offset)
        self.pending = 0


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        log.warning(
            "CompressedCache was built from a config, not the model: every step dequantizes the whole cache. "
            "Build it as CompressedCache(model, ...) so attention reads the compressed form."
        )


def hybrid_layer(spec: CacheSpec, layer_idx: int, attention_options, number_of_states: int):
    """A layer holding an SSM / linear-attention state and attention K/V at once (Falcon-H1's layers):
    transformers' linear-attention state kept as it is, the K/V compressed. None where the installed
    transformers has no such layers."""
    try:
        from transformers.cache_utils import LinearAttentionLayer
    except ImportError:
        return None

    class CompressedHybridLayer(LinearAttentionLayer, CompressedLayer):
        is_compileable = False

        def __init__(self):
            CompressedLayer.__init__(self, spec, layer_idx, attention_options)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs) -> None:
            # two positional tensors: K/V from update; keywords: conv / recurrent states (as transformers' own)
            if len(args) == 2 and not kwargs:
                CompressedLayer.lazy_initialization(self, *args)
            elif not args:
                LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def update(self, key_states, value_states, *args, **kwargs):
            return CompressedLayer.update(self, key_states, value_states, *args, **kwargs)

        def get_seq_length(self) -> int:
            return CompressedLayer.get_seq_length(self)

        def get_mask_sizes(self, query_length) -> tuple[int, int]:
            return CompressedLayer.get_mask_sizes(self, query_length)

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            LinearAttentionLayer.reset(self)
            CompressedLayer.reset(self)

        def reorder_cache(self, beam_idx) -> None:
            LinearAttentionLayer.reorder_cache(self, beam_idx)
            CompressedLayer.reorder_cache(self, beam_idx)

        def crop(self, max_length: int) -> None:
            LinearAttentionLayer.crop(self, max_length)
            CompressedLayer.crop(self, max_length)

        def batch_repeat_interleave(self, repeats: int) -> None:
            LinearAttentionLayer.batch_repeat_interleave(self, repeats)
            CompressedLayer.batch_repeat_interleave(self, repeats)

        def batch_select_indices(self, indices) -> None:
            LinearAttentionLayer.batch_select_indices(self, indices)
            CompressedLayer.batch_select_indices(self, indices)

        def offload(self):
            pass

        def prefetch(self):
            pass

    return CompressedHybridLayer()
