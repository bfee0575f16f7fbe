"""CompressedCache: a ``transformers.Cache`` whose layers hold compressed K/V bytes.

Usage, one line once the model is enabled::

    cache = CompressedCache(model, method="turboquant", key_bits=4, value_bits=3)
    model.generate(ids, cache=cache)  # past_key_values=cache before transformers 5.24

Passing the model (not only its config) lets forwards that receive this cache attend on its
compressed form (``kvcodec.hf.binding``: the model itself is left as it was). Built from a config
alone, the cache still works with any attention implementation, but ``update`` has to return
dequantized K/V for the whole history every step (slow, like HF's QuantizedCache): kvcodec warns once.

Every layer kind transformers' own ``DynamicCache`` builds for the model is kept: full-attention
layers are compressed; sliding-window and chunked layers are compressed when their window is longer
than ``residual + 2 * block_size`` (else transformers' exact window layer is smaller); linear-attention,
SSM and conv states pass through untouched. A model with no attention K/V is refused when the cache
is built.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvcodec.hf.attention import AttentionOptions, enable
from kvcodec.hf.layer import CompressedLayer, SlidingCompressedLayer, hybrid_layer
from kvcodec.hf.methods import _text_config, build_spec
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES


_STATIC_MODE: list = []  # the static cache class, registered by kvcodec.hf.static_cache at package import


def register_static_mode(cls) -> None:
    """Called once by ``kvcodec.hf.static_cache``: the class ``max_cache_len=`` builds (kept apart so
    this module does not import the static cache, which builds on it)."""
    _STATIC_MODE[:] = [cls]


def _static_mode():
    return _STATIC_MODE[0]  # registered when the package kvcodec.hf is imported (its __init__)


def _on_cuda_with_kernels(model) -> bool:
    """A model whose weights are on a CUDA device, with kvcodec's CUDA kernels usable."""
    if not isinstance(model, torch.nn.Module):
        return False
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cuda":
        return False
    from kvcodec.device import is_available

    return is_available()


def exact_memory(layer) -> dict:
    """Bytes of the tensors an uncompressed (transformers) cache layer holds."""
    total = 0
    for value in vars(layer).values():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    seq = layer.get_seq_length() if hasattr(layer, "get_seq_length") else 0
    return {"tokens": int(seq), "exact": total, "total": total}


class KvcodecCache(Cache):
    """What every kvcodec cache shares with the binding (``kvcodec.hf.binding``): the attention
    implementation its forwards switch to, and the hand-off of new tokens to it."""

    attention_name = "kvcodec"
    binds = True  # False: a cache built from a config alone, which any attention reads decoded

    def compressed_layers(self) -> list:
        return [layer for layer in self.layers if getattr(layer, "compressed", False)]

    def bind(self, on: bool, decoded: bool = False) -> None:
        """Called at the start (True) and end (False) of a forward that received this cache. ``decoded``:
        the model does not attend through the attention interface, so its layers return the history
        decoded (kvcodec.hf.binding)."""
        for layer in self.compressed_layers():
            layer.bound = on
            layer.handed = (None, None)
            if decoded:
                layer.decoded = True

    def before_forward(self, args: tuple, kwargs: dict) -> None:
        """Called by the binding's pre-hook with the arguments of a forward this cache is bound to
        (the static cache reads the prompt's padding from its attention mask here)."""

    def check_attended(self, completed: bool = True) -> None:
        """After a bound forward: every compressed layer's new tokens were attended by kvcodec. A layer
        whose model reads something else than what ``update`` returned (transformers' MLA expands its
        latent cache after ``update``; a few modules bypass the attention interface) is switched to
        returning the whole history decoded; that is only safe to find out on the cache's first forward,
        where the new tokens are the whole history: later, refuse loudly (the forward saw too little)."""
        missed = []
        for layer in self.compressed_layers():
            pending = getattr(layer, "pending", 0)
            if not pending:
                continue
            if not layer.handed_whole:
                missed.append(layer.layer_idx)
            layer.decoded = True
            layer.finish_step()
        if missed and completed:
            raise RuntimeError(f"layers {missed} of this model did not attend through kvcodec on a cache that "
                               "already held tokens, so this forward saw only its new tokens; start from a fresh "
                               "cache (the first forward finds such layers) or build the cache from the config")


