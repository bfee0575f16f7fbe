"""Attention computed on the compressed cache, plugged into transformers' AttentionInterface.

transformers calls ``fn(module, query, key, value, attention_mask, scaling=..., dropout=...)``
but never passes the cache. A forward pre-hook on every attention module (installed by
:func:`enable`) sees ``past_key_values`` in the module's kwargs, *arms* the module's
:class:`~kvcodec.hf.cache.CompressedLayer` (so its ``update`` returns only the new exact K/V)
and leaves the function a weak reference to it. The function then runs one joint softmax over
``[sink | compressed blocks | full-precision window (which ends with the new tokens)]``:

* exact parts: ``q @ k^T`` in float32;
* compressed blocks: ``codec.scores`` / ``codec.weighted_sum`` on the compressed form, never a
  dense K/V copy;
* online (flash-style) softmax over the parts, chunked over query rows and key tokens so the
  working memory stays bounded; GQA by viewing the queries as [B, H_kv, G*Tq, D].

Prefill (no compressed block yet) and the exact codecs ("none", "lossless") attend with
transformers' own SDPA over the exact/decoded K/V: the prompt is attended at full precision (best
quality) and only then compressed, and the lossless cache reproduces DynamicCache bit for bit.
"""

from __future__ import annotations

import weakref

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "kvcodec"
Q_CHUNK = 128  # query tokens per pass (times the GQA group)
KV_CHUNK = 1024  # exact key tokens per pass
COMPRESSED_CHUNK = 4096  # compressed key tokens per quantizer call
_HOOK_ATTR = "_kvcodec_pre_hook"
_LAYER_ATTR = "_kvcodec_layer"


