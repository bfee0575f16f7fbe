"""Decode a ``planes`` blob straight onto a CUDA device with the GPU rANS decoder.

Why: a planes chunk stream of format 2 is a 32-lane rANS stream in the layout of
``kvcodec.cuda.rans`` (one warp per stream), so when the tensor is wanted on a GPU the coded
planes can be uploaded compressed and decoded there, instead of decoded on the CPU and copied.

``plan(meta, sections)`` is host-only: it validates the blob (the same checks as the CPU decoder)
and lists, per plane, what the device must do: fill a constant, upload raw bytes, or decode one
stream per chunk (with an ``entropy.stream.StreamHeader`` describing it). It returns None when the
GPU decoder cannot take the blob (format 1 with 8 lanes, or row-context tables: the kernel reads
one table per stream); the caller then decodes on the CPU. ``run(plan, device)`` executes a plan:
the streams are decoded by ``decode_streams`` (the GPU kernel for CUDA devices; the CPU fast path
otherwise, which is how the host logic is tested without a GPU), then the planes are merged into
the tensor on the device with torch operations.

Integrity: the container's section checksums (checked when the blob is parsed) and every
stream's final-state check (on the device); the whole-tensor crc32 would need the bytes back on
the host, so this path does not recompute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.entropy import rans_lanes
from kvcodec.entropy.stream import StreamHeader
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.planes import _SIGN_LOW, PlaneCodec, _dtype_shape

GPU_LANES = 32
_ALIGN = 16


@dataclass(frozen=True)
class CodedPlane:
    """One rANS-coded plane: the chunk streams' bytes (each at a 16-byte aligned offset of
    ``data``), their offsets and headers (one per chunk)."""

    data: np.ndarray
    offsets: list[int]
    headers: list[StreamHeader]


@dataclass(frozen=True)
class DevicePlan:
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str
    n: int
    planes: list  # ("const", int) | ("raw", np.ndarray) | ("rans", CodedPlane)


def plan(meta, sections) -> DevicePlan | None:
    """Validate a planes codec meta + sections and describe the device work (None: CPU only)."""
    dtype, shape = _dtype_shape(meta)
    layout, _, chunk, n_chunks, info, lanes = PlaneCodec()._prepare(meta, sections, dtype, shape)
    if lanes != GPU_LANES:
        return None
    n = math.prod(shape)
    planes = []
    for mode, data, off, tabs, ctx, D in info:
        if mode != "rans":
            planes.append((mode, data))
            continue
        if D < n or ctx.size != 1:  # row-context tables: one table per stream only on the GPU
            return None
        freqs = _freqs_of(tabs)
        offsets, headers, total = [], [], 0
        for c in range(n_chunks):
            nbytes = 2 * int(off[c + 1] - off[c])
            offsets.append(total)
            headers.append(StreamHeader("rans", np.dtype(np.uint8), min(n, (c + 1) * chunk) - c * chunk,
                                        rans_lanes.PRECISION, GPU_LANES, freqs, 0, nbytes))
            total += -(-nbytes // _ALIGN) * _ALIGN
        buf = np.zeros(max(total, _ALIGN), np.uint8)
        raw = data.view(np.uint8)
        for c, o in enumerate(offsets):
            buf[o:o + headers[c].payload_len] = raw[2 * off[c]:2 * off[c + 1]]
        planes.append(("rans", CodedPlane(buf, offsets, headers)))
    return DevicePlan(dtype, shape, layout, n, planes)


def _freqs_of(tabs: np.ndarray) -> np.ndarray:
    """The 256 frequencies of a one-context decode table (symbol << 24 | (freq - 1) << 12 | ...)."""
    sym = (tabs >> 24).astype(np.int64)
    return np.bincount(sym, minlength=256).astype(np.uint32)


def gpu_streams(coded: CodedPlane, device: torch.device) -> torch.Tensor:
    """Decode a plane's chunk streams on a CUDA device (one kernel launch); uint8, chunks in order."""
    from kvcodec.cuda.rans import RansBatch

    data = torch.from_numpy(coded.data).to(device)
    n = sum(h.n for h in coded.headers)  # the tensor's size was capped by decompress
    batch = RansBatch.from_device(data, coded.offsets, coded.headers, max_output_bytes=n)
    out, status = batch.launch()
    batch.check(status)
    return out[:n]


def cpu_streams(coded: CodedPlane, device: torch.device) -> torch.Tensor:
    """The same streams decoded by the CPU fast path (``entropy.rans_fast``), then moved to ``device``."""
    from kvcodec.entropy import rans_fast

    parts = [rans_fast.decode_table(coded.data[o:o + h.payload_len], h.freqs, h.param, h.n, h.streams)
             for o, h in zip(coded.offsets, coded.headers)]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return torch.from_numpy(flat).to(device)


def run(p: DevicePlan, device, decode_streams=None) -> torch.Tensor:
    """Execute a plan on ``device``; ``decode_streams(coded, device)`` decodes one coded plane
    (default: ``gpu_streams`` on CUDA, ``cpu_streams`` elsewhere)."""
    device = torch.device(device)
    if decode_streams is None:
        decode_streams = gpu_streams if device.type == "cuda" else cpu_streams
    if p.n == 0:
        return torch.empty(p.shape, dtype=p.dtype, device=device)
    planes = []
    for mode, data in p.planes:
        if mode == "const":
            planes.append(torch.full((p.n,), data, dtype=torch.uint8, device=device))
        elif mode == "raw":
            planes.append(torch.from_numpy(np.array(data)).to(device))  # a copy: sections are read-only views
        else:
            plane = decode_streams(data, device)
            if plane.numel() != p.n:
                raise CorruptStreamError("planes: decoded plane has the wrong size")
            planes.append(plane)
    return _merge(planes, p.layout, p.dtype, device).reshape(p.shape)


def _merge(planes: list[torch.Tensor], layout: str, dtype: torch.dtype, device) -> torch.Tensor:
    """Inverse of ``planes.split_planes`` with torch operations (runs on any device)."""
    if layout == "f16":
        lut = torch.from_numpy(_SIGN_LOW.astype(np.int32)).to(device)
        u = (planes[0].to(torch.int32) << 7) | lut[planes[1].long()]
        return (u - ((u >> 15) << 16)).to(torch.int16).view(dtype)  # to signed 16-bit, then the dtype
    if layout == "f32":
        p0, p1, p2, p3 = (q.to(torch.int64) for q in planes)
        u = ((p1 & 0x80) << 24) | (p0 << 23) | ((p1 & 0x7F) << 16) | (p2 << 8) | p3
        return (u - ((u >> 31) << 32)).to(torch.int32).view(dtype)
    return torch.stack(planes, dim=-1).reshape(-1).view(dtype)
