"""The ``planes`` codec on a CUDA device: encode and decode without the tensor leaving the GPU.

Why: the codec's streams are 32-lane rANS streams in the GPU warp layout (``kvcodec.entropy.rans_lanes``),
so a GPU can write and read exactly the blobs the CPU writes and reads. Moving a tensor to the CPU
to code it costs more (PCIe, host memory) than coding it.

Encoding (:func:`encode`; ``kvcodec.compress`` / ``compress_device`` call it for CUDA tensors):
one pass splits the tensor into byte planes and counts each plane's histogram
(``kvcodec.cuda.planes_codec``; 1-byte elements are their own plane: counted, not copied); the histograms (256 counts per plane) come to the host, where the
CPU encoder's own functions pick each plane's mode and table (``planes.one_table``,
``planes.pays_to_code``: the same integer tables, so the same bytes); one kernel encodes every
chunk of every coded plane (one warp per chunk), the stream lengths come back (one int per chunk),
and one kernel packs the streams into their sections. One table per plane (``max_classes=1``): the
GPU decoder reads one table per stream. The result equals ``PlaneCodec.encode`` with
``max_classes=1`` byte for byte.

Decoding (:func:`decode`): the blob's sections are views of a device blob
(``kvcodec.lossless.device_container``); one launch of ``kvcodec.cuda.rans``'s decoder decodes
every chunk stream of every coded plane straight from the blob (no staging copy), one kernel
merges the planes (decoded, raw sections, constants) into the tensor; a tensor of one coded plane
(1-byte elements) is decoded straight into the output. Blobs the kernels cannot
take (format 1 with 8 lanes, or row-context tables) return None: the caller decodes on the CPU.

GPU decode speed needs many chunks (one warp each): ``GPU_CHUNK_BYTES`` (64 KiB of input per
chunk) is the GPU encoder's default; 2 MiB chunks (the CPU default) give a 128 MB tensor only 64
warps.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcodec import container
from kvcodec.lossless.planes import (FORMAT_VERSION, LANES, MAX_CHUNK_ELEMS, PlaneCodec, _dtype_shape,
                                     _n_planes, _table_from_json, _table_json, layout_of, one_table, pays_to_code)

GPU_CHUNK_BYTES = 64 << 10


def encode(t: torch.Tensor, chunk_bytes: int = GPU_CHUNK_BYTES, min_gain: float = 0.02):
    """(codec meta, sections {name: 1-D CUDA tensor}) of the contiguous CUDA tensor ``t`` (n > 0),
    equal to ``PlaneCodec().encode(t.cpu(), ..., max_classes=1)`` with the sections on the device."""
    from kvcodec.cuda import planes_codec as pc

    itemsize = t.element_size()
    layout = layout_of(t.dtype)
    n = t.numel()
    chunk = min(MAX_CHUNK_ELEMS, max(1, chunk_bytes // itemsize))
    n_chunks = -(-n // chunk)
    n_planes = _n_planes(layout, itemsize)
    planes, hist = pc.split_hist(t.reshape(-1).view(torch.uint8), layout, itemsize, n_planes)  # [P, >= n]
    counts = hist.cpu().numpy()  # synchronizes: the tables are chosen on the host
    meta = {"v": FORMAT_VERSION, "dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape),
            "layout": layout, "chunk": chunk, "lanes": LANES, "planes": []}
    kinds, tables = [], []
    for k in range(n_planes):
        used = np.flatnonzero(counts[k])
        if used.size == 1:
            kinds.append(("const", int(used[0])))
            continue
        est, freqs = one_table(counts[k])
        kinds.append(("rans", len(tables)) if pays_to_code(est, n, n_chunks, min_gain) else ("raw", None))
        if kinds[-1][0] == "rans":
            tables.append(freqs[0])
    coded = [k for k, (mode, _) in enumerate(kinds) if mode == "rans"]
    streams, offsets = _encode_streams(planes, coded, tables, n, chunk, n_chunks)
    sections = {}
    for k, (mode, value) in enumerate(kinds):
        if mode == "const":
            meta["planes"].append({"mode": "const", "value": value})
        elif mode == "raw":
            meta["planes"].append({"mode": "raw"})
            sections[f"p{k}"] = planes[k, :n]
        else:
            meta["planes"].append({"mode": "rans", "tables": [_table_json(tables[value])],
                                   "offsets": offsets[value].tolist()})
            sections[f"p{k}"] = streams[value]
    return meta, sections


def _encode_streams(planes: torch.Tensor, coded: list[int], tables: list, n: int, chunk: int, n_chunks: int):
    """Encode every chunk of the coded planes; returns (one int16 CUDA tensor of words per coded
    plane, its chunk offsets in words as int64 arrays)."""
    from kvcodec.cuda import planes_codec as pc

    if not coded:
        return [], []
    starts = np.arange(n_chunks, dtype=np.int64) * chunk
    counts = np.minimum(chunk, n - starts)
    jobs = np.zeros((len(coded) * n_chunks, 4), np.int64)
    for j, k in enumerate(coded):
        rows = slice(j * n_chunks, (j + 1) * n_chunks)
        jobs[rows, 0] = k * planes.stride(0) + starts
        jobs[rows, 1] = counts
        jobs[rows, 2] = j
    scratch, lens, cap = pc.encode_chunks(planes, jobs, np.stack(tables), chunk)
    lens_h = lens.cpu().numpy()  # synchronizes: the section sizes
    if (lens_h < 0).any():
        raise RuntimeError("GPU planes encoder: a symbol without frequency (internal error)")
    per_plane = lens_h.reshape(len(coded), n_chunks)
    offsets = [np.concatenate(([0], np.cumsum(row))).astype(np.int64) for row in per_plane]
    sizes = [int(o[-1]) for o in offsets]
    words = torch.empty(sum(sizes), dtype=torch.int16, device=planes.device)
    base = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    dst = np.concatenate([b + o[:-1] for b, o in zip(base, offsets)])
    pc.gather(scratch, cap, lens, dst, words)
    streams = [words[b: b + s] for b, s in zip(base.tolist(), sizes)]
    return streams, offsets


def gpu_decodable(meta) -> bool:
    """Whether the GPU kernels take a planes codec meta: format 2 (32 lanes), one table per plane."""
    if not isinstance(meta, dict) or meta.get("v") != FORMAT_VERSION or meta.get("lanes") != LANES:
        return False
    planes = meta.get("planes")
    if not isinstance(planes, list):
        return False
    return all(not isinstance(p, dict) or p.get("mode") != "rans" or
               (isinstance(p.get("tables"), list) and len(p["tables"]) == 1) for p in planes)


def decode(meta, sections, device, reuse: dict | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode on ``device``: ``sections`` are ``device_container.DeviceSection``s of one blob there.
    Returns (tensor, rANS status int32 [streams], 0 = good) without synchronizing, or None when
    the blob needs the CPU decoder. Raises CorruptStreamError for metadata the CPU would refuse.
    ``reuse``: a dict that keeps the launch descriptors and decode tables (host arrays) for the next
    decode of the same bytes (filled when empty; ``device_container.BlobCache``)."""
    from kvcodec.cuda import planes_codec as pc
    from kvcodec.cuda import rans as gr

    if not gpu_decodable(meta):
        return None
    dtype, shape = _dtype_shape(meta)
    layout, itemsize, chunk, n_chunks, info, lanes = PlaneCodec()._prepare(meta, sections, dtype, shape)
    n = math.prod(shape)
    blob = next(iter(sections.values())).blob if sections else None
    row = n if len(info) == 1 else pc.row_stride(n)  # decoded planes' rows: 16-byte aligned for the merge
    got = reuse.get("planes streams") if reuse is not None else None
    if got is None:
        got = stream_descriptors(meta, sections, info, n, chunk, n_chunks, row)
        if reuse is not None:
            reuse["planes streams"] = got
    coded, pdesc, table_of, tables = got
    out = torch.empty(n * itemsize, dtype=torch.uint8, device=device)
    alone = len(info) == 1 and coded  # one coded plane (1-byte elements): decoded straight into out
    decoded = out.view(1, n) if alone else torch.empty((max(len(coded), 1), row), dtype=torch.uint8, device=device)
    planes = [p[1] if p[0] == "const" else sections[f"p{k}"].bytes if p[0] == "raw" else decoded[coded.index(k), :n]
              for k, p in enumerate(info)]
    status = torch.empty(len(pdesc), dtype=torch.int32, device=device)  # the kernel writes every entry
    desc = None
    if coded:  # one upload: the decode launch's descriptors and tables, and the merge's planes
        plan = gr.LaunchPlan.build(pdesc, table_of, tables, device, also=[] if alone else [pc.merge_desc(planes)])
        plan.launch(blob, decoded, status)
        desc = None if alone else plan.also[0]
    if not alone:
        pc.merge(planes, layout, itemsize, n, out, desc)
    return out.view(dtype).reshape(shape), status


