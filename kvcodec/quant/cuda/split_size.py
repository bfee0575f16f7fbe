"""Split size of the decode kernel: how many tokens one warp reads (tokens per warp), from a cost
model fitted to H200 measurements, so the last wave of blocks is well filled at every batch and length.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvcodec.device.build import sm_count
from kvcodec.quant.cuda.decode_kernels import FUSED_MAX_BLOCKS, MAX_SPLITS, WARPS_PER_BLOCK

# Split-size model (H200 measurements, `benchmarks/gpu_kernels.py` split-size grid): microseconds one warp
# needs for a 16-token step when an SM runs 4 / 8 / 16+ of them at once (per-SM throughput grows
# with resident warps, less and less: the kernel is latency bound), the fixed cost of a warp's
# prologue and partial write, and the merge's cost per 16 splits (one batch of loads).
STEP_US = ((4, 1.0), (8, 1.4), (16, 2.2), (24, 3.0))
WARP_FIXED_US = 2.0
MERGE_US_PER_16_SPLITS = 1.5
# The one-launch kernel (tq_decode_fused): each block rotates its query tile first (prologue), the
# tile's last block merges one partial per block and applies the inverse rotation (tail). Fitted to
# its split-size sweep (H200: the tail costs ~1.5 us at 8 blocks per tile, ~7 at 32-64).
# Per block 0.25 us (was 0.15): b1 x 32k then takes 256 tokens per warp (32 blocks per tile), measured
# 33.3 and 33.8 us in two runs against 34.6 and 35.0 for the 176 (47 blocks) that 0.15 picked; the kernel table's other shapes keep their picks for any value in 0.2-0.4.
FUSED_PROLOGUE_US = 1.0
FUSED_TAIL_US = 1.0
FUSED_TAIL_US_PER_BLOCK = 0.25


def blocks_per_sm(dim: int, rows: int, qjl: bool, num_regs: int | None = None, narrow: bool = True) -> int:
    """Resident split-kernel blocks per SM: from the compiled kernel's registers when known (65,536
    per SM, allocated per warp in units of 256), else the kernel's __launch_bounds__ minimum."""
    if num_regs:
        per_warp = -(-num_regs * 32 // 256) * 256
        return max(1, min(16, 65536 // (per_warp * WARPS_PER_BLOCK)))
    if qjl or rows > 8 or not narrow:
        return 2
    return 4 if dim <= 64 else 3


def _step_us(warps: int) -> float:
    """Per-warp step time at `warps` resident warps per SM (piecewise linear in STEP_US)."""
    pts = STEP_US
    if warps <= pts[0][0]:
        return pts[0][1]
    for (w0, t0), (w1, t1) in zip(pts, pts[1:]):
        if warps <= w1:
            return t0 + (t1 - t0) * (warps - w0) / (w1 - w0)
    return pts[-1][1] * warps / pts[-1][0]  # saturated: per-SM throughput stays flat


def modelled_us(bh_tiles: int, capacity: int, sms: int, per_sm: int, tpw: int, fused: bool) -> float:
    """Modelled time of one call at split size ``tpw``: the busiest SM runs ceil(blocks / SMs) blocks,
    at most ``per_sm`` at once; a round costs its warps' steps at the per-warp step time of that
    occupancy (STEP_US) plus a fixed per-warp cost (fused: plus the block's query prologue); the
    three-launch merge costs a little per split, the fused tail a little per block (plus its fixed
    part)."""
    n = -(-capacity // tpw)
    nblk = -(-n // WARPS_PER_BLOCK)
    on_sm = -(-(bh_tiles * nblk) // sms)  # blocks the busiest SM runs
    rounds = -(-on_sm // per_sm)
    warps = WARPS_PER_BLOCK * min(on_sm, per_sm)
    step = (tpw / 16) * _step_us(warps) + WARP_FIXED_US
    if fused:
        return rounds * (step + FUSED_PROLOGUE_US) + FUSED_TAIL_US + FUSED_TAIL_US_PER_BLOCK * nblk
    return rounds * step + MERGE_US_PER_16_SPLITS * -(-n // 16)


def _split_sizes(capacity: int, max_splits: int):
    """Every distinct tokens-per-warp (a multiple of 16) that gives at most ``max_splits`` splits."""
    seen = set()
    for nsplit in range(1, min(max_splits, -(-capacity // 16)) + 1):
        tpw = -(-(-(-capacity // nsplit)) // 16) * 16  # ceil(capacity / nsplit), up to a multiple of 16
        if tpw not in seen and -(-capacity // tpw) <= max_splits:
            seen.add(tpw)
            yield tpw


@lru_cache(maxsize=4096)
def best_split(bh_tiles: int, capacity: int, sms: int, per_sm: int, fused: bool = False) -> tuple[int, float]:
    """(tokens per warp, modelled microseconds) of the fastest split size; the fused kernel's last
    block merges at most FUSED_MAX_BLOCKS blocks, so its splits are capped at 4x that."""
    cap = WARPS_PER_BLOCK * FUSED_MAX_BLOCKS if fused else MAX_SPLITS
    best, best_cost = 16, None
    for tpw in _split_sizes(capacity, cap):
        cost = modelled_us(bh_tiles, capacity, sms, per_sm, tpw, fused)
        if best_cost is None or cost < best_cost:
            best, best_cost = tpw, cost
    return best, best_cost


def default_tokens_per_warp(bh_tiles: int, capacity: int, device: torch.device, dim: int = 128,
                            rows: int = 4, qjl: bool = False, num_regs: int | None = None,
                            narrow: bool = True, fused: bool = False) -> int:
    """Split size (tokens per warp, a multiple of 16) minimizing the modelled decode time
    (``modelled_us``). Any multiple of 16 may win (not only powers of two): filling the last wave
    matters more than the split size itself."""
    per_sm = blocks_per_sm(dim, rows, qjl, num_regs, narrow)
    return best_split(bh_tiles, capacity, sm_count(device), per_sm, fused)[0]

