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

from kvcodec.cache_argument import cache_kwargs

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
    out = model(ids[:, :prefix], **cache_kwargs(model, base), use_cache=True)
    kv = [(layer.keys, layer.values) for layer in base.layers]
    ref = model(ids[:, prefix:], **cache_kwargs(model, _dynamic_cache(config, kv)), use_cache=True).logits.float()
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
        logits = model(ids[:, prefix:].repeat(len(group), 1), **cache_kwargs(model, _dynamic_cache(config, batched)),
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


CAPTURE = "kvcodec_capture_queries"


@torch.no_grad()
def capture_prefill(model, ids: torch.Tensor):
    """Exact prefill of ids [B, T]: per-layer (keys, values) [B, H_kv, T, D] (post-RoPE, as a cache
    receives them) and the query RMS per (layer, KV head, channel) [L, H_kv, D], post-RoPE, the query
    heads of a GQA group pooled (HF layout: query head h reads KV head h // group)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    rms = {}

    def capture(module, query, key, value, attention_mask, **kw):
        b, hq, t, d = query.shape
        q = query.float().reshape(b, key.shape[1], (hq // key.shape[1]) * t, d)
        rms[module.layer_idx] = q.pow(2).mean(dim=(0, 2)).sqrt()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(CAPTURE, capture)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE, sdpa_mask)
    old = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        cache = _dynamic_cache(model.config, [])
        model(ids, **cache_kwargs(model, cache), use_cache=True)
    finally:
        model.set_attn_implementation(old)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return kv, torch.stack([rms[i] for i in range(len(kv))])


def rotated_coordinates(quantizer, x: torch.Tensor, pre) -> tuple[torch.Tensor, torch.Tensor]:
    """What a TurboQuantMSE codebook quantizes: the preconditioned, normalized, rotated coordinates
    y [N, D] of x [..., T, D], and each vector's squared norm [N, 1] (its weight in the error)."""
    xp = pre.apply(x.float()).reshape(-1, x.shape[-1])
    n2 = xp.pow(2).sum(-1, keepdim=True)
    keep = n2[:, 0] > 0
    y = (xp[keep] / n2[keep].sqrt()) @ quantizer.rotation.T
    return y, n2[keep]


@torch.no_grad()
def fit_statistics(model, ids: torch.Tensor, *, levels=DEFAULT_LEVELS, sink: int = 1, query_scales: bool = True,
                   spec_options: dict | None = None):
    """A :class:`kvcodec.hf.fitted.Fit` from the model's own text ids [B, T]: query RMS per (layer, KV
    head, channel), and Lloyd-Max codebooks per (keys|values, bits) fitted to the coordinates the
    cache's TurboQuant-MSE quantizers see (preconditioned as the cache does, query-aware for keys when
    ``query_scales``), each vector weighted by its squared norm."""
    import numpy as np

    from kvcodec.hf.fitted import Fit
    from kvcodec.hf.methods import build_spec
    from kvcodec.hf.quant_encodings import make_quantizers
    from kvcodec.quant.codebooks import fit_codebook, lloyd_max_codebook

    opts = {"method": "turboquant", "key_mode": "mse", "residual": 0, "block_size": None, "sink": sink,
            "outliers": 0, "seed": 0, "key_precondition": "scale", "value_precondition": "none"}
    opts.update(spec_options or {})
    kv, qrms = capture_prefill(model, ids)
    spec = build_spec(model.config, key_bits=levels[0], value_bits=levels[0], **opts)
    samples = {"key": [], "value": []}
    for layer, (k, v) in enumerate(kv):
        kq, vq = make_quantizers(spec, layer)
        k, v = k[..., sink:, :], v[..., sink:, :]
        queries = qrms[layer][:, None, :].expand(*k.shape[:-2], 1, k.shape[-1]) if query_scales else None
        samples["key"].append(rotated_coordinates(kq, k, kq.calibrate(k, queries=queries)))
        samples["value"].append(rotated_coordinates(vq, v, vq.calibrate(v)))
    codebooks = {}
    for part, rows in samples.items():
        y = torch.cat([r[0] for r in rows]).double().numpy()
        w = np.broadcast_to(torch.cat([r[1] for r in rows]).double().numpy(), y.shape)
        codebooks[part] = {b: torch.from_numpy(fit_codebook(y, b, weights=w, init=lloyd_max_codebook(y.shape[1], b))
                                               .astype(np.float32)) for b in levels}
    return Fit(qrms if query_scales else None, codebooks)
