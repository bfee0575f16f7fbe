"""Cache configuration: validate the user's choices once, at construction, and build per-layer encodings.

Every bad argument (unknown method, bits out of range, head_dim a quantizer cannot take,
sliding-window layers) raises ``ValueError`` here, before any token is seen.
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

    def make_encodings(self, layer_idx: int):
        """(key encoding, value encoding) for one layer; quantizers get a per-layer seed."""
        if self.method == "none":
            return ExactEncoding(), ExactEncoding()
        if self.method == "lossless":
            return LosslessEncoding(), LosslessEncoding()
        if isinstance(self.key_bits, tuple) or isinstance(self.value_bits, tuple):  # per-layer widths
            return make_quant_encodings(replace(self, key_bits=_at(self.key_bits, layer_idx),
                                                value_bits=_at(self.value_bits, layer_idx)), layer_idx)
        return make_quant_encodings(self, layer_idx)


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


def model_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config; ValueError for unsupported layouts."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    try:
        n_layers = int(config.num_hidden_layers)
        n_heads = int(config.num_attention_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    except AttributeError as exc:
        raise ValueError(f"config does not describe a decoder-only attention model: {exc}") from exc
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"CompressedCache supports full-attention layers only; this model also has {other}")
    if n_heads % n_kv:
        raise ValueError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    return n_layers, n_kv, int(head_dim)


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
    if outliers >= head_dim:
        raise ValueError(f"outliers must be < head_dim ({head_dim}), got {outliers}")
    spec = CacheSpec(method, key_bits, value_bits, key_mode, residual, block_size, sink, outliers, seed,
                     n_layers, n_kv, head_dim, key_precondition, value_precondition, calibration=calibration or None)
    if method in QUANT_METHODS:
        for layer in range(n_layers if isinstance(key_bits, tuple) or isinstance(value_bits, tuple) else 1):
            spec.make_encodings(layer)  # surfaces the quantizer's own ValueError (e.g. head_dim it cannot rotate) now
    return spec
