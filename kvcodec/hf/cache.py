"""CompressedCache: a ``transformers.Cache`` whose layers hold compressed K/V bytes.

Usage, one line once the model is enabled::

    cache = CompressedCache(model, method="turboquant", key_bits=4, value_bits=3)
    model.generate(ids, past_key_values=cache)

Passing the model (not only its config) installs the kvcodec attention function and the
pre-hooks that let it read this cache (``kvcodec.hf.attention.enable``); attention then scores the
compressed blocks directly. With any other attention implementation the cache still works, but
``update`` has to return dequantized K/V for the whole history every step (slow, like HF's
QuantizedCache): kvcodec warns once.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcodec.hf.methods import CacheSpec, build_spec
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

    def __init__(self, spec: CacheSpec, layer_idx: int):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.store: LayerStore | None = None
        self.armed = False
        self.pending = 0

    # ------------------------------------------------------------------ contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        key_codec, value_codec = self.spec.make_codecs(self.layer_idx)
        self.store = LayerStore(
            key_codec, value_codec, residual=self.spec.residual, block_size=self.spec.block_size, sink=self.spec.sink
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


class CompressedCache(Cache):
    """A Hugging Face cache that keeps K/V compressed (TurboQuant, QJL, KIVI, lossless or none).

    Args:
        config_or_model: the model (recommended: also enables kvcodec attention on it) or its config.
        method: "turboquant", "qjl", "kivi", "lossless" or "none" (full precision, for reference).
        key_bits / value_bits: bits per coordinate for keys and values (value_bits defaults to
            key_bits). Ignored by "lossless" and "none".
        key_mode: "mse" or "prod" (TurboQuant keys: MSE-optimal or unbiased inner products).
        residual: the most recent ``residual`` tokens always stay full precision.
        block_size: tokens compressed together when they leave the window (default: residual, or 64
            if residual is 0); the window holds between residual and residual + block_size - 1 tokens.
        sink: the first ``sink`` tokens stay full precision for good (attention sinks). Default 1:
            on SmolLM2 the first token draws so much attention that quantizing it alone moved
            4-bit TurboQuant perplexity by +3.2% (vs -0.7% with it kept exact; benchmarks/bench_hf.py).
        outliers: number of outlier key channels handled apart (passed to the quantizer).
        seed: seeds rotations / sketches (each layer derives its own from it).
        key_precondition / value_precondition: "none", "center" or "scale": per-(layer, head)
            channel transform fitted on the first compressed tokens (TurboQuant methods).
    """

    def __init__(
        self,
        config_or_model,
        method: str = "turboquant",
        key_bits: int = 4,
        value_bits: int | None = None,
        *,
        key_mode: str = "mse",
        residual: int = 128,
        block_size: int | None = None,
        sink: int = 1,
        outliers: int = 0,
        seed: int = 0,
        key_precondition: str = "scale",
        value_precondition: str = "none",
    ):
        model = None
        config = config_or_model
        if hasattr(config_or_model, "config") and isinstance(config_or_model, torch.nn.Module):
            model, config = config_or_model, config_or_model.config
        self.spec = build_spec(
            config,
            method=method,
            key_bits=key_bits,
            value_bits=value_bits,
            key_mode=key_mode,
            residual=residual,
            block_size=block_size,
            sink=sink,
            outliers=outliers,
            seed=seed,
            key_precondition=key_precondition,
            value_precondition=value_precondition,
        )
        layers = [CompressedLayer(self.spec, i) for i in range(self.spec.num_layers)]
        super().__init__(layers=layers)
        if model is not None:
            from kvcodec.hf.attention import enable

            enable(model)

    def nbytes(self) -> int:
        """Bytes actually held: compressed blocks, full-precision sink and window, side data."""
        return sum(layer.memory()["total"] for layer in self.layers)

    def memory_report(self) -> list[dict]:
        """Per-layer bytes by part (sink, window, compressed keys/values, side data) and tokens."""
        return [{"layer": i, **layer.memory()} for i, layer in enumerate(self.layers)]

    def save(self, path) -> None:
        """Write the cache (compressed as held) to ``path``; reload with :meth:`load`."""
        from kvcodec.hf.persist import save_cache

        save_cache(self, path)

    @classmethod
    def load(cls, path, config_or_model, device: str | torch.device = "cpu") -> "CompressedCache":
        """Read a cache written by :meth:`save`; ``config_or_model`` must match the saving model."""
        from kvcodec.hf.persist import load_cache

        return load_cache(cls, path, config_or_model, device=device)


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        log.warning(
            "CompressedCache is used without kvcodec attention: every step dequantizes the whole cache. "
            "Pass the model to CompressedCache(model, ...) or call kvcodec.hf.enable(model)."
        )
