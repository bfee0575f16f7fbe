"""Launcher of the kvctx / predictive format 2 GPU decoder (``kvctx_decode.cu``): one warp per chunk.

``KernelPlan`` holds what the host plan (``kvcodec.lossless.kvctx_device``) knows of a stream: chunk
descriptors, the stored fields' layout, the dtype's bit layout, in one staged host buffer with the plan's
other device inputs; ``kvcodec.lossless.cuda.kvctx_plan`` puts them on the device (decoding the stored fields and
building the decode tables there), and ``launch`` runs the kernel on torch's current stream without
synchronizing, reading every input by address. The same plan drives the CPU emulation of the kernel in the
tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.device import build

SOURCE = "kvcodec.lossless.cuda/kvctx_decode.cu"
WARPS = 4  # chunks (warps) per block
ROUNDS = 2  # rounds of 32 values decoded together (template NR); 4 spills at the 128 registers of 16 warps per SM
SWEEP_ROUNDS = (1, 2, 4)  # the NR instances compile-checked and swept by benchmarks/gpu_kvctx.py
OUT_KINDS = (1, 2, 4)  # bytes per output element: 8-bit and 16-bit patterns, float32 (bf16 half + lo16)
CHUNK_FIELDS = 8
RING_BYTES = 512 * 2 + (256 + 32) * 4  # per warp: the rANS-word and raw-bit-word rings (KX_RING_*)
CHANNEL_BYTES = 5 * 8  # per warp and channel: dev, and the channel table's m, c, a, es | level
SMEM_MAX = 48 * 1024  # rings + channel tables in shared memory up to this (no opt-in); beyond, a global scratch
SIGNATURE = ("(const unsigned short*, const unsigned int*, const long long*, int, const float*, long long, "
             "long long, const unsigned char*, const long long*, int, const unsigned int*, int, int, int, int, "
             "int, int, long long, void*, const unsigned short*, double*, int*)")


BF16_GRID = (16, 0x8000, 7, 0x7F7F, -133)  # bins.bin_grid(torch.bfloat16): the kernel's BF16 constants


GENERAL, ALIGNED, REGS = 0, 1, 2  # kernel layouts (KX_GENERAL, KX_ALIGNED, KX_REGS)


def variant(out_kind: int, grid: tuple, d: int, nr: int) -> tuple[int, bool]:
    """(layout, bf16) template arguments of the kernel for a plan: REGS when D = 32 * nr (one batch a token,
    parameters in registers), ALIGNED when 32 * nr divides D (every batch starts at lane 0 with full
    rounds), else GENERAL; bf16 for the bf16 grid (float32 outputs are bf16 upper halves)."""
    layout = REGS if d == 32 * nr else ALIGNED if d % (32 * nr) == 0 else GENERAL
    return layout, out_kind == 4 or (out_kind == 2 and tuple(int(v) for v in grid) == BF16_GRID)


def kernel_name(out_kind: int, nr: int, warps: int = WARPS, layout: int = REGS, bf16: bool = False,
                mag: bool = False) -> str:
    """The instance's name; ``mag``: the stream's "mag" flag (its own instances: streams without it pay nothing)."""
    return f"kx_decode<{out_kind}, {warps}, {nr}, {layout}, {str(bf16).lower()}, {str(bool(mag)).lower()}>"


def instance_declarations() -> list[str]:
    """Explicit instantiations for the nvcc compile check: every instance ``launch`` picks with the default
    rounds, and the bf16 ones of the other rounds the benchmark sweeps; the flagged ("mag") ones of 8-bit outputs
    (fp8 with a prediction writes the flag by default; other flagged streams compile their instance on first use)."""
    bf16 = {1: (False,), 2: (False, True), 4: (True,)}
    names = [kernel_name(k, ROUNDS, WARPS, lay, b) for k in OUT_KINDS for b in bf16[k] for lay in (GENERAL, ALIGNED, REGS)]
    names += [kernel_name(2, nr, WARPS, lay, True) for nr in SWEEP_ROUNDS if nr != ROUNDS for lay in (GENERAL, ALIGNED, REGS)]
    names += [kernel_name(1, ROUNDS, WARPS, lay, False, True) for lay in (GENERAL, ALIGNED, REGS)]
    return [f"__global__ void {n}{SIGNATURE}" for n in names]


@dataclass
class KernelPlan:
    """What the kernel reads besides the blob, as built on the host: ``chunks`` [n, 8] int64 (rANS word
    start and count, raw word start and count, first g, g count, first token, token count), ``layout``
    int64 [13] (``format2.StoredFields.layout`` then Gp * D: where the stored parameter fields lie in
    their byte planes), the grid's ``(width, sign, mb, maxmag, eoff)``, the output's shape [G, T, D] and
    kind, ``mag`` the stream's "mag" flag (0 / 1); ``staged``: the host buffer (``transfer.Staging``) ``chunks``
    and ``layout`` are views of, with the rest of the plan's device inputs (``kvcodec.lossless.cuda.kvctx_plan``)."""

    chunks: np.ndarray
    layout: np.ndarray
    shared: bool
    grid: tuple
    shape: tuple[int, int, int]
    out_kind: int
    staged: object = None
    mag: int = 0

    def smem_bytes(self, warps: int = WARPS) -> int:
        """Dynamic shared memory per block: the warps' rings, and their channel tables when they fit."""
        return warps * (RING_BYTES + (self.shape[2] * CHANNEL_BYTES if self.tables_in_shared(warps) else 0))

    def tables_in_shared(self, warps: int = WARPS) -> bool:
        """Whether the per-channel tables (dev and parameters) of a block's chunks fit in shared memory."""
        return warps * (RING_BYTES + self.shape[2] * CHANNEL_BYTES) <= SMEM_MAX

    def scratch(self, count: int, device, warps: int = WARPS) -> torch.Tensor | None:
        """The global scratch for the channel tables of ``count`` chunks, or None (shared memory)."""
        if self.tables_in_shared(warps):
            return None
        return torch.empty(count * self.shape[2] * CHANNEL_BYTES // 8, dtype=torch.float64, device=device)


def launch(dp, words: int, bits: int, out: torch.Tensor, status: torch.Tensor, first: int = 0,
           count: int | None = None, pred: torch.Tensor | None = None, pred_g0: int = 0,
           lo16: int = 0, nr: int | None = None, warps: int = WARPS) -> None:
    """Decode chunks ``first .. first + count`` into ``out`` (the whole [G, T, D] output; uint8, int16 or
    int32 by the plan's kind); ``words``/``bits``: device addresses of the blob's payload and raw-bit
    sections (2- and 4-byte aligned); ``pred``: float32 [., T, D] CUDA tensor whose row 0 is g = ``pred_g0``;
    ``lo16``: address of the float32 low halves; ``status`` int32 [n chunks], zeroed by the caller; ``dp``: a
    ``kvctx_plan.DeviceInputs`` (the plan and the device addresses of its chunks, fields, layout and tables).
    ``nr`` / ``warps``: the kernel's rounds per batch and warps per block (default ``ROUNDS``, ``WARPS``;
    other values for benchmark sweeps)."""
    plan = dp.plan
    n_all = plan.chunks.shape[0]
    count = n_all - first if count is None else count
    if count <= 0:
        return
    _, tt, d = plan.shape
    device = out.device
    scratch = plan.scratch(count, device, warps)
    nr = nr or ROUNDS
    fn = build.get_function(SOURCE, kernel_name(plan.out_kind, nr, warps, *variant(plan.out_kind, plan.grid, d, nr),
                                                     plan.mag))
    width, sign, mb, maxmag, eoff = plan.grid
    with build.cupy_stream(device):
        fn((-(-count // warps),), (32 * warps,),
           (np.uint64(words), np.uint64(bits), np.uint64(dp.chunks + 8 * CHUNK_FIELDS * first),
            np.int32(count), np.uint64(pred.data_ptr() if pred is not None else 0), np.int64(pred_g0),
            np.int64(tt), np.uint64(dp.raw), np.uint64(dp.layout), np.int32(plan.shared), np.uint64(dp.tabs),
            np.int32(width), np.int32(sign), np.int32(mb), np.int32(maxmag), np.int32(eoff), np.int32(d),
            np.int64(tt), out.data_ptr(), np.uint64(lo16), np.uint64(scratch.data_ptr() if scratch is not None else 0),
            np.uint64(status.data_ptr() + 4 * first)),
           shared_mem=plan.smem_bytes(warps))
