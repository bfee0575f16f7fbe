"""Per-layer bit allocation: measure what each layer's keys and values cost, spend bits where they buy most.

Why: on SmolLM2 the perplexity cost of quantizing K/V is concentrated in a few layers (and keys
cost more than values), so a uniform 3 bits wastes bits on layers that do not need them and
starves the ones that do. The calibration pass measures, for every (layer, keys|values, bits),
the KL divergence of the model's next-token distribution from the exact one when *only that part*
is quantized ("fake quantization": the prefix K/V of that layer go through the same encoding the cache
builds, ``encode`` then ``decode``, with the sink and the recent window kept exact as the cache
keeps them). :func:`allocate` then picks per-part bit widths greedily by KL saved per bit until
the budget of true bits per value (codes, norms, side data, sink) is spent.

The result is plain per-layer ``key_bits`` / ``value_bits`` lists, which ``CompressedCache``
accepts and saves with the cache (``kvcodec.hf.presets`` ships them for known models).
"""

from __future__ import annotations

import math

import torch

DEFAULT_LEVELS = (2, 3, 4)


def _dynamic_cache(config, layers_kv):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers_kv):
        cache.update(k, v, i)
    return cache


def _roundtrip(spec_for_bits, layer: int, part: int, x: torch.Tensor, sink: int, residual: int) -> torch.Tensor:
    """x [B, H, T, D] with tokens [sink, T - residual) replaced by the cache encoding's encode -> decode."""
    encodings = spec_for_bits.make_encodings(layer)
    enc = encodings[part]
    a, b = sink, x.shape[-2] - residual
    if b <= a:
        return x
    mid = enc.decode(enc.encode(x[..., a:b, :])).to(x.dtype)
    return torch.cat([x[..., :a, :], mid, x[..., b:, :]], dim=-2)


@torch.no_grad()
def layer_sensitivity(model, ids: torch.Tensor, *, prefix: int, levels=DEFAULT_LEVELS, sink: int = 1,
                      residual: int = 128, configs_per_forward: int = 8, spec_options: dict | None = None,
                      progress=None) -> dict:
    """KL(exact || quantized) summed over the scored tokens, per (part, layer, bits).

    ids [B, prefix + E]: the prefix is prefilled exactly; the next E tokens are scored in one
    forward against the prefix K/V in which one layer's keys or values were quantized.
    Returns ``{"key": [[kl per level] per layer], "value": [...], "levels": levels, "tokens": B*E}``.
    """
    from kvcodec.hf.methods import build_spec

    opts = {"method": "turboquant", "key_mode": "mse", "residual": residual, "block_size": None, "sink": sink,
            "outliers": 0, "seed": 0, "key_precondition": "scale", "value_precondition": "none"}
    opts.update(spec_options or {})
    config = model.config
    n_layers = config.num_hidden_layers
    B, E = ids.shape[0], ids.shape[1] - prefix
    base = _dynamic_cache(config, [])
    out = model(ids[:, :prefix], past_key_values=base, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in base.layers]
    ref = model(ids[:, prefix:], past_key_values=_dynamic_cache(config, kv), use_cache=True).logits.float()
    ref_logp = torch.log_softmax(ref, dim=-1)
    specs = {b: build_spec(config, key_bits=b, value_bits=b, **opts) for b in levels}
    jobs = [(part, layer, b) for part in (0, 1) for layer in range(n_layers) for b in levels]
    kl = {}
    for j0 in range(0, len(jobs), configs_per_forward):
        group = jobs[j0:j0 + configs_per_forward]
        rows = []
        for part, layer, b in group:
            mod = [list(p) for p in kv]
            mod[layer][part] = _roundtrip(specs[b], layer, part, kv[layer][part], sink, residual)
            rows.append(mod)
        batched = [tuple(torch.cat([r[i][p] for r in rows], dim=0) for p in (0, 1)) for i in range(n_layers)]
        logits = model(ids[:, prefix:].repeat(len(group), 1), past_key_values=_dynamic_cache(config, batched),
                       use_cache=True).logits.float()
        logp = torch.log_softmax(logits, dim=-1).view(len(group), B, E, -1)
        div = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [G, B, E]
        for g, job in enumerate(group):
            kl[job] = float(div[g].sum())
        if progress:
            progress(j0 + len(group), len(jobs))
    del out
    return {
        "key": [[kl[(0, layer, b)] for b in levels] for layer in range(n_layers)],
        "value": [[kl[(1, layer, b)] for b in levels] for layer in range(n_layers)],
        "levels": list(levels), "tokens": B * E,
    }


