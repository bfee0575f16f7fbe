"""Launchers of the ``planes`` codec's GPU kernels (``planes_codec.cu``): split + histograms, the
32-lane rANS chunk encoder, stream compaction and the plane merge. Each launches on torch's current
stream and does not synchronize; the orchestration (what to code, the container) is
``kvcodec.lossless.planes_device``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.device import build
from kvcodec.device.transfer import upload

SOURCE = "kvcodec.lossless.cuda/planes_codec.cu"
LAYOUTS = {"f16": 0, "f32": 1, "bytes": 2}
ENCODE_WARPS = 4
LANES = 32
SPLIT_SIG = "(const unsigned char*, long long, long long, unsigned char*, unsigned long long*)"
HIST_WARPS_TIMES_PLANES = 4
ENCODE_SIG = "(const unsigned char*, const long long*, int, const unsigned int*, unsigned short*, long long, long long*)"
MERGE_SIG = "(" + "long long, " * 17 + "unsigned char*)"
DESC_SIG = ("(const unsigned char*, const long long*, long long, long long, long long, long long*, const int*, long long, "
            "unsigned char*)")
DESC_JOB = 6  # int64 per coded plane in pc_stream_desc's jobs
DESC_THREADS = 512  # pc_stream_desc: (1024 spills on sm_100)


def split_instances() -> list[tuple[str, int, int]]:
    """(layout, itemsize, planes per block) of every pc_split_hist instance."""
    return [("f16", 2, 2), ("f32", 4, 2), ("bytes", 1, 1), ("bytes", 2, 2), ("bytes", 4, 2), ("bytes", 8, 2)]


def _split_name(layout: str, itemsize: int, pp: int) -> str:
    return f"pc_split_hist<{LAYOUTS[layout]}, {itemsize}, {pp}>"


def instance_declarations() -> list[str]:
    """Explicit instantiations for the nvcc compile check."""
    return ([f"__global__ void {_split_name(*inst)}{SPLIT_SIG}" for inst in split_instances()]
            + [f"__global__ void pc_rans_encode<{ENCODE_WARPS}>{ENCODE_SIG}"]
            + [f"__global__ void pc_merge<{LAYOUTS[lay]}, {item}>{MERGE_SIG}" for lay, item, _ in split_instances()])


def stream_desc(data: torch.Tensor, jobs: torch.Tensor, planes: int, n_chunks: int, chunk: int, n: int,
                pdesc: torch.Tensor, freqs: torch.Tensor, slots: int, tables: torch.Tensor) -> None:
    """Fill the rANS decoder's payload rows ``pdesc`` [planes * n_chunks, 4] (int64 CUDA) from the
    chunk stream lengths that format 3 stores in the blob ``data`` (``jobs`` [planes, DESC_JOB] int64 on
    the device: see ``pc_stream_desc``; bad lengths become rows the decoder flags, status 1), and each
    plane's decode table (mode 0, ``slots`` = 2**precision words) into the uint8 tensor ``tables`` from
    its checked frequencies ``freqs`` [planes, 256] int32. ``n_chunks`` 0: the tables only."""
    if not planes:
        return
    with build.cupy_stream(data.device):
        build.get_function(SOURCE, "pc_stream_desc")((planes,), (DESC_THREADS,), (
            data.data_ptr(), jobs.data_ptr(), np.int64(n_chunks), np.int64(chunk), np.int64(n), pdesc.data_ptr(),
            freqs.data_ptr(), np.int64(slots), tables.data_ptr()))


def _grid(n: int, device) -> int:
    return max(1, min(-(-n // 256), 8 * build.sm_count(device)))


def split_hist(raw: torch.Tensor, layout: str, itemsize: int, n_planes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte planes and their histograms ([n_planes, 256] int64) of the contiguous uint8 CUDA
    tensor ``raw`` (n elements of ``itemsize`` bytes). The planes are a [n_planes, stride] uint8
    tensor whose rows hold the planes in their first n bytes (stride a multiple of 16, so the
    kernel stores 16-byte vectors); 1-byte elements have one plane, the input itself (no copy)."""
    n = raw.numel() // itemsize
    if raw.data_ptr() % 16:
        raw = raw.clone()  # the kernel loads aligned 16-byte vectors
    pp = 1 if n_planes == 1 else 2
    alone = n_planes == 1  # the plane is the input
    stride = n if alone else row_stride(n)
    planes = raw.view(1, n) if alone else torch.empty((n_planes, stride), dtype=torch.uint8, device=raw.device)
    if not n:
        return planes, torch.zeros((n_planes, 256), dtype=torch.int64, device=raw.device)
    fn = build.get_function(SOURCE, _split_name(layout, itemsize, pp))
    warps = HIST_WARPS_TIMES_PLANES // pp
    nvec = n * itemsize // 16
    grid = max(1, min(-(-nvec // (32 * warps)), 6 * build.sm_count(raw.device)))
    partial = torch.empty((grid, n_planes, 256), dtype=torch.int64, device=raw.device)  # every entry written
    with build.cupy_stream(raw.device):
        fn((grid, n_planes // pp), (32 * warps,),
           (raw.data_ptr(), np.int64(n), np.int64(stride), 0 if alone else planes.data_ptr(), partial.data_ptr()))
    hist = partial.sum(0)
    return planes, hist


def encode_chunks(planes: torch.Tensor, jobs: np.ndarray, freqs: np.ndarray, chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Encode every job (a chunk of one plane) as a 32-lane rANS stream.

    ``jobs`` [J, 4] int64: byte offset of the chunk in ``planes``, symbol count, table id, 0;
    ``freqs`` [T, 256]: the tables. Returns (scratch [J * cap] uint16, lens [J] int64 on the device,
    cap): job j's stream is the last ``lens[j]`` words of slot j (``lens[j] = -1``: a symbol had no
    frequency)."""
    device = planes.device
    cap = chunk + 2 * LANES
    J = len(jobs)
    scratch = torch.empty(J * cap, dtype=torch.int16, device=device)
    lens = torch.empty(J, dtype=torch.int64, device=device)
    jobs_d, tabs = upload([np.asarray(jobs, np.int64), np.asarray(freqs, np.uint32)], device)
    fn = build.get_function(SOURCE, f"pc_rans_encode<{ENCODE_WARPS}>")
    with build.cupy_stream(device):
        fn((-(-J // ENCODE_WARPS),), (32 * ENCODE_WARPS,),
           (planes.data_ptr(), jobs_d.data_ptr(), np.int32(J), tabs.data_ptr(), scratch.data_ptr(), np.int64(cap),
            lens.data_ptr()))
    return scratch, lens, cap


def gather(scratch: torch.Tensor, cap: int, lens: torch.Tensor, dst_off: np.ndarray, dst: torch.Tensor) -> None:
    """Copy job j's stream to ``dst`` (int16/uint16 words) at word ``dst_off[j]``."""
    if not len(dst_off):
        return
    (off,) = upload([np.asarray(dst_off, np.int64)], dst.device)
    with build.cupy_stream(dst.device):
        build.get_function(SOURCE, "pc_gather")((len(dst_off),), (256,), (scratch.data_ptr(), np.int64(cap),
                                                                           lens.data_ptr(), off.data_ptr(),
                                                                           dst.data_ptr()))


def merge_desc(planes: list) -> np.ndarray:
    """The merge kernel's plane arguments: (address, 0) of a uint8 CUDA tensor of n bytes, or
    (0, value) of a constant plane (an int); 16 values (8 planes at most)."""
    desc = np.zeros(16, np.int64)
    for k, p in enumerate(planes):
        if isinstance(p, torch.Tensor):
            desc[2 * k] = p.data_ptr()
        else:
            desc[2 * k + 1] = int(p)
    return desc


def merge(planes: list, layout: str, itemsize: int, n: int, out: torch.Tensor) -> None:
    """Rebuild n elements into the uint8 CUDA tensor ``out`` from planes: each a uint8 CUDA tensor
    of n bytes, or an int (a constant plane); their addresses travel as kernel arguments. 16-byte
    aligned planes (rows of ``row_stride``) take the kernel's vector path."""
    if not n:
        return
    elems = max(1, n * itemsize // 16)  # one thread per 16 output bytes
    with build.cupy_stream(out.device):
        build.get_function(SOURCE, f"pc_merge<{LAYOUTS[layout]}, {itemsize}>")(
            (_grid(elems, out.device),), (256,), (*map(np.int64, merge_desc(planes)), np.int64(n), out.data_ptr()))


def row_stride(n: int) -> int:
    """Row length of a [planes, n] buffer whose rows start 16-byte aligned."""
    return -(-n // 16) * 16
