"""zlib's CRC-32 of device buffers in one pass over them (``crc32.cu``), so a blob can be checked
and written without its bytes leaving the GPU.

Why it parallelizes: the CRC register is affine in its start value. With ``R(c, M)`` the register
after the bytes ``M`` from register ``c`` (no inversions), ``R(c, M) = S_|M|(c) ^ R(0, M)`` where
``S_n`` (feeding n zero bytes) is a linear map of the 32 register bits, and
``R(0, A || B) = S_|B|(R(0, A)) ^ R(0, B)``; zlib's ``crc32(M) = ~(S_|M|(0xFFFFFFFF) ^ R(0, M))``.
Pieces are CRC'd independently and combined with the ``S`` maps of powers of two (tables of 4 x 256
words each, made here once; the per-piece maps S_4 and S_512 by 5-bit slices, one table entry per lane:
:func:`lane_tables`). :func:`reference` runs the kernel's exact piece / lane / block
structure in numpy, so the tests check the decomposition against ``zlib`` without a GPU.

    crcs = crc32_many([t1, t2, ...])      # CUDA uint8 tensors -> int64 CUDA tensor of crc32 values
    flags = check_many(bufs, expected, slots, n)  # int32 flags: 1 where a buffer's crc32 (or zeros) fails
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kvcodec.checksum import crc32

SOURCE = "kvcodec.device/crc32.cu"
POLY = 0xEDB88320
ITERS = 32  # CRC_ITERS: pieces per lane per block
BLOCK = 512 * ITERS  # CRC_BLOCK bytes per warp
BLOCK_LOG2 = 14
FINISH_THREADS = 256
SHIFTS = 48  # tables for S_{2^i}, i < 48 (buffers up to 256 TiB)
WARPS = 8  # warps per thread block of crc_blocks


# ------------------------------------------------------------------------------------- tables
@lru_cache(maxsize=1)
def slice_tables() -> np.ndarray:
    """uint32 [4, 256]: zlib's slicing-by-4 tables (T[0] is the byte-at-a-time table)."""
    t = np.zeros((4, 256), np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (POLY if c & 1 else 0)
        t[0, i] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> np.uint32(8)) ^ t[0][t[k - 1] & np.uint32(255)]
    return t


