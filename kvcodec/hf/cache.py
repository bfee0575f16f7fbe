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

import torch
from transformers.cache_utils import Cache

from kvcodec.hf.attention import AttentionOptions, enable
from kvcodec.hf.layer import CompressedLayer
from kvcodec.hf.methods import build_spec
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES


_STATIC_MODE: list = []  # the static cache class, registered by kvcodec.hf.static_cache at package import


def register_static_mode(cls) -> None:
    """Called once by ``kvcodec.hf.static_cache``: the class ``max_cache_len=`` builds (kept apart so
    this module does not import the static cache, which builds on it)."""
    _STATIC_MODE[:] = [cls]


def _static_mode():
    return _STATIC_MODE[0]  # registered when the package kvcodec.hf is imported (its __init__)


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
        attention: :class:`~kvcodec.hf.attention.AttentionOptions` (fused kernel on/off, chunk sizes);
            default: the fused kernel on CUDA where it applies.
        preset: "2.5bit", "3bit" or "3.5bit" (kvcodec.hf.presets): per-layer TurboQuant widths
            whose true bits per value are what the name says; it sets method, key_bits, value_bits,
            key_mode, sink, outliers and the preconditioning (residual, block_size, seed stay yours).
            key_bits / value_bits may also be lists with one width per layer.
        calibration: name of fitted quantizer statistics (kvcodec.hf.fitted: query-aware key scales,
            codebooks fitted to real K/V; opt-in: on SmolLM2 they did not beat the presets, docs/quality.md).
    """

    def __new__(cls, *args, max_cache_len: int | None = None, **kwargs):
        """``max_cache_len=N`` gives the static, graph-capturable mode (kvcodec.hf.static_cache)."""
        if max_cache_len is None:
            return super().__new__(cls)
        return _static_mode()(*args, max_cache_len=max_cache_len, **kwargs)

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
        max_cache_len: None = None,  # not None: __new__ returned a StaticCompressedCache instead
    ):
        model = None
        config = config_or_model
        if hasattr(config_or_model, "config") and isinstance(config_or_model, torch.nn.Module):
            model, config = config_or_model, config_or_model.config
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
        layers = [CompressedLayer(self.spec, i, self.attention_options) for i in range(self.spec.num_layers)]
        super().__init__(layers=layers)
        if model is not None:
            enable(model)

    def nbytes(self) -> int:
        """Bytes actually held: compressed blocks, full-precision sink and window, side data."""
        return sum(layer.memory()["total"] for layer in self.layers)

    def memory_report(self) -> list[dict]:
        """Per-layer bytes by part (sink, window, compressed keys/values, side data) and tokens."""
        return [{"layer": i, **layer.memory()} for i, layer in enumerate(self.layers)]

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
