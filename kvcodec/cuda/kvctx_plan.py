"""Launchers of the kvctx / predictive format 2 GPU decode's plan on the device (``kvctx_plan.cu``,
and ``rans_decode.cu`` for the model's field parts).

Why: the host plan of a 256 MB decode was ~3.9 ms against a ~4 ms kernel, in series; most of it the
entropy decode of megabytes of stored parameter fields, their checks and 1.1 MB of decode tables. Here
the fields of an ``mfields`` stream (``format2.code_model``: parts of 32 interleaved rANS states, one
warp each) decode on the GPU straight from the blob's model section, their values are checked into a
status flag, and the decode tables are built from the 68 x 256 frequencies: everything on torch's
current stream, nothing synchronized; the caller checks the flags with the kernel's chunk statuses.

``DeviceInputs`` carries what ``kvctx_decode.launch`` reads of a ``kvctx_decode.DevicePlan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.cuda import build
from kvcodec.cuda import rans as cuda_rans

SOURCE = "kvctx_plan.cu"
TABLE_SLOTS = 4096  # rans_lanes.M
TABLE_THREADS = 256  # kp_tables: one thread per symbol
CHECK_THREADS = 256
CHECK_BLOCKS = 264  # kp_check_fields' grid (grid-stride): a few blocks per SM


@dataclass
class DeviceInputs:
    """The device inputs ``kvctx_decode.launch`` reads (those of a ``kvctx_decode.DevicePlan``): the
    host plan, chunk descriptors, field byte planes, field layout and decode tables."""

    plan: object  # kvctx_decode.KernelPlan
    chunks: torch.Tensor
    raw: torch.Tensor
    layout: torch.Tensor
    tabs: torch.Tensor


def build_tables(freq: torch.Tensor) -> torch.Tensor:
    """uint32 decode tables [classes * 4096] (as int32) of ``freq`` (int16 [classes * 256] CUDA
    tensor of frequencies, rows summing to 4096 or all 0), as ``tables.decode_tables`` builds them."""
    classes = freq.numel() // 256
    tabs = torch.empty(classes * TABLE_SLOTS, dtype=torch.int32, device=freq.device)
    fn = build.get_function(SOURCE, "kp_tables")
    with build.cupy_stream(freq.device):
        fn((classes,), (TABLE_THREADS,), (freq.data_ptr(), tabs.data_ptr()))
    return tabs


def check_fields(raw: torch.Tensor, n: int, level: tuple[int, int], level_limit: int, mq: tuple[int, int],
                 flag: torch.Tensor) -> None:
    """Set ``flag`` (int32 CUDA tensor of one element) to 1 when the field byte planes ``raw`` hold a
    level above ``level_limit`` or a 2-byte zigzag location of 65535 (``format2.check_field_values``);
    ``level`` / ``mq``: (offset of the low plane, width) of the two fields among ``n`` channels."""
    if n == 0:
        return
    fn = build.get_function(SOURCE, "kp_check_fields")
    blocks = min(CHECK_BLOCKS, -(-n // CHECK_THREADS))
    with build.cupy_stream(raw.device):
        fn((blocks,), (CHECK_THREADS,),
           (raw.data_ptr(), np.int64(n), np.int64(level[0]), np.int32(level[1]), np.int32(level_limit),
            np.int64(mq[0]), np.int32(mq[1]), flag.data_ptr()))


def field_parts_launch(parts, device, also=()):
    """(``rans.LaunchPlan`` of ``format2.FieldParts``: one warp a part, the ``also`` arrays uploaded in
    the same copy). The parts share one table, so the plan is written straight (biggest parts first,
    blocks of ``rans.WARPS`` parts; what ``LaunchPlan.build`` gives one table, without its general
    grouping: ~0.2 ms of a first decode's host time). The table is not uploaded: :func:`decode_field_parts`
    points the plan at a row :func:`build_tables` built on the device (a 12-bit table of ``tables``'
    layout is the decoder's mode 0 with lo = 0). Payload byte offsets are relative to the first part."""
    from kvcodec.cuda.transfer import upload
    from kvcodec.lossless.predictive.format2 import FIELD_PRECISION, FIELD_STATES

    assert FIELD_STATES == cuda_rans.STATES and FIELD_PRECISION <= 12
    warps = cuda_rans.WARPS
    count = np.asarray(parts.count, np.int64)
    pdesc = np.empty((len(count), 4), np.int64)
    pdesc[:, 0] = parts.start - parts.start[0]
    pdesc[:, 1] = parts.length
    np.cumsum(count, out=pdesc[:, 2])
    pdesc[:, 2] -= count
    pdesc[:, 3] = count
    order, blocks = _part_order(count, warps)
    # (offset, mode, precision, lo, shared-memory words, aux, symbol bytes, 0): rans.Table's descriptor
    tdesc = np.array([[0, 0, FIELD_PRECISION, 0, TABLE_SLOTS, 0, 1, 0]], np.int64)
    pd, od, bd, td, *more = upload([pdesc, order, blocks, tdesc, *also], device)
    lp = cuda_rans.LaunchPlan(pd.reshape(-1, 4), od, bd.reshape(-1, 4), td.reshape(-1, 8), None,
                              warps * cuda_rans.RING_BYTES + 4 * TABLE_SLOTS, len(blocks), more, warps)
    return lp, more


_part_orders: dict = {}


def _part_order(count: np.ndarray, warps: int) -> tuple[np.ndarray, np.ndarray]:
    """(launch order: biggest parts first, blocks of ``warps`` parts of the one table) of parts of ``count``
    symbols; kept per count list (a part count and field size give the same list for every stream of
    that shape; with the pdesc fill, 0.033 -> 0.006 ms of a first decode's host time on a 2-core dev host)."""
    key = (count.tobytes(), warps)
    got = _part_orders.get(key)
    if got is None:
        if len(_part_orders) >= 64:
            _part_orders.clear()
        got = _part_orders[key] = (np.argsort(-count, kind="stable").astype(np.int32),
                                   cuda_rans._blocks(np.zeros(len(count), np.int64), warps))
    return got


def decode_field_parts(lp, model: torch.Tensor, parts, table: torch.Tensor, status: torch.Tensor) -> torch.Tensor:
    """The field bytes (uint8 [parts.size] CUDA tensor) of ``format2.FieldParts`` whose payloads lie in
    ``model`` (the model section's bytes on the device), launched with :func:`field_parts_launch`'s
    plan ``lp`` and the parts' decode table ``table`` (int32 [4096], a row of :func:`build_tables`);
    ``status`` (int32 [parts]) gets each part's rANS status (0 = good)."""
    first, end = int(parts.start[0]), int(parts.start[-1] + parts.length[-1])
    data = model[first:end]
    if data.data_ptr() % 2:  # the kernel reads 16-bit words: an aligned copy of the payloads
        data = data.clone()
    out = torch.empty(max(parts.size, 1), dtype=torch.uint8, device=model.device)
    lp.table_data = table.view(torch.uint8)
    lp.launch(data, out, status)
    return out
