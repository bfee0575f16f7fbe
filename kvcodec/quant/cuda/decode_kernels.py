"""The fused decode kernels of ``tq_decode_attention.cu`` as compiled objects: their template
instance names and signatures (for CuPy and the nvcc checks), the build variants, the macros a call
adds (symmetric register codebooks) and the query layout the mma fragments expect.

Launching them is ``kvcodec.quant.cuda.attention``'s job; choosing their split size is ``split_size``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvcodec.device import build

SOURCE = "kvcodec.quant.cuda/tq_decode_attention.cu"
LOG2E = 1.4426950408889634
WARPS_PER_BLOCK = 4

SPLIT_SIGNATURE = (
    "(const tq_u16*, const float*, const tq_u8*, const tq_u16*, const tq_u8*, const tq_u16*, "
    "const tq_u16*, const float*, const tq_u8*, const tq_u16*, const float*, const float*, const int*, "
    "int, int, int, int, int, int, float*, float*)"
)
MERGE_SIGNATURE = "(const float*, const float*, const float*, int, int, float*, float*)"
PREP_SIGNATURE = "(const void*, const float*, const int*, float, int, int, tq_u16*, float*)"
FUSED_SIGNATURE = (
    "(const void*, int, const float*, const int*, float, const tq_u8*, const tq_u16*, const tq_u8*, "
    "const tq_u16*, const float*, const float*, const float*, const float*, int, const float*, int, const int*, "
    "int, int, int, int, int, int, float*, float*, unsigned int*, void*, int, float*)"
)
MAX_SPLITS = 4096  # the merge keeps one weight per split in shared memory
FUSED_MAX_BLOCKS = 64  # tq::FUSED_MAX_BLOCKS: blocks per tile the one-launch kernel's last block merges


@dataclass(frozen=True)
class KernelVariant:
    """A build of the decode kernels: the default is the shipped one; benchmarks compare others.

    ``defines``: extra ``NAME=value`` macros for the kernels (the launcher's own, e.g. ``TQ_REG_LUT_SYM=0``
    or ``TQ_FUSED_STAGES=2``, set explicitly);
    ``narrow``: let tiles of <= 8 query rows use the transposed-P.V split kernel (off: always the
    general one); ``fused``: the one-launch kernel ``tq_decode_fused`` (True: wherever it applies,
    False: always the three launches prep/split/merge, None: the launcher decides); ``arch``: an
    explicit compile target of the split and one-launch kernels such as ``"sm_90a"`` (``build.compile_cubin``),
    None: CuPy's NVRTC route."""

    defines: tuple[str, ...] = ()
    narrow: bool = True
    fused: bool | None = None
    arch: str | None = None


DEFAULT_VARIANT = KernelVariant()