def check_model(model) -> None:
    """Refuse, when the cache is built, a model that runs only on a cache class of its own (MiniMax's
    linear attention, xLSTM, RWKV: transformers' ``_supports_default_dynamic_cache`` says so): a
    ``Cache`` of kvcodec's cannot stand in for it."""
    probe = getattr(type(model), "_supports_default_dynamic_cache", None)
    if probe is not None and not probe():
        raise ValueError(f"{type(model).__name__} keeps its state in a cache class of its own, which a kvcodec "
                         "cache cannot stand in for")


def cache_layers(config, make_compressed) -> list:
    """The layers transformers' ``DynamicCache`` builds for ``config``, each attention K/V one replaced by
    ``make_compressed(layer_idx, sliding_window)`` (``sliding_window`` None for full attention); the
    others (linear-attention, SSM, conv states, shared-KV placeholders) kept as they are. ValueError when
    the model caches no attention K/V."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    n_layers = int(_text_config(config).num_hidden_layers)
    template = DynamicCache(config=config).layers or [DynamicLayer() for _ in range(n_layers)]
    layers, attention = [], 0
    for i, layer in enumerate(template):
        kind = type(layer).__name__
        if type(layer) is DynamicLayer:
            layer = make_compressed(i, None)
        elif type(layer) is DynamicSlidingWindowLayer:
            layer = make_compressed(i, int(layer.sliding_window)) or layer
        elif kind == "LinearAttentionAndFullAttentionLayer":  # Falcon-H1: an SSM state and K/V in one layer
            layer = make_compressed(i, None, number_of_states=layer.number_of_states) or layer
        else:
            attention -= 1  # linear attention, SSM, conv, shared-KV placeholders
        attention += 1
        layers.append(layer)
    if not attention:
        kinds = sorted({type(layer).__name__ for layer in template})
        raise ValueError(f"{type(_text_config(config)).__name__} caches no attention K/V: kvcodec compresses "
                         f"attention caches only (its cache layers: {', '.join(kinds)})")
    return layers


def make_layer(spec, options):
    """``cache_layers``' factory for the eager cache's layers. A sliding layer is compressed only when its
    window exceeds ``residual + 2 * block_size``: below that it would hold no compressed block for long
    (the exact window plus one block are at least the window), and transformers' exact sliding layer,
    ``sliding_window - 1`` tokens, is the smaller (returns None: the caller keeps transformers' layer)."""
    def make(i: int, sliding_window: int | None, number_of_states: int | None = None):
        if number_of_states is not None:
            return hybrid_layer(spec, i, options, number_of_states)
        if sliding_window is not None and sliding_window <= spec.residual + 2 * spec.block_size:
            return None
        if sliding_window is None:
            return CompressedLayer(spec, i, options)
        return SlidingCompressedLayer(spec, i, options, sliding_window=sliding_window)
    return make


class CompressedCache(KvcodecCache):
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
        attention: :class:`~kvcodec.hf.attention.AttentionOptions` (fused kernel on/off, chunk sizes);
            default: the fused kernel on CUDA where it applies.
        preset: "2.5bit", "3bit" or "3.5bit" (kvcodec.hf.presets): per-layer TurboQuant widths
            whose true bits per value are what the name says; it sets method, key_bits, value_bits,
            key_mode, sink, outliers and the preconditioning (residual, block_size, seed stay yours).
            key_bits / value_bits may also be lists with one width per layer.
        calibration: name of fitted quantizer statistics (kvcodec.hf.fitted: query-aware key scales,
            codebooks fitted to real K/V; opt-in: on SmolLM2 they did not beat the presets, docs/quality.md).
        max_cache_len: "auto" (default): for a model on CUDA with kvcodec's kernels, where the static
            mode holds the model and options (every layer full attention, TurboQuant MSE keys, 1-4
            bits, no outliers), ``CompressedCache(...)`` returns a :class:`~kvcodec.hf.static_cache.StaticCompressedCache`
            that grows in pages, whose decode step ``generate`` compiles and replays from CUDA graphs;
            otherwise this eager cache. N: the static mode with room for N tokens per sequence.
            None: this eager cache.
    """

    def __new__(cls, *args, max_cache_len: int | str | None = "auto", **kwargs):
        """The static, graph-capturable mode (kvcodec.hf.static_cache) for ``max_cache_len=N``, and by
        default (``"auto"``) for a model on CUDA with kvcodec's kernels whose configuration that mode
        holds (then growing in pages); else this eager cache (always for ``max_cache_len=None``)."""
        if max_cache_len is None:
            return super().__new__(cls)
        static = _static_mode()
        if max_cache_len == "auto":
            if not _on_cuda_with_kernels(args[0] if args else kwargs.get("config_or_model")):
                return super().__new__(cls)
            try:
                cache = static(*args, max_cache_len=None, **kwargs)
            except ValueError:  # a model or option the static mode does not hold: the eager cache
                return super().__new__(cls)
            # models with sliding-window layers take the static mode when asked (max_cache_len=N); the
            # default picks it where every layer is compressed, the configuration run on GPUs so far
            return cache if cache.all_compressed else super().__new__(cls)
        return static(*args, max_cache_len=max_cache_len, **kwargs)

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
        attention: AttentionOptions | None = None,
        preset: str | None = None,
        calibration: str | None = None,
        max_cache_len: int | str | None = "auto",  # __new__ chose this eager cache (see there)
    ):
        model = None
        config = config_or_model
        if hasattr(config_or_model, "config") and isinstance(config_or_model, torch.nn.Module):
            model, config = config_or_model, config_or_model.config
            check_model(model)
        if preset is not None:  # a named quality preset sets the quantizer options (kvcodec.hf.presets)
            from kvcodec.hf.presets import preset_options

            p = preset_options(preset, config)
            method, key_bits, value_bits, key_mode, sink, outliers = (
                p[k] for k in ("method", "key_bits", "value_bits", "key_mode", "sink", "outliers"))
            key_precondition, value_precondition = p["key_precondition"], p["value_precondition"]
            calibration = p.get("calibration", calibration)
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
            calibration=calibration,
        )
        self.attention_options = attention or AttentionOptions()
        super().__init__(layers=cache_layers(config, make_layer(self.spec, self.attention_options)))
        self.binds = model is not None
        if model is not None:
            enable(model)

    def nbytes(self) -> int:
        """Bytes actually held: compressed blocks, full-precision sink and window, side data, and the
        uncompressed layers' tensors (sliding windows, linear-attention states)."""
        return sum(row["total"] for row in self.memory_report())

    def memory_report(self) -> list[dict]:
        """Per-layer bytes by part (sink, window, compressed keys/values, side data) and tokens;
        uncompressed layers report their tensors as ``exact``."""
        return [{"layer": i, **(layer.memory() if getattr(layer, "compressed", False) else exact_memory(layer))}
                for i, layer in enumerate(self.layers)]

    def save(self, path, *, transform=None, overwrite: bool = False, **options) -> None:
        """Write the cache (compressed as held) to ``path``; reload with :meth:`load`. ``transform``: a
        ``kvcodec.transform.Calibration``: store it transform-coded instead (lossy, ``options`` as for
        ``kvcodec.transform.encode``, e.g. ``bits=2.0``; reload with ``load(..., transform=)``).
        Written through ``kvcodec.safe_write`` (the old file or the whole new one); an existing
        ``path`` raises kvcodec.WriteRefusedError unless ``overwrite=True``."""
        if transform is not None:
            from kvcodec.transform.hf import save_cache as save_transformed

            save_transformed(self, path, transform, overwrite=overwrite, **options)
            return
        from kvcodec.hf.persist import save_cache

        save_cache(self, path, overwrite=overwrite)

    @classmethod
    def load(cls, path, config_or_model, device: str | torch.device = "cpu",
             max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES, max_cache_len: int | None = None,
             transform=None):
        """Read a cache written by :meth:`save`; ``config_or_model`` must match the saving model.
        ``max_output_bytes`` caps the cache's decoded size (default 4 GiB; ``None``: no cap).
        ``max_cache_len``: load into a static cache (kvcodec.hf.static_cache; needs the model); files of
        static and eager caches are the same format, so either loads as either. ``transform``: the
        calibration of a file saved with ``save(..., transform=)``; its K/V fill a new cache with this
        class's default options (``kvcodec.transform.hf.load_cache(path, calib, cache=...)`` for others)."""
        if transform is not None:
            from kvcodec.transform.hf import load_cache as load_transformed

            return load_transformed(path, transform, cache=cls(config_or_model), device=device,
                                    max_output_bytes=max_output_bytes)
        from kvcodec.hf.persist import load_cache

        if max_cache_len is None:
            return load_cache(cls, path, config_or_model, device=device, max_output_bytes=max_output_bytes)
        return _static_mode().load(path, config_or_model, max_cache_len, device=device,
                                   max_output_bytes=max_output_bytes)
