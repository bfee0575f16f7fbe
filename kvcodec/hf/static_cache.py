"""Static compressed cache: pre-allocated buffers, device-side lengths, a decode step a CUDA graph can hold.

``CompressedCache(model, method="turboquant", key_bits=4, value_bits=4, max_cache_len=N)`` builds a
:class:`StaticCompressedCache`. Per layer it allocates, once, on the first (prefill) call:

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

Limits (ValueError): method "turboquant" with key_mode "mse", 1-4 bits, no outliers; the model must
be passed (its attention is switched to ``"kvcodec_static"``); no padded batches; after the prefill at
most ``block_size`` tokens per forward; ``max_cache_len`` is a hard limit. When the prompt is too
short for its own compaction, the key preconditioner is fitted on the device, on the first block
that leaves the window (as the eager store does). ``save``/``load`` write and read the eager cache's
file (``kvcodec.hf.static_convert``): the bytes are the same, so either cache loads the other's file.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from kvcodec.quant.cuda import ops
from kvcodec.quant.cuda.quantized import PackedConsts, attend_packed
from kvcodec.hf.binding import attach
from kvcodec.hf.cache import KvcodecCache, register_static_mode
from kvcodec.hf.methods import build_spec
from kvcodec.quant import QuantizedTensor
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES

NAME = "kvcodec_static"
_EMPTY_SLOT = 1 << 62  # key_pos of a ring slot that holds no token: after every query position


def _compiling() -> bool:
    """True while dynamo traces (``torch.compiler.is_compiling`` is torch >= 2.3)."""
    fn = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
    return bool(fn())


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Active:
    """The layer whose ``update`` ran last: transformers does not pass the cache to attention
    functions, and the attention of a layer always follows its ``update`` in the same forward."""

    layer = None


_ACTIVE = _Active()


def _check_model(config, spec) -> None:
    """Static mode serves models whose every layer is full attention with one K/V head dim: refuse the
    others here, naming what is not supported, instead of mis-attending them (the eager cache serves them)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    other = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer})
    if other:
        raise ValueError(f"max_cache_len (static mode) supports full-attention layers only; this model's cache also "
                         f"has {', '.join(other)} (sliding-window, linear-attention or SSM layers): use "
                         "CompressedCache(model, ...) without max_cache_len")
    if spec.value_dim != spec.head_dim:
        raise ValueError(f"max_cache_len (static mode) needs keys and values of one head dim; this model has "
                         f"{spec.head_dim} and {spec.value_dim} (MLA): use CompressedCache(model, ...) without max_cache_len")


def _check_supported(spec) -> None:
    if spec.method != "turboquant" or spec.key_mode != "mse" or spec.outliers:
        raise ValueError("max_cache_len (static mode) supports method='turboquant' with key_mode='mse' and no outliers")
    for name, bits in (("key_bits", spec.key_bits), ("value_bits", spec.value_bits)):
        for b in bits if isinstance(bits, tuple) else (bits,):  # one width, or one per layer
            if not 1 <= b <= 4:
                raise ValueError(f"static mode takes {name} in 1..4 (the fused kernel's range), got {b}")


def _mark_static(t: torch.Tensor) -> None:
    """Tell dynamo the buffer keeps its address, so cudagraph trees do not copy it every replay."""
    if not _compiling():
        torch._dynamo.mark_static_address(t)


