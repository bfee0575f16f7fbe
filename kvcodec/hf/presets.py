"""Named quality presets for ``CompressedCache`` whose name is their true bits per value.

``CompressedCache(model, preset="3.5bit")`` picks TurboQuant keys and values with a *per-layer*
bit width for each (``key_bits`` / ``value_bits`` lists), chosen so that the true bits per value
(packed codes + fp16 norms + per-head side data + the full-precision sink tokens, amortised over
``REFERENCE_TOKENS`` compressed tokens) stay within the name. The recent full-precision window is
not in the figure (every cache keeps one; it is reported apart as bytes held).

Where the bits go:
* a calibration pass (``kvcodec.hf.calibrate``) measured on SmolLM2-135M what each layer's keys
  and values cost at 2, 3 and 4 bits (KL of the next-token distribution, on the project's own
  ``real_text("mixed")``, never on the held-out benchmark texts); the allocations below are its
  output (``python benchmarks/calibrate_smollm2.py`` in a source checkout reproduces them);
* for any other model shape no calibration is stored: a fixed prior (keys cost twice values, the
  first two and the last layer cost four times the others: boundary layers are where Qwen2-style
  key biases and attention sinks live) goes through the same budgeted allocation. For a better
  allocation, run :func:`calibrated_options` on the model with some of its own text.

Levers measured and left out (docs/quality.md, benchmarks/bench_quality_levers.py): query-aware key
scales and codebooks fitted to real K/V (``calibration=``, kvcodec.hf.fitted) did not lower the KL on
SmolLM2 (the query-aware scales raised it); the paper's outlier split costs bits + 0.5 or more at
head_dim 64; 4 sink tokens instead of 1 bought nothing measurable and break the budget.
"""

from __future__ import annotations

import math

from kvcodec.hf.calibrate import DEFAULT_LEVELS, allocate

REFERENCE_TOKENS = 512  # compressed tokens per sequence the budget is met at (longer contexts: fewer bits)
SINK = 1

PRESETS = {  # name -> true bits per value budget
    "2.5bit": 2.5,
    "3bit": 3.0,
    "3.5bit": 3.5,
}

COMMON = {"method": "turboquant", "key_mode": "mse", "outliers": 0, "sink": SINK,
          "key_precondition": "scale", "value_precondition": "none"}

# Calibrated allocations: model fingerprint -> preset -> (key_bits per layer, value_bits per layer).
# SmolLM2-135M: `python benchmarks/calibrate_smollm2.py` (2 segments of real_text("mixed"), prefix 512, 64 scored
# tokens each; KL summed over the 128 scored tokens). Keys of layers 14-24 cost most at 2 bits (up to 0.9
# vs a ~0.2 floor); values are nearly flat, so they get the fewer bits.
CALIBRATED: dict[str, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "llama-L30-kv3-d64-h576-v49152": {
        "2.5bit": ((2, 2, 2, 2, 2, 3, 2, 2, 3, 2, 2, 2, 2, 2, 3, 2, 2, 3, 4, 2, 3, 3, 2, 3, 3, 2, 2, 2, 2, 2),
                   (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 2, 2, 2, 2, 2, 2)),
        "3bit": ((2, 3, 2, 4, 3, 4, 2, 4, 3, 4, 3, 2, 2, 2, 3, 3, 2, 4, 4, 2, 4, 3, 3, 4, 4, 2, 3, 2, 4, 2),
                 (3, 2, 2, 2, 2, 2, 2, 2, 3, 3, 2, 2, 2, 2, 3, 3, 2, 3, 3, 2, 3, 2, 2, 4, 3, 3, 2, 2, 2, 2)),
        "3.5bit": ((3, 4, 2, 4, 3, 4, 4, 4, 3, 4, 4, 3, 3, 2, 4, 4, 4, 4, 4, 2, 4, 3, 3, 4, 4, 4, 3, 3, 4, 4),
                   (4, 2, 2, 2, 2, 2, 2, 3, 4, 3, 3, 2, 2, 2, 4, 3, 3, 3, 3, 3, 4, 3, 3, 4, 3, 3, 3, 2, 4, 3)),
    },
}