def stream_descriptors(meta, sections, info, n: int, chunk: int, n_chunks: int, row: int | None = None):
    """The decode launch of a checked planes blob (``PlaneCodec._prepare``'s ``info``): coded plane
    indices, the kernel's payload rows [P, 4] (byte offset of chunk c's stream in the blob, its
    length, output offset in the [coded planes, row] buffer (``row`` >= n, default n), symbols),
    each row's table and the tables (``kvcodec.cuda.rans.Table``, one per coded plane)."""
    from kvcodec.cuda import rans as gr
    from kvcodec.entropy import rans_lanes

    coded = [k for k, p in enumerate(info) if p[0] == "rans"]
    starts = np.arange(n_chunks, dtype=np.int64) * chunk
    counts = np.minimum(chunk, n - starts)
    pdesc, table_of, tables = [np.zeros((0, 4), np.int64)], [np.zeros(0, np.int32)], []
    for j, k in enumerate(coded):
        off = np.asarray(info[k][2], np.int64)
        pdesc.append(np.stack([sections[f"p{k}"].offset + 2 * off[:-1], 2 * np.diff(off), j * (row or n) + starts,
                               counts], 1))
        table_of.append(np.full(n_chunks, j, np.int32))
        tables.append(gr.build_table(_table_from_json(meta["planes"][k]["tables"][0]), rans_lanes.PRECISION, np.uint8))
    return coded, np.concatenate(pdesc), np.concatenate(table_of), tables
