"""Distortion weights measured on the model: what a unit of squared error in each layer's keys or
values costs in next-token KL, so the bit allocation optimises the model's loss, not raw MSE.

Why: on SmolLM2 the cost of K/V error is far from uniform (docs/quality.md: keys cost more than
values and a few layers' keys dominate). ``measure`` stores a calibration prefix with the
transform at a low rate, then puts the reconstruction of *one* (layer, K/V) part at a time back
into an otherwise exact cache and scores the next tokens: weight = KL(exact || perturbed) summed
over the scored tokens / the part's squared error (in the calibration's channel metric). With the
weights folded into the metric (``fit(..., weights=)``), one quantizer step is the
rate-distortion optimum of the additive model "KL = sum of weight x squared error".

``fit_model`` is the whole per-model calibration: prefill calibration text, record queries (key
metric), fit, measure, refit with the measured weights.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.cache_argument import cache_kwargs, output_cache
from kvcodec.transform.calibration import Calibration, fit, query_key_scales
from kvcodec.transform.codec import decode, encode
from kvcodec.transform.rope import RoPE

WEIGHT_FLOOR = 0.05  # relative to the median: a part measured near zero (noise) still gets coded


def _cache(config, keys: torch.Tensor, values: torch.Tensor):
    """A DynamicCache of batch B from keys/values [B, L, H, T, D]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i in range(keys.shape[1]):
        cache.update(keys[:, i], values[:, i], i)
    return cache


@torch.no_grad()
def _prefix_kv(model, ids: torch.Tensor):
    from kvcodec.transform.hf import cache_tensors

    out = model(ids, use_cache=True)
    return cache_tensors(output_cache(out))


@torch.no_grad()
def measure(model, ids: torch.Tensor, calib: Calibration, *, prefix: int, distortion: float = 0.1, sinks: int = 4,
            window: int = 128, batch: int = 6) -> dict:
    """KL and squared error of every (layer, K/V) part of one calibration sequence.

    ids [1, prefix + E]: the prefix is prefilled exactly, stored with ``calib`` (sinks
    and window exact), and the next E tokens are scored once per part with only that part
    reconstructed. ``distortion``: the relative squared error of the stored prefix (0.1:
    about what 1.5 bits per value give on SmolLM2). Returns ``{"kl": [L, 2], "sq_error": [L, 2], "tokens": E}`` (float64 numpy).
    A float32 model keeps the bf16 forward's noise (~0.1 KL per 100 tokens) out of the measurement.
    """
    if ids.ndim != 2 or ids.shape[0] != 1 or not 0 < prefix < ids.shape[1]:
        raise ValueError("ids must be [1, prefix + scored tokens] with at least one scored token")
    keys, values = _prefix_kv(model, ids[:, :prefix])
    hat = decode(encode(keys, values, calib, distortion=distortion, sinks=sinks, window=window), calib)
    exact = (keys, values)
    scored = ids[:, prefix:]
    ref = torch.log_softmax(model(scored, **cache_kwargs(model, _cache(model.config, keys[None], values[None])),
                                  use_cache=True).logits.double(), dim=-1)
    L = keys.shape[0]
    scales = torch.from_numpy(calib.scales).double()  # [L, 2, H, D]
    sq = np.zeros((L, 2))
    for kind in (0, 1):
        err = (hat[kind].double() - exact[kind].double()) * scales[:, kind, :, None, :]
        sq[:, kind] = err.pow(2).sum(dim=(1, 2, 3)).numpy()
    jobs = [(layer, kind) for layer in range(L) for kind in (0, 1)]
    kl = np.zeros((L, 2))
    for j0 in range(0, len(jobs), batch):
        group = jobs[j0:j0 + batch]
        parts = [torch.stack([t.clone() for t in exact]) for _ in group]  # [2, L, H, T, D] each
        for p, (layer, kind) in zip(parts, group):
            p[kind, layer] = hat[kind][layer].to(p.dtype)
        kv = torch.stack(parts, dim=1)  # [2, B, L, H, T, D]
        logits = model(scored.repeat(len(group), 1), **cache_kwargs(model, _cache(model.config, kv[0], kv[1])),
                       use_cache=True).logits.double()
        logp = torch.log_softmax(logits, dim=-1)
        div = (ref.exp() * (ref - logp)).sum(-1).sum(-1)  # [B]
        for b, (layer, kind) in enumerate(group):
            kl[layer, kind] = float(div[b])
    return {"kl": kl, "sq_error": sq, "tokens": int(scored.shape[1])}


def weights_from(measurements: list[dict]) -> np.ndarray:
    """Distortion weights [L, 2]: KL per unit squared error, pooled over sequences, floored at
    WEIGHT_FLOOR x the median and normalised to mean 1."""
    kl = sum(m["kl"] for m in measurements)
    sq = sum(m["sq_error"] for m in measurements)
    w = np.clip(kl, 0, None) / np.maximum(sq, 1e-30)
    w = np.maximum(w, WEIGHT_FLOOR * np.median(w))
    return w / w.mean()


@torch.no_grad()
def fit_model(model, sequences, *, layers_per_group: int = 5, joint_kv: bool = True, scored: int = 128,
              distortion: float = 0.1, query_weighted: bool = True, sinks: int = 4, window: int = 128,
              progress=None) -> Calibration:
    """The whole calibration of a Hugging Face model from calibration token ids (a list of [1, T]
    tensors, a few thousand tokens in all): K/V of every sequence -> ``fit`` (relative weights,
    keys weighted by the queries of the first sequence) -> ``measure`` on the last ``scored``
    tokens of each sequence (stored prefix = the rest) -> ``fit`` again with the measured weights.
    """
    from kvcodec.recording import record_qkv

    rope = RoPE.from_model(model)
    ks, vs = [], []
    for ids in sequences:
        k, v = _prefix_kv(model, ids)
        ks.append(k.float())
        vs.append(v.float())
    opts = {"layers_per_group": layers_per_group, "joint_kv": joint_kv}
    if query_weighted:
        rec = record_qkv(model, sequences[0])
        q = torch.stack([rec["q"][i][0] for i in sorted(rec["q"])]).float()
        opts["key_scales"] = query_key_scales(q, ks[0].shape[1])
    first = fit(ks, vs, rope, **opts)
    found = []
    for i, ids in enumerate(sequences):
        found.append(measure(model, ids, first, prefix=ids.shape[1] - scored, distortion=distortion, sinks=sinks,
                             window=window))
        if progress:
            progress(i + 1, len(sequences))
    return fit(ks, vs, rope, weights=weights_from(found), **opts)