class SharedLengths:
    """Token counts and positions shared by every layer of one static cache (all layers hold the same
    tokens). ``begin_step`` (layer 0's update) decides this step's compaction and writes the step's
    slots and mask into fixed buffers that the other layers read: once per forward, not per layer.

    ``seen``/``comp`` int64 scalars; ``comp_lens`` [B] int32 (the kernel's lengths); ``key_pos``
    [sink + ring] the position each exact slot holds (``_EMPTY_SLOT`` for none); per step: ``slots``
    / ``dest`` [block] (ring slot and compressed slot of each new token), ``blk_slots`` / ``blk_dest``
    (CPU: the block that may leave the window), ``move`` (it does), ``bias`` [block, sink + ring]
    (0 where a query may attend a slot, -inf elsewhere)."""

    def __init__(self, sink: int, residual: int, block: int, ring: int):
        self.sink, self.residual, self.block, self.ring = sink, residual, block, ring
        self.batch = None
        self.seen = torch.tensor(0, dtype=torch.int64)

    def allocate(self, batch: int, device: torch.device) -> None:
        """Buffers for ``batch`` sequences on ``device`` (idempotent: every layer's init calls it)."""
        if self.batch == batch and self.seen.device == device:
            return
        S, bs, e = self.sink, self.block, self.sink + self.ring
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.batch = batch
        self.seen, self.comp, self.move = z(()), z(()), z((), dt=torch.bool)
        self.comp_lens = z(batch, dt=torch.int32)
        self.key_pos = self._empty_positions(device)
        self.arange = torch.arange(bs, device=device)
        self.slots, self.dest, self.blk_slots, self.blk_dest = z(bs), z(bs), z(bs), z(bs)
        self.bias = z(bs, e, dt=torch.float32)
        for t in self.tensors():
            _mark_static(t)

    def _empty_positions(self, device) -> torch.Tensor:
        return torch.cat([torch.arange(self.sink), torch.full((self.ring,), _EMPTY_SLOT)]).to(device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.seen, self.comp, self.move, self.comp_lens, self.key_pos, self.arange, self.slots, self.dest,
                self.blk_slots, self.blk_dest, self.bias]

    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        return self.sink + torch.remainder(pos - self.sink, self.ring)

    def set(self, seen: int, comp: int) -> None:
        """Host-side state after a prefill / load: ``seen`` tokens, ``comp`` compressed, window in the ring."""
        dev = self.seen.device
        self.seen.fill_(seen)
        self.comp.fill_(comp)
        self.comp_lens.fill_(comp)
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
            self.blk_dest.copy_(bp)
            self.blk_slots.copy_(self.slot_of(bp + S))
        self.comp.add_(self.move, alpha=bs)
        self.comp_lens.copy_(self.comp.expand_as(self.comp_lens))
        pos = self.seen + self.arange[:q]
        self.dest[:q].copy_(pos - S)
        self.slots[:q].copy_(self.slot_of(pos))
        self.key_pos.index_copy_(0, self.slots[:q], pos)
        self.seen.add_(q)
        kp = self.key_pos
        allowed = ((kp < S) | (kp >= S + self.comp)) & (kp <= pos[:, None])  # [q, sink + ring]
        self.bias[:q].copy_(torch.where(allowed, 0.0, float("-inf")))

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` tokens (host side): compressed tokens past them are dropped."""
        c = min(int(self.comp), max(keep - self.sink, 0))
        self.seen.fill_(keep)
        self.comp.fill_(c)
        self.comp_lens.fill_(c)
        self.key_pos.masked_fill_(self.key_pos >= keep, _EMPTY_SLOT)

    def reset(self) -> None:
        if self.batch is not None:
            for t in (self.seen, self.comp, self.comp_lens):
                t.zero_()
            self.key_pos.copy_(self._empty_positions(self.key_pos.device))

    def resize_batch(self, batch: int) -> None:
        if batch != self.comp_lens.numel():
            self.comp_lens = self.comp.to(torch.int32).expand(batch).clone()
            self.batch = batch
            _mark_static(self.comp_lens)


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
        cap = max(self.max_cache_len - self.sink, 0) + self.block
        self.capacity = cap
        e = self.sink + self.ring
        # float32 (the model's values exactly): attention and quantization read them with no conversion
        self.exact_k = torch.zeros(B, H, e, D, dtype=torch.float32, device=dev)
        self.exact_v = torch.zeros(B, H, e, D, dtype=torch.float32, device=dev)
        kb, vb = self.kc.q_config()["bits"], self.vc.q_config()["bits"]  # this layer's widths
        self.k_codes = torch.zeros(B, H, cap, (D * kb + 7) // 8, dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros(B, H, cap, (D * vb + 7) // 8, dtype=torch.uint8, device=dev)
        self.k_norms = torch.zeros(B, H, cap, dtype=torch.float16, device=dev)
        self.v_norms = torch.zeros(B, H, cap, dtype=torch.float16, device=dev)
        self.pre = {}
        for side, enc in (("k", self.kc), ("v", self.vc)):
            mode = enc.q_config()["precondition"]
            if mode != "none":
                self.pre[side + "_center"] = torch.zeros(B, H, 1, D, dtype=torch.float16, device=dev)
            if mode == "scale":
                self.pre[side + "_scale"] = torch.ones(B, H, 1, D, dtype=torch.float16, device=dev)
        self.fitted = torch.zeros((), dtype=torch.bool, device=dev)
        self.lengths.allocate(B, dev)
        for t in self._state_tensors():
            _mark_static(t)
        self._describe()
        self.is_initialized = True

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.exact_k, self.exact_v, self.k_codes, self.v_codes, self.k_norms, self.v_norms, self.fitted,
                *self.pre.values()]

    def _describe(self) -> None:
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
        self.consts = None
        self._refresh_consts()

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
        if self.layer_idx == 0:  # once per forward: every layer holds the same tokens
            self._check_room(q)
            self.lengths.begin_step(q, block_path=not self.on_append)
        if not self.on_append:
            self._compact_block()
        L = self.lengths
        k, v = key_states.float(), value_states.float()
        self.exact_k.index_copy_(2, L.slots[:q], k)
        self.exact_v.index_copy_(2, L.slots[:q], v)
        if self.on_append:
            self._quantize_into(k, v, L.dest[:q])
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
            if center is not None:  # ChannelPreconditioner.apply's arithmetic: the eager bytes
                x = x - center
            if scale is not None:
                x = x / scale
            p = self.packed[side]
            norms_buf = getattr(self, side + "_norms")
            codes, norms = ops.tq_quantize(x, p.rotation, p.codebook, p.bits, self.norm_correction[side],
                                           norms_buf.dtype == torch.bfloat16)
            getattr(self, side + "_codes").index_copy_(2, dest, codes)
            norms_buf.index_copy_(2, dest, norms)

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
                getattr(self, side + "_codes")[:, :, :c] = p.codes
                if p.norms.dtype != getattr(self, side + "_norms").dtype:  # bf16 norms: kept for good
                    setattr(self, side + "_norms", getattr(self, side + "_norms").to(p.norms.dtype))
                    _mark_static(getattr(self, side + "_norms"))
                getattr(self, side + "_norms")[:, :, :c] = p.norms
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
            self._quantize_into(win_k.float(), win_v.float(), pos - S)
        self._warm_kernels()

    def _warm_kernels(self) -> None:
        """Run the attention and quantize ops once outside any graph: the launcher's cached plan and
        derived constants are then allocated in the ordinary pool, not inside a cudagraph tree's pool."""
        if self.device.type == "cuda":
            query = torch.zeros(self.batch_size, self.num_heads * self.group, 1, self.head_dim, device=self.device)
            attend_packed(query, self.packed["k"], self.packed["v"], self.consts, self.lengths.comp_lens)
            row = torch.zeros(1, self.head_dim, device=self.device)
            for side, p in self.packed.items():
                ops.tq_quantize(row, p.rotation, p.codebook, p.bits, self.norm_correction[side], False)

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

    # ------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of query [B, Hq, Tq, D] over every held token (the Tq newest are the queries'
        own); returns [B, Tq, Hq, D] in the query dtype. The compressed tokens by the kernel
        (``attend_packed``), the sink and ring in the kernel's query domain, one softmax."""
        B, Hq, Tq, D = query.shape
        H, E = self.num_heads, self.exact_k.shape[-2]
        G = Hq // H
        if scaling != self.scaling:  # (the module's scaling is a constant: set once)
            self.scaling = scaling
            self.consts = None
            self._refresh_consts()
        consts = self.consts
        if self.device_fit:  # the preconditioner may have been fitted in this very step
            consts = PackedConsts.build(self.packed["k"], self.packed["v"], scaling, Hq, self.device)
        q, out_c, lse = attend_packed(query, self.packed["k"], self.packed["v"], consts, self.lengths.comp_lens)
        keys = torch.addcmul(consts.k_add, self.exact_k, consts.k_mul)  # scaling * (k - center) / scale
        s = (q @ keys.transpose(-1, -2)).view(B, H, G, Tq, E) + self.lengths.bias[:Tq]
        p = torch.softmax(torch.cat([lse, s.view(B, H, G * Tq, E)], dim=-1), dim=-1)
        out = torch.addcmul(p[..., 1:] @ self.exact_v, p[..., :1], out_c)
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
        """A batch of another size: new buffers (a compiled step recompiles for the new shapes)."""
        for name in ("exact_k", "exact_v", "k_codes", "v_codes", "k_norms", "v_norms"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.pre = {name: t.index_select(0, idx) for name, t in self.pre.items()}
        self.batch_size = int(idx.numel())
        self.lengths.resize_batch(self.batch_size)
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


def _device_const(t: torch.Tensor, device) -> torch.Tensor:
    """A quantizer's float32 constant (rotation, codebook) on the cache's device."""
    return t.to(device, torch.float32).contiguous()


class StaticCompressedCache(KvcodecCache):
    """Static-shape compressed cache (``CompressedCache(..., max_cache_len=N)``); see the module doc.

    Same arguments as :class:`kvcodec.hf.CompressedCache` plus ``max_cache_len``, the most tokens a
    sequence may hold (prompt + generated). ``config_or_model`` must be the model."""

    attention_name = NAME

    def __init__(self, config_or_model, method: str = "turboquant", key_bits: int = 4, value_bits: int | None = None,
                 *, max_cache_len: int, key_mode: str = "mse", residual: int = 128, block_size: int | None = None,
                 sink: int = 1, outliers: int = 0, seed: int = 0, key_precondition: str = "scale",
                 value_precondition: str = "none", preset: str | None = None, attention=None, **spec_options):
        if not isinstance(config_or_model, torch.nn.Module) or not hasattr(config_or_model, "config"):
            raise ValueError("max_cache_len (static mode) needs the model, not only its config: "
                             "CompressedCache(model, ..., max_cache_len=N)")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
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
        _check_model(model.config, self.spec)
        _check_supported(self.spec)  # (max_cache_len lives on the layers: transformers 5.17's Cache reads it there)
        scalings = {m.layer_idx: float(m.scaling) for m in model.modules()
                    if isinstance(getattr(m, "layer_idx", None), int) and isinstance(getattr(m, "scaling", None), float)}
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        group = cfg.num_attention_heads // self.spec.num_kv_heads
        sp = self.spec
        self.lengths = SharedLengths(sp.sink, sp.residual, sp.block_size, sp.residual + 2 * sp.block_size)
        super().__init__(layers=[StaticCompressedLayer(sp, i, max_cache_len, self.lengths, group, scalings.get(i))
                                 for i in range(sp.num_layers)])
        enable_static(model)

    def nbytes(self) -> int:
        """Bytes allocated by the static buffers (codes, norms, side data, sink and window ring)."""
        return sum(layer.memory()["total"] for layer in self.layers)

    def memory_report(self) -> list[dict]:
        return [{"layer": i, **layer.memory()} for i, layer in enumerate(self.layers)]

    def compact(self) -> None:
        """Apply the compaction the last step deferred to the next one (a block leaves the window when
        the eager store would have moved it): afterwards the buffers hold what the eager cache holds."""
        first = self.layers[0]
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
        if not self.layers[0].is_initialized or max_length == 0:
            return
        self.compact()
        n = int(self.lengths.seen)
        keep = max(n + max_length if max_length < 0 else max_length, 0)
        if keep < n:
            self.lengths.crop(keep)

    def to_eager(self):
        """An eager :class:`~kvcodec.hf.CompressedCache` holding the same tokens and bytes (not tied to the
        model's attention: build it with the config); see ``kvcodec.hf.static_convert``."""
        from kvcodec.hf.static_convert import to_eager

        return to_eager(self)

    def save(self, path, *, overwrite: bool = False) -> None:
        """Write the cache in the eager cache's format (the same bytes): either cache loads it. An
        existing ``path`` raises kvcodec.WriteRefusedError unless ``overwrite=True``."""
        from kvcodec.hf.persist import save_cache

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
    """Register ``"kvcodec_static"`` with transformers and attach the binding hooks to ``model``: its
    forwards switch to it only while they receive a static cache (``kvcodec.hf.binding``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, static_attention)
    AttentionMaskInterface.register(NAME, static_mask)
    return attach(model)


register_static_mode(StaticCompressedCache)
