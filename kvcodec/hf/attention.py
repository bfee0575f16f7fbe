"""Attention computed on the compressed cache, plugged into transformers' AttentionInterface.

transformers calls ``fn(module, query, key, value, attention_mask, scaling=..., dropout=...)``
but never passes the cache. A forward pre-hook on every attention module (installed by
:func:`enable`) sees ``past_key_values`` in the module's kwargs, *arms* the module's
:class:`~kvcodec.hf.layer.CompressedLayer` (so its ``update`` returns only the new exact K/V)
and leaves the function a weak reference to it. The function then runs one joint softmax over
``[sink | compressed blocks | full-precision window (which ends with the new tokens)]``:

* exact parts: ``q @ k^T`` in float32;
* compressed blocks: ``encoding.scores`` / ``encoding.weighted_sum`` (kvcodec.hf.encodings) on the compressed form, never a
  dense K/V copy;
* online (flash-style) softmax over the parts, chunked over query rows and key tokens so the
  working memory stays bounded; GQA by viewing the queries as [B, H_kv, G*Tq, D].

On CUDA (TurboQuant, no padding mask) the compressed tokens go through the fused kernel instead
(:func:`fused_compressed`) and the exact tokens join them in one softmax
(:func:`_attend_with_compressed`): about ten torch kernels per layer and step besides the kernel's
own, because a decode step is host-bound (launch overhead, not GPU time, sets its speed).

Prefill (no compressed block yet) and the exact encodings ("none", "lossless") attend with
transformers' own SDPA over the exact/decoded K/V: the prompt is attended at full precision (best
quality) and only then compressed, and the lossless cache reproduces DynamicCache bit for bit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvcodec.cuda as kcuda
from kvcodec.cuda import quantized as packed_attention
from kvcodec.hf.layer import CompressedLayer
from kvcodec.hf.storage import Block, Segment
from kvcodec.quant.packed import PackedKV

NAME = "kvcodec"
FUSED_MODES = ("auto", "off", "cpu-reference")
_HOOK_ATTR = "_kvcodec_pre_hook"
_LAYER_ATTR = "_kvcodec_layer"


@dataclass(frozen=True)
class AttentionOptions:
    """How the attention function runs on one cache (``CompressedCache(..., attention=...)``).

    ``fused``: "auto" runs the compressed tokens through kvcodec.cuda's fused kernel on CUDA tensors
    when it applies (TurboQuant, no padding mask); "off" always takes the torch path; "cpu-reference"
    also takes the fused wiring on CPU, through the kernel's float64 reference (tests, CPU smoke runs).
    ``q_chunk`` query tokens per pass (times the GQA group), ``kv_chunk`` exact and
    ``compressed_chunk`` compressed key tokens per pass: they bound the working memory."""

    fused: str = "auto"
    q_chunk: int = 128
    kv_chunk: int = 1024
    compressed_chunk: int = 4096

    def __post_init__(self):
        if self.fused not in FUSED_MODES:
            raise ValueError(f"fused must be one of {FUSED_MODES}, got {self.fused!r}")
        for name in ("q_chunk", "kv_chunk", "compressed_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


DEFAULT_OPTIONS = AttentionOptions()


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
    """Pre-hook: arm the module's layer when ``past_key_values`` is a compressed cache (its layers are
    :class:`CompressedLayer`; a CompressedCache holds nothing else)."""
    layers = getattr(kwargs.get("past_key_values"), "layers", None)
    config = getattr(module, "config", None)
    setattr(module, _LAYER_ATTR, None)
    if isinstance(layers, list) and getattr(config, "_attn_implementation", None) == NAME:
        idx = module.layer_idx
        if idx < len(layers) and isinstance(layers[idx], CompressedLayer):
            layer = layers[idx]
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
    options = layer.attention_options or DEFAULT_OPTIONS
    try:
        if store.key_encoding.decoded_attention or not store.blocks:
            k, v = store.materialize(query.dtype)
            return sdpa_attention_forward(module, query, k, v, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
        fused = fused_compressed(layer, query, attention_mask, scaling, options)
        out = attend_store(store, query, attention_mask, scaling, layer.spec.num_kv_heads, compressed=fused,
                           options=options)
        return out, None
    finally:
        layer.finish_step()


def attend_store(store, query: torch.Tensor, mask, scaling: float, num_kv_heads: int, compressed=None,
                 options: AttentionOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, Tq, D] over every token of ``store`` (which ends with the
    Tq query tokens themselves). ``mask``: None (causal), bool [B, 1|H, Tq, Tkv] (True = attend) or an
    additive float mask. ``compressed``: optional :class:`CompressedPart` of the compressed tokens
    already computed by the fused kernel (``fused_compressed``, which takes no padding mask); then only
    the exact parts are attended here, merged with it in one softmax (:func:`_attend_with_compressed`).
    ``options``: the chunk sizes. Returns [B, Tq, H, D] in the query dtype."""
    B, H, Tq, D = query.shape
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads do not group over {num_kv_heads} KV heads")
    G = H // num_kv_heads
    total = len(store)
    past = total - Tq
    if mask is not None and mask.shape[-1] != total:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys but the cache holds {total}")
    if compressed is not None:
        out = _attend_with_compressed(store, mask, compressed, G, Tq, options.q_chunk)
        return out.reshape(B, H, Tq, D).transpose(1, 2).to(query.dtype).contiguous()
    parts = _split(store, options.kv_chunk, options.compressed_chunk)
    q = query.float().reshape(B, num_kv_heads, G, Tq, D)
    out = torch.empty(B, num_kv_heads, G, Tq, D, dtype=torch.float32, device=query.device)
    for q0 in range(0, Tq, options.q_chunk):
        n = min(options.q_chunk, Tq - q0)
        qc = (q[:, :, :, q0 : q0 + n] * scaling).reshape(B, num_kv_heads, G * n, D)
        m = torch.full((B, num_kv_heads, G * n, 1), float("-inf"), device=query.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, num_kv_heads, G * n, D, device=query.device)
        for seg in parts:
            s = qc @ seg.key.float().transpose(-1, -2) if seg.exact else store.key_encoding.scores(seg.key, qc)
            s = _apply_mask(s, seg.start, seg.length, mask, q0, n, past, G, num_kv_heads)
            if s is None:  # every key of this part lies after every query of the chunk
                continue
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            pv = p @ seg.value.float() if seg.exact else store.value_encoding.weighted_sum(seg.value, p)
            acc = acc * alpha + pv
            m = m_new
        out[:, :, :, q0 : q0 + n] = (acc / l.clamp_min(1e-30)).reshape(B, num_kv_heads, G, n, D)
    return out.reshape(B, H, Tq, D).transpose(1, 2).to(query.dtype).contiguous()


