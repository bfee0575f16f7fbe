"""Static compressed cache: pre-allocated buffers, device-side lengths, a decode step a CUDA graph can hold.

``CompressedCache(model, method="turboquant", key_bits=4, value_bits=4, max_cache_len=N)`` builds a
:class:`StaticCompressedCache` (and ``CompressedCache(model, ...)`` does, growing, for a model on CUDA). Per layer it allocates, once, on the first (prefill) call:

* ``codes``/``norms`` of keys and values for ``max_cache_len`` tokens (+ one block of slack),
* ``exact_k``/``exact_v`` [B, H_kv, sink + W, D] float32 (the model's values exactly): the sink, then
  a ring of ``W = residual + 2 * block_size`` window slots (token p >= sink lives in slot ``sink +
  (p - sink) % W``),
* the key/value channel preconditioners (centre, scale) [B, H_kv, 1, D].

Every layer holds the same tokens, so what only depends on the token count lives once per cache in
:class:`SharedLengths` and is computed once per forward (by layer 0's ``update``): device scalars
``seen`` (tokens held) and ``comp`` (compressed tokens), ``comp_lens`` [B], the position each ring
slot holds, this step's slots and the step's attention mask (an additive bias over the slots).

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
``torch.compile(fullgraph=True)`` (the kernels are ``kvcodec.quant.cuda.ops`` custom ops).

Attention of a step goes through the one packed-attention path of the eager cache: the layer's
buffers are a ``QuantizedTensor`` its encodings describe for the kernel (``encoding.packed`` ->
``kvcodec.quant.PackedKV``), ``kvcodec.quant.cuda.quantized.attend_packed`` runs the kernel with the
preconditioners folded around it (``PackedConsts``, built once, not per step) and returns (q, out,
lse); the sink and ring join in one softmax where the compressed part is a single pseudo-key (its
lse), with exact keys mapped into the kernel's domain as the eager cache does. The prefill (first
call) is transformers' SDPA on the exact prompt, as in the eager cache.

Left-padded batches (``generate``'s padding) are held with each row's pads masked: pads past the
sink are never stored compressed (row b's compressed slots start at its first real token), so the
kernel's per-row lengths cover real tokens only; the sink and ring are masked per row.

Every kernel the step launches has its launch plan built before any capture, when the buffers are
described, and pinned to the layer (``kvcodec.device.plans``): a compiled or captured step allocates
nothing that outlives it, whatever other caches do to the plan caches in between.

Sliding-window layers are transformers' own ``StaticSlidingWindowLayer``: exact, attended by
transformers' SDPA (or the model's eager attention) with its sliding mask. Full-attention layers are the compressed ones.

Limits (ValueError when built): the model (its attention is switched to ``"kvcodec_static"``)
attending through transformers' attention interface with plain softmax scores (``_check_model``);
method "turboquant" with key_mode "mse", 1-4 bits, no outliers; padding on the left only; a padded
cache, or one with sliding layers, is not saved; a compiled or captured step takes at most
``block_size`` new tokens (a longer forward runs host side); a fixed ``max_cache_len`` is a hard
limit, ``max_cache_len=None`` grows. When the prompt is too short for its own compaction, the key
preconditioner is fitted on the device, on the first block that leaves the window (as the eager
store does). ``save``/``load`` write and read the eager cache's
file (``kvcodec.hf.static_convert``): the bytes are the same, so either cache loads the other's file.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcodec.device.plans import pinned_by
from kvcodec.quant.cuda import ops
from kvcodec.quant.cuda.attention import join_exact
from kvcodec.quant.cuda.quantized import PackedConsts, attend_packed
from kvcodec.hf.binding import BOUND_ATTR, attach, bound
from kvcodec.hf.cache import KvcodecCache, register_static_mode
from kvcodec.hf.methods import build_spec
from kvcodec.quant import QuantizedTensor
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES

NAME = "kvcodec_static"
EAGER_NAME = NAME + "_eager"  # the same attention, for models that attend with their eager attention (sinks)
_EMPTY_SLOT = 1 << 62  # key_pos of a ring slot that holds no token: after every query position


def _compiling() -> bool:
    """True while dynamo traces (``torch.compiler.is_compiling`` is torch >= 2.3)."""
    fn = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
    return bool(fn())


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_TRANSFORMED_KV = {"diffllama": "splits its values in halves after the cache"}  # model_type: what it does


def _check_model(model, spec) -> None:
    """Static mode serves models whose layers are full attention (compressed) or sliding-window
    attention (held exact, transformers' ``StaticSlidingWindowLayer``) with one K/V head dim, attended
    through transformers' attention interface with plain softmax scores: refuse the others here, naming
    what is not supported, instead of mis-attending them (the eager cache serves them)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    eager = "use CompressedCache(model, ..., max_cache_len=None)"
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"static mode: {type(model).__name__} does not attend through transformers' attention "
                         f"interface: {eager}")
    if getattr(text, "attn_logit_softcapping", None):
        raise ValueError(f"static mode: {type(model).__name__} soft-caps its attention scores: {eager}")
    if getattr(text, "kv_lora_rank", None):
        raise ValueError(f"static mode: {type(model).__name__} attends a latent K/V (MLA): {eager}")
    if getattr(text, "attention_chunk_size", None):  # (generate's masks for compileable caches fail on 5.17)
        raise ValueError(f"static mode: {type(model).__name__} uses chunked attention: {eager}")
    if getattr(text, "num_kv_shared_layers", 0):
        raise ValueError(f"static mode: {type(model).__name__} shares K/V between layers: {eager}")
    if getattr(text, "model_type", None) in _TRANSFORMED_KV:
        raise ValueError(f"static mode: {type(model).__name__} {_TRANSFORMED_KV[text.model_type]}: {eager}")

    kinds = [type(layer) for layer in DynamicCache(config=config).layers]
    other = sorted({k.__name__ for k in kinds if k not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if other:
        raise ValueError(f"static mode supports full-attention and sliding-window layers only; this model's cache "
                         f"also has {', '.join(other)} (chunked, linear-attention or SSM layers): {eager}")
    if DynamicLayer not in kinds:
        raise ValueError(f"static mode: {type(model).__name__} has no full-attention layer to compress: {eager}")
    if spec.value_dim != spec.head_dim:
        raise ValueError(f"static mode needs keys and values of one head dim; this model has {spec.head_dim} and "
                         f"{spec.value_dim}: {eager}")


def _check_supported(spec) -> None:
    if spec.method != "turboquant" or spec.key_mode != "mse" or spec.outliers:
        raise ValueError("static mode supports method='turboquant' with key_mode='mse' and no outliers")
    for name, bits in (("key_bits", spec.key_bits), ("value_bits", spec.value_bits)):
        for b in bits if isinstance(bits, tuple) else (bits,):  # one width, or one per layer
            if not 1 <= b <= 4:
                raise ValueError(f"static mode takes {name} in 1..4 (the fused kernel's range), got {b}")


def _mark_static(t: torch.Tensor) -> None:
    """Tell dynamo the buffer keeps its address, so cudagraph trees do not copy it every replay."""
    if not _compiling():
        torch._dynamo.mark_static_address(t)


@dataclasses.dataclass
class _LongStep:
    """A forward of more than block_size tokens: the held tokens before it and its attention mask."""

    seen: int
    comp: int
    comp_after: int
    comp_lens: torch.Tensor  # [B] int32, before the forward
    bias: torch.Tensor  # [B, q, sink + ring + q]


class SharedLengths:
    """Token counts and positions shared by every layer of one static cache (all layers hold the same
    tokens). ``begin_step`` (layer 0's update) decides this step's compaction and writes the step's
    slots and mask into fixed buffers that the other layers read: once per forward, not per layer.

    ``seen``/``comp`` int64 scalars (positions, pads included); ``pads`` [B] the left padding of each
    row's prompt and ``skip`` [B] how many of those lie past the sink (they are never stored
    compressed: row b's compressed slot of position p is ``p - sink - skip[b]``, so its valid slots
    start at 0 and ``comp_lens`` [B] int32, the kernel's lengths, counts them); ``key_pos`` [sink +
    ring] the position each exact slot holds (``_EMPTY_SLOT`` for none); per step: ``slots`` [block]
    (ring slot of each new token), ``dest`` / ``blk_dest`` [B, block] (compressed slot of each new
    token / of the block that may leave the window; a pad's is the spare ``dump`` slot, never read),
    ``blk_slots`` [block], ``move`` (the block leaves), ``bias`` [B, block, sink + ring] (0 where a
    query may attend a slot, -inf elsewhere)."""

    def __init__(self, sink: int, residual: int, block: int, ring: int):
        self.sink, self.residual, self.block, self.ring = sink, residual, block, ring
        self.batch = None
        self.padded = False  # host flag: some row of the prompt was left-padded
        self.prompt_pads = None  # [B] pads of the next prefill's prompt (set by the mask function)
        self.seen = torch.tensor(0, dtype=torch.int64)

    def allocate(self, batch: int, device: torch.device, dump: int) -> None:
        """Buffers for ``batch`` sequences on ``device`` (idempotent: every layer's init calls it);
        ``dump`` is the spare compressed slot pads are written to."""
        if self.batch == batch and self.seen.device == device:
            return
        bs = self.block
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.batch, self.dump = batch, dump
        self.seen, self.comp, self.move = z(()), z(()), z((), dt=torch.bool)
        self.pads, self.skip = z(batch), z(batch)
        self.key_pos = self._empty_positions(device)
        self.arange = torch.arange(bs, device=device)
        self.slots, self.blk_slots = z(bs), z(bs)
        self._allocate_rows(batch, device)
        for t in self.tensors():
            _mark_static(t)

    def _allocate_rows(self, batch: int, device: torch.device) -> None:
        """The per-row step buffers (lengths, compressed slots, mask) for ``batch`` rows."""
        bs, e = self.block, self.sink + self.ring
        self.comp_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.dest = torch.zeros(batch, bs, dtype=torch.int64, device=device)
        self.blk_dest = torch.zeros(batch, bs, dtype=torch.int64, device=device)
        self.bias = torch.zeros(batch, bs, e, dtype=torch.float32, device=device)

    def _empty_positions(self, device) -> torch.Tensor:
        return torch.cat([torch.arange(self.sink), torch.full((self.ring,), _EMPTY_SLOT)]).to(device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.seen, self.comp, self.move, self.pads, self.skip, self.comp_lens, self.key_pos, self.arange,
                self.slots, self.dest, self.blk_slots, self.blk_dest, self.bias]

    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        return self.sink + torch.remainder(pos - self.sink, self.ring)

    def dest_of(self, rel: torch.Tensor) -> torch.Tensor:
        """Compressed slots [B, n] of positions ``sink + rel`` ([n]) in each row; pads go to ``dump``."""
        d = rel[None, :] - self.skip[:, None]
        return torch.where(d >= 0, d, self.dump)

    def start(self) -> None:
        """The prefill's padding (``prompt_pads``, or none): host side, once per prompt."""
        pads = self.prompt_pads
        self.prompt_pads = None
        if pads is None or pads.shape != self.pads.shape:
            self.pads.zero_()
        else:
            self.pads.copy_(pads)
        self.skip.copy_((self.pads - self.sink).clamp_min(0))
        self.padded = bool(self.pads.any())

    def _update_lens(self) -> None:
        self.comp_lens.copy_((self.comp - self.skip).clamp_min(0))

    def set(self, seen: int, comp: int) -> None:
        """Host-side state after a prefill / load: ``seen`` tokens, ``comp`` compressed, window in the ring."""
        dev = self.seen.device
        self.seen.fill_(seen)
        self.comp.fill_(comp)
        self._update_lens()
        self.key_pos.copy_(self._empty_positions(dev))
        pos = torch.arange(self.sink + comp, seen, device=dev)
        self.key_pos.index_copy_(0, self.slot_of(pos), pos)

    def begin_step(self, q: int, block_path: bool) -> None:
        """One forward of ``q`` new tokens: the deferred compaction (a block leaves the window when the
        eager store would move it), the new tokens' slots, ``seen += q`` and the attention mask."""
        S, bs = self.sink, self.block
        self.move.copy_((self.seen - self.comp) >= S + self.residual + bs)
        if block_path:  # the block that would leave: positions S + comp ...
            bp = self.comp + self.arange
            self.blk_dest.copy_(self.dest_of(bp))
            self.blk_slots.copy_(self.slot_of(bp + S))
        self.comp.add_(self.move, alpha=bs)
        self._update_lens()
        pos = self.seen + self.arange[:q]
        self.dest[:, :q].copy_(self.dest_of(pos - S))
        self.slots[:q].copy_(self.slot_of(pos))
        self.key_pos.index_copy_(0, self.slots[:q], pos)
        self.seen.add_(q)
        kp = self.key_pos
        allowed = ((kp < S) | (kp >= S + self.comp)) & (kp <= pos[:, None])  # [q, sink + ring]
        allowed = allowed & ((kp >= self.pads[:, None, None]) | (kp == pos[:, None]))  # [B, q, sink + ring]
        self.bias[:, :q].copy_(torch.where(allowed, 0.0, float("-inf")))

    def begin_long(self, q: int) -> None:
        """Host side: a forward of ``q`` > block tokens (a conversation continued). ``long`` keeps what
        its attention reads (the lengths and mask before it: the held tokens, then the new ones causal);
        the shared state moves on at once to after the eager store's compaction of that forward."""
        S, E = self.sink, self.sink + self.ring
        seen, comp = int(self.seen), int(self.comp)
        dev, B = self.seen.device, self.pads.shape[0]
        pos = torch.arange(seen, seen + q, device=dev)
        kp = self.key_pos
        held = ((kp < S) | (kp >= S + comp)) & (kp < seen)  # [E]
        held = held[None, None, :] & (kp[None, None, :] >= self.pads[:, None, None])  # [B, 1, E]
        causal = pos[None, :] <= pos[:, None]  # [q, q]
        allowed = torch.cat([held.expand(B, q, E), causal.expand(B, q, q)], dim=-1)
        window = seen + q - S - comp
        after = comp + max((window - self.residual) // self.block, 0) * self.block
        self.long = _LongStep(seen, comp, after, self.comp_lens.clone(), torch.where(allowed, 0.0, float("-inf")))
        self.seen.fill_(seen + q)
        self.comp.fill_(after)
        self._update_lens()
        kept = pos[pos >= S + after]
        self.key_pos.index_copy_(0, self.slot_of(kept), kept)

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` tokens (host side): compressed tokens past them are dropped."""
        c = min(int(self.comp), max(keep - self.sink, 0))
        self.seen.fill_(keep)
        self.comp.fill_(c)
        self._update_lens()
        self.key_pos.masked_fill_(self.key_pos >= keep, _EMPTY_SLOT)

    def reset(self) -> None:
        if self.batch is not None:
            for t in (self.seen, self.comp, self.comp_lens, self.pads, self.skip):
                t.zero_()
            self.key_pos.copy_(self._empty_positions(self.key_pos.device))
        self.padded = False

    def reorder(self, idx: torch.Tensor) -> None:
        """Beam search: rows follow ``idx`` in place (same batch size)."""
        for t in (self.pads, self.skip):
            t.copy_(t.index_select(0, idx))
        self._update_lens()

    def select(self, idx: torch.Tensor) -> None:
        """Rows ``idx`` of the batch (another size: new per-row buffers)."""
        self.pads, self.skip = self.pads.index_select(0, idx), self.skip.index_select(0, idx)
        self.batch = int(idx.numel())
        self._allocate_rows(self.batch, self.pads.device)
        self._update_lens()
        for t in (self.pads, self.skip, self.comp_lens, self.dest, self.blk_dest, self.bias):
            _mark_static(t)


class StaticCompressedLayer(CacheLayerMixin):
    """One layer's static buffers and its append / compaction / attention (see the module doc)."""

    is_sliding = False
    is_croppable = True
    is_compileable = True
    compressed = True
    bound = False  # set while the cache is bound to a forward (kvcodec.hf.binding)

    def __init__(self, spec, layer_idx: int, max_cache_len: int, lengths: SharedLengths, group: int = 1,
                 scaling: float | None = None):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.max_cache_len = max_cache_len
        self.lengths = lengths
        self.group = group  # query heads per KV head
        self.scaling = spec.head_dim ** -0.5 if scaling is None else scaling  # the attention module's
        self.sink, self.residual, self.block = spec.sink, spec.residual, spec.block_size
        self.ring = spec.residual + 2 * spec.block_size
        self.kc, self.vc = spec.make_encodings(layer_idx)  # the eager encodings: prefill encodes are theirs
        self.prefill_now = False
        self.first = False  # the model's first compressed layer: it moves the shared lengths once per forward
        self.long_kv = None  # (k, v) float32 of a forward of more than block_size tokens, until attended
        self.handed = (None, None)
        self.device_fit = False  # True when the preconditioner is still to be fitted on the device

    @property
    def seen(self) -> torch.Tensor:
        return self.lengths.seen

    @property
    def comp(self) -> torch.Tensor:
        return self.lengths.comp

    # ------------------------------------------------------------------ buffers
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        self.dtype, self.device, self.batch_size, self.num_heads, self.head_dim = dt, dev, B, H, D
        if self.max_cache_len is None:  # a growable cache called without its pre-hook (kvcodec.hf.use)
            self.max_cache_len = grown_capacity(key_states.shape[-2])
        cap = max(self.max_cache_len - self.sink, 0) + self.block
        self.capacity = cap + 1  # + the spare slot pads are written to (never read: past every length)
        e = self.sink + self.ring
        # float32 (the model's values exactly): attention and quantization read them with no conversion
        self.exact_k = torch.zeros(B, H, e, D, dtype=torch.float32, device=dev)
        self.exact_v = torch.zeros(B, H, e, D, dtype=torch.float32, device=dev)
        kb, vb = self.kc.q_config()["bits"], self.vc.q_config()["bits"]  # this layer's widths
        n = self.capacity
        self.k_codes = torch.zeros(B, H, n, (D * kb + 7) // 8, dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros(B, H, n, (D * vb + 7) // 8, dtype=torch.uint8, device=dev)
        self.k_norms = torch.zeros(B, H, n, dtype=torch.float16, device=dev)
        self.v_norms = torch.zeros(B, H, n, dtype=torch.float16, device=dev)
        self.pre = {}
        for side, enc in (("k", self.kc), ("v", self.vc)):
            mode = enc.q_config()["precondition"]
            if mode != "none":
                self.pre[side + "_center"] = torch.zeros(B, H, 1, D, dtype=torch.float16, device=dev)
            if mode == "scale":
                self.pre[side + "_scale"] = torch.ones(B, H, 1, D, dtype=torch.float16, device=dev)
        self.fitted = torch.zeros((), dtype=torch.bool, device=dev)
        self.lengths.allocate(B, dev, dump=cap)
        for t in self._state_tensors():
            _mark_static(t)
        self._describe(warm=False)  # every caller installs tokens next, which describes and warms
        self.is_initialized = True

    def grow(self, max_cache_len: int) -> None:
        """Room for ``max_cache_len`` tokens (``StaticCompressedCache.grow``): before the prefill only the
        size; after it, larger code/norm buffers with the compressed tokens copied, described anew."""
        if self.is_initialized and max_cache_len > self.max_cache_len:
            n = max(max_cache_len - self.sink, 0) + self.block + 1
            for name in ("k_codes", "v_codes", "k_norms", "v_norms"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], n, *old.shape[3:])
                new[:, :, :old.shape[2]] = old
                setattr(self, name, new)
                _mark_static(new)
            self.capacity = n
            self.max_cache_len = max_cache_len
            self._describe()
        elif not self.is_initialized:
            self.max_cache_len = max_cache_len

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.exact_k, self.exact_v, self.k_codes, self.v_codes, self.k_norms, self.v_norms, self.fitted,
                *self.pre.values()]

    def _describe(self, warm: bool = True) -> None:
        """The buffers as the encodings describe them for the kernel (``encoding.packed`` of a
        QuantizedTensor over every slot: ``kvcodec.quant.PackedKV``), with the rotation and codebook on
        the device, and the preconditioner constants around the kernel (``PackedConsts``). Called
        whenever a buffer is replaced; ``_refresh_consts`` when the preconditioners change in place."""
        self.packed = {}
        for side, enc in (("k", self.kc), ("v", self.vc)):
            side_data = {name.split("_", 1)[1]: t for name, t in self.pre.items() if name.startswith(side + "_")}
            qt = QuantizedTensor(config=enc.q_config(), lead_shape=(self.batch_size, self.num_heads),
                                 num_tokens=self.capacity, dim=self.head_dim, side=side_data,
                                 token={"codes": getattr(self, side + "_codes"),
                                        "norms": getattr(self, side + "_norms")})
            p = enc.packed(qt)
            rot, cb = _device_const(p.rotation, self.device), _device_const(p.codebook, self.device)
            _mark_static(rot)  # the kernels' caches key on these tensors: a cudagraph tree must not copy them
            _mark_static(cb)
            self.packed[side] = dataclasses.replace(p, rotation=rot, codebook=cb)
        self.norm_correction = {"k": self.kc.q_config()["norm_correction"], "v": self.vc.q_config()["norm_correction"]}
        self._new_consts(warm)

    def set_scaling(self, scaling: float) -> None:
        """The attention module's scaling, seen at the prefill (host side): constants and plans anew."""
        self.scaling = float(scaling)
        self._new_consts()

    def _new_consts(self, warm: bool = True) -> None:
        """Constants built anew (not in place) and (``warm``) the kernels' plans for them, pinned."""
        self.consts = None
        self._refresh_consts()
        if warm:
            self._warm_kernels()

    def _refresh_consts(self) -> None:
        """Rebuild the float32 constants from the stored preconditioners: in place when they exist, so a
        captured graph keeps reading the same addresses (beam reorders, loads)."""
        new = PackedConsts.build(self.packed["k"], self.packed["v"], self.scaling, self.num_heads * self.group,
                                 self.device)
        pre32 = {name: t.float() for name, t in self.pre.items()}
        old = self.consts
        if old is not None and all(
                (a is None) == (b is None) and (a is None or a.shape == b.shape)
                for a, b in ((getattr(old, f), getattr(new, f)) for f in _CONST_FIELDS)):
            for f in _CONST_FIELDS:
                if getattr(new, f) is not None:
                    getattr(old, f).copy_(getattr(new, f))
            for name, t in pre32.items():
                self.pre32[name].copy_(t)
            return
        self.consts, self.pre32 = new, pre32
        for t in [*(getattr(new, f) for f in _CONST_FIELDS), *pre32.values()]:
            if t is not None:
                _mark_static(t)

    # ------------------------------------------------------------------ contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.bound:
            raise RuntimeError("a static kvcodec cache attends only in forwards it is bound to: call the model "
                               "(model(...), model.generate) or wrap direct model.forward calls in "
                               "kvcodec.hf.use(model, cache)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            if self.first:  # the first compressed layer of a forward: the prompt's padding, once
                self.lengths.start()
            self._prefill(key_states, value_states)
            self.prefill_now = True
            self.handed = (key_states, value_states)  # what the prefill's attention must receive
            return key_states, value_states
        self.prefill_now = False
        q = key_states.shape[-2]
        if q > self.block:  # a conversation continued: host side, like a prefill
            if _compiling() or _capturing(self.device):
                raise ValueError(f"static compressed cache: a compiled or captured step takes at most "
                                 f"block_size={self.block} tokens, got {q}")
            if self.first:
                self._check_room(q)
                self.lengths.begin_long(q)
            self.long_kv = (key_states.float(), value_states.float())
            return key_states, value_states
        if self.first:  # once per forward: every compressed layer holds the same tokens
            self._check_room(q)
            self.lengths.begin_step(q, block_path=not self.on_append)
        if not self.on_append:
            self._compact_block()
        L = self.lengths
        k, v = key_states.float(), value_states.float()
        self.exact_k.index_copy_(2, L.slots[:q], k)
        self.exact_v.index_copy_(2, L.slots[:q], v)
        if self.on_append:
            self._quantize_into(k, v, L.dest[:, :q])
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
        """Quantize float32 K/V [B, H, n, D] with the layer's preconditioners into compressed slots
        ``dest`` [B, n] (each row its own: left padding shifts them), in place (``tq_quantize_into``)."""
        for side, x in (("k", k), ("v", v)):
            center, scale = self._precond(side, x, move)
            if center is not None:  # ChannelPreconditioner.apply's arithmetic: the eager bytes
                x = x - center
            if scale is not None:
                x = x / scale
            p = self.packed[side]
            ops.tq_quantize_into(x, p.rotation, p.codebook, p.bits, self.norm_correction[side],
                                 getattr(self, side + "_codes"), getattr(self, side + "_norms"), dest)

    def _compact_block(self) -> None:
        """CPU path: quantize the block that may leave the window this step (``lengths.begin_step``
        decided it) into its compressed slots; it counts only when ``lengths.move`` (``comp`` grew)."""
        L = self.lengths
        self._quantize_into(self.exact_k.index_select(2, L.blk_slots), self.exact_v.index_select(2, L.blk_slots),
                            L.blk_dest, L.move)
        if self.device_fit:
            self.fitted.logical_or_(L.move)

    def _check_room(self, q: int) -> None:
        """max_cache_len is a hard limit; checked on the host only outside compiled/captured code
        (the host count is read with one sync; a captured step relies on the check of its warm-up)."""
        if _compiling() or _capturing(self.device):
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
        window = T - S
        c = (window - self.residual) // self.block * self.block if window >= self.residual + self.block else 0
        blocks = None
        if c:  # the eager encode (fits the preconditioner on the compacted tokens)
            blocks = (self.kc.packed(self.kc.encode(k[..., S:S + c, :])),
                      self.vc.packed(self.vc.encode(v[..., S:S + c, :])))
        self.install(k[:, :, :S], v[:, :, :S], blocks, c, k[:, :, S + c:], v[:, :, S + c:])

    def install(self, sink_k, sink_v, blocks, c: int, win_k, win_v) -> None:
        """Fill the buffers from the eager store's parts (host side: prefill and ``from_eager``): the sink,
        ``c`` compressed tokens as (key, value) ``PackedKV`` (None when c == 0) and the window."""
        S = self.sink
        self.exact_k[:, :, :S] = sink_k.float()
        self.exact_v[:, :, :S] = sink_v.float()
        if c:
            for side, p in zip(("k", "v"), blocks):
                codes, norms = self._unpadded(p.codes, c), self._unpadded(p.norms, c)
                getattr(self, side + "_codes")[:, :, :c] = codes
                if p.norms.dtype != getattr(self, side + "_norms").dtype:  # bf16 norms: kept for good
                    setattr(self, side + "_norms", getattr(self, side + "_norms").to(p.norms.dtype))
                    _mark_static(getattr(self, side + "_norms"))
                getattr(self, side + "_norms")[:, :, :c] = norms
                for name, t in (("center", p.center), ("scale", p.scale)):
                    if t is not None:
                        self.pre[f"{side}_{name}"].copy_(t.expand_as(self.pre[f"{side}_{name}"]))
            self.fitted.fill_(True)
        self.device_fit = not c and bool(self.pre)
        T = S + c + win_k.shape[-2]
        self.lengths.set(T, c)
        pos = torch.arange(S + c, T, device=self.device)
        slots = self.lengths.slot_of(pos)
        self.exact_k.index_copy_(2, slots, win_k.float())
        self.exact_v.index_copy_(2, slots, win_v.float())
        self._describe()
        if self.on_append:  # the window's tokens go to their future slots now
            self._quantize_into(win_k.float(), win_v.float(), self.lengths.dest_of(pos - S))

    def _unpadded(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """Compressed rows [B, H, c, ...] of positions sink .. sink + c with each row's pads past the
        sink left out (row b's slot j holds position sink + skip[b] + j; the tail is never read)."""
        if not self.lengths.padded:
            return t
        src = (torch.arange(c, device=t.device)[None, :] + self.lengths.skip[:, None]).clamp_max(c - 1)  # [B, c]
        src = src[:, None, :].expand(t.shape[0], t.shape[1], c)
        return t.gather(2, src if t.dim() == 3 else src[..., None].expand_as(t))

    def _warm_kernels(self) -> None:
        """Run the attention and quantize ops once outside any graph, under ``pinned_by(self)``: their
        launch plans (device tensors included) are built now, in the ordinary memory pool, and stay
        cached while this layer lives, so a captured or compiled step only looks them up
        (``kvcodec.device.plans``). Called whenever the buffers are described anew."""
        if self.device.type != "cuda":
            return
        with pinned_by(self):
            query = torch.zeros(self.batch_size, self.num_heads * self.group, 1, self.head_dim, device=self.device)
            attend_packed(query, self.packed["k"], self.packed["v"], self.consts, self.lengths.comp_lens)
            row = torch.zeros(1, self.head_dim, device=self.device)
            for side, p in self.packed.items():
                bf16 = getattr(self, side + "_norms").dtype == torch.bfloat16
                ops.tq_quantize(row, p.rotation, p.codebook, p.bits, self.norm_correction[side], bf16)

    def _precond(self, side: str, x: torch.Tensor, move: torch.Tensor):
        """(centre, scale) float32 for the block x: the stored ones, or, before the first fit (device_fit),
        the eager fit on this block (``calibrate``), which is stored when the block really moves."""
        center, scale = self.pre32.get(side + "_center"), self.pre32.get(side + "_scale")
        if not self.device_fit or center is None or move is None:
            return center, scale
        from kvcodec.quant.precondition import calibrate

        c16, s16 = self.pre[side + "_center"], self.pre.get(side + "_scale")
        enc = self.kc if side == "k" else self.vc
        qrms = getattr(enc, "query_rms", None)  # fitted query statistics (calibration=): the eager encode's fit
        queries = None if qrms is None else qrms.to(x.device)[..., None, :].expand(*x.shape[:-2], 1, x.shape[-1])
        fit = calibrate(x, enc.q_config()["precondition"], queries=queries)
        keep = self.fitted
        new_center = torch.where(keep, c16, fit.center)
        store = keep | move
        c16.copy_(torch.where(store, new_center, c16))
        if s16 is None:
            return new_center.float(), None
        new_scale = torch.where(keep, s16, fit.scale)
        s16.copy_(torch.where(store, new_scale, s16))
        return new_center.float(), new_scale.float()

    # ------------------------------------------------------------------ attention parts
    def _sink_logits(self, query: torch.Tensor, consts, sinks, scaling: float):
        """Sink logits [B, H_kv, G*Tq, 1] in the kernel's score domain (which lacks each query's
        ``scaling * q . centre``), or None: they join the softmax with no value (GPT-OSS)."""
        if sinks is None:
            return None
        B, Hq, Tq, D = query.shape
        H = self.num_heads
        G = Hq // H
        sink = sinks.float().view(1, H, G, 1).expand(B, H, G, Tq).reshape(B, H, G * Tq, 1)
        if consts.k_center is not None:
            q = query.float().reshape(B, H, G * Tq, D)
            sink = sink - scaling * (q * consts.k_center).sum(-1, keepdim=True)
        return sink

    def _store_long(self) -> None:
        """After ``attend`` of a forward of more than ``block_size`` tokens: the tokens that leave the window (as the eager store compacts after
        the forward) go to compressed slots, the others to the ring."""
        L, lg, S = self.lengths, self.lengths.long, self.sink
        k_new, v_new = self.long_kv
        self.long_kv = None
        dev, q = self.device, k_new.shape[-2]
        c0, c1 = S + lg.comp, S + lg.comp_after  # positions [c0, c1) leave the window
        new_pos = torch.arange(lg.seen, lg.seen + q, device=dev)
        if self.on_append:  # the ring's tokens were quantized on arrival: the new ones now
            self._quantize_into(k_new, v_new, L.dest_of(new_pos - S))
        elif c1 > c0:
            old = L.slot_of(torch.arange(c0, min(lg.seen, c1), device=dev))
            n_new = max(c1 - lg.seen, 0)
            mk = torch.cat([self.exact_k.index_select(2, old), k_new[:, :, :n_new]], dim=2)
            mv = torch.cat([self.exact_v.index_select(2, old), v_new[:, :, :n_new]], dim=2)
            move = torch.ones((), dtype=torch.bool, device=dev)
            self._quantize_into(mk, mv, L.dest_of(torch.arange(c0 - S, c1 - S, device=dev)), move)
            if self.device_fit:
                self.fitted.fill_(True)
        keep = new_pos >= c1
        self.exact_k.index_copy_(2, L.slot_of(new_pos[keep]), k_new[:, :, keep])
        self.exact_v.index_copy_(2, L.slot_of(new_pos[keep]), v_new[:, :, keep])

    # ------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, scaling: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of query [B, Hq, Tq, D] over every held token (the Tq newest are the queries'
        own); returns [B, Tq, Hq, D] in the query dtype. The compressed tokens by the kernel
        (``attend_packed``), the sink and ring in the kernel's query domain, one softmax. A forward of
        more than ``block_size`` tokens (host side, ``long_kv``) attends the held tokens as they were
        before it and its own tokens exact and causal, as the eager cache does; they are stored after
        (``_store_long``)."""
        B, Hq, Tq, D = query.shape
        H = self.num_heads
        G = Hq // H
        consts = self.consts
        if self.device_fit or scaling != self.scaling:  # fitted in this very step (or earlier, in place),
            # or another scaling: this step's constants (nothing a captured step allocates may outlive it)
            consts = PackedConsts.build(self.packed["k"], self.packed["v"], scaling, Hq, self.device)
        if self.long_kv is None:
            lens, bias = self.lengths.comp_lens, self.lengths.bias[:, None, None, :Tq]
            exact_k, exact_v = self.exact_k, self.exact_v
        else:
            lens, bias = self.lengths.long.comp_lens, self.lengths.long.bias[:, None, None]
            exact_k = torch.cat([self.exact_k, self.long_kv[0]], dim=2)
            exact_v = torch.cat([self.exact_v, self.long_kv[1]], dim=2)
        E = exact_k.shape[-2]
        q, out_c, lse = attend_packed(query, self.packed["k"], self.packed["v"], consts, lens)
        keys = torch.addcmul(consts.k_add, exact_k, consts.k_mul)  # scaling * (k - center) / scale
        s = _product(q, keys.transpose(-1, -2)).view(B, H, G, Tq, E) + bias
        out, _ = join_exact(lse, out_c, s.view(B, H, G * Tq, E), exact_v,
                            self._sink_logits(query, consts, sinks, scaling), _product)
        if self.long_kv is not None:
            self._store_long()
        return out.view(B, H, G, Tq, D).reshape(B, Hq, Tq, D).transpose(1, 2).to(query.dtype).contiguous()

    # ------------------------------------------------------------------ sizes and edits
    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        if not self.is_initialized:  # the prefill attends its own tokens (SDPA, transformers' mask)
            return query_length, 0
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
        for name, t in self.pre.items():
            t.fill_(1.0 if name.endswith("scale") else 0.0)
        self.lengths.reset()
        self.kc.reset()
        self.vc.reset()
        self.is_initialized = False  # the next call is a prefill again (buffers are reallocated)

    def crop(self, max_length: int) -> None:
        """Crop the whole cache (its layers share the token counts): ``StaticCompressedCache.crop``."""
        raise NotImplementedError("crop a static compressed cache as a whole: cache.crop(n)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: batch rows follow ``beam_idx`` in place (same size: the buffers keep their addresses)."""
        if self.is_initialized:
            idx = beam_idx.to(self.device, torch.long)
            for t in self._batch_tensors():
                t.copy_(t.index_select(0, idx))
            self._refresh_consts()

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
        """A batch of another size: new buffers (a compiled step recompiles for the new shapes); the
        shared lengths follow in ``StaticCompressedCache``."""
        for name in ("exact_k", "exact_v", "k_codes", "v_codes", "k_norms", "v_norms"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.pre = {name: t.index_select(0, idx) for name, t in self.pre.items()}
        self.batch_size = int(idx.numel())
        for t in self._state_tensors():
            _mark_static(t)
        self._describe()

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


_CONST_FIELDS = ("q_scale", "k_mul", "k_add", "k_center", "v_scale", "v_center")


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of the window attention (float32, [B, H, m, k] @ [B, H, k, n], m and n small). In a
    compiled step as a broadcast product summed over k, which inductor fuses with its neighbours into
    one reduction: 13 us a layer instead of 33 for cuBLAS's float32 kernels at 1 x 32k on an H100
    (8B shape: m = 4 query heads a KV head, k or n = 385 window slots, the other 128). Eager code keeps
    the matmul (the broadcast product would be materialized)."""
    if _compiling():
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
    return a @ b


def _device_const(t: torch.Tensor, device) -> torch.Tensor:
    """A quantizer's float32 constant (rotation, codebook) on the cache's device, one tensor per value:
    every cache of a model then hands the kernels the same constants, so the launch plans built for
    one cache (host work, ~6 ms each on a GPU) serve the next fresh cache of that shape. Never written
    to (the kernels and the plans only read them)."""
    src = t.detach().to("cpu", torch.float32).contiguous()
    key = (str(torch.device(device)), tuple(src.shape), hashlib.sha1(src.numpy().tobytes()).digest())
    hit = _CONSTS.get(key)
    if hit is None:
        if len(_CONSTS) >= _CONSTS_LIMIT:
            _CONSTS.clear()
        hit = _CONSTS[key] = src.to(device).contiguous()
    return hit


_CONSTS: dict = {}  # (device, shape, digest of the float32 bytes) -> the constant on that device
_CONSTS_LIMIT = 1024  # two per layer and side: a few models' worth


class StaticCompressedCache(KvcodecCache):
    """Static-shape compressed cache (``CompressedCache(..., max_cache_len=N)``); see the module doc.

    Same arguments as :class:`kvcodec.hf.CompressedCache` plus ``max_cache_len``, the most tokens a
    sequence may hold (prompt + generated), or None: the buffers grow (``grown_capacity``) when a
    forward needs more room, which the binding's pre-hook finds from the forward's input length before
    the forward runs (host side; a compiled ``generate`` step breaks its graph there, and each growth
    is a new buffer shape: one more capture). ``config_or_model`` must be the model."""

    attention_name = NAME

    def __init__(self, config_or_model, method: str = "turboquant", key_bits: int = 4, value_bits: int | None = None,
                 *, max_cache_len: int, key_mode: str = "mse", residual: int = 128, block_size: int | None = None,
                 sink: int = 1, outliers: int = 0, seed: int = 0, key_precondition: str = "scale",
                 value_precondition: str = "none", preset: str | None = None, attention=None, **spec_options):
        if not isinstance(config_or_model, torch.nn.Module) or not hasattr(config_or_model, "config"):
            raise ValueError("max_cache_len (static mode) needs the model, not only its config: "
                             "CompressedCache(model, ..., max_cache_len=N)")
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive integer or None (grow), got {max_cache_len!r}")
        self.growable = max_cache_len is None
        # models that cannot run SDPA (sink logits) keep their eager attention for the exact tokens
        self.attention_name = NAME if getattr(config_or_model, "_supports_sdpa", True) else EAGER_NAME
        self._host_seen = None  # tokens held, counted on the host by before_forward (growable caches)
        if attention is not None:
            raise ValueError("attention options are the eager cache's; the static mode always runs its own path")
        model = config_or_model
        self.config = model.config
        options = dict(method=method, key_bits=key_bits, value_bits=value_bits, key_mode=key_mode, residual=residual,
                       block_size=block_size, sink=sink, outliers=outliers, seed=seed,
                       key_precondition=key_precondition, value_precondition=value_precondition, **spec_options)
        if preset is not None:  # a named quality preset sets the quantizer options, as in CompressedCache
            from kvcodec.hf.presets import preset_options

            options.update(preset_options(preset, model.config))
        self.spec = build_spec(model.config, **options)
        _check_model(model, self.spec)
        _check_supported(self.spec)  # (max_cache_len lives on the layers: transformers 5.17's Cache reads it there)
        scalings = {m.layer_idx: float(m.scaling) for m in model.modules()
                    if isinstance(getattr(m, "layer_idx", None), int) and isinstance(getattr(m, "scaling", None), float)}
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        group = cfg.num_attention_heads // self.spec.num_kv_heads
        sp = self.spec
        self.lengths = SharedLengths(sp.sink, sp.residual, sp.block_size, sp.residual + 2 * sp.block_size)
        super().__init__(layers=_static_layers(model.config, sp, max_cache_len, self.lengths, group, scalings))
        self.first_layer = next(layer for layer in self.layers if isinstance(layer, StaticCompressedLayer))
        self.first_layer.first = True
        enable_static(model)

    @property
    def all_compressed(self) -> bool:
        """Every layer is a compressed one (no sliding-window layers)."""
        return all(isinstance(layer, StaticCompressedLayer) for layer in self.layers)

    def before_forward(self, args: tuple, kwargs: dict) -> None:
        """Before a prefill: the prompt's left padding, from the forward's attention mask (2D, or the 4D
        mask ``generate`` builds for compileable caches, whose last query row is a real token). A
        growable cache also makes room for the forward's tokens (``_make_room``)."""
        if self.growable:
            _make_room(self, _input_length(args, kwargs))
        if self.first_layer.is_initialized:
            return
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]  # (input_ids, attention_mask, ...) positionally
        if isinstance(mask, dict):  # generate's masks of a model with several layer types
            mask = mask.get("full_attention")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            row = mask[:, 0, -1, :]
            mask = row if row.dtype == torch.bool else row == 0
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            self.lengths.prompt_pads = _left_pads(mask, check=not _compiling())

    def make_room(self, tokens: int) -> None:
        """A growable cache's size for ``tokens`` held (``grown_capacity``), grown if it is smaller."""
        current = self.first_layer.max_cache_len or 0
        if tokens > current:
            self.grow(grown_capacity(tokens, current))

    def fill(self, keys: torch.Tensor, values: torch.Tensor) -> "StaticCompressedCache":
        """Fill an empty cache with dense K/V [layers, batch, heads, tokens, dim] (a stored prefix):
        compressed as the eager cache compresses them (through its eager form, the same bytes)."""
        from kvcodec.hf.cache import CompressedCache
        from kvcodec.hf.static_convert import from_eager

        eager = CompressedCache(self.config, **self.spec.options(), max_cache_len=None)
        for i in range(keys.shape[0]):
            eager.update(keys[i], values[i], i)
        return from_eager(eager, self)

    def grow(self, max_cache_len: int) -> None:
        """Room for ``max_cache_len`` tokens per sequence: larger buffers, the held tokens copied, launch
        plans built anew (host side; a compiled step recompiles or re-captures for the new shapes)."""
        for layer in self.compressed_layers():
            layer.grow(max_cache_len)
        if self.first_layer.is_initialized:
            self.lengths.dump = self.first_layer.capacity - 1

    def nbytes(self) -> int:
        """Bytes allocated by the static buffers (codes, norms, side data, sink and window ring; the
        exact K/V of sliding-window layers)."""
        return sum(_memory(layer)["total"] for layer in self.layers)

    def memory_report(self) -> list[dict]:
        return [{"layer": i, **_memory(layer)} for i, layer in enumerate(self.layers)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: every row follows ``beam_idx`` in place (the buffers keep their addresses)."""
        if self.first_layer.is_initialized:
            self.lengths.reorder(beam_idx.to(self.first_layer.device, torch.long))
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.first_layer.is_initialized:
            indices = torch.as_tensor(indices)
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            self.lengths.select(indices.to(self.first_layer.device, torch.long))
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.first_layer.is_initialized:
            first = self.first_layer
            self.lengths.select(torch.arange(first.batch_size, device=first.device).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)

    def compact(self) -> None:
        """Apply the compaction the last step deferred to the next one (a block leaves the window when
        the eager store would have moved it): afterwards the buffers hold what the eager cache holds."""
        first = self.first_layer
        if not first.is_initialized:
            return
        L = self.lengths
        with torch.no_grad():
            L.begin_step(0, block_path=not first.on_append)
            for layer in self.layers:
                if layer.is_initialized and not layer.on_append:
                    layer._compact_block()

    def crop(self, max_length: int) -> None:
        """Keep the first n tokens (negative: remove that many), as the eager store's ``truncate``:
        compressed tokens past n are dropped, never decompressed back into the window."""
        if not self.first_layer.is_initialized or max_length == 0:
            return
        self.compact()
        n = int(self.lengths.seen)
        keep = max(n + max_length if max_length < 0 else max_length, 0)
        if keep < n:
            self.lengths.crop(keep)
        self._host_seen = None  # read from the device at the next forward of a growable cache

    def reset(self) -> None:
        super().reset()
        self._host_seen = None

    def to_eager(self):
        """An eager :class:`~kvcodec.hf.CompressedCache` holding the same tokens and bytes (not tied to the
        model's attention: build it with the config); see ``kvcodec.hf.static_convert``."""
        from kvcodec.hf.static_convert import to_eager

        self._refuse_padded("converted to an eager cache")
        return to_eager(self)

    def _refuse_padded(self, what: str) -> None:
        if self.lengths.padded:
            raise ValueError(f"a static cache of a left-padded batch cannot be {what}: its pad tokens are not stored")
        if any(not isinstance(layer, StaticCompressedLayer) for layer in self.layers):
            raise ValueError(f"a static cache with sliding-window layers cannot be {what} (those layers are "
                             "transformers' own); the eager cache can")

    def save(self, path, *, overwrite: bool = False) -> None:
        """Write the cache in the eager cache's format (the same bytes): either cache loads it. An
        existing ``path`` raises kvcodec.WriteRefusedError unless ``overwrite=True``."""
        from kvcodec.hf.persist import save_cache

        self._refuse_padded("saved")
        save_cache(self, path, overwrite=overwrite)

    @classmethod
    def load(cls, path, model, max_cache_len: int, device: str | torch.device = "cpu",
             max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> "StaticCompressedCache":
        """Read a cache file written by either cache's ``save`` into a static cache of ``max_cache_len``."""
        from kvcodec.hf.cache import CompressedCache
        from kvcodec.hf.persist import load_cache
        from kvcodec.hf.static_convert import from_eager

        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ValueError("loading a static cache (max_cache_len) needs the model, not only its config")
        eager = load_cache(CompressedCache, path, model.config, device=device, max_output_bytes=max_output_bytes)
        return from_eager(eager, cls(model, **eager.spec.options(), max_cache_len=max_cache_len))


def _static_layers(config, spec, max_cache_len, lengths, group, scalings) -> list:
    """One layer per layer of ``DynamicCache(config=config)``: a StaticCompressedLayer for full attention,
    transformers' StaticSlidingWindowLayer (exact, the window's size) for sliding windows."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

    layers = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            window = int(layer.sliding_window)
            # a growable cache's sliding layers never grow: the window's size (+1: never "croppable")
            layers.append(StaticSlidingWindowLayer(max_cache_len=max_cache_len or window + 1, sliding_window=window))
        else:
            layers.append(StaticCompressedLayer(spec, i, max_cache_len, lengths, group, scalings.get(i)))
    return layers


def _memory(layer) -> dict:
    if isinstance(layer, StaticCompressedLayer):
        return layer.memory()
    held = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
    exact = sum(t.numel() * t.element_size() for t in held) if layer.is_initialized else 0
    return {"tokens": int(layer.get_seq_length()) if layer.is_initialized else 0, "exact": exact,
            "compressed_keys": 0, "compressed_values": 0, "side": 0, "total": exact}


PAGE = 4096  # a growable cache's sizes are multiples of this many tokens
HEADROOM = 1024  # the least room a growable cache's first size leaves past its prompt


def grown_capacity(tokens: int, current: int = 0) -> int:
    """A growable cache's next size for ``tokens`` held: the first size a prompt of n tokens gets is n
    plus an eighth (at least HEADROOM) rounded up to PAGE; later it doubles until the tokens fit, so a
    generation of any length captures its step a bounded number of times (log2 of the growth)."""
    if current <= 0:
        want = tokens + max(tokens // 8, HEADROOM)
        return -(-want // PAGE) * PAGE
    size = current
    while size < tokens:
        size *= 2
    return size


def _input_length(args: tuple, kwargs: dict) -> int:
    """New tokens of a forward: the length of its input_ids or inputs_embeds (0 when neither is found)."""
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor):
            return x.shape[1]
    return args[0].shape[1] if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 else 0


def _make_room(cache: StaticCompressedCache, q: int) -> None:
    """``_grow_if_needed`` outside dynamo's graphs (wrapped on first use: importing torch._dynamo
    costs ~1.6 s, which ``import kvcodec.hf`` should not pay)."""
    global _room_outside_graphs
    if _room_outside_graphs is None:
        _room_outside_graphs = torch.compiler.disable(_grow_if_needed)
    _room_outside_graphs(cache, q)


_room_outside_graphs = None


def _grow_if_needed(cache: StaticCompressedCache, q: int) -> None:
    """Host side, before a forward of ``q`` tokens on a growable cache: grow it when they do not fit.
    The count of held tokens is kept on the host (read from the device once after a crop or load), so
    a decode step never waits for the GPU; outside dynamo's graphs (a graph break in a compiled step)."""
    first = cache.first_layer
    if not first.is_initialized:
        cache._host_seen = 0
    elif cache._host_seen is None:
        cache._host_seen = int(cache.lengths.seen)
    need = cache._host_seen + q
    if first.max_cache_len is None or need > first.max_cache_len:
        cache.grow(grown_capacity(need, first.max_cache_len or 0))
    cache._host_seen = need


# ---------------------------------------------------------------------------------------------
# transformers hooks: the attention function and its mask function


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface ``"kvcodec_static"`` (and ``"kvcodec_static_eager"``): the bound static cache's
    compressed layer attends; the prefill (the exact prompt, like the eager cache) and the sliding-window
    layers go to transformers' SDPA, or to the model's own eager attention for models that cannot run
    SDPA (sink logits: GPT-OSS), with the mask ``static_mask`` built in that format."""
    binding = bound(module)
    cache = None if binding is None else binding.cache
    layer = None if cache is None else cache.layers[module.layer_idx]
    scaling = module.scaling if scaling is None else scaling
    if not isinstance(layer, StaticCompressedLayer) or layer.prefill_now:
        if isinstance(layer, StaticCompressedLayer):
            _check_prefill(module, layer, key, value, kwargs)
            if scaling != layer.scaling:  # the module's own (host side, before any capture)
                layer.set_scaling(scaling)
        delegate = _delegate(module, cache)
        return delegate(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return layer.attend(query, scaling, _sinks(module, kwargs)), None


def _delegate(module, cache):
    """The attention the static cache hands exact tokens to: SDPA, or the model's eager attention."""
    if getattr(cache, "attention_name", NAME) == EAGER_NAME:
        from kvcodec.hf.attention import _eager_function

        return _eager_function(module)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _sinks(module, kwargs):
    """The layer's sink logits [heads] (GPT-OSS passes them as ``s_aux`` and keeps them as ``sinks``)."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def _check_prefill(module, layer, key, value, kwargs) -> None:
    """The prefill's attention must receive what the layer's ``update`` returned, and no soft-capping:
    a model that attends K/V computed from its cache entries would be mis-attended by every later
    step. Refused loudly on the first forward."""
    handed = layer.handed
    layer.handed = (None, None)
    if handed[0] is not key or handed[1] is not value:
        raise RuntimeError(f"layer {layer.layer_idx} of {type(module).__name__} attends K/V computed from its cache "
                           "entries, which the static mode cannot serve: CompressedCache(model, ..., max_cache_len=None)")
    if kwargs.get("softcap"):
        raise RuntimeError(f"{type(module).__name__} soft-caps its attention scores, which the static mode does "
                           "not apply: CompressedCache(model, ..., max_cache_len=None)")


def static_mask(*args, **kwargs):
    """Mask function of ``"kvcodec_static"``: SDPA's boolean masks (``static_eager_mask``: eager's
    additive ones). The prefill gets transformers' mask over the prompt (padding included), and the
    prompt's left padding is handed to the cache; sliding-window layers get transformers' sliding
    mask; a decode step of the compressed layers builds none (the cache masks by token position and
    padding). Padding that is not on the left, or that changes after the prefill, raises ValueError
    (checked outside compiled or captured code)."""
    from transformers.masking_utils import sdpa_mask

    return _static_mask(sdpa_mask, *args, **kwargs)


def static_eager_mask(*args, **kwargs):
    """``static_mask`` with eager's additive float masks (models that attend with their eager attention)."""
    from transformers.masking_utils import eager_mask

    return _static_mask(eager_mask, *args, **kwargs)


def _static_mask(build, *args, **kwargs):
    binding = getattr(kwargs.get("config"), BOUND_ATTR, None)
    cache = None if binding is None else binding.cache
    mask = kwargs.get("attention_mask")
    if cache is None or not isinstance(cache, StaticCompressedCache):
        return None
    if kwargs.get("local_size") is not None:  # the mask of the sliding-window layers (transformers' own)
        return build(*args, **kwargs)
    host = not _compiling() and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    if not cache.first_layer.is_initialized:  # the prefill (its padding: before_forward, or here)
        if cache.lengths.prompt_pads is None:
            cache.lengths.prompt_pads = _left_pads(mask, check=host)
        return build(*args, **kwargs)
    if host and mask is not None and mask.dim() == 2 and mask.shape[-1] == int(cache.lengths.seen) + kwargs.get("q_length", 1):
        pads = cache.lengths.pads
        want = torch.arange(mask.shape[-1], device=mask.device)[None, :] >= pads.to(mask.device)[:, None]
        if not torch.equal(mask.bool(), want):
            raise ValueError("the static compressed cache takes the padding of the prompt only (left padding, "
                             "unchanged while it decodes)")
    return None


def _left_pads(mask, check: bool) -> torch.Tensor | None:
    """[B] leading zeros of a 2D attention mask (None: no mask); ValueError where a row is not left padded."""
    if mask is None or mask.dim() != 2:
        return None
    m = mask.bool()
    pads = (m.long().cumsum(-1) == 0).sum(-1)
    if check and not torch.equal(m, torch.arange(m.shape[-1], device=m.device)[None, :] >= pads[:, None]):
        raise ValueError("the static compressed cache takes left-padded batches only (a 0 after a 1 in the "
                         "attention mask)")
    return pads


def enable_static(model: torch.nn.Module) -> torch.nn.Module:
    """Register ``"kvcodec_static"`` with transformers and attach the binding hooks to ``model``: its
    forwards switch to it only while they receive a static cache (``kvcodec.hf.binding``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, static_attention)
    AttentionMaskInterface.register(NAME, static_mask)
    AttentionInterface.register(EAGER_NAME, static_attention)
    AttentionMaskInterface.register(EAGER_NAME, static_eager_mask)
    return attach(model)


register_static_mode(StaticCompressedCache)