def fingerprint(config) -> str:
    """A model shape key: type, layers, KV heads, head_dim, hidden size, vocabulary."""
    from kvcodec.hf.methods import model_shape

    n_layers, n_kv, head_dim = model_shape(config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return (f"{getattr(text, 'model_type', '?')}-L{n_layers}-kv{n_kv}-d{head_dim}"
            f"-h{getattr(text, 'hidden_size', '?')}-v{getattr(text, 'vocab_size', '?')}")


def part_true_bits(part: int, bits: int, head_dim: int, *, tokens: int = REFERENCE_TOKENS, sink: int = SINK,
                   precondition: str | None = None) -> float:
    """True bits per value of one layer's keys (part 0) or values (part 1) for TurboQuant-MSE at ``bits``:
    packed codes + fp16 norm per vector + fp16 side data per head + the exact sink, over tokens + sink."""
    if precondition is None:
        precondition = COMMON["key_precondition"] if part == 0 else COMMON["value_precondition"]
    code_bits = 8 * math.ceil(head_dim * bits / 8)
    side_bits = {"none": 0, "center": 16 * head_dim, "scale": 32 * head_dim}[precondition]
    per_head = tokens * (code_bits + 16) + side_bits + sink * 16 * head_dim
    return per_head / ((tokens + sink) * head_dim)


def mean_true_bits(key_bits, value_bits, head_dim: int, **kw) -> float:
    """Mean true bits per value of a per-layer allocation (keys and values weigh the same)."""
    parts = [part_true_bits(0, b, head_dim, **kw) for b in key_bits] + [part_true_bits(1, b, head_dim, **kw) for b in value_bits]
    return math.fsum(parts) / len(parts)


def prior_sensitivity(n_layers: int, levels=DEFAULT_LEVELS) -> dict:
    """A model-free stand-in for calibration: error ~ 4^-bits, keys x2, layers 0, 1 and last x4."""
    def cost(layer, weight):
        boost = 4.0 if layer in (0, 1, n_layers - 1) else 1.0
        return [weight * boost * 4.0 ** -b for b in levels]

    return {"key": [cost(i, 2.0) for i in range(n_layers)], "value": [cost(i, 1.0) for i in range(n_layers)],
            "levels": list(levels)}


def allocation_for(budget: float, sensitivity: dict, head_dim: int) -> tuple[list[int], list[int]]:
    return allocate(sensitivity, budget, lambda part, b: part_true_bits(part, b, head_dim))


def preset_options(name: str, config) -> dict:
    """CompressedCache keyword arguments of a named preset for this model (ValueError if unknown)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    from kvcodec.hf.methods import model_shape

    n_layers, _, head_dim = model_shape(config)
    stored = CALIBRATED.get(fingerprint(config), {}).get(name)
    if stored is not None:
        key_bits, value_bits = (list(b) for b in stored)
    else:
        try:
            key_bits, value_bits = allocation_for(PRESETS[name], prior_sensitivity(n_layers), head_dim)
        except ValueError:  # small head_dim: fp16 norms cost more, some parts must go down to 1 bit
            key_bits, value_bits = allocation_for(PRESETS[name], prior_sensitivity(n_layers, (1, *DEFAULT_LEVELS)),
                                                  head_dim)
    return {**COMMON, "key_bits": key_bits, "value_bits": value_bits}


def calibrated_options(model, ids, budget: float, *, prefix: int = 512, **kw) -> dict:
    """Run the calibration pass on ``ids`` [B, prefix + E] (the model's own text) and return
    CompressedCache keyword arguments meeting ``budget`` true bits per value."""
    from kvcodec.hf.calibrate import layer_sensitivity

    sens = layer_sensitivity(model, ids, prefix=prefix, sink=SINK, **kw)
    _, _, head_dim = _shape(model.config)
    key_bits, value_bits = allocation_for(budget, sens, head_dim)
    return {**COMMON, "key_bits": key_bits, "value_bits": value_bits}


def _shape(config):
    from kvcodec.hf.methods import model_shape

    return model_shape(config)