@dataclass(eq=False)
class CompressedPart:
    """Attention over a layer's compressed tokens from the fused kernel, in the GQA layout
    [B, H_kv, G*Tq, ...] (query head h = kv * G + g, HF repeat_kv order) and the kernel's domain
    (``kvcodec.cuda.quantized.attend_packed``):

    * ``q``: the queries the kernel saw (key preconditioner folded in: q * key scale), float32;
    * ``out``: their normalized output over the compressed tokens (value preconditioner undone);
    * ``lse``: [.., 1] log-sum-exp of the scores ``scaling * q . k'`` with k' = (k - center) / scale:
      the true scores minus the per-query constant ``scaling * q . center``;
    * ``consts``: the layer's :class:`_FusedConsts` (its ``packed`` maps exact keys into that domain)."""

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    consts: "_FusedConsts"


@dataclass(eq=False)
class _FusedConsts:
    """The fused path's per-block state, built once per compressed block (the side data and the token
    count only change when a compaction, crop or beam reorder makes a new block) instead of once per
    layer and step: the kernel operands' float32 preconditioner constants and the kernel's ``seq_lens``."""

    block: weakref.ref  # the Block they were built from (weak: a replaced block's codes are freed at once)
    scaling: float
    batch: int
    packed: packed_attention.PackedConsts
    seq_lens: torch.Tensor | None  # [B] int32 compressed tokens per sequence; None: all the block's slots

    @classmethod
    def of(cls, layer: CompressedLayer, block: Block, keys: PackedKV, values: PackedKV, scaling: float,
           query: torch.Tensor) -> "_FusedConsts":
        """The layer's cached constants for ``block``, rebuilt only when the block changed."""
        batch, heads, device = query.shape[0], query.shape[1], query.device
        c = layer.fused_consts
        if c is not None and c.block() is block and c.scaling == scaling and c.batch == batch:
            return c
        # every sequence holds all of the block's tokens: when the packed tensors have exactly that many
        # slots, seq_lens=None lets the kernel use its cached full lengths (no per-call clamp kernel)
        full = keys.codes.shape[-2] == block.length
        c = cls(weakref.ref(block), scaling, batch,
                packed_attention.PackedConsts.build(keys, values, scaling, heads, device),
                None if full else torch.full((batch,), block.length, dtype=torch.int32, device=device))
        layer.fused_consts = c
        return c


