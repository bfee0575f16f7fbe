"""Static compressed cache: pre-allocated buffers, device-side lengths, a decode step a CUDA graph can hold.

``CompressedCache(model, method="turboquant", key_bits=4, value_bits=4, max_cache_len=N)`` builds a
:class:`StaticCompressedCache`. Per layer it allocates, once, on the first (prefill) call:

* ``codes``/``norms`` of keys and values for ``max_cache_len`` tokens (+ one block of slack),
* ``exact_k``/``exact_v`` [B, H_kv, sink + W, D] float32 (the model's values exactly): the sink, then
  a ring of ``W = residual + 2 * block_size`` window slots (token p >= sink lives in slot ``sink +
  (p - sink) % W``), with ``key_pos`` [sink + W] the position each slot holds,
* the key/value channel preconditioners (centre, scale) [B, H_kv, 1, D],
* device scalars ``seen`` (tokens held) and ``comp`` (compressed tokens), ``comp_lens`` [B] int32.

The semantics are the eager cache's (``kvcodec.hf.storage.LayerStore``) token for token: the prompt
is attended exactly and its compaction (and the preconditioner fit) is the eager encode itself; after
that, a block of ``block_size`` tokens leaves the window exactly when the eager store would move it.
What is data-dependent in the eager store is arithmetic on device tensors here: ``comp`` grows by a
block when ``window >= residual + block_size``, and slots past ``comp`` are never read, so writes to
them are harmless. On CPU every decode step gathers the block that would leave the window and
quantizes it as one [B, H_kv, block_size, D] batch, like the eager store, so the bytes are identical
(tested). On CUDA each token is quantized once, on arrival, into the slot it will hold (the quantize
kernel treats rows independently), and compaction is only the length update; the kernel and torch's
quantizer differ on ~1e-6 of the codes (float ties). No host synchronisation, no Python branch on
data: the step is capturable by ``torch.cuda.CUDAGraph`` and compiles with
``torch.compile(fullgraph=True)`` (the kernels are ``kvcodec.cuda.ops`` custom ops).

Attention of a step: the compressed tokens by ``tq_attention`` (fused kernel on CUDA, float64
reference on CPU) returning (out, lse), the sink and ring by one masked matmul in the kernel's query
domain, merged in one softmax where the compressed part is a single pseudo-key (its lse). The prefill
(first call) is transformers' SDPA on the exact prompt, as in the eager cache.

Limits (ValueError): method "turboquant" with key_mode "mse", 1-4 bits, no outliers; the model must
be passed (its attention is switched to ``"kvcodec_static"``); no padded batches; after the prefill at
most ``block_size`` tokens per forward; ``max_cache_len`` is a hard limit. When the prompt is too
short for its own compaction, the key preconditioner is fitted on the device, on the first block
that leaves the window (as the eager store does).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcodec.cuda import ops
from kvcodec.hf.methods import build_spec

NAME = "kvcodec_static"
_FP16_MAX = 65504.0


def _compiling() -> bool:
    """True while dynamo traces (``torch.compiler.is_compiling`` is torch >= 2.3)."""
    fn = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
    return bool(fn())


class _Active:
    """The layer whose ``update`` ran last: transformers does not pass the cache to attention
    functions, and the attention of a layer always follows its ``update`` in the same forward."""

    layer = None


_ACTIVE = _Active()


def _check_supported(spec) -> None:
    if spec.method != "turboquant" or spec.key_mode != "mse" or spec.outliers:
        raise ValueError("max_cache_len (static mode) supports method='turboquant' with key_mode='mse' and no outliers")
    for name, bits in (("key_bits", spec.key_bits), ("value_bits", spec.value_bits)):
        if not 1 <= bits <= 4:
            raise ValueError(f"static mode takes {name} in 1..4 (the fused kernel's range), got {bits}")


class StaticCompressedLayer(CacheLayerMixin):
    """One layer's static buffers and its append / compaction / attention (see the module doc)."""

    is_sliding = False
    is_croppable = True
    is_compileable = True

    def __init__(self, spec, layer_idx: int, max_cache_len: int, group: int = 1, scaling: float | None = None):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.max_cache_len = max_cache_len
        self.group = group  # query heads per KV head
        self.scaling = spec.head_dim ** -0.5 if scaling is None else scaling  # the attention module's
        self.sink, self.residual, self.block = spec.sink, spec.residual, spec.block_size
        self.ring = spec.residual + 2 * spec.block_size
        self.kc, self.vc = spec.make_encodings(layer_idx)  # the eager encodings: prefill encodes are theirs
        self.prefill_now = False
        self.device_fit = False  # True when the preconditioner is still to be fitted on the device
        self.seen = torch.tensor(0, dtype=torch.int64)

    # ------------------------------------------------------------------ buffers
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        self.dtype, self.device, self.batch_size, self.num_heads, self.head_dim = dt, dev, B, H, D
        cap = max(self.max_cache_len - self.sink, 0) + self.block
        self.capacity = cap
        e = self.sink + self.ring
        # float32 (the model's values exactly): attention and quantization read them with no conversion
        self.exact_k = torch.zeros(B, H, e, D, dtype=torch.float32, device=dev)
        self.exact_v = torch.zeros(B, H, e, D, dtype=torch.float32, device=dev)
        self.key_pos = torch.cat([torch.arange(self.sink), torch.full((self.ring,), -1)]).to(dev)
        kb, vb = self.spec.key_bits, self.spec.value_bits
        self.k_codes = torch.zeros(B, H, cap, (D * kb + 7) // 8, dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros(B, H, cap, (D * vb + 7) // 8, dtype=torch.uint8, device=dev)
        self.k_norms = torch.zeros(B, H, cap, dtype=torch.float16, device=dev)
        self.v_norms = torch.zeros(B, H, cap, dtype=torch.float16, device=dev)
        self.pre = {}
        for side, q in (("k", self.kc.q), ("v", self.vc.q)):
            if q.precondition != "none":
                self.pre[side + "_center"] = torch.zeros(B, H, 1, D, dtype=torch.float16, device=dev)
            if q.precondition == "scale":
                self.pre[side + "_scale"] = torch.ones(B, H, 1, D, dtype=torch.float16, device=dev)
        self.fitted = torch.zeros((), dtype=torch.bool, device=dev)
        self.seen = torch.zeros((), dtype=torch.int64, device=dev)
        self.comp = torch.zeros((), dtype=torch.int64, device=dev)
        self.comp_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.consts = {side: _quant_consts(q, dev) for side, q in (("k", self.kc.q), ("v", self.vc.q))}
        for t in self._state_tensors() + [t for c in self.consts.values() for t in (c["rot"], c["cb"])]:
            _mark_static(t)
        self.is_initialized = True

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.exact_k, self.exact_v, self.key_pos, self.k_codes, self.v_codes, self.k_norms, self.v_norms,
                self.fitted, self.seen, self.comp, self.comp_lens, *self.pre.values()]

    # ------------------------------------------------------------------ contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _ACTIVE.layer = self
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._prefill(key_states, value_states)
            self.prefill_now = True
            return key_states, value_states
        self.prefill_now = False
        q = key_states.shape[-2]
        if q > self.block:
            raise ValueError(f"static compressed cache: at most block_size={self.block} tokens per forward "
                             f"after the prefill, got {q}")
        self._compact()
        if self.layer_idx == 0:  # once per forward: every layer holds the same tokens
            self._check_room(q)
        pos = self.seen + torch.arange(q, device=self.device)
        slots = self.sink + (pos - self.sink) % self.ring
        k, v = key_states.float(), value_states.float()
        self.exact_k.index_copy_(2, slots, k)
        self.exact_v.index_copy_(2, slots, v)
        self.key_pos.index_copy_(0, slots, pos)
        if self.on_append:
            self._quantize_into(k, v, pos - self.sink)
        self.seen.add_(q)
        return key_states, value_states

    @property
    def on_append(self) -> bool:
        """CUDA with a fitted preconditioner: every token is quantized once, when it arrives, into the
        slot it will hold once compressed (the quantize kernel treats rows independently, so these are
        the bytes a block quantization gives); compaction is then only ``comp += block_size``. On CPU
        (or before the fit) blocks are quantized when they leave the window, as the eager store does:
        float32 matmuls of other shapes may round differently there."""
        return self.device.type == "cuda" and not self.device_fit

    def _quantize_into(self, k: torch.Tensor, v: torch.Tensor, dest: torch.Tensor, move=None) -> None:
        """Quantize float32 K/V [B, H, n, D] with the layer's preconditioners into compressed slots ``dest``."""
        for side, x in (("k", k), ("v", v)):
            center, scale = self._precond(side, x, move)
            if center is not None:
                x = x - center.float()
            if scale is not None:
                x = x / scale.float()
            c = self.consts[side]
            norms_buf = getattr(self, side + "_norms")
            codes, norms = ops.tq_quantize(x, c["rot"], c["cb"], c["bits"], c["nc"], norms_buf.dtype == torch.bfloat16)
            getattr(self, side + "_codes").index_copy_(2, dest, codes)
            norms_buf.index_copy_(2, dest, norms)

    def _check_room(self, q: int) -> None:
        """max_cache_len is a hard limit; checked on the host only outside compiled/captured code
        (the host count is read with one sync; a captured step relies on the check of its warm-up)."""
        if _compiling() or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        if int(self.seen) + q > self.max_cache_len:
            raise ValueError(f"static compressed cache is full: {int(self.seen)} + {q} tokens > max_cache_len="
                             f"{self.max_cache_len}")

    def _prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Host-side first call: the eager store's append + compaction of the prompt, into the buffers."""
        T = k.shape[-2]
        if T < self.sink:
            raise ValueError(f"static compressed cache: the first call needs at least sink={self.sink} tokens")
        if T > self.max_cache_len:
            raise ValueError(f"static compressed cache is full: prompt of {T} tokens > max_cache_len={self.max_cache_len}")
        S = self.sink
        k, v = k.float(), v.float()
        self.exact_k[:, :, :S] = k[:, :, :S]
        self.exact_v[:, :, :S] = v[:, :, :S]
        window = T - S
        c = (window - self.residual) // self.block * self.block if window >= self.residual + self.block else 0
        if c:
            kb, vb = self.kc.encode(k[..., S:S + c, :]), self.vc.encode(v[..., S:S + c, :])  # fits the preconditioner
            for side, blk in (("k", kb), ("v", vb)):
                codes, norms = getattr(self, side + "_codes"), getattr(self, side + "_norms")
                codes[:, :, :c] = blk.token["codes"]
                if blk.token["norms"].dtype != norms.dtype:  # the prompt needed bf16 norms: keep them for good
                    setattr(self, side + "_norms", norms.to(blk.token["norms"].dtype))
                    _mark_static(getattr(self, side + "_norms"))
                getattr(self, side + "_norms")[:, :, :c] = blk.token["norms"]
                for name, t in blk.side.items():
                    self.pre[f"{side}_{name}"].copy_(t.expand_as(self.pre[f"{side}_{name}"]))
            self.fitted.fill_(True)
        self.device_fit = not c and bool(self.pre)
        pos = torch.arange(S + c, T, device=self.device)
        slots = S + (pos - S) % self.ring
        self.exact_k.index_copy_(2, slots, k[:, :, S + c:])
        self.exact_v.index_copy_(2, slots, v[:, :, S + c:])
        self.key_pos.index_copy_(0, slots, pos)
        self.seen.fill_(T)
        self.comp.fill_(c)
        self.comp_lens.fill_(c)
        if self.on_append:  # the window's tokens go to their future slots now
            self._quantize_into(k[:, :, S + c:], v[:, :, S + c:], pos - S)
        self._warm_kernels()

    def _warm_kernels(self) -> None:
        """Run the attention op once outside any graph: the launcher's cached plan and derived
        constants are then allocated in the ordinary pool, not inside a cudagraph tree's pool."""
        if self.device.type == "cuda":
            query = torch.zeros(self.batch_size, self.num_heads * self.group, 1, self.head_dim, device=self.device)
            kc, vc = self.consts["k"], self.consts["v"]
            ops.tq_attention(query, self.k_codes, self.k_norms, self.v_codes, self.v_norms, self.comp_lens, kc["rot"],
                             vc["rot"], kc["cb"], vc["cb"], kc["bits"], vc["bits"], float(self.scaling))
            row = torch.zeros(1, self.head_dim, device=self.device)
            for c in (kc, vc):
                ops.tq_quantize(row, c["rot"], c["cb"], c["bits"], c["nc"], False)

    def _compact(self) -> None:
        """Move the window's oldest block into the compressed slots when the eager store would
        (window >= residual + block_size): always computed, committed by growing ``comp``."""
        S, bs = self.sink, self.block
        move = (self.seen - S - self.comp) >= self.residual + bs
        if not self.on_append:
            pos = S + self.comp + torch.arange(bs, device=self.device)
            slots = S + (pos - S) % self.ring
            self._quantize_into(self.exact_k.index_select(2, slots), self.exact_v.index_select(2, slots),
                                pos - S, move)
            if self.device_fit:
                self.fitted.logical_or_(move)
        self.comp.add_(move.to(torch.int64) * bs)
        self.comp_lens.copy_(self.comp.to(torch.int32).expand_as(self.comp_lens))

    def _precond(self, side: str, x: torch.Tensor, move: torch.Tensor):
        """(centre, scale) for the block x: the stored ones, or, before the first fit (device_fit), the
        eager fit on this block (``calibrate``), which is stored when the block really moves."""
        center, scale = self.pre.get(side + "_center"), self.pre.get(side + "_scale")
        if not self.device_fit or center is None or move is None:
            return center, scale
        from kvcodec.quant.precondition import calibrate

        q = (self.kc if side == "k" else self.vc).q
        fit = calibrate(x, q.precondition)
        keep = self.fitted
        new_center = torch.where(keep, center, fit.center)
        store = keep | move
        center.copy_(torch.where(store, new_center, center))
        if scale is not None:
            new_scale = torch.where(keep, scale, fit.scale)
            scale.copy_(torch.where(store, new_scale, scale))
            return new_center, new_scale
        return new_center, None

    # ------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of query [B, Hq, Tq, D] over every held token (the Tq newest are the queries'
        own); returns [B, Tq, Hq, D] in the query dtype."""
        B, Hq, Tq, D = query.shape
        H = self.num_heads
        G = Hq // H
        k_scale, k_center = self.pre.get("k_scale"), self.pre.get("k_center")
        v_scale, v_center = self.pre.get("v_scale"), self.pre.get("v_center")
        q_in = query.float()
        if k_scale is not None:
            q_in = q_in * k_scale.float().repeat_interleave(G, dim=1)
        q_in = q_in.contiguous()
        kc, vc = self.consts["k"], self.consts["v"]
        out_c, lse = ops.tq_attention(q_in, self.k_codes, self.k_norms, self.v_codes, self.v_norms,
                                      self.comp_lens, kc["rot"], vc["rot"], kc["cb"], vc["cb"], kc["bits"], vc["bits"],
                                      float(scaling))
        out_c = out_c.view(B, H, G * Tq, D)
        if v_scale is not None:
            out_c = out_c * v_scale.float()
        if v_center is not None:
            out_c = out_c + v_center.float()
        # exact sink + ring: scaling * q . (k - centre), the compressed part's scores lack the same
        # per-query constant scaling * q . centre (q_in . k' with q_in = q * scale, k' = (k - centre) / scale)
        qg = query.float().reshape(B, H, G * Tq, D)
        s = (qg * scaling) @ self.exact_k.transpose(-1, -2)  # [B, H, G*Tq, E]
        if k_center is not None:
            s = s - scaling * (qg * k_center.float()).sum(-1, keepdim=True)
        q_pos = self.seen - Tq + torch.arange(Tq, device=query.device)
        lo = self.sink + self.comp  # ring slots hold window tokens from position lo on
        kp = self.key_pos
        valid = ((kp < self.sink) | (kp >= lo)) & (kp >= 0)
        allowed = valid[None, :] & (kp[None, :] <= q_pos[:, None])  # [Tq, E]
        s = s.masked_fill(~allowed.repeat(G, 1), float("-inf"))
        p = torch.softmax(torch.cat([lse.view(B, H, G * Tq, 1), s], dim=-1), dim=-1)
        out = p[..., 1:] @ self.exact_v + p[..., :1] * out_c
        return out.view(B, H, G, Tq, D).reshape(B, Hq, Tq, D).transpose(1, 2).to(query.dtype).contiguous()

    # ------------------------------------------------------------------ sizes and edits
    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if not self.is_initialized:
            return
        for t in self._state_tensors():
            t.zero_()
        self.key_pos.copy_(torch.cat([torch.arange(self.sink), torch.full((self.ring,), -1)]).to(self.device))
        for name, t in self.pre.items():
            t.fill_(1.0 if name.endswith("scale") else 0.0)
        self.kc.reset()
        self.vc.reset()
        self.is_initialized = False  # the next call is a prefill again (buffers are reallocated)

    def crop(self, max_length: int) -> None:
        """Keep the first n tokens (negative: remove that many), as the eager store's ``truncate``:
        compressed tokens past n are dropped, never decompressed back into the window."""
        if not self.is_initialized or max_length == 0:
            return
        self._compact()
        n = int(self.seen)
        keep = max(n + max_length if max_length < 0 else max_length, 0)
        if keep >= n:
            return
        c = min(int(self.comp), max(keep - self.sink, 0))
        self.seen.fill_(keep)
        self.comp.fill_(c)
        self.comp_lens.fill_(c)
        self.key_pos.masked_fill_(self.key_pos >= keep, -1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: batch rows follow ``beam_idx`` in place (same size: the buffers keep their addresses)."""
        if self.is_initialized:
            idx = beam_idx.to(self.device, torch.long)
            for t in self._batch_tensors():
                t.copy_(t.index_select(0, idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            indices = torch.as_tensor(indices)
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            self._resize_batch(indices.to(self.device, torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._resize_batch(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def _batch_tensors(self) -> list[torch.Tensor]:
        return [self.exact_k, self.exact_v, self.k_codes, self.v_codes, self.k_norms, self.v_norms,
                *self.pre.values()]

    def _resize_batch(self, idx: torch.Tensor) -> None:
        """A batch of another size: new buffers (a compiled step recompiles for the new shapes)."""
        for name in ("exact_k", "exact_v", "k_codes", "v_codes", "k_norms", "v_norms"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.pre = {name: t.index_select(0, idx) for name, t in self.pre.items()}
        self.batch_size = int(idx.numel())
        self.comp_lens = self.comp.to(torch.int32).expand(self.batch_size).clone()
        for t in self._state_tensors():
            _mark_static(t)

    def offload(self):
        pass

    def prefetch(self):
        pass

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict:
        """Bytes allocated by the layer's static buffers (they do not grow with the tokens held)."""
        if not self.is_initialized:
            return {"tokens": 0, "exact": 0, "compressed_keys": 0, "compressed_values": 0, "side": 0, "total": 0}
        nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        rep = {"tokens": int(self.seen), "exact": nb(self.exact_k, self.exact_v),
               "compressed_keys": nb(self.k_codes, self.k_norms), "compressed_values": nb(self.v_codes, self.v_norms),
               "side": nb(*self.pre.values())}
        rep["total"] = sum(v for k, v in rep.items() if k != "tokens")
        return rep


def _quant_consts(q, device) -> dict:
    """What the ops need of a TurboQuantMSE quantizer, on the cache's device."""
    return {"rot": q.rotation.to(device, torch.float32).contiguous(),
            "cb": q.codebook.to(device, torch.float32).contiguous(),
            "bits": int(q.bits), "nc": bool(q.norm_correction)}


def _mark_static(t: torch.Tensor) -> None:
    """Tell dynamo the buffer keeps its address, so cudagraph trees do not copy it every replay."""
    if not _compiling():
        torch._dynamo.mark_static_address(t)


class StaticCompressedCache(Cache):
    """Static-shape compressed cache (``CompressedCache(..., max_cache_len=N)``); see the module doc.

    Same arguments as :class:`kvcodec.hf.CompressedCache` plus ``max_cache_len``, the most tokens a
    sequence may hold (prompt + generated). ``config_or_model`` must be the model."""

    def __init__(self, config_or_model, method: str = "turboquant", key_bits: int = 4, value_bits: int | None = None,
                 *, max_cache_len: int, key_mode: str = "mse", residual: int = 128, block_size: int | None = None,
                 sink: int = 1, outliers: int = 0, seed: int = 0, key_precondition: str = "scale",
                 value_precondition: str = "none"):
        if not isinstance(config_or_model, torch.nn.Module) or not hasattr(config_or_model, "config"):
            raise ValueError("max_cache_len (static mode) needs the model, not only its config: "
                             "CompressedCache(model, ..., max_cache_len=N)")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        model = config_or_model
        self.spec = build_spec(model.config, method=method, key_bits=key_bits, value_bits=value_bits,
                               key_mode=key_mode, residual=residual, block_size=block_size, sink=sink,
                               outliers=outliers, seed=seed, key_precondition=key_precondition,
                               value_precondition=value_precondition)
        _check_supported(self.spec)  # (max_cache_len lives on the layers: transformers 5.17's Cache reads it there)
        scalings = {m.layer_idx: float(m.scaling) for m in model.modules()
                    if isinstance(getattr(m, "layer_idx", None), int) and isinstance(getattr(m, "scaling", None), float)}
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        group = cfg.num_attention_heads // self.spec.num_kv_heads
        super().__init__(layers=[StaticCompressedLayer(self.spec, i, max_cache_len, group, scalings.get(i))
                                 for i in range(self.spec.num_layers)])
        enable_static(model)

    def nbytes(self) -> int:
        """Bytes allocated by the static buffers (codes, norms, side data, sink and window ring)."""
        return sum(layer.memory()["total"] for layer in self.layers)

    def memory_report(self) -> list[dict]:
        return [{"layer": i, **layer.memory()} for i, layer in enumerate(self.layers)]


# ---------------------------------------------------------------------------------------------
# transformers hooks: the attention function and its mask function


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface ``"kvcodec_static"``: the active static layer's attention; transformers' SDPA
    for the prefill (exact prompt, like the eager cache) and when no static layer is active."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _ACTIVE.layer
    scaling = module.scaling if scaling is None else scaling
    if layer is None or layer.layer_idx != module.layer_idx or layer.prefill_now:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return layer.attend(query, scaling), None


def static_mask(*args, **kwargs):
    """Mask function of ``"kvcodec_static"``: causality comes from the cache's token positions, so no
    mask is built; padded batches are refused (checked outside compiled or captured code)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2 or _compiling():
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        if not bool(mask.all()):
            raise ValueError("the static compressed cache does not support padded batches")
    return None


def enable_static(model: torch.nn.Module) -> torch.nn.Module:
    """Register ``"kvcodec_static"`` with transformers and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, static_attention)
    AttentionMaskInterface.register(NAME, static_mask)
    model.set_attn_implementation(NAME)
    return model
