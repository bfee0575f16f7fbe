"""Launcher of the kvctx / predictive format 2 GPU decoder (``kvctx_decode.cu``): one warp per chunk.

``KernelPlan`` holds everything the kernel reads besides the blob (chunk descriptors, the model's
per-channel arrays, decode tables, the dtype's bit layout), as host arrays built by
``kvcodec.lossless.kvctx_device``; ``launch`` uploads them in one asynchronous copy and runs the
kernel on torch's current stream without synchronizing. The same plan drives the CPU emulation of
the kernel in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.cuda import build
from kvcodec.cuda.transfer import upload

SOURCE = "kvctx_decode.cu"
WARPS = 4  # chunks (warps) per block
OUT_KINDS = (1, 2, 4)  # bytes per output element: 8-bit and 16-bit patterns, float32 (bf16 half + lo16)
CHUNK_FIELDS = 8
SMEM_MAX = 48 * 1024  # dev[] in shared memory up to this (no opt-in); beyond it, a global scratch
SIGNATURE = ("(const unsigned short*, const unsigned int*, const long long*, int, const float*, long long, "
             "long long, const double*, const double*, const double*, const int*, const int*, int, "
             "const unsigned int*, int, int, int, int, int, double, int, long long, void*, "
             "const unsigned short*, double*, int*)")


def kernel_name(out_kind: int) -> str:
    return f"kx_decode<{out_kind}, {WARPS}>"


def instance_declarations() -> list[str]:
    """Explicit instantiations for the nvcc compile check."""
    return [f"__global__ void kx_decode<{k}, {WARPS}>{SIGNATURE}" for k in OUT_KINDS]


@dataclass
class KernelPlan:
    """The kernel's inputs besides the blob: ``chunks`` [n, 8] int64 (rANS word start and count, raw
    word start and count, first g, g count, first token, token count), the model ``m``/``c``/``a``
    (float64 [Gp * D]) and ``es``/``level`` (int32), ``tabs`` (uint32 decode tables), the grid's
    ``(width, sign, mb, maxmag, eoff, inv_unit)``, the output's shape [G, T, D] and kind."""

    chunks: np.ndarray
    m: np.ndarray
    c: np.ndarray
    a: np.ndarray
    es: np.ndarray
    level: np.ndarray
    shared: bool
    tabs: np.ndarray
    grid: tuple
    shape: tuple[int, int, int]
    out_kind: int

    def dev_in_shared(self) -> bool:
        """Whether the per-channel deviations of a block's chunks fit in shared memory."""
        return WARPS * self.shape[2] * 8 <= SMEM_MAX


class DevicePlan:
    """A ``KernelPlan`` uploaded to one device (one asynchronous copy)."""

    def __init__(self, plan: KernelPlan, device):
        self.plan = plan
        f64 = [np.ascontiguousarray(x, np.float64).view(np.int64) for x in (plan.m, plan.c, plan.a)]
        (self.chunks, m, c, a, self.es, self.level, self.tabs) = upload(
            [plan.chunks, *f64, plan.es, plan.level, plan.tabs], device)
        self.m, self.c, self.a = (x.view(torch.float64) for x in (m, c, a))


def launch(dp: DevicePlan, words: int, bits: int, out: torch.Tensor, status: torch.Tensor, first: int = 0,
           count: int | None = None, pred: torch.Tensor | None = None, pred_g0: int = 0,
           lo16: int = 0) -> None:
    """Decode chunks ``first .. first + count`` into ``out`` (the whole [G, T, D] output; uint8, int16 or
    int32 by the plan's kind); ``words``/``bits``: device addresses of the blob's payload and raw-bit
    sections (2- and 4-byte aligned); ``pred``: float32 [., T, D] CUDA tensor whose row 0 is g = ``pred_g0``;
    ``lo16``: address of the float32 low halves; ``status`` int32 [n chunks], zeroed by the caller."""
    plan = dp.plan
    n_all = plan.chunks.shape[0]
    count = n_all - first if count is None else count
    if count <= 0:
        return
    _, tt, d = plan.shape
    device = out.device
    smem = WARPS * d * 8 if plan.dev_in_shared() else 0
    scratch = None if smem else torch.empty(count * d, dtype=torch.float64, device=device)
    fn = build.get_function(SOURCE, kernel_name(plan.out_kind))
    width, sign, mb, maxmag, eoff, inv_unit = plan.grid
    with build.cupy_stream(device):
        fn((-(-count // WARPS),), (32 * WARPS,),
           (np.uint64(words), np.uint64(bits), np.uint64(dp.chunks.data_ptr() + 8 * CHUNK_FIELDS * first),
            np.int32(count), np.uint64(pred.data_ptr() if pred is not None else 0), np.int64(pred_g0),
            np.int64(tt), dp.m.data_ptr(), dp.c.data_ptr(), dp.a.data_ptr(), dp.es.data_ptr(), dp.level.data_ptr(),
            np.int32(plan.shared), dp.tabs.data_ptr(), np.int32(width), np.int32(sign), np.int32(mb),
            np.int32(maxmag), np.int32(eoff), np.float64(inv_unit), np.int32(d), np.int64(tt),
            out.data_ptr(), np.uint64(lo16), np.uint64(scratch.data_ptr() if scratch is not None else 0),
            np.uint64(status.data_ptr() + 4 * first)),
           shared_mem=smem)
