"""The launcher of the fused decode attention over a TurboQuant-compressed KV cache (tq layout v1).

``decode_attention`` is the one entry point for raw packed tensors (``kvcodec.quant.cuda.quantized`` wraps
it for quantizer objects). On CUDA tensors it launches either the one-launch kernel
``tq_decode_fused`` (MSE keys; query prep, split-KV and merge in one kernel: the last block of each
tile merges) or the three kernels ``tq_decode_prep`` (query rotation, scaling, fp16, mma order),
``tq_decode_split`` (reads packed codes + norms, dequantizes in registers, tensor-core scores and
P.V, online softmax, split-KV) and ``tq_decode_merge`` (log-sum-exp merge of the splits and the
inverse rotation) for prod keys and splits the one-launch kernel cannot merge
(``KernelVariant.fused`` forces one path). The full-precision recent window, if given, is attended with torch and merged by log-sum-exp
(``merge_window``). Everything runs on torch's current stream. On CPU it falls back to the float64
torch reference (same arguments, same results up to rounding).

Host work is split in two: ``plan`` validates a call and derives everything that depends only on its
invariants (cached: ``DecodePlan``), ``run`` launches the kernel(s) of one call from a plan. The
kernels' names and build variants live in ``decode_kernels``, the split-size model in ``split_size``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvcodec.device import build
from kvcodec.device.plans import PlanCache
from kvcodec.quant.cuda import fallback
from kvcodec.quant.cuda.decode_kernels import (
    DEFAULT_VARIANT,
    FUSED_MAX_BLOCKS,
    LOG2E,
    MAX_SPLITS,
    SOURCE,
    WARPS_PER_BLOCK,
    KernelVariant,
    fused_defines,
    fused_name,
    fused_shared_bytes,
    key_permutation,
    merge_name,
    prep_name,
    split_defines,
    split_name,
)
from kvcodec.quant.cuda.pack import _signs_for
from kvcodec.quant.cuda.split_size import default_tokens_per_warp

_QIN = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_perm_cache: dict = {}


def _perm_on(dim: int, device: torch.device) -> torch.Tensor:
    """key_permutation as a device int32 tensor, cached (no host copy inside a CUDA-graph capture)."""
    key = (dim, str(device))
    if key not in _perm_cache:
        _perm_cache[key] = torch.as_tensor(key_permutation(dim), device=device, dtype=torch.int32)
    return _perm_cache[key]


_derive = build.derived


@lru_cache(maxsize=1)
def _cupy_ok() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def _norm_is_bf16(t: torch.Tensor, what: str) -> bool:
    if t.dtype == torch.float16:
        return False
    if t.dtype == torch.bfloat16:
        return True
    raise ValueError(f"{what} must be float16 or bfloat16, got {t.dtype}")


def _check_codes(codes: torch.Tensor, shape3, bits: int, dim: int, what: str) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8, got {codes.dtype}")
    want = (*shape3, (dim * bits + 7) // 8)
    if tuple(codes.shape) != want:
        raise ValueError(f"{what} has shape {tuple(codes.shape)}, expected {want}")


def _scaled_rows(x: torch.Tensor, perm: torch.Tensor, rows_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [BH, R, D] -> (fp16 rows divided by their max |.|, key-permuted, padded to rows_pad; scales)."""
    bh, r, d = x.shape
    amax = x.abs().amax(-1).clamp_min(1e-30)
    q16 = torch.zeros(bh, rows_pad, d, device=x.device, dtype=torch.float16)
    q16[:, :r] = (x / amax.unsqueeze(-1))[..., perm].to(torch.float16)
    sc = torch.zeros(bh, rows_pad, device=x.device, dtype=torch.float32)
    sc[:, :r] = amax
    return q16, sc



