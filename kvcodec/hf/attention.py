"""Attention computed on the compressed cache, plugged into transformers' AttentionInterface.

transformers calls ``fn(module, query, key, value, attention_mask, scaling=..., dropout=...)``
but never passes the cache: during a forward that received a kvcodec cache, ``kvcodec.hf.binding``
switches the model's configs to this function and leaves the cache where it finds it
(``module.config``). A compressed layer's ``update`` then returns only the new tokens, and the
function runs one joint softmax over ``[sink | compressed blocks | full-precision window (which ends
with the new tokens)]``:

* exact parts: ``q @ k^T`` in float32;
* compressed blocks: ``encoding.scores`` / ``encoding.weighted_sum`` (kvcodec.hf.encodings) on the compressed form, never a
  dense K/V copy;
* online (flash-style) softmax over the parts, chunked over query rows and key tokens so the
  working memory stays bounded; GQA by viewing the queries as [B, H_kv, G*Tq, D]; K and V may have
  different head dims (MLA); logit soft-capping (Gemma 2) and learned sink logits (GPT-OSS) as the
  models' own eager attention applies them.

On CUDA (TurboQuant, no padding mask, no soft-cap or sinks) the compressed tokens go through the fused
kernel instead (:func:`fused_compressed`) and the exact tokens join them in one softmax
(:func:`_attend_with_compressed`): about ten torch kernels per layer and step besides the kernel's
own, because a decode step is host-bound (launch overhead, not GPU time, sets its speed).

Layers that are not compressed (sliding-window, linear-attention and SSM layers keep transformers' own
cache layers), the prefill (no compressed block yet) and the exact encodings ("none", "lossless")
attend with the model's own implementation (``delegate``: its eager function when the model runs
eager or cannot run SDPA, else SDPA) over the exact/decoded K/V: the prompt is attended at full
precision and only then compressed, and the lossless cache reproduces DynamicCache bit for bit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvcodec.device as kcuda
from kvcodec.quant.cuda import quantized as packed_attention
from kvcodec.quant.cuda.attention import join_exact
from kvcodec.hf.binding import EAGER_NAME, NAME, attach, bound, bound_to, detach, implementation_for  # noqa: F401
from kvcodec.hf.layer import CompressedLayer
from kvcodec.hf.storage import Block, Segment
from kvcodec.quant.packed import PackedKV

FUSED_MODES = ("auto", "off", "cpu-reference")


@dataclass(frozen=True)
class AttentionOptions:
    """How the attention function runs on one cache (``CompressedCache(..., attention=...)``).

    ``fused``: "auto" runs the compressed tokens through kvcodec.quant.cuda's fused kernel on CUDA tensors
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
    """Register the attention functions and their mask functions (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    AttentionInterface.register(NAME, compressed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # boolean [B, 1, Tq, Tkv] masks, None when causal
    AttentionInterface.register(EAGER_NAME, compressed_attention_eager)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EAGER_NAME, eager_mask)  # additive float masks


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Let kvcodec caches passed to ``model`` attend on their compressed form (idempotent). The model is
    not changed: see ``kvcodec.hf.binding``. ``CompressedCache(model, ...)`` calls this."""
    register()
    return attach(model)


def use(model: torch.nn.Module, cache):
    """Bind ``cache`` to ``model`` for a block of code (``with kvcodec.hf.use(model, cache): ...``), for
    callers that run ``model.forward`` or a compiled copy of it directly, which skips the binding hooks."""
    register()
    return bound_to(model, cache)


def disable(model: torch.nn.Module, attn_implementation: str | None = None) -> torch.nn.Module:
    """Remove what :func:`enable` installed. ``attn_implementation``: also switch the model to it."""
    detach(model)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


def _eager_function(module):
    """The model's own eager attention (defined in its modeling file: GPT-OSS adds sinks there)."""
    import sys

    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward in its modeling module; "
                           "kvcodec cannot attend its uncompressed layers with eager masks")
    return fn


def _layer_of(module):
    """The compressed layer whose new tokens this attention call must attend, or None."""
    binding = bound(module)
    idx = getattr(module, "layer_idx", None)
    if binding is None or not isinstance(idx, int):
        return None
    layers = binding.cache.layers
    layer = layers[idx] if idx < len(layers) else None
    return layer if isinstance(layer, CompressedLayer) and layer.pending else None