def fused_compressed(layer: CompressedLayer, query: torch.Tensor, mask, scaling: float,
                     options: AttentionOptions = DEFAULT_OPTIONS) -> CompressedPart | None:
    """The compressed tokens' attention from the fused kernel (``kvcodec.cuda.quantized.attend_packed``:
    packed codes read by the kernel) as a :class:`CompressedPart`, or None when it does not apply: CPU
    tensors, padding masks, encodings without a packed layout the kernel takes (``encoding.packed``), or
    ``options.fused`` says so (see AttentionOptions). The exact sink and window are attended by
    ``attend_store`` and merged with it. The per-block constants are cached on ``layer``."""
    store = layer.store
    if options.fused == "off" or not (query.is_cuda or options.fused == "cpu-reference") or len(store.blocks) != 1:
        return None
    block = store.blocks[0]
    keys, values = store.key_encoding.packed(block.key), store.value_encoding.packed(block.value)
    if not packed_attention.supported(keys, values, query.shape[-1]):
        return None
    if mask is not None and not (mask.dtype == torch.bool and bool(mask.all())):  # host sync, only with a mask
        return None
    if query.is_cuda and not kcuda.is_available():
        return None
    c = _FusedConsts.of(layer, block, keys, values, scaling, query)
    # (q * s) . x' = q . x - q . center: the kernel's scores lack the per-query q . center, and so do the
    # exact keys mapped by k_mul/k_add in the merge, so the joint softmax is unchanged
    q, out, lse = packed_attention.attend_packed(query, keys, values, c.packed, c.seq_lens)
    return CompressedPart(q, out, lse, c)


def _attend_with_compressed(store, mask, part: CompressedPart, G: int, Tq: int, q_chunk: int) -> torch.Tensor:
    """[B, H_kv, G*Tq, D] float32 attention over every token when the compressed ones come from the
    fused kernel: one softmax (per chunk of queries) over [compressed | sink | window], in which the
    compressed tokens are a single pseudo-key with score ``lse`` and value ``out`` (exactly their
    log-sum-exp merge) and the exact tokens (one contiguous buffer) are keys mapped into the kernel's
    query domain, so the kernel's queries are used as they are. ``mask``: None (causal inside the
    window) or all True (checked by ``fused_compressed``: nothing to mask)."""
    B, Hkv, _, D = part.q.shape
    c = part.consts.packed
    keys = torch.addcmul(c.k_add, store.exact_k, c.k_mul)  # [B, H_kv, E, D] float32
    values = store.exact_v.float()
    E = keys.shape[-2]
    chunks = []
    for q0 in range(0, Tq, q_chunk):
        n = min(q_chunk, Tq - q0)
        s = _query_rows(part.q, G, Tq, q0, n) @ keys.transpose(-1, -2)
        if mask is None and Tq > 1:  # exact index order is token order: the queries are the last Tq
            s = _apply_mask(s, 0, E, None, q0, n, E - Tq, G, Hkv)
        p = torch.softmax(torch.cat([_query_rows(part.lse, G, Tq, q0, n), s], dim=-1), dim=-1)
        chunks.append(torch.addcmul(p[..., 1:] @ values, p[..., :1], _query_rows(part.out, G, Tq, q0, n)))
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat([ch.view(B, Hkv, G, -1, D) for ch in chunks], dim=3).view(B, Hkv, G * Tq, D)


def _query_rows(t: torch.Tensor, G: int, Tq: int, q0: int, n: int) -> torch.Tensor:
    """Rows of queries q0..q0+n-1 of every group member from t [B, H_kv, G*Tq, X] (a view when n == Tq)."""
    if n == Tq:
        return t
    B, Hkv, _, X = t.shape
    return t.view(B, Hkv, G, Tq, X)[:, :, :, q0 : q0 + n].reshape(B, Hkv, G * n, X)


def _split(store, exact_chunk: int, compressed_chunk: int):
    """The store's segments cut into bounded runs (views, no copies), so the scores stay small."""
    out = []
    for seg in store.segments():
        chunk = exact_chunk if seg.exact else compressed_chunk
        if seg.length <= chunk or (not seg.exact and not hasattr(store.key_encoding, "view")):
            out.append(seg)
            continue
        for a in range(0, seg.length, chunk):
            b = min(a + chunk, seg.length)
            if seg.exact:
                k, v = seg.key[..., a:b, :], seg.value[..., a:b, :]
            else:
                k, v = store.key_encoding.view(seg.key, a, b), store.value_encoding.view(seg.value, a, b)
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
