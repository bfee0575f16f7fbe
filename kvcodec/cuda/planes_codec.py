"""Launchers of the ``planes`` codec's GPU kernels (``planes_codec.cu``): split + histograms, the
32-lane rANS chunk encoder, stream compaction and the plane merge. Each launches on torch's current
stream and does not synchronize; the orchestration (what to code, the container) is
``kvcodec.lossless.planes_device``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.cuda import build
from kvcodec.cuda.transfer import upload

SOURCE = "planes_codec.cu"
LAYOUTS = {"f16": 0, "f32": 1, "bytes": 2}
ENCODE_WARPS = 4
LANES = 32
SPLIT_SIG = "(const unsigned char*, long long, int, int, unsigned char*, unsigned long long*)"
ENCODE_SIG = "(const unsigned char*, const long long*, int, const unsigned int*, unsigned short*, long long, long long*)"
MERGE_SIG = "(const long long*, int, long long, unsigned char*)"


def instance_declarations() -> list[str]:
    """Explicit instantiations for the nvcc compile check."""
    return ([f"__global__ void pc_split_hist<{k}>{SPLIT_SIG}" for k in LAYOUTS.values()]
            + [f"__global__ void pc_rans_encode<{ENCODE_WARPS}>{ENCODE_SIG}"]
            + [f"__global__ void pc_merge<{k}>{MERGE_SIG}" for k in LAYOUTS.values()])


def _grid(n: int, device) -> int:
    return max(1, min(-(-n // 256), 8 * build.sm_count(device)))


def split_hist(raw: torch.Tensor, layout: str, itemsize: int, n_planes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte planes ([n_planes, n] uint8) and their histograms ([n_planes, 256] int64) of the
    contiguous uint8 CUDA tensor ``raw`` (n elements of ``itemsize`` bytes)."""
    n = raw.numel() // itemsize
    planes = torch.empty((n_planes, n), dtype=torch.uint8, device=raw.device)
    hist = torch.zeros((n_planes, 256), dtype=torch.int64, device=raw.device)
    if n:
        fn = build.get_function(SOURCE, f"pc_split_hist<{LAYOUTS[layout]}>")
        with build.cupy_stream(raw.device):
            fn((_grid(n, raw.device),), (256,), (raw.data_ptr(), np.int64(n), np.int32(itemsize), np.int32(n_planes),
                                                 planes.data_ptr(), hist.data_ptr()))
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


def merge(planes: list, layout: str, itemsize: int, n: int, out: torch.Tensor) -> None:
    """Rebuild n elements into the uint8 CUDA tensor ``out`` from planes: each a uint8 CUDA tensor
    of n bytes, or an int (a constant plane)."""
    desc = np.zeros(16, np.int64)
    for k, p in enumerate(planes):
        if isinstance(p, torch.Tensor):
            desc[2 * k] = p.data_ptr()
        else:
            desc[2 * k + 1] = int(p)
    if not n:
        return
    (desc_d,) = upload([desc], out.device)
    with build.cupy_stream(out.device):
        build.get_function(SOURCE, f"pc_merge<{LAYOUTS[layout]}>")(
            (_grid(n, out.device),), (256,), (desc_d.data_ptr(), np.int32(itemsize), np.int64(n), out.data_ptr()))
