"""TurboQuant-MSE quantize + pack on CUDA, writing tq layout v1 directly (``tq_pack.cu``).

``quantize_pack(x, rotation, codebook, bits)`` returns (codes uint8 [..., D*bits/8], norms [...]),
the same bytes as ``fallback.quantize_reference`` except where a coordinate lies within float
rounding of a decision threshold (the kernel rotates with tensor cores and butterflies, the reference
with a float32 matmul; see docs/cuda.md, "How quantize + pack works"). The kernel takes the
randomized Hadamard rotations ("hadamard": H diag(s)/sqrt(D); "hadamard2": H diag(s2) H diag(s1)/D,
kvcodec.quant's default for power-of-two head_dim); other rotations (e.g. "qr"), CPU tensors and
head_dims the kernel does not take use the torch reference. x must already be preconditioned
(kvcodec.quant's ``pre.apply(x)``); norms are stored in norm_dtype as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.device import build
from kvcodec.device.plans import PlanCache
from kvcodec.quant.cuda import fallback

SOURCE = "kvcodec.quant.cuda/tq_pack.cu"
WARPS_PER_BLOCK = 8  # tqp::WARPS in tq_pack.cu: blocks of 256 threads
SIGNATURE = "(const void*, long long, const float*, const float*, const float*, int, tq_u8*, tq_u16*)"
_IN_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def pack_name(dim: int, bits: int, in_code: int, norm_bf16: bool, rounds: int = 1, norm_correction: bool = False) -> str:
    b = lambda v: "true" if v else "false"  # noqa: E731
    return f"tq_quant_pack<{dim}, {bits}, {in_code}, {b(norm_bf16)}, {rounds}, {b(norm_correction)}>"


def instance_declarations(configs) -> list[str]:
    """Explicit-instantiation declarations (for nvcc) of (dim, bits, in_code, norm_bf16, rounds, nc) configs."""
    return [f"__global__ void {pack_name(*c)}{SIGNATURE}" for c in configs]


def rows_per_warp(dim: int) -> int:
    """Rows one warp quantizes per step (Geo<D>::R in tq_pack.cu): 8 columns of the mma, a column is a
    row for dim <= 128 and a 128-wide segment of a row above."""
    return 8 // max(1, dim // 128)


def rows_per_block(dim: int) -> int:
    return WARPS_PER_BLOCK * rows_per_warp(dim)


def grid_blocks(n_rows: int, dim: int, sms: int, num_regs: int | None) -> int:
    """Blocks to launch: one per 8 warps of row groups, capped at one resident wave (the kernel
    strides over the rest, so every block does the same work and the per-block table setup is paid
    once per block). Residency from the kernel's registers (65,536 per SM, allocated per warp in units
    of 256), else the __launch_bounds__ minimum of 3."""
    need = -(-n_rows // rows_per_block(dim))
    per_sm = 3
    if num_regs:
        per_warp = -(-num_regs * 32 // 256) * 256
        per_sm = max(1, min(2048 // (32 * WARPS_PER_BLOCK), 65536 // (per_warp * WARPS_PER_BLOCK)))
    return max(1, min(need, sms * per_sm))


_signs_cache: dict[tuple, tuple] = {}


def _signs_for(rotation: torch.Tensor, device) -> torch.Tensor | None:
    """Hadamard signs of a rotation, checked once per (tensor, version, device); the tensor is kept
    alive in the cache so its id cannot be reused by another tensor."""
    key = (id(rotation), rotation._version, str(device))
    hit = _signs_cache.get(key)
    if hit is None or hit[0] is not rotation:
        s = fallback.hadamard_signs(rotation)  # [D]: one round
        if s is None:
            s = fallback.hadamard2_signs(rotation)  # [2, D]: two rounds
        hit = (rotation, None if s is None else s.to(device).contiguous())
        if len(_signs_cache) > 256:
            _signs_cache.clear()
        _signs_cache[key] = hit
    return hit[1]


@dataclass(eq=False)
class QuantizePlan:
    """What ``quantize_pack`` derives from its invariants (rotation, codebook, bits, dtypes, device):
    the Hadamard signs (None: the rotation is not one the kernel takes, use the reference), the
    codebook's decision thresholds and float32 copy on the device, the compiled kernel. Cached in a
    :class:`~kvcodec.device.plans.PlanCache`, so a captured step never builds one."""

    signs: torch.Tensor | None
    thresholds: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    fn: object = None
    sms: int = 0
    keep: tuple = ()  # the key's tensors: their ids stay unique while the plan is cached


_quantize_plans = PlanCache("quantize + pack", 256)


def _quantize_plan(x, rotation, codebook, bits, norm_dtype, norm_correction) -> QuantizePlan:
    d, dev = x.shape[-1], x.device
    key = (id(rotation), rotation._version, id(codebook), codebook._version, bits, x.dtype, norm_dtype,
           norm_correction, str(dev), d)

    def build_plan() -> QuantizePlan:
        signs = _signs_for(rotation, dev) if d % 32 == 0 and d <= 1024 else None
        if signs is None:
            return QuantizePlan(None, keep=(rotation, codebook))
        rounds = 1 if signs.dim() == 1 else 2
        fn = build.get_function(SOURCE, pack_name(d, bits, _IN_CODE[x.dtype], norm_dtype == torch.bfloat16, rounds,
                                                  norm_correction))
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return QuantizePlan(signs, fallback.thresholds_of(codebook.to(torch.float32)).to(dev).contiguous(),
                            codebook.to(dev, torch.float32).contiguous(), fn, build.sm_count(index),
                            keep=(rotation, codebook))

    return _quantize_plans.get(key, build_plan)


def quantize_pack(x: torch.Tensor, rotation: torch.Tensor, codebook: torch.Tensor, bits: int,
                  norm_dtype: torch.dtype = torch.float16,
                  norm_correction: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows x [..., D] (float32/float16/bfloat16) -> (packed codes, norms in norm_dtype).

    norm_correction: store ||x|| / <y, c> instead of ||x|| (kvcodec.quant's default, see
    TurboQuantMSE); the attention kernels read either the same way.
    """
    if x.dim() < 1:
        raise ValueError("x must have a last dimension")
    d = x.shape[-1]
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if len(codebook) != 1 << bits:
        raise ValueError("codebook size must be 2^bits")
    if norm_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("norm_dtype must be float16 or bfloat16")
    if tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be [{d}, {d}]")
    if x.dtype not in _IN_CODE:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    plan = _quantize_plan(x, rotation, codebook, bits, norm_dtype, norm_correction) if x.is_cuda else None
    if plan is None or plan.signs is None:
        return fallback.quantize_reference(x, rotation, codebook, bits, norm_dtype, norm_correction)

    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    codes = torch.empty(n, d * bits // 8, device=x.device, dtype=torch.uint8)
    norms = torch.empty(n, device=x.device, dtype=norm_dtype)
    if n:
        grid = grid_blocks(n, d, plan.sms, getattr(plan.fn, "num_regs", None))
        with build.cupy_stream(x.device):
            plan.fn((grid,), (32 * WARPS_PER_BLOCK,),
                    (rows.data_ptr(), np.int64(rows.stride(0)), plan.signs.data_ptr(), plan.thresholds.data_ptr(),
                     plan.codebook.data_ptr(), np.int32(n), codes.data_ptr(), norms.data_ptr()))
    return codes.reshape(*x.shape[:-1], -1), norms.reshape(x.shape[:-1])
