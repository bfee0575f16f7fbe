"""The kvctx / predictive format 2 GPU decode's plan on the device (``kvctx_plan.cu``, and
``rans_decode.cu`` for the model's field parts).

Why: the host plan of a 256 MB decode was ~3.9 ms against a ~4 ms kernel, in series; most of it the
entropy decode of megabytes of stored parameter fields, their checks and 1.1 MB of decode tables. Here
the fields of an ``mfields`` stream (``format2.code_model``: parts of 32 interleaved rANS states, one
warp each) decode on the GPU straight from the blob's model section, and one more launch builds the
decode tables from the 68 x 256 frequencies and checks the fields' values into a status flag: everything
on torch's current stream, nothing synchronized; the caller checks the flags with the kernel's chunk
statuses.

A first decode's host time before the kernel's launch is a count of small steps (~0.01-0.05 ms each: a
torch or CuPy call, a copy), so the host writes every input of these launches and of the decode kernel
into one staged buffer (``kvctx_device.plan`` with :func:`pieces` and :func:`stage_parts`:
``transfer.Staging``), uploads it in one copy and hands the kernels addresses inside it
(:class:`DeviceInputs`), not tensors: 2 launches and 2 allocations before the decode kernel's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from kvcodec.device import build
from kvcodec.entropy.cuda import rans as cuda_rans
from kvcodec.lossless.predictive.format2 import FIELD_PRECISION, FIELD_STATES
from kvcodec.lossless.predictive.tables import decode_tables

SOURCE = "kvcodec.lossless.cuda/kvctx_plan.cu"
TABLE_SLOTS = 4096  # rans_lanes.M
PLAN_THREADS = 256  # kp_plan's blocks: one thread per symbol of a table
CHECK_BLOCKS = 264  # kp_plan's field-check blocks at most (grid-stride): a few blocks per SM
_CUDA_MEMCPY_DEVICE_TO_DEVICE = 3


@dataclass
class DeviceInputs:
    """What ``kvctx_decode.launch`` reads: the host plan (a ``kvctx_decode.KernelPlan``) and the device
    addresses of the chunk descriptors, the field byte planes, the field layout and the decode tables;
    ``keep``: the buffers they lie in."""

    plan: object
    chunks: int
    raw: int
    layout: int
    tabs: int
    keep: tuple


def pieces(nc: int, classes: int, parts, raw_bytes: int) -> dict:
    """The staged pieces' byte sizes (``transfer.Staging``): chunk descriptors, field layout, table
    frequencies (int16), and either the field parts' launch descriptors and table (:func:`stage_parts`)
    or the host-decoded field bytes (``raw``)."""
    out = {"chunks": 64 * nc, "layout": 8 * 13, "freq": 2 * 256 * classes}
    if parts is None:
        out["raw"] = raw_bytes
    else:
        out.update(parts_pieces(parts))
    return out


@njit(cache=True, nogil=True)
def fill_chunks(out, wstart, wlen, bstart, blen, cg0, cng, ct0, cnt):
    """The decode kernel's chunk descriptors ``out`` [n, 8] (``kvctx_decode.KernelPlan.chunks``) from the
    stream's per-chunk word and raw-word starts and counts and ``format2.chunk_layout``'s columns, in one
    pass (8 numpy column copies were ~0.015 ms of a first decode's host time)."""
    for i in range(out.shape[0]):
        out[i, 0], out[i, 1], out[i, 2], out[i, 3] = wstart[i], wlen[i], bstart[i], blen[i]
        out[i, 4], out[i, 5], out[i, 6], out[i, 7] = cg0[i], cng[i], ct0[i], cnt[i]


def parts_pieces(parts) -> dict:
    """Byte sizes of :func:`stage_parts`' pieces for ``format2.FieldParts`` ``parts``."""
    p = len(parts.count)
    blocks = -(-p // cuda_rans.WARPS)
    return {"pdesc": 32 * p, "order": 4 * p, "blocks": 16 * blocks, "tdesc": 64, "ptable": 4 * TABLE_SLOTS}


def stage_parts(st, parts) -> int:
    """Write the field parts' ``rans32_decode`` launch into the staged buffer ``st``: what ``rans.LaunchPlan.build``
    gives one table (biggest parts first, blocks of ``rans.WARPS`` parts), written straight, and the parts'
    12-bit decode table (``tables.decode_tables`` of their frequencies: the decoder's mode 0 with lo = 0).
    Payload byte offsets are relative to the first part. Returns the launch's block count."""
    assert FIELD_STATES == cuda_rans.STATES and FIELD_PRECISION == 12
    count = np.asarray(parts.count, np.int64)
    pdesc = st.view("pdesc", np.int64, (-1, 4))
    pdesc[:, 0] = parts.start - parts.start[0]
    pdesc[:, 1] = parts.length
    np.cumsum(count, out=pdesc[:, 2])
    pdesc[:, 2] -= count
    pdesc[:, 3] = count
    blocks = cuda_rans._grouped_blocks((len(count),), cuda_rans.WARPS)[1]  # one table's blocks, cached per count
    st.view("order", np.int32)[:] = np.argsort(-count, kind="stable")
    st.view("blocks", np.int32, (-1, 4))[:] = blocks
    # (offset, mode, precision, lo, shared-memory words, aux, symbol bytes, 0): rans.Table's descriptor
    st.view("tdesc", np.int64)[:] = (0, 0, FIELD_PRECISION, 0, TABLE_SLOTS, 0, 1, 0)
    st.view("ptable", np.uint32)[:] = decode_tables(parts.freqs[None])
    return len(blocks)


def decode_field_parts(base: int, offsets: dict, n_blocks: int, parts, model: int, copy: int, out: int,
                       status: int, device) -> None:
    """Decode ``format2.FieldParts`` whose payloads lie at device address ``model`` (the model section's
    first byte) into ``out`` (field bytes), each part's rANS status (0 = good) into int32 ``status[p]``,
    with the launch :func:`stage_parts` staged (``offsets``, uploaded to ``base``). The kernel reads 16-bit
    words: payloads at an odd address are first copied to ``copy`` (room for them). Addresses are ints."""
    first, end = int(parts.start[0]), int(parts.start[-1] + parts.length[-1])
    data = model + first
    stream = build.cupy_stream(device)
    if data % 2:
        import cupy

        cupy.cuda.runtime.memcpyAsync(copy, data, end - first, _CUDA_MEMCPY_DEVICE_TO_DEVICE, stream.ptr)
        data = copy
    fn = build.get_function(cuda_rans.SOURCE, f"rans32_decode<{cuda_rans.WARPS}>")
    with stream:
        fn((n_blocks,), (32 * cuda_rans.WARPS,),
           (data, base + offsets["pdesc"], base + offsets["order"], base + offsets["blocks"], base + offsets["tdesc"],
            base + offsets["ptable"], out, status),
           shared_mem=cuda_rans.WARPS * cuda_rans.RING_BYTES + 4 * TABLE_SLOTS)


def plan_kernel(device, freq: int = 0, classes: int = 0, tabs: int = 0, raw: int = 0, n: int = 0,
                level: tuple[int, int] = (0, 0), level_limit: int = 0, mq: tuple[int, int] = (0, 0),
                flag: int = 0) -> None:
    """One ``kp_plan`` launch (device addresses as ints): the decode tables ``tabs`` (uint32 [classes * 4096])
    of ``freq`` (int16 [classes * 256], rows summing to 4096 or all 0), as ``tables.decode_tables`` builds
    them; and ``flag`` (int32) set to 1 when the ``n`` channels' field byte planes ``raw`` hold a level
    above ``level_limit`` or a 2-byte zigzag location of 65535 (``format2.check_field_values``; ``level``,
    ``mq``: (offset of the low plane, width) of the two fields; n = 0: no check)."""
    checks = min(CHECK_BLOCKS, -(-n // PLAN_THREADS))
    if classes + checks == 0:
        return
    fn = build.get_function(SOURCE, "kp_plan")
    with build.cupy_stream(device):
        fn((classes + checks,), (PLAN_THREADS,),
           (freq, np.int32(classes), tabs, raw, np.int64(n), np.int64(level[0]), np.int32(level[1]),
            np.int32(level_limit), np.int64(mq[0]), np.int32(mq[1]), flag))


def build_tables(freq: torch.Tensor) -> torch.Tensor:
    """uint32 decode tables [classes * 4096] (as int32) of ``freq`` (int16 [classes * 256] CUDA tensor):
    :func:`plan_kernel`'s tables alone."""
    classes = freq.numel() // 256
    tabs = torch.empty(classes * TABLE_SLOTS, dtype=torch.int32, device=freq.device)
    plan_kernel(freq.device, freq.data_ptr(), classes, tabs.data_ptr())
    return tabs


def check_fields(raw: torch.Tensor, n: int, level: tuple[int, int], level_limit: int, mq: tuple[int, int],
                 flag: torch.Tensor) -> None:
    """:func:`plan_kernel`'s field checks alone: ``flag`` (int32 CUDA tensor of one element) set to 1 for
    what ``format2.check_field_values`` refuses in the field byte planes ``raw``."""
    plan_kernel(raw.device, raw=raw.data_ptr(), n=n, level=level, level_limit=level_limit, mq=mq,
                flag=flag.data_ptr())
