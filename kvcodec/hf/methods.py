"""Cache configuration: validate the user's choices once, at construction, and build per-layer encodings.

Every bad argument (unknown method, bits out of range, a head dim a quantizer cannot take) raises
``ValueError`` here, before any token is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvcodec.hf.encodings import ExactEncoding, LosslessEncoding
from kvcodec.hf.quant_encodings import make_quant_encodings

QUANT_METHODS = ("turboquant", "qjl", "kivi")
METHODS = QUANT_METHODS + ("lossless", "none")
KEY_MODES = ("mse", "prod")
PRECONDITIONS = ("none", "center", "scale")
MIN_BITS, MAX_BITS = 1, 8


@dataclass
class CacheSpec:
    """Everything needed to rebuild a cache's encodings (saved alongside a persisted cache)."""

    method: str
    key_bits: int | tuple[int, ...]  # one width for every layer, or one per layer (kvcodec.hf.presets)
    value_bits: int | tuple[int, ...]
    key_mode: str
    residual: int
    block_size: int
    sink: int
    outliers: int
    seed: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    key_precondition: str = "scale"
    value_precondition: str = "none"
    kivi_group: int | None = None
    calibration: str | None = None  # name of fitted query scales / codebooks (kvcodec.hf.fitted)
    value_head_dim: int | None = None  # None: head_dim (MLA models give values another head dim)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def options(self) -> dict:
        """The constructor arguments that reproduce this spec (for save/load)."""
        return {
            "method": self.method,
            "key_bits": _plain(self.key_bits),
            "value_bits": _plain(self.value_bits),
            "key_mode": self.key_mode,
            "residual": self.residual,
            "block_size": self.block_size,
            "sink": self.sink,
            "outliers": self.outliers,
            "seed": self.seed,
            "key_precondition": self.key_precondition,
            "value_precondition": self.value_precondition,
            **({"calibration": self.calibration} if self.calibration else {}),
        }

    def make_encodings(self, layer_idx: int, key_dim: int | None = None, value_dim: int | None = None):
        """(key encoding, value encoding) for one layer; quantizers get a per-layer seed. ``key_dim`` /
        ``value_dim``: the head dims the layer really caches, when they differ from the config's (MLA
        latents, per-layer head dims)."""
        if self.method == "none":
            return ExactEncoding(), ExactEncoding()
        if self.method == "lossless":
            return LosslessEncoding(), LosslessEncoding()
        spec = self
        if key_dim is not None and (key_dim, value_dim) != (self.head_dim, self.value_dim):
            spec = replace(spec, head_dim=key_dim, value_head_dim=None if value_dim == key_dim else value_dim)
        if isinstance(self.key_bits, tuple) or isinstance(self.value_bits, tuple):  # per-layer widths
            return make_quant_encodings(replace(spec, key_bits=_at(self.key_bits, layer_idx),
                                                value_bits=_at(self.value_bits, layer_idx)), layer_idx)
        return make_quant_encodings(spec, layer_idx)


def _at(bits, layer_idx: int) -> int:
    return bits[layer_idx] if isinstance(bits, tuple) else bits


def _plain(bits):
    return list(bits) if isinstance(bits, tuple) else bits


def _bits_arg(name: str, value, n_layers: int):
    """An int, or a list/tuple of one int per layer (returned as a tuple)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_layers:
            raise ValueError(f"{name} lists {len(value)} widths, the model has {n_layers} layers")
        return tuple(_int_arg(f"{name}[{i}]", b, MIN_BITS, MAX_BITS) for i, b in enumerate(value))
    return _int_arg(name, value, MIN_BITS, MAX_BITS)


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, key head dim) of a decoder config; ValueError for configs that
    describe no attention (pure state-space models)."""
    config = _text_config(config)
    try:
        n_layers = int(config.num_hidden_layers)
        n_heads = int(config.num_attention_heads)
        n_kv = int(_attr(config, "num_key_value_heads") or n_heads)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"{type(config).__name__} describes no attention K/V to cache ({exc}); "
                         "kvcodec compresses attention caches only") from exc
    if n_heads % n_kv:
        raise ValueError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    return n_layers, n_kv, head_dims(config)[0]


def head_dims(config) -> tuple[int, int]:
    """(key head dim, value head dim): MLA configs (DeepSeek-V2/V3, Kimi-K2) cache keys of
    ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim``; their ``head_dim`` is the
    rope part only."""
    config = _text_config(config)
    nope, rope = _attr(config, "qk_nope_head_dim"), _attr(config, "qk_rope_head_dim")
    if nope is not None and rope is not None:
        key = int(nope) + int(rope)
    else:
        key = int(_attr(config, "head_dim") or config.hidden_size // config.num_attention_heads)
    value = _attr(config, "v_head_dim")
    return key, int(value) if value else key


def _attr(config, name: str):
    """A config attribute, or the first layer's where the config holds it per layer (Gemma 3n / 4:
    reading the global value raises). Layers may differ: the cache takes each layer's dims from the
    tensors it receives; this value only checks the arguments early."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' per-layer attribute guard
        layers = getattr(config, "per_layer_config", None)
        return getattr(layers[0], name, None) if layers else None


def build_spec(config, *, method, key_bits, value_bits, key_mode, residual, block_size, sink, outliers, seed,
               key_precondition="scale", value_precondition="none", calibration=None) -> CacheSpec:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if key_mode not in KEY_MODES:
        raise ValueError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
    for name, value in (("key_precondition", key_precondition), ("value_precondition", value_precondition)):
        if value not in PRECONDITIONS:
            raise ValueError(f"{name} must be one of {PRECONDITIONS}, got {value!r}")
    value_bits = key_bits if value_bits is None else value_bits
    n_layers, n_kv, head_dim = model_shape(config)
    key_bits = _bits_arg("key_bits", key_bits, n_layers)
    value_bits = _bits_arg("value_bits", value_bits, n_layers)
    residual = _int_arg("residual", residual, 0)
    sink = _int_arg("sink", sink, 0)
    outliers = _int_arg("outliers", outliers, 0)
    seed = _int_arg("seed", seed, 0)
    group = 32 if method == "kivi" else 1  # KIVI keys are quantized in groups of 32 tokens
    if block_size is None:
        block_size = -(-residual // group) * group if residual > 0 else 64
    block_size = _int_arg("block_size", block_size, 1)
    if block_size % group:
        raise ValueError(f"block_size must be a multiple of {group} for method {method!r}, got {block_size}")
    if calibration is not None and (not isinstance(calibration, str) or method not in QUANT_METHODS):
        raise ValueError(f"calibration must be the name of a fit (kvcodec.hf.fitted) for a quantizing method, got {calibration!r}")
    if outliers >= min(head_dim, head_dims(config)[1]):
        raise ValueError(f"outliers must be < head_dim ({min(head_dim, head_dims(config)[1])}), got {outliers}")
    value_dim = head_dims(config)[1]
    spec = CacheSpec(method, key_bits, value_bits, key_mode, residual, block_size, sink, outliers, seed,
                     n_layers, n_kv, head_dim, key_precondition, value_precondition, calibration=calibration or None,
                     value_head_dim=None if value_dim == head_dim else value_dim)
    if method in QUANT_METHODS:
        for layer in range(n_layers if isinstance(key_bits, tuple) or isinstance(value_bits, tuple) else 1):
            spec.make_encodings(layer)  # surfaces the quantizer's own ValueError (e.g. head_dim it cannot rotate) now
    return spec