def _apply_cols(cols: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The linear map with column images ``cols`` (uint32 [32]) applied to the uint32 array ``c``."""
    out = np.zeros_like(c)
    for j in range(32):
        out ^= np.where((c >> np.uint32(j)) & np.uint32(1), cols[j], np.uint32(0)).astype(np.uint32)
    return out


@lru_cache(maxsize=1)
def shift_tables() -> np.ndarray:
    """uint32 [SHIFTS, 4, 256]: entry [i, k, v] = S_{2^i}(v << 8k)."""
    t0 = slice_tables()[0]
    unit = (np.uint32(1) << np.arange(32, dtype=np.uint32)).astype(np.uint32)
    cols = t0[unit & np.uint32(255)] ^ (unit >> np.uint32(8))  # S_1 on each register bit
    v = np.arange(256, dtype=np.uint32)
    out = np.zeros((SHIFTS, 4, 256), np.uint32)
    for i in range(SHIFTS):
        for k in range(4):
            out[i, k] = _apply_cols(cols, v << np.uint32(8 * k))
        cols = _apply_cols(cols, cols)  # S_{2^(i+1)} = S_{2^i} o S_{2^i}
    return out


def _shift(log2n: int, c):
    t = shift_tables()[log2n]
    c = np.asarray(c, np.uint32)
    return t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24]


SLICES = 7  # CRC_SLICES: 5-bit slices of a register


@lru_cache(maxsize=1)
def lane_tables() -> np.ndarray:
    """uint32 [2, SLICES, 32]: crc_blocks' S_4 and S_512 by 5-bit slices, [m, j, v] = S(v << 5j) (the
    top slice has 2 bits; its entries past 3 are never read), one entry per lane of a warp."""
    v = np.arange(32, dtype=np.uint64)
    slices = np.stack([((v << np.uint64(5 * j)) & np.uint64(0xFFFFFFFF)).astype(np.uint32) for j in range(SLICES)])
    return np.stack([_shift(2, slices), _shift(9, slices)]).astype(np.uint32)


def lane_map(tab: np.ndarray, c):
    """The map of one ``lane_tables`` row applied to the register ``c`` (uint32 array), as crc_blocks'
    shuffles do."""
    c = np.asarray(c, np.uint32)
    out = np.zeros_like(c)
    for j in range(SLICES):
        out ^= tab[j][(c >> np.uint32(5 * j)) & np.uint32(31)]
    return out


def shift_by(n: int, c):
    """S_n(c): the register ``c`` (uint32, or an array of them) after n zero bytes."""
    c = np.asarray(c, np.uint32)
    for i in range(SHIFTS):
        if (n >> i) & 1:
            c = _shift(i, c)
    return c


# ------------------------------------------------------------------------------------- layout
def block_layout(ptr: int, length: int) -> tuple[int, int]:
    """(address of block 0, blocks) of a buffer: 16-byte pieces from ``ptr & ~15`` to
    ``(ptr + length) & ~15`` in right-aligned blocks of BLOCK bytes (no blocks: one 16-byte window)."""
    a0, end = ptr & ~15, (ptr + length) & ~15
    if end <= a0:
        return a0, 0
    nb = -(-(end - a0) // BLOCK)
    return end - nb * BLOCK, nb


def reference(data: bytes, ptr: int = 0) -> int:
    """The kernels' computation in numpy for ``data`` stored at address ``ptr`` (equals zlib.crc32)."""
    buf = np.frombuffer(bytes(data), np.uint8)
    n = buf.size
    vs, nb = block_layout(ptr, n)
    t = slice_tables()
    lanes = lane_tables()
    end = (ptr + n) & ~15
    blocks = []
    for j in range(nb):
        start = vs + j * BLOCK
        acc = np.zeros(32, np.uint32)  # one per lane
        for i in range(ITERS):
            a = start + 16 * (np.arange(32) + 32 * i)
            piece = np.zeros((32, 16), np.uint8)
            for lane in range(32):
                lo, hi = max(a[lane], ptr), min(a[lane] + 16, end)
                if hi > lo:
                    piece[lane, lo - a[lane]: hi - a[lane]] = buf[lo - ptr: hi - ptr]
            w = piece.view("<u4").astype(np.uint32)  # [32, 4]
            c = np.zeros(32, np.uint32)
            for k in range(4):
                c = lane_map(lanes[0], c ^ w[:, k])  # S_4(c ^ w): the word through the register
            acc = lane_map(lanes[1], acc) ^ c
        g = 1
        while g < 32:
            other = np.roll(acc, -g)
            heads = (np.arange(32) & (2 * g - 1)) == 0
            acc = np.where(heads, _shift(4 + g.bit_length() - 1, acc) ^ other, acc)
            g *= 2
        blocks.append(int(acc[0]))
    mp, mlog = 1, 0
    while mp * FINISH_THREADS < nb:
        mp, mlog = mp * 2, mlog + 1
    pad = mp * FINISH_THREADS - nb
    part = np.zeros(FINISH_THREADS, np.uint32)
    for tid in range(FINISH_THREADS):
        acc = np.uint32(0)
        for v in range(tid * mp, (tid + 1) * mp):
            acc = _shift(BLOCK_LOG2, acc) ^ np.uint32(blocks[v - pad] if v >= pad else 0)
        part[tid] = acc
    g, lg = 1, 0
    while g < FINISH_THREADS:
        heads = (np.arange(FINISH_THREADS) & (2 * g - 1)) == 0
        part = np.where(heads, _shift(BLOCK_LOG2 + mlog + lg, part) ^ np.roll(part, -g), part).astype(np.uint32)
        g, lg = g * 2, lg + 1
    c = int(part[0]) if nb else 0
    t0 = end if nb else ptr
    for b in buf[t0 - ptr:]:
        c = int(t[0][(c ^ int(b)) & 255]) ^ (c >> 8)
    return ~(int(shift_by(n, 0xFFFFFFFF)) ^ c) & 0xFFFFFFFF


# ------------------------------------------------------------------------------------- launch
_tables_on: dict = {}