def register() -> None:
    """Register the attention function and its mask function under ``NAME`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, compressed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # boolean [B, 1, Tq, Tkv] masks, None when causal


def attention_modules(model: torch.nn.Module):
    """The self-attention modules of a decoder (those that receive ``past_key_values``)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            yield name, module


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` to kvcodec attention and hook its attention modules (idempotent)."""
    register()
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    found = 0
    for _, module in attention_modules(model):
        found += 1
        if getattr(module, _HOOK_ATTR, None) is None:
            setattr(module, _HOOK_ATTR, module.register_forward_pre_hook(_arm_layer, with_kwargs=True))
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention modules with k_proj/v_proj and layer_idx")
    return model


def disable(model: torch.nn.Module, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Remove the hooks and restore another attention implementation."""
    for _, module in attention_modules(model):
        handle = getattr(module, _HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
            setattr(module, _HOOK_ATTR, None)
        setattr(module, _LAYER_ATTR, None)
    model.set_attn_implementation(attn_implementation)
    return model


def _arm_layer(module, args, kwargs):
    from kvcodec.hf.cache import CompressedCache

    cache = kwargs.get("past_key_values")
    config = getattr(module, "config", None)
    setattr(module, _LAYER_ATTR, None)
    if isinstance(cache, CompressedCache) and getattr(config, "_attn_implementation", None) == NAME:
        idx = module.layer_idx
        if idx < len(cache.layers):
            layer = cache.layers[idx]
            layer.armed = True
            setattr(module, _LAYER_ATTR, weakref.ref(layer))
    return None


def compressed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: returns (output [B, Tq, H, D], None)."""
    ref = getattr(module, _LAYER_ATTR, None)
    layer = ref() if ref is not None else None
    if layer is None or not layer.pending:
        # no compressed cache armed (no cache, DynamicCache, use_cache=False): plain SDPA on what we got
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    setattr(module, _LAYER_ATTR, None)
    if dropout and module.training:
        raise ValueError("kvcodec attention is for inference; dropout is not supported")
    scaling = module.scaling if scaling is None else scaling
    store = layer.store
    try:
        if store.key_codec.decoded_attention or not store.blocks:
            k, v = store.materialize(query.dtype)
            return sdpa_attention_forward(module, query, k, v, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
        return attend_store(store, query, attention_mask, scaling, layer.spec.num_kv_heads), None
    finally:
        layer.finish_step()


def attend_store(store, query: torch.Tensor, mask, scaling: float, num_kv_heads: int) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, Tq, D] over every token of ``store`` (which ends with the
    Tq query tokens themselves). ``mask``: None (causal), bool [B, 1|H, Tq, Tkv] (True = attend) or an
    additive float mask. Returns [B, Tq, H, D] in the query dtype."""
    B, H, Tq, D = query.shape
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads do not group over {num_kv_heads} KV heads")
    G = H // num_kv_heads
    total = len(store)
    past = total - Tq
    if mask is not None and mask.shape[-1] != total:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys but the cache holds {total}")
    parts = _split(store, KV_CHUNK, COMPRESSED_CHUNK)
    q = query.float().reshape(B, num_kv_heads, G, Tq, D)
    out = torch.empty(B, num_kv_heads, G, Tq, D, dtype=torch.float32, device=query.device)
    for q0 in range(0, Tq, Q_CHUNK):
        n = min(Q_CHUNK, Tq - q0)
        qc = (q[:, :, :, q0 : q0 + n] * scaling).reshape(B, num_kv_heads, G * n, D)
        m = torch.full((B, num_kv_heads, G * n, 1), float("-inf"), device=query.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, num_kv_heads, G * n, D, device=query.device)
        for seg in parts:
            s = qc @ seg.key.float().transpose(-1, -2) if seg.exact else store.key_codec.scores(seg.key, qc)
            s = _apply_mask(s, seg.start, seg.length, mask, q0, n, past, G, num_kv_heads)
            if s is None:  # every key of this part lies after every query of the chunk
                continue
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            pv = p @ seg.value.float() if seg.exact else store.value_codec.weighted_sum(seg.value, p)
            acc = acc * alpha + pv
            m = m_new
        out[:, :, :, q0 : q0 + n] = (acc / l.clamp_min(1e-30)).reshape(B, num_kv_heads, G, n, D)
    return out.reshape(B, H, Tq, D).transpose(1, 2).to(query.dtype).contiguous()


def _split(store, exact_chunk: int, compressed_chunk: int):
    """The store's segments cut into bounded runs (views, no copies), so the scores stay small."""
    from kvcodec.hf.storage import Segment

    out = []
    for seg in store.segments():
        chunk = exact_chunk if seg.exact else compressed_chunk
        if seg.length <= chunk or (not seg.exact and not hasattr(store.key_codec, "view")):
            out.append(seg)
            continue
        for a in range(0, seg.length, chunk):
            b = min(a + chunk, seg.length)
            if seg.exact:
                k, v = seg.key[..., a:b, :], seg.value[..., a:b, :]
            else:
                k, v = store.key_codec.view(seg.key, a, b), store.value_codec.view(seg.value, a, b)
            out.append(Segment(seg.start + a, b - a, k, v, seg.exact))
    return out


def _apply_mask(s, start, length, mask, q0, n, past, G, Hkv):
    """Scores ``s`` [B, Hkv, G*n, L] of keys start..start+L-1 against queries q0..q0+n-1, masked."""
    if mask is None:
        first_q = past + q0
        if start + length - 1 <= first_q:
            return s
        if start > first_q + n - 1:
            return None
        k_pos = torch.arange(start, start + length, device=s.device)
        q_pos = torch.arange(first_q, first_q + n, device=s.device)
        allowed = (k_pos[None, :] <= q_pos[:, None]).repeat(G, 1)
        return s.masked_fill(~allowed, float("-inf"))
    sl = mask[:, :, q0 : q0 + n, start : start + length]
    B = sl.shape[0]
    if sl.shape[1] == 1:
        sl = sl.unsqueeze(2).expand(B, 1, G, n, length).reshape(B, 1, G * n, length)
    else:
        sl = sl.reshape(B, Hkv, G * n, length)
    if sl.dtype == torch.bool:
        return s.masked_fill(~sl, float("-inf"))
    return s + sl.float()