def codebook_is_symmetric(codebook: torch.Tensor, bf16: bool) -> bool:
    """True when the 16-entry codebook, rounded to fp16 (bf16), satisfies cb[15 - i] == -cb[i]
    bitwise: the condition of the TQ_REG_LUT_SYM lookups (8 stored entries + sign flip)."""
    c = codebook.detach().reshape(-1).to("cpu", torch.float32)
    if c.numel() != 16:
        return False
    h = c.to(torch.bfloat16 if bf16 else torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return bool(torch.equal(h.flip(0), h ^ 0x8000))


def split_defines(defines, k_bits, v_bits, k_codebook, v_codebook, v_bf16) -> tuple[str, ...]:
    """The split kernel's macros for one call: the symmetric register codebooks (TQ_REG_LUT_SYM=1,
    8 stored entries + sign flip) are added when every 4-bit codebook they would serve is symmetric
    (the Lloyd-Max ones are; cached per codebook tensor version) and dropped when one is not; a
    caller's explicit TQ_REG_LUT_SYM=0 stays."""
    defines = tuple(defines)
    if "TQ_REG_LUT_SYM=0" in defines:
        return defines
    ok = all(bits != 4 or build.derived(cb, f"sym {bf}", lambda t, bf=bf: codebook_is_symmetric(t, bf))
             for bits, cb, bf in ((k_bits, k_codebook, False), (v_bits, v_codebook, v_bf16)))
    rest = tuple(d for d in defines if not d.startswith("TQ_REG_LUT_SYM"))
    return rest + ("TQ_REG_LUT_SYM=1",) if ok else rest


# The one-launch kernel's lane-private pair tables (TQ_LANE_LUT): dynamic shared memory per block, and
# the head_dims that get them: 128 (3 blocks per SM fit: 64 KB + 10.4 KB static each); not 64 (the 4
# blocks per SM its registers allow would not fit) nor 256 (its static shared memory leaves room for 2).
LANE_LUT_BYTES = 65536
LANE_LUT_DIMS = (128,)
# Macros that come with the tables by default: rotations of the query and the output in warp registers
# (TQ_FUSED_WARP_ROTATE: no block barrier in the prologue or the final merge) and a 2-step copy ring.
LANE_LUT_COMPANIONS = (("TQ_FUSED_WARP_ROTATE", "1"), ("TQ_FUSED_STAGES", "2"))


def _macro(defines, name: str) -> str | None:
    """Value of the last ``NAME=value`` macro in ``defines`` (None: not set)."""
    value = None
    for d in defines:
        key, _, v = d.partition("=")
        if key == name:
            value = v or "1"
    return value


def fused_defines(defines, dim: int = 0, k_bits: int = 0, v_bits: int = 0, narrow: bool = False) -> tuple[str, ...]:
    """The one-launch kernel's macros for one call: narrow 4/4-bit tiles of a head_dim in LANE_LUT_DIMS get
    the lane-private pair tables (``TQ_LANE_LUT=1``), with warp-register rotations and a 2-step ring
    (``LANE_LUT_COMPANIONS``, each unless the caller set it), unless the caller set ``TQ_LANE_LUT`` itself."""
    defines = tuple(defines)
    if _macro(defines, "TQ_LANE_LUT") is None and narrow and k_bits == 4 and v_bits == 4 and dim in LANE_LUT_DIMS:
        defines += ("TQ_LANE_LUT=1",)
        # with the tables: the query and output rotations in registers and a 2-step ring (H200,
        # `gpu_kernels.py --fused`: 1 x 32k 29.2 -> 25.6 us, every other timed shape equal or faster)
        defines += tuple(f"{m}={v}" for m, v in LANE_LUT_COMPANIONS if _macro(defines, m) is None)
    return defines


def fused_shared_bytes(defines) -> int:
    """Dynamic shared memory of a one-launch build: the lane tables' 64 KB when ``TQ_LANE_LUT`` is set
    (the kernel uses them only where that macro is set, so this is never less than it needs)."""
    return LANE_LUT_BYTES if _macro(defines, "TQ_LANE_LUT") not in (None, "0") else 0


def _b(x: bool) -> str:
    return "true" if x else "false"


def split_name(dim: int, k_bits: int, v_bits: int, k_bf16: bool, v_bf16: bool, qjl: bool, narrow: bool) -> str:
    """Template instance name of the split kernel for one configuration (narrow: <= 8 rows per tile)."""
    return f"tq_decode_split<{dim}, {k_bits}, {v_bits}, {_b(k_bf16)}, {_b(v_bf16)}, {_b(qjl)}, {_b(narrow)}>"


def fused_name(dim: int, k_bits: int, v_bits: int, k_bf16: bool, v_bf16: bool, narrow: bool) -> str:
    """Template instance name of the one-launch kernel (MSE keys only: no QJL instance)."""
    return f"tq_decode_fused<{dim}, {k_bits}, {v_bits}, {_b(k_bf16)}, {_b(v_bf16)}, {_b(narrow)}>"


def merge_name(dim: int) -> str:
    return f"tq_decode_merge<{dim}>"


def prep_name(dim: int, qin: int) -> str:
    return f"tq_decode_prep<{dim}, {qin}>"


def instance_declarations(configs, fused_configs=None) -> list[str]:
    """Explicit-instantiation declarations (for nvcc) of the split kernels in ``configs``, the
    one-launch twins of those in ``fused_configs`` (default: every configuration without QJL),
    merges and preps."""
    decls, dims = [], set()
    for cfg in configs:
        decls.append(f"__global__ void {split_name(*cfg)}{SPLIT_SIGNATURE}")
        d, kb, vb, kbf, vbf, qjl, narrow = cfg
        if not qjl and (fused_configs is None or cfg in fused_configs):
            decls.append(f"__global__ void {fused_name(d, kb, vb, kbf, vbf, narrow)}{FUSED_SIGNATURE}")
        dims.add(cfg[0])
    decls += [f"__global__ void {merge_name(d)}{MERGE_SIGNATURE}" for d in sorted(dims)]
    decls += [f"__global__ void {prep_name(d, qin)}{PREP_SIGNATURE}" for d in sorted(dims) for qin in (0, 1, 2)]
    return decls


@lru_cache(maxsize=None)
def key_permutation(dim: int) -> np.ndarray:
    """Order of the head dimension along the mma k index (see the .cu header).

    Entry 16*s + kk is the original coordinate held by thread t = (kk % 8) // 2 in its k-step s:
    t * dim/4 + 4*s + 2*(kk >= 8) + kk % 2. The query (and S q for QJL) is permuted with it.
    """
    ck = dim // 4
    perm = np.empty(dim, dtype=np.int64)
    for s in range(dim // 16):
        for kk in range(16):
            perm[16 * s + kk] = ((kk % 8) // 2) * ck + 4 * s + 2 * (kk >= 8) + kk % 2
    assert sorted(perm.tolist()) == list(range(dim))
    return perm