def compressed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function ``"kvcodec"`` (SDPA masks): returns (output [B, Tq, H, Dv], None)."""
    return _attention(sdpa_attention_forward, module, query, key, value, attention_mask, scaling, dropout, kwargs)


def compressed_attention_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function ``"kvcodec_eager"`` (eager's additive masks)."""
    return _attention(_eager_function(module), module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _attention(delegate, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    layer = _layer_of(module)
    if layer is None:  # an uncompressed layer (linear, KV-sharing), or no kvcodec cache bound
        _check_shared(module, key)
        return delegate(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout and module.training:
        raise ValueError("kvcodec attention is for inference; dropout is not supported")
    store = layer.store
    options = layer.attention_options or DEFAULT_OPTIONS
    # not the tensors update returned, or a scale kvcodec cannot know (GPT-2 passes none on transformers 5.0)
    if key is not layer.handed[0] or value is not layer.handed[1] or (scaling is None and not hasattr(module, "scaling")):
        return _attends_transformed(delegate, layer, module, query, key, value, attention_mask, scaling, kwargs)
    scaling = module.scaling if scaling is None else scaling
    if key.shape[-2] == len(store):  # the new tokens are the whole history (a prompt on an empty cache)
        layer.finish_step()
        return delegate(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
    try:
        skip = layer.hidden(query.shape[-2])  # sliding layers: held tokens outside the step's window
        if store.key_encoding.decoded_attention or not store.blocks:
            k, v = store.materialize(query.dtype)
            return delegate(module, query, k[..., skip:, :], v[..., skip:, :], attention_mask, dropout=0.0,
                            scaling=scaling, **kwargs)
        extras = Extras(kwargs.get("softcap"), kwargs.get("s_aux"))
        fused = None if extras.any or skip else fused_compressed(layer, query, attention_mask, scaling, options)
        out = attend_store(store, query, attention_mask, scaling, key.shape[1], compressed=fused,
                           options=options, extras=extras, skip=skip)
        return out, None
    finally:
        layer.finish_step()


def _check_shared(module, key) -> None:
    """A layer that reuses another layer's K/V (Gemma 3n / 4 KV sharing) receives what that layer's
    ``update`` returned: the producer must return its whole history, so it is switched to decoded mode
    (found on the first forward, where the new tokens are the whole history; later: refuse)."""
    binding = bound(module)
    if binding is None:
        return
    for producer in binding.cache.compressed_layers():
        if producer.handed[0] is key:
            if not producer.decoded and not producer.handed_whole:
                raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')} reuses layer {producer.layer_idx}'s K/V, "
                                   "found on a cache that already held tokens: start from a fresh cache")
            producer.decoded = True


def _attends_transformed(delegate, layer, module, query, key, value, attention_mask, scaling, kwargs):
    """The model attends something computed from what ``update`` returned (transformers' MLA expands its
    cached latent into per-head K/V; DiffLlama splits V in halves): kvcodec cannot attend the compressed
    form, so the layer returns its whole history decoded from now on. Found on the cache's first forward,
    where the new tokens are the whole history and this call is exact; later it would have seen too
    little: refuse."""
    layer.decoded = True
    layer.finish_step()
    if not layer.handed_whole:
        raise RuntimeError(f"layer {layer.layer_idx} of {type(module).__name__} attends K/V computed from its cache "
                           "entries, found on a cache that already held tokens: start from a fresh cache")
    return delegate(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs)


@dataclass(frozen=True)
class Extras:
    """Score transforms some models apply inside attention: ``softcap`` (Gemma 2: scores become
    ``softcap * tanh(scores / softcap)``) and ``sinks`` ([H] learned logits that join every softmax
    with no value: GPT-OSS)."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return bool(self.softcap) or self.sinks is not None


NO_EXTRAS = Extras()


def attend_store(store, query: torch.Tensor, mask, scaling: float, num_kv_heads: int, compressed=None,
                 options: AttentionOptions = DEFAULT_OPTIONS, extras: Extras = NO_EXTRAS, skip: int = 0) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, Tq, D] over every token of ``store`` (which ends with the
    Tq query tokens themselves). ``mask``: None (causal), bool [B, 1|H, Tq, Tkv] (True = attend) or an
    additive float mask. ``compressed``: optional :class:`CompressedPart` of the compressed tokens
    already computed by the fused kernel (``fused_compressed``, which takes no padding mask); then only
    the exact parts are attended here, merged with it in one softmax (:func:`_attend_with_compressed`).
    ``options``: the chunk sizes; ``extras``: soft-capping and sink logits; ``skip``: the oldest held
    tokens the queries may not see (sliding windows; the mask covers the rest). Returns [B, Tq, H, Dv]
    in the query dtype (Dv: the values' head dim, which MLA models make differ from the keys')."""
    B, H, Tq, D = query.shape
    if H % num_kv_heads:
        raise ValueError(f"{H} query heads do not group over {num_kv_heads} KV heads")
    G = H // num_kv_heads
    total = len(store) - skip
    past = total - Tq
    if mask is not None and mask.shape[-1] != total:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys but the cache holds {total}")
    if compressed is not None:
        out = _attend_with_compressed(store, mask, compressed, G, Tq, options.q_chunk)
        return out.reshape(B, H, Tq, -1).transpose(1, 2).to(query.dtype).contiguous()
    Dv = store.exact_v.shape[-1]
    parts = _split(store, options.kv_chunk, options.compressed_chunk, skip)
    q = query.float().reshape(B, num_kv_heads, G, Tq, D)
    out = torch.empty(B, num_kv_heads, G, Tq, Dv, dtype=torch.float32, device=query.device)
    cap = float(extras.softcap) if extras.softcap else None
    sinks = None if extras.sinks is None else extras.sinks.float().reshape(num_kv_heads, G, 1)
    for q0 in range(0, Tq, options.q_chunk):
        n = min(options.q_chunk, Tq - q0)
        qc = (q[:, :, :, q0 : q0 + n] * scaling).reshape(B, num_kv_heads, G * n, D)
        m = torch.full((B, num_kv_heads, G * n, 1), float("-inf"), device=query.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, num_kv_heads, G * n, Dv, device=query.device)
        for seg in parts:
            s = qc @ seg.key.float().transpose(-1, -2) if seg.exact else store.key_encoding.scores(seg.key, qc)
            if cap is not None:
                s = torch.tanh(s / cap) * cap
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
        if sinks is not None:  # one more logit per head in the softmax, with no value
            sink = sinks.expand(num_kv_heads, G, n).reshape(1, num_kv_heads, G * n, 1).to(m.device)
            m_new = torch.maximum(m, sink)
            alpha = torch.exp(m - m_new)
            l = l * alpha + torch.exp(sink - m_new)
            acc = acc * alpha
        out[:, :, :, q0 : q0 + n] = (acc / l.clamp_min(1e-30)).reshape(B, num_kv_heads, G, n, Dv)
    return out.reshape(B, H, Tq, Dv).transpose(1, 2).to(query.dtype).contiguous()


@dataclass(eq=False)
class CompressedPart:
    """Attention over a layer's compressed tokens from the fused kernel, in the GQA layout
    [B, H_kv, G*Tq, ...] (query head h = kv * G + g, HF repeat_kv order) and the kernel's domain
    (``kvcodec.quant.cuda.quantized.attend_packed``):

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
    """The compressed tokens' attention from the fused kernel (``kvcodec.quant.cuda.quantized.attend_packed``:
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
    if mask is not None and not _attends_everything(mask):  # host sync, only with a mask
        return None
    if query.is_cuda and not kcuda.is_available():
        return None
    c = _FusedConsts.of(layer, block, keys, values, scaling, query)
    # (q * s) . x' = q . x - q . center: the kernel's scores lack the per-query q . center, and so do the
    # exact keys mapped by k_mul/k_add in the merge, so the joint softmax is unchanged
    q, out, lse = packed_attention.attend_packed(query, keys, values, c.packed, c.seq_lens)
    return CompressedPart(q, out, lse, c)


def _attends_everything(mask: torch.Tensor) -> bool:
    """True when a boolean or additive mask masks nothing."""
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())


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
        joined, _ = join_exact(_query_rows(part.lse, G, Tq, q0, n), _query_rows(part.out, G, Tq, q0, n), s, values)
        chunks.append(joined)
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat([ch.view(B, Hkv, G, -1, D) for ch in chunks], dim=3).view(B, Hkv, G * Tq, D)


def _query_rows(t: torch.Tensor, G: int, Tq: int, q0: int, n: int) -> torch.Tensor:
    """Rows of queries q0..q0+n-1 of every group member from t [B, H_kv, G*Tq, X] (a view when n == Tq)."""
    if n == Tq:
        return t
    B, Hkv, _, X = t.shape
    return t.view(B, Hkv, G, Tq, X)[:, :, :, q0 : q0 + n].reshape(B, Hkv, G * n, X)


def _split(store, exact_chunk: int, compressed_chunk: int, skip: int = 0):
    """The store's segments cut into bounded runs (views, no copies), so the scores stay small; the
    first ``skip`` tokens left out and the positions counted from the first one kept."""
    out = []
    for seg in store.segments():
        lo = max(skip - seg.start, 0)  # tokens of this segment that are skipped
        if lo >= seg.length:
            continue
        chunk = exact_chunk if seg.exact else compressed_chunk
        if lo == 0 and (seg.length <= chunk or (not seg.exact and not hasattr(store.key_encoding, "view"))):
            out.append(Segment(seg.start - skip, seg.length, seg.key, seg.value, seg.exact))
            continue
        if lo and not seg.exact and not hasattr(store.key_encoding, "view"):
            raise ValueError(f"{type(store.key_encoding).__name__} blocks cannot be read from a middle token")
        for a in range(lo, seg.length, chunk):
            b = min(a + chunk, seg.length)
            if seg.exact:
                k, v = seg.key[..., a:b, :], seg.value[..., a:b, :]
            else:
                k, v = store.key_encoding.view(seg.key, a, b), store.value_encoding.view(seg.value, a, b)
            out.append(Segment(seg.start + a - skip, b - a, k, v, seg.exact))
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
