"""CompressedLayer: one attention layer of a :class:`~kvcodec.hf.cache.CompressedCache`.

It holds the layer's :class:`~kvcodec.hf.storage.LayerStore` and hands freshly appended tokens to
the kvcodec attention function (``kvcodec.hf.attention``), which arms it just before the layer's
forward. A module of its own so the attention function and the cache can both import it.
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

    ``armed`` is set by the attention pre-hook just before the layer's forward: ``update`` then
    returns only the new exact K/V and leaves ``pending`` tokens for the kvcodec attention function,
    which reads the store and compacts it afterwards (so the prompt is attended exactly, then
    compressed)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, spec: CacheSpec, layer_idx: int, attention_options=None):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.attention_options = attention_options  # kvcodec.hf.attention.AttentionOptions; None: defaults
        self.store: LayerStore | None = None
        self.armed = False
        self.pending = 0
        self.fused_consts = None  # the attention function's constants for the store's block (fused path)

    # ------------------------------------------------------------------ contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        key_encoding, value_encoding = self.spec.make_encodings(self.layer_idx)
        self.store = LayerStore(
            key_encoding, value_encoding, residual=self.spec.residual, block_size=self.spec.block_size, sink=self.spec.sink
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending:  # the previous tokens were never attended by kvcodec: compress them now
            self.finish_step()
        self.store.append(key_states, value_states)
        if self.armed:
            self.armed = False
            self.pending = key_states.shape[-2]
            return key_states, value_states
        _warn_fallback()
        keys, values = self.store.materialize(key_states.dtype)
        self.store.compact()
        return keys, values

    def finish_step(self) -> None:
        """Called by the attention function once it has read this step's tokens."""
        self.pending = 0
        self.store.compact()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position instead
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.store is None else len(self.store)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.clear()
        self.armed = False
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


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        log.warning(
            "CompressedCache is used without kvcodec attention: every step dequantizes the whole cache. "
            "Pass the model to CompressedCache(model, ...) or call kvcodec.hf.enable(model)."
        )