def _validate(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_codebook, v_codebook, k_bits, v_bits,
              k_qjl, k_rnorms, qjl_matrix, window_k, window_v) -> None:
    """Raise ValueError for arguments ``decode_attention`` does not take (any device)."""
    if query.dim() != 4:
        raise ValueError("query must be [B, Hq, q_len, D]")
    b, hq, ql, d = query.shape
    if k_codes.dim() != 4:
        raise ValueError("k_codes must be [B, Hkv, Tcap, bytes]")
    hkv, tcap = k_codes.shape[1], k_codes.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if k_codes.shape[0] != b:
        raise ValueError("batch of query and cache differ")
    for bits, what in ((k_bits, "k_bits"), (v_bits, "v_bits")):
        if not 1 <= bits <= 4:
            raise ValueError(f"{what} must be in 1..4, got {bits}")
    _check_codes(k_codes, (b, hkv, tcap), k_bits, d, "k_codes")
    _check_codes(v_codes, (b, hkv, tcap), v_bits, d, "v_codes")
    for t, what in ((k_norms, "k_norms"), (v_norms, "v_norms")):
        if tuple(t.shape) != (b, hkv, tcap):
            raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {(b, hkv, tcap)}")
    _norm_is_bf16(k_norms, "k_norms")  # raises for other dtypes
    _norm_is_bf16(v_norms, "v_norms")
    qjl = k_qjl is not None
    if qjl and (k_rnorms is None or qjl_matrix is None):
        raise ValueError("prod keys need k_qjl, k_rnorms and qjl_matrix together")
    if qjl and (tuple(qjl_matrix.shape) != (d, d) or tuple(k_qjl.shape) != (b, hkv, tcap, d // 8)):
        raise ValueError("QJL: qjl_matrix must be [D, D] and k_qjl [B, Hkv, Tcap, D/8]")
    if len(k_codebook) != 1 << k_bits or len(v_codebook) != 1 << v_bits:
        raise ValueError("codebook sizes must be 2^bits")
    _check_per_call(b, seq_lens, window_k, window_v)


def _check_per_call(batch: int, seq_lens, window_k, window_v) -> None:
    """The checks a cached plan does not cover (these arguments are not part of its key)."""
    if seq_lens is not None and tuple(seq_lens.shape) != (batch,):
        raise ValueError("seq_lens must be [B]")
    if (window_k is None) != (window_v is None):
        raise ValueError("window_k and window_v go together")


def decode_attention(query, k_codes, k_norms, v_codes, v_norms, seq_lens, *, k_rotation, v_rotation,
                     k_codebook, v_codebook, k_bits, v_bits, scale=None, k_qjl=None, k_rnorms=None,
                     qjl_matrix=None, window_k=None, window_v=None, window_lens=None, causal=True,
                     tokens_per_warp=None, variant: KernelVariant = DEFAULT_VARIANT, return_lse=False):
    """Attention of a few new queries over a compressed cache (+ optional full-precision window).

    query        [B, Hq, q_len, D] (after any query-side key transform, e.g. channel scales); Hq is a
                 multiple of Hkv and query head h uses kv head h // (Hq // Hkv) (HF repeat_kv order)
    k_codes      [B, Hkv, Tcap, D*k_bits/8] uint8; k_norms [B, Hkv, Tcap] float16/bfloat16
    v_codes      [B, Hkv, Tcap, D*v_bits/8] uint8; v_norms [B, Hkv, Tcap] float16/bfloat16
    seq_lens     [B] int: compressed tokens per sequence (slots past it are ignored, may hold anything);
                 None: every sequence uses all Tcap slots (no per-call clamp of a length tensor)
    k_rotation, v_rotation  [D, D] float32 with y = x @ rotation.T; k_codebook/v_codebook float32 [2^b]
    k_qjl, k_rnorms, qjl_matrix  prod keys: sign bits [B, Hkv, Tcap, D/8], ||r|| [B, Hkv, Tcap] and
                 S [m=D, D]; the score adds ||r|| * sqrt(pi/2)/m * <S q_rot, signs>
    window_k, window_v  [B, Hkv, W, D] full-precision recent tokens (after all compressed ones);
                 window_lens [B] valid window tokens (default W); with q_len > 1 and causal=True, query
                 i sees window tokens j < window_len - (q_len - 1) + i (the queries are the last q_len)
    Returns out [B, Hq, q_len, D] in query.dtype (values in their original space, before any
    value-side inverse transform) and, with return_lse=True, the float32 log-sum-exp [B, Hq, q_len].
    """
    if scale is not None:
        scale = float(scale)
    elif query.dim() == 4:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if query.is_cuda and _cupy_ok():
        p = plan(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_rotation, v_rotation, k_codebook,
                 v_codebook, k_bits, v_bits, scale, k_qjl, k_rnorms, qjl_matrix, window_k, window_v,
                 tokens_per_warp, variant)
        _check_per_call(p.batch, seq_lens, window_k, window_v)
        # the one-launch kernel writes the query's dtype itself (no cast launch); the window merge
        # wants float32
        out_dtype = query.dtype if window_k is None and query.dtype in _QIN else torch.float32
        out, lse = run(p, query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_qjl, k_rnorms, out_dtype=out_dtype)
        if window_k is not None:
            out, lse = merge_window(query, out, lse, window_k, window_v, window_lens, scale, causal)
    else:
        _validate(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_codebook, v_codebook, k_bits, v_bits,
                  k_qjl, k_rnorms, qjl_matrix, window_k, window_v)
        if seq_lens is None:
            seq_lens = torch.full((query.shape[0],), k_codes.shape[2], dtype=torch.int32, device=query.device)
        if query.is_cuda:
            warnings.warn("kvcodec.quant.cuda: CuPy is not installed (pip install 'kvcodec[cuda]'); "
                          "using the slow torch reference on the GPU", RuntimeWarning, stacklevel=2)
        out, lse = fallback.decode_attention_reference(
            query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_rotation=k_rotation, v_rotation=v_rotation,
            k_codebook=k_codebook, v_codebook=v_codebook, k_bits=k_bits, v_bits=v_bits, scale=scale,
            k_qjl=k_qjl, k_rnorms=k_rnorms, qjl_matrix=qjl_matrix, window_k=window_k, window_v=window_v,
            window_lens=window_lens, causal=causal)
        lse = lse.to(torch.float32)
    out = out.to(query.dtype)
    return (out, lse) if return_lse else out


@dataclass(eq=False)
class DecodePlan:
    """Everything the CUDA launcher derives from a call's invariants, built once per configuration.

    A decode step is host bound (batch-1 decode: ~1 ms of GPU time per step against several ms of
    Python), and per layer and step the launcher used to re-validate the arguments, look up the
    device copies of rotations/codebooks, check codebook symmetry, fetch three compiled kernels, ask
    the device for its SM count, run the split-size model and build the scalar launch arguments.
    All of that depends only on the plan key (``_plan_key``: shapes and dtypes of every argument the
    checks read, bits, scale, the identity and ``_version`` of the rotation/codebook/QJL tensors,
    the device, the kernel variant and ``tokens_per_warp``), so a repeated call
    only reads the per-call tensors' pointers, allocates its outputs and launches. The plan holds the
    key's tensors, so their ids cannot be reused while it is cached. A new plan is built when the
    cache grows (new Tcap: once per compaction in the HF cache) or a rotation/codebook changes.
    """

    batch: int
    out_shape: tuple  # [B, Hq, q_len, D] == [B*Hkv, rows, D] in memory
    lse_shape: tuple
    qjl: bool
    q_cast: bool  # the query dtype is not one the prep kernel reads: cast to float32 first
    rows: int  # query rows per (sequence, kv head): GQA group size x q_len
    row_tiles: int  # 16-row tiles
    tcap: int
    full_lens: torch.Tensor  # [B] int32 filled with Tcap: the lengths when the call passes seq_lens=None
    scale: float
    keep: tuple  # the key's tensors (ids stay unique) and the device tensors behind ``pointers``
    perm: torch.Tensor  # key_permutation on the device (int32)
    kr: torch.Tensor  # key rotation, float32 on the device
    kr_t: torch.Tensor  # its transpose, contiguous (the prep kernel's layout)
    qjl_matrix: torch.Tensor | None  # S, float32 on the device
    qjl_scale: float  # the QJL score factor folded into the S q row scales
    pointers: tuple  # device pointers of (kr_t, perm, k codebook, v codebook, v rotation)
    prep_fn: object  # the three-launch path (None when the plan uses the one-launch kernel)
    split_fn: object
    merge_fn: object
    prep_launch: tuple  # (grid, block, scalar args after the two pointers)
    split_launch: tuple  # (grid, block, scalar args)
    merge_launch: tuple  # (grid, block, scalar args, shared memory bytes)
    scratch: tuple  # byte offsets of q16, row scales, partial outputs, partial (m, l); total bytes
    fused_fn: object = None  # the one-launch kernel (None: the three launches above)
    fused_launch: tuple = ()  # (grid, block, scalar args from Hkv to nsplit, dynamic shared memory bytes)
    fused_rotations: tuple = ()  # (k signs pointer, k rounds, v signs pointer, v rounds): see _hadamard
    counters: torch.Tensor | None = None  # [BH * row tiles] int32 zeros: the last-block counters
    tokens_per_warp: int = 0


MAX_PLANS = 256  # unpinned plans: one per (layer, cache length) in use; dropped together when full
_plans = PlanCache("decode attention", MAX_PLANS)  # a static cache's plans are pinned (kvcodec.device.plans)


def _tensor_key(t):
    return None if t is None else (id(t), t._version)


def _plan_key(query, k_codes, k_norms, v_codes, v_norms, k_rotation, v_rotation, k_codebook, v_codebook,
              k_bits, v_bits, scale, k_qjl, k_rnorms, qjl_matrix, tokens_per_warp, variant) -> tuple:
    """Everything a plan (and the argument checks) depends on; see DecodePlan."""
    qjl = None if k_qjl is None else (k_qjl.shape, None if k_rnorms is None else k_rnorms.dtype,
                                      _tensor_key(qjl_matrix), None if qjl_matrix is None else qjl_matrix.shape)
    return (query.shape, query.dtype, query.device, k_codes.shape, k_codes.dtype, k_norms.shape, k_norms.dtype,
            v_codes.shape, v_codes.dtype, v_norms.shape, v_norms.dtype, k_bits, v_bits, scale,
            _tensor_key(k_rotation), _tensor_key(v_rotation), _tensor_key(k_codebook), _tensor_key(v_codebook),
            qjl, variant, tokens_per_warp)


def plan(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_rotation, v_rotation, k_codebook,
         v_codebook, k_bits, v_bits, scale, k_qjl, k_rnorms, qjl_matrix, window_k, window_v,
         tokens_per_warp, variant: KernelVariant = DEFAULT_VARIANT) -> DecodePlan:
    """The cached DecodePlan of a CUDA call (validating the arguments and building it on a miss).
    Pure host work: with ``build.get_function`` and ``split_size.sm_count`` stubbed it runs on CPU
    tensors."""
    key = _plan_key(query, k_codes, k_norms, v_codes, v_norms, k_rotation, v_rotation, k_codebook, v_codebook,
                    k_bits, v_bits, scale, k_qjl, k_rnorms, qjl_matrix, tokens_per_warp, variant)

    def build_plan() -> DecodePlan:
        _validate(query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_codebook, v_codebook, k_bits, v_bits,
                  k_qjl, k_rnorms, qjl_matrix, window_k, window_v)
        return _build_plan(query, k_codes, k_norms, v_norms, k_rotation, v_rotation, k_codebook, v_codebook,
                           k_bits, v_bits, scale, k_qjl is not None, k_rnorms, qjl_matrix, tokens_per_warp, variant)

    return _plans.get(key, build_plan)


def _build_plan(query, k_codes, k_norms, v_norms, k_rotation, v_rotation, k_codebook, v_codebook, k_bits,
                v_bits, scale, qjl, k_rnorms, qjl_matrix, tokens_per_warp, variant) -> DecodePlan:
    b, hq, ql, d = query.shape
    hkv, tcap = k_codes.shape[1], k_codes.shape[2]
    if d % 32 or not 32 <= d <= 256:
        raise ValueError(f"CUDA kernel needs head_dim a multiple of 32 in [32, 256], got {d}")
    if tcap * d * max(k_bits, v_bits) // 32 >= 2**31:
        raise ValueError("cache too long for the kernel's 32-bit row offsets (Tcap * row words >= 2^31)")
    r = (hq // hkv) * ql
    rt = -(-r // 16)
    rows_pad = rt * 16
    bh = b * hkv
    dev = query.device
    k_bf, v_bf = _norm_is_bf16(k_norms, "k_norms"), _norm_is_bf16(v_norms, "v_norms")
    if qjl and _norm_is_bf16(k_rnorms, "k_rnorms") != k_bf:
        raise ValueError("k_rnorms must have the dtype of k_norms")

    perm = _perm_on(d, dev)
    kr = _derive(k_rotation, f"f32 {dev}", lambda m: m.to(dev, torch.float32).contiguous())
    kr_t = _derive(kr, "T", lambda m: m.T.contiguous())
    kcb = _derive(k_codebook, f"f32 {dev}", lambda c: c.to(dev, torch.float32).contiguous())
    vcb = _derive(v_codebook, f"f32 {dev}", lambda c: c.to(dev, torch.float32).contiguous())
    vrot = _derive(v_rotation, f"f32 {dev}", lambda m: m.to(dev, torch.float32).contiguous())
    qin = query.dtype if query.dtype in _QIN else torch.float32

    narrow = r <= 8 and variant.narrow
    defines = split_defines(variant.defines, k_bits, v_bits, k_codebook, v_codebook, v_bf)
    fused = use_fused(variant, qjl, tcap, tokens_per_warp)
    fused_fn = split_fn = None
    fused_smem = 0
    if fused:
        fdefines = fused_defines(defines, d, k_bits, v_bits, narrow)
        kernel = fused_fn = build.get_function(SOURCE, fused_name(d, k_bits, v_bits, k_bf, v_bf, narrow), fdefines,
                                               variant.arch)
        fused_smem = fused_shared_bytes(fdefines)
        if fused_smem:  # over the 48 KB default: the kernel's limit must be raised first
            fused_fn.max_dynamic_shared_size_bytes = fused_smem
    else:
        kernel = split_fn = build.get_function(SOURCE, split_name(d, k_bits, v_bits, k_bf, v_bf, qjl, narrow), defines,
                                               variant.arch)
    tpw = tokens_per_warp or default_tokens_per_warp(bh * rt, tcap, dev, d, r, qjl, getattr(kernel, "num_regs", None),
                                                     variant.narrow, fused)
    if tpw <= 0 or tpw % 16:
        raise ValueError("tokens_per_warp must be a positive multiple of 16")
    if -(-tcap // tpw) > MAX_SPLITS:
        raise ValueError(f"tokens_per_warp too small: more than {MAX_SPLITS} splits")
    nsplit = max(1, -(-tcap // tpw))
    nblk = -(-nsplit // WARPS_PER_BLOCK)
    i32 = np.int32
    common = dict(
        batch=b, out_shape=(b, hq, ql, d), lse_shape=(b, hq, ql), qjl=qjl, q_cast=query.dtype not in _QIN,
        rows=r, row_tiles=rt, tcap=tcap, full_lens=torch.full((b,), tcap, dtype=torch.int32, device=dev),
        scale=scale,
        keep=(k_rotation, v_rotation, k_codebook, v_codebook, qjl_matrix, kcb, vcb, vrot),
        perm=perm, kr=kr, kr_t=kr_t,
        qjl_matrix=qjl_matrix.to(dev, torch.float32) if qjl else None,
        qjl_scale=scale * LOG2E * math.sqrt(math.pi / 2) / d,
        pointers=(kr_t.data_ptr(), perm.data_ptr(), kcb.data_ptr(), vcb.data_ptr(), vrot.data_ptr()),
        tokens_per_warp=tpw,
    )
    if fused:
        # scratch: one partial output [BH, nblk, rows, D] and (m, l) [BH, nblk, rows, 2] per block
        scratch = _scratch_layout(0, 0, bh * nblk * r * d * 4, bh * nblk * r * 2 * 4)
        (ks, kr_n), (vs, vr_n) = _hadamard(k_rotation, dev), _hadamard(v_rotation, dev)
        common["keep"] += (ks, vs)
        return DecodePlan(**common, prep_fn=None, split_fn=None, merge_fn=None, prep_launch=(), split_launch=(),
                          merge_launch=(), scratch=scratch, fused_fn=fused_fn,
                          fused_rotations=(ks.data_ptr() if kr_n else kr_t.data_ptr(), i32(kr_n),
                                           vs.data_ptr() if vr_n else vrot.data_ptr(), i32(vr_n)),
                          fused_launch=((nblk, bh, rt), (32 * WARPS_PER_BLOCK,),
                                        (i32(hkv), i32(r), i32(rt), i32(tcap), i32(tpw), i32(nsplit)), fused_smem),
                          counters=_counters(dev, bh * rt))
    # three launches; scratch: q16 [BH, rows_pad, D] fp16, row scales [BH, rows_pad] fp32,
    # partial outputs [BH, nsplit, rows, D] and (m, l) [BH, nsplit, rows, 2] fp32
    scratch = _scratch_layout(bh * rows_pad * d * 2, bh * rows_pad * 4, bh * nsplit * r * d * 4,
                              bh * nsplit * r * 2 * 4)
    return DecodePlan(
        **common,
        prep_fn=build.get_function(SOURCE, prep_name(d, _QIN[qin]), variant.defines),
        split_fn=split_fn,
        merge_fn=build.get_function(SOURCE, merge_name(d), variant.defines),
        prep_launch=((bh * rows_pad,), (d,), (np.float32(scale * LOG2E), i32(r), i32(rows_pad))),
        split_launch=((-(-nsplit // WARPS_PER_BLOCK), bh, rt), (32 * WARPS_PER_BLOCK,),
                      (i32(hkv), i32(r), i32(rt), i32(tcap), i32(tpw), i32(nsplit))),
        merge_launch=((bh * r,), (d,), (i32(r), i32(nsplit)), 8 * nsplit),
        scratch=scratch,
    )


def _hadamard(rotation: torch.Tensor, device) -> tuple[torch.Tensor | None, int]:
    """(signs [rounds, D] float32 on ``device``, rounds) when ``rotation`` is a randomized Hadamard
    transform of kvcodec's kinds ("hadamard": 1 round, "hadamard2": 2; the one-launch kernel then
    runs butterflies instead of reading the matrix), else (None, 0). Checked once per tensor version."""
    signs = _signs_for(rotation, device)
    if signs is None:
        return None, 0
    signs = signs.reshape(-1, rotation.shape[-1]).contiguous()
    return signs, signs.shape[0]


_counter_pool: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The one-launch kernel's last-block counters: n int32 zeros on ``device``, one buffer per
    (device, n) shared by every plan of that size and never freed, so a captured CUDA graph never
    points at a freed buffer when plans are evicted. The kernel leaves them zero after every launch;
    launches that share a buffer must not run concurrently (one stream)."""
    key = (str(device), n)
    buf = _counter_pool.get(key)
    if buf is None:
        buf = _counter_pool[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return buf


def _scratch_layout(*nbytes) -> tuple:
    """Byte offsets of consecutive 256-byte aligned parts of one scratch allocation, then the total."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-n // 256) * 256
    return (*offsets, total)


def use_fused(variant: KernelVariant, qjl: bool, tcap: int, tokens_per_warp: int | None) -> bool:
    """Whether a call runs the one-launch kernel: wherever it applies unless the variant says
    ``fused=False`` (measured as fast or faster than the three launches on every shape of the kernel
    table, H200, CHANGELOG.md 2026-11-24). It takes MSE keys only (prod keys: three launches) and at
    most FUSED_MAX_BLOCKS blocks per tile (an explicit ``tokens_per_warp`` may ask for more)."""
    if variant.fused is False or qjl:
        return False
    return not (tokens_per_warp and -(-tcap // tokens_per_warp) > WARPS_PER_BLOCK * FUSED_MAX_BLOCKS)


def run(plan: DecodePlan, query, k_codes, k_norms, v_codes, v_norms, seq_lens, k_qjl, k_rnorms, *,
        out_dtype: torch.dtype = torch.float32):
    """Launch one call on torch's current stream from its ``plan`` (the one-launch kernel, or prep,
    split and merge); returns (out, lse): out [B, Hq, q_len, D] in ``out_dtype`` (float32, float16 or
    bfloat16), lse float32 [B, Hq, q_len]. Lengths in ``seq_lens`` are clamped to [0, Tcap] by the
    kernels. Calls must not run on two streams at once (the one-launch kernel's counters)."""
    dev = query.device
    q_in = (query.to(torch.float32) if plan.q_cast else query).contiguous()
    kc, kn, vc, vn = k_codes.contiguous(), k_norms.contiguous(), v_codes.contiguous(), v_norms.contiguous()
    # the kernel reads code chunks with 16-byte vector loads: a misaligned view gets an aligned copy (the
    # norms likewise)
    kc, vc, kn, vn = (x if x.data_ptr() % 16 == 0 else x.clone() for x in (kc, vc, kn, vn))
    lens = plan.full_lens if seq_lens is None else seq_lens.to(dev, torch.int32).contiguous()
    o_q16, o_scale, o_part, o_ml, nbytes = plan.scratch
    scratch = torch.empty(nbytes, device=dev, dtype=torch.uint8)  # alive until the launches are queued
    base = scratch.data_ptr()
    q16, row_scale, part_o, part_ml = base + o_q16, base + o_scale, base + o_part, base + o_ml
    lse = torch.empty(plan.lse_shape, device=dev, dtype=torch.float32)
    kr_t, perm, kcb, vcb, vrot = plan.pointers
    if plan.fused_fn is not None:
        out = torch.empty(plan.out_shape, device=dev, dtype=out_dtype)
        grid, block, scalars, smem = plan.fused_launch
        with build.cupy_stream(dev):
            plan.fused_fn(grid, block, (q_in.data_ptr(), np.int32(_QIN[q_in.dtype]), kr_t, perm,
                                        np.float32(plan.scale * LOG2E), kc.data_ptr(), kn.data_ptr(), vc.data_ptr(),
                                        vn.data_ptr(), kcb, vcb, vrot, *plan.fused_rotations, lens.data_ptr(),
                                        *scalars, part_o, part_ml,
                                        plan.counters.data_ptr(), out.data_ptr(), np.int32(_QIN[out_dtype]),
                                        lse.data_ptr()), shared_mem=smem)
        return out, lse
    out = torch.empty(plan.out_shape, device=dev, dtype=torch.float32)
    if plan.qjl:
        q_rot = (query.to(torch.float32) @ plan.kr.T).reshape(-1, plan.rows, query.shape[-1])
        qs16, qs_scale = _scaled_rows(q_rot @ plan.qjl_matrix.T, plan.perm, plan.row_tiles * 16)
        qs_scale *= plan.qjl_scale
        qjl_bits, rnorms = k_qjl.contiguous(), k_rnorms.contiguous()
        qjl_ptrs = (qs16.data_ptr(), qs_scale.data_ptr(), qjl_bits.data_ptr(), rnorms.data_ptr())
    else:
        qjl_ptrs = (q16, row_scale, kc.data_ptr(), kn.data_ptr())  # unused by the kernel
    grid, block, scalars = plan.prep_launch
    with build.cupy_stream(dev):
        plan.prep_fn(grid, block, (q_in.data_ptr(), kr_t, perm, *scalars, q16, row_scale))
        grid, block, scalars = plan.split_launch
        plan.split_fn(grid, block, (q16, row_scale, kc.data_ptr(), kn.data_ptr(), vc.data_ptr(), vn.data_ptr(),
                                    *qjl_ptrs, kcb, vcb, lens.data_ptr(), *scalars, part_o, part_ml))
        grid, block, scalars, smem = plan.merge_launch
        plan.merge_fn(grid, block, (part_o, part_ml, vrot, *scalars, out.data_ptr(), lse.data_ptr()),
                      shared_mem=smem)
    return out.to(out_dtype), lse


def join_exact(lse, out, scores, values, sink=None, product=torch.matmul):
    """Attention over compressed tokens joined with exact ones: one softmax over [compressed | exact |
    sink] in which the compressed tokens are a single pseudo-key with score ``lse`` (their log-sum-exp,
    [.., 1]) and value ``out`` (their normalized output), which is exactly the log-sum-exp merge of the
    two parts. ``scores`` [.., E] / ``values`` [.., E, Dv]: the exact tokens (masked scores -inf);
    ``sink`` [.., 1]: logits with no value (attention sinks); ``product``: the matmul (a compiled step
    passes its own). Returns (output, logits); a row whose logits are all -inf comes out NaN. The eager
    and static caches and :func:`merge_window` all merge here."""
    logits = torch.cat([lse, scores] if sink is None else [lse, scores, sink], dim=-1)
    p = torch.softmax(logits, dim=-1)
    n = scores.shape[-1]
    return torch.addcmul(product(p[..., 1:1 + n], values), p[..., :1], out), logits


def merge_window(query, out, lse, window_k, window_v, window_lens, scale, causal):
    """Attend the full-precision window with torch and merge it with the compressed part
    (:func:`join_exact`); a row with neither compressed tokens nor window tokens gives zeros, lse -inf."""
    b, hq, ql, d = query.shape
    hkv, w = window_k.shape[1], window_k.shape[2]
    g = hq // hkv
    qf = query.to(torch.float32)
    wk = window_k.to(torch.float32).repeat_interleave(g, dim=1)
    wv = window_v.to(torch.float32).repeat_interleave(g, dim=1)
    s = (qf @ wk.transpose(-1, -2)) * scale
    dev = query.device
    wl = torch.full((b,), w, device=dev) if window_lens is None else window_lens.to(dev)
    limit = wl.view(b, 1, 1, 1).expand(b, 1, ql, 1)
    if causal and ql > 1:
        limit = limit - (ql - 1) + torch.arange(ql, device=dev).view(1, 1, ql, 1)
    s = s.masked_fill(torch.arange(w, device=dev).view(1, 1, 1, w) >= limit, float("-inf"))
    joined, logits = join_exact(lse.unsqueeze(-1), out, s, wv)
    total = torch.logsumexp(logits, -1)
    return torch.where(torch.isfinite(total).unsqueeze(-1), joined, torch.zeros_like(joined)), total
