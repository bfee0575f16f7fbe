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
USE_FUSED = True  # call kvcodec.cuda's fused decode kernel on CUDA tensors when it applies
FUSED_ON_CPU = False  # tests set this to run the fused-kernel wiring through kvcodec.cuda's CPU reference
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
        fused = fused_compressed(store, query, attention_mask, scaling)
        return attend_store(store, query, attention_mask, scaling, layer.spec.num_kv_heads, compressed=fused), None
    finally:
        layer.finish_step()


def attend_store(store, query: torch.Tensor, mask, scaling: float, num_kv_heads: int, compressed=None) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, Tq, D] over every token of ``store`` (which ends with the
    Tq query tokens themselves). ``mask``: None (causal), bool [B, 1|H, Tq, Tkv] (True = attend) or an
    additive float mask. ``compressed``: optional (out, lse) of the compressed tokens already computed
    (by the fused CUDA kernel); then only the exact parts are attended here and merged by lse.
    Returns [B, Tq, H, D] in the query dtype."""
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
        if compressed is not None:  # start from the kernel's normalized output: m = lse, l = 1
            c_out, c_lse = compressed
            m = c_lse.reshape(B, num_kv_heads, G, Tq)[:, :, :, q0 : q0 + n].reshape(B, num_kv_heads, G * n, 1).float()
            acc = c_out.reshape(B, num_kv_heads, G, Tq, D)[:, :, :, q0 : q0 + n].reshape(B, num_kv_heads, G * n, D).float()
            l = torch.where(torch.isfinite(m), torch.ones_like(m), torch.zeros_like(m))
            m = m.clone()
        for seg in parts:
            if compressed is not None and not seg.exact:
                continue
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


def fused_compressed(store, query: torch.Tensor, mask, scaling: float):
    """(out [B, H, Tq, D], lse [B, H, Tq]) of the compressed tokens from ``kvcodec.cuda.decode_attention``
    (packed codes read by the fused kernel), or None when it does not apply: CPU tensors, padding
    masks, non-TurboQuant codecs, bits > 4 or a head_dim the kernel does not take. The exact sink and
    window are attended by the caller and merged by lse."""
    if not USE_FUSED or not (query.is_cuda or FUSED_ON_CPU) or len(store.blocks) != 1:
        return None
    kq, vq = getattr(store.key_codec, "q", None), getattr(store.value_codec, "q", None)
    kmethod, vmethod = getattr(kq, "method", ""), getattr(vq, "method", "")
    if kmethod not in ("turboquant_mse", "turboquant_prod") or vmethod != "turboquant_mse":
        return None
    D = query.shape[-1]
    k_bits = kq._mse_bits
    if not (1 <= k_bits <= 4 and 1 <= vq.bits <= 4) or D % 32 or not 32 <= D <= 256:
        return None
    if kmethod == "turboquant_prod" and tuple(kq.qjl_matrix.shape) != (D, D):
        return None
    if mask is not None and not (mask.dtype == torch.bool and bool(mask.all())):
        return None
    try:
        import kvcodec.cuda as kcuda
    except ImportError:
        return None
    if query.is_cuda and not kcuda.is_available():
        return None
    from kvcodec.quant.precondition import ChannelPreconditioner

    block = store.blocks[0]
    ck, cv = block.key, block.value
    B, H = query.shape[:2]
    G = H // ck.lead_shape[1]

    def per_q_head(t):  # side data [B|1, Hkv, 1, D] -> [B|1, H, 1, D] (HF repeat_kv order)
        return None if t is None else t.float().repeat_interleave(G, dim=1)

    pk, pv = ChannelPreconditioner.from_side(ck.side), ChannelPreconditioner.from_side(cv.side)
    q = query.float()
    k_scale, k_center = per_q_head(pk.scale), per_q_head(pk.center)
    q_in = q * k_scale if k_scale is not None else q  # (q * s) . x' = q . x - q . center
    extra = {}
    if kmethod == "turboquant_prod":
        extra = dict(k_qjl=ck.token["qjl"], k_rnorms=ck.token["rnorms"], qjl_matrix=kq.qjl_matrix)
    seq_lens = torch.full((B,), ck.num_tokens, dtype=torch.int32, device=query.device)
    out, lse = kcuda.decode_attention(
        q_in, ck.token["codes"], ck.token["norms"], cv.token["codes"], cv.token["norms"], seq_lens,
        k_rotation=kq.rotation, v_rotation=vq.rotation, k_codebook=kq.codebook, v_codebook=vq.codebook,
        k_bits=k_bits, v_bits=vq.bits, scale=scaling, return_lse=True, **extra)
    out = out.float()
    if k_center is not None:  # restore the softmax-invariant q . center so lse matches the exact parts
        lse = lse + scaling * (q * k_center).sum(-1)
    v_scale, v_center = per_q_head(pv.scale), per_q_head(pv.center)
    if v_scale is not None:
        out = out * v_scale
    if v_center is not None:
        out = out + v_center
    return out, lse


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