def _device_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slice_tables, shift_tables, lane_tables) as int32 tensors on ``device``, made once."""
    hit = _tables_on.get(device)
    if hit is None:
        hit = _tables_on[device] = tuple(torch.from_numpy(a.reshape(-1).view(np.int32).copy()).to(device)
                                         for a in (slice_tables(), shift_tables(), lane_tables()))
    return hit


def crc32_many(buffers: list[torch.Tensor]) -> torch.Tensor:
    """zlib crc32 of each contiguous CUDA tensor's bytes (any dtype), as an int64 tensor on the
    device, computed with two kernel launches on torch's current stream (no synchronization)."""
    return _launch(buffers)[0].to(torch.int64) & 0xFFFFFFFF


def check_many(buffers: list[torch.Tensor], expected, slots, n_flags: int) -> torch.Tensor:
    """Checks of contiguous tensors' bytes: buffer i is bad when its zlib crc32 differs from
    ``expected[i]``, or, where ``expected[i]`` is None, when one of its bytes is not zero; a bad
    buffer sets ``flags[slots[i]]`` to 1. Returns the int32 flags [n_flags] on the buffers' device,
    with one upload and two kernel launches on torch's current stream (no synchronization). CPU
    tensors (the tests' emulated decode paths) are checked on the host (``kvcodec.checksum``)."""
    if not buffers:
        raise ValueError("no buffers")
    check = np.array([(-1 if e is None else int(e), int(q), int(e is None), 0) for e, q in zip(expected, slots)],
                     np.int64).reshape(-1, 4)
    if not buffers[0].is_cuda:
        flags = np.zeros(n_flags, np.int32)
        for b, (want, q, zero, _) in zip(buffers, check):
            raw = b.contiguous().reshape(-1).view(torch.uint8).numpy()
            if (zero and raw.any()) or (want >= 0 and crc32(raw) != want):
                flags[q] = 1
        return torch.from_numpy(flags)
    return _launch(buffers, check, n_flags)[1]


def _launch(buffers: list[torch.Tensor], check: np.ndarray | None = None, n_flags: int = 0):
    """crc_blocks + crc_finish over ``buffers``: (crc32 values as int32 [N], flags int32 [n_flags] or
    None); the descriptors, the checks and the zeroed flags travel in one upload."""
    from kvcodec.device import build
    from kvcodec.device.transfer import upload

    if not buffers:
        raise ValueError("no buffers")
    device = buffers[0].device
    desc, counts = [], []
    for b in buffers:
        if not b.is_cuda or b.device != device or not b.is_contiguous():
            raise ValueError("buffers must be contiguous tensors on one CUDA device")
        ptr, n = b.data_ptr(), b.numel() * b.element_size()
        vs, nb = block_layout(ptr, n)
        desc.append((ptr, n, vs, nb))
        counts.append(nb)
    counts = np.asarray(counts, np.int64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    total = int(counts.sum())
    block_buf = np.repeat(np.arange(len(buffers), dtype=np.int32), counts)
    arrays = [np.asarray(desc, np.int64), first, block_buf]
    if check is not None:
        arrays += [check, np.zeros(max(n_flags, 1), np.int32)]
    desc_d, first_d, bb, *checks = upload(arrays, device)
    tab, sh, lanes = _device_tables(device)
    rblk = torch.empty(max(total, 1), dtype=torch.int32, device=device)
    out = torch.empty(len(buffers), dtype=torch.int32, device=device)
    check_d, flags = checks if checks else (None, None)
    with build.cupy_stream(device):
        if total:
            build.get_function(SOURCE, "crc_blocks")(
                (-(-total // WARPS),), (32 * WARPS,),
                (desc_d.data_ptr(), bb.data_ptr(), first_d.data_ptr(), np.int64(total), lanes.data_ptr(),
                 sh.data_ptr(), rblk.data_ptr()))
        build.get_function(SOURCE, "crc_finish")(
            (len(buffers),), (FINISH_THREADS,),
            (desc_d.data_ptr(), first_d.data_ptr(), rblk.data_ptr(), tab.data_ptr(), sh.data_ptr(), out.data_ptr(),
             0 if check_d is None else check_d.data_ptr(), 0 if flags is None else flags.data_ptr()))
    return out, None if flags is None else flags[:n_flags]