def allocate(sensitivity: dict, budget_bits: float, bits_per_level) -> tuple[list[int], list[int]]:
    """Greedy allocation: start every part at the lowest level, then repeatedly raise the part whose
    next level saves the most KL per extra true bit, while the mean true bits stay within budget.

    bits_per_level(part, bits) -> true bits per value of one layer's keys (part 0) or values (1) at
    that width (codes + norms + side data + amortised sink), so the budget is in true bits.
    """
    levels = sensitivity["levels"]
    parts = [sensitivity["key"], sensitivity["value"]]
    n = len(parts[0])
    choice = [[0] * n, [0] * n]
    total = sum(bits_per_level(p, levels[0]) for p in (0, 1) for _ in range(n))
    limit = budget_bits * 2 * n
    if total > limit + 1e-9:
        raise ValueError(f"budget {budget_bits} bits/value is below the lowest level ({total / (2 * n):.3f})")
    while True:
        best = None
        for p in (0, 1):
            for layer in range(n):
                i = choice[p][layer]
                for j in range(i + 1, len(levels)):  # allow skipping a level (non-convex gains)
                    cost = bits_per_level(p, levels[j]) - bits_per_level(p, levels[i])
                    if total + cost > limit + 1e-9:
                        continue
                    gain = (parts[p][layer][i] - parts[p][layer][j]) / cost
                    if best is None or gain > best[0]:
                        best = (gain, p, layer, j, cost)
        if best is None or best[0] <= 0:
            break
        _, p, layer, j, cost = best
        choice[p][layer] = j
        total += cost
    return [levels[i] for i in choice[0]], [levels[i] for i in choice[1]]


def predicted_kl(sensitivity: dict, key_bits, value_bits) -> float:
    """Sum of the per-part KLs of an allocation (additive model used by :func:`allocate`)."""
    lv = sensitivity["levels"]
    return sum(sensitivity["key"][i][lv.index(b)] for i, b in enumerate(key_bits)) + sum(
        sensitivity["value"][i][lv.index(b)] for i, b in enumerate(value_bits))


def mean_bits(values) -> float:
    values = list(values)
    return math.fsum(values) / len(values)


def smollm2_sensitivity(progress=print) -> dict:
    """The calibration pass behind kvcodec.hf.presets.CALIBRATED: SmolLM2-135M bf16, two 576-token
    segments of ``real_text("mixed")`` (the project's own tuning text, never the benchmark's held-out
    texts), prefix 512, 64 scored tokens each (about 30-40 minutes on 2 busy CPU cores)."""
    from kvcodec import smollm2

    model = smollm2.load_model(torch.bfloat16)
    ids = smollm2.load_tokenizer()(smollm2.real_text("mixed"), return_tensors="pt").input_ids[0]
    segments = torch.stack([ids[:576], ids[4000:4576]])
    return layer_sensitivity(model, segments, prefix=512, levels=DEFAULT_LEVELS, configs_per_forward=6,
                             progress=lambda a, b: progress(f"{a}/{b}"))


if __name__ == "__main__":  # python -m kvcodec.hf.calibrate: print the SmolLM2 preset allocations
    import json

    from kvcodec.hf.presets import PRESETS, allocation_for

    sens = smollm2_sensitivity()
    print(json.dumps(sens))
    for name, budget in PRESETS.items():
        kb, vb = allocation_for(budget, sens, 64)
        print(f'"{name}": ({tuple(kb)}, {tuple(vb)}),  # predicted KL {predicted_kl(sens, kb, vb):.3f}')
