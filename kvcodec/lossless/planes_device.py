"""The ``planes`` codec on a CUDA device: encode and decode without the tensor leaving the GPU.

Why: the codec's streams are 32-lane rANS streams in the GPU warp layout (``kvcodec.entropy.rans_lanes``),
so a GPU can write and read exactly the blobs the CPU writes and reads. Moving a tensor to the CPU
to code it costs more (PCIe, host memory) than coding it.

Encoding (:func:`encode`; ``kvcodec.compress`` / ``compress_device`` call it for CUDA tensors):
one pass splits the tensor into byte planes and counts each plane's histogram
(``kvcodec.lossless.cuda.planes_codec``; 1-byte elements are their own plane: counted, not copied); the histograms (256 counts per plane) come to the host, where the
CPU encoder's own functions pick each plane's mode and table (``planes.one_table``,
``planes.pays_to_code``: the same integer tables, so the same bytes); one kernel encodes every
chunk of every coded plane (one warp per chunk), the stream lengths come back (one int per chunk),
and one kernel packs the streams into their sections. One table per plane (``max_classes=1``): the
GPU decoder reads one table per stream. The result equals ``PlaneCodec.encode`` with
``max_classes=1`` byte for byte.

Decoding (:func:`decode`): the blob's sections are views of a device blob
(``kvcodec.lossless.device_container``); one launch of ``kvcodec.entropy.cuda.rans``'s decoder decodes
every chunk stream of every coded plane straight from the blob (no staging copy), one kernel
merges the planes (decoded, raw sections, constants) into the tensor; a tensor of one coded plane
(1-byte elements) is decoded straight into the output. Blobs the kernels cannot
take (format 1 with 8 lanes, or row-context tables) return None: the caller decodes on the CPU.

GPU decode speed needs many chunks (one warp each): ``GPU_CHUNK_BYTES`` (64 KiB of input per
chunk) is the GPU encoder's default; 2 MiB chunks (the CPU default) give a 128 MB tensor only 64
warps.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from kvcodec import container
from kvcodec.entropy import rans_lanes
from kvcodec.lossless.planes import (FORMAT_VERSION, LANES, MAX_CHUNK_ELEMS, PlaneCodec, _dtype_shape,
                                     _n_planes, _table_json, layout_of, one_table, pays_to_code)

GPU_CHUNK_BYTES = 64 << 10


def encode(t: torch.Tensor, chunk_bytes: int = GPU_CHUNK_BYTES, min_gain: float = 0.02):
    """(codec meta, sections {name: 1-D CUDA tensor}) of the contiguous CUDA tensor ``t`` (n > 0),
    equal to ``PlaneCodec().encode(t.cpu(), ..., max_classes=1)`` with the sections on the device."""
    from kvcodec.lossless.cuda import planes_codec as pc

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
    streams, lens = _encode_streams(planes, coded, tables, n, chunk, n_chunks)
    sections = {}
    for k, (mode, value) in enumerate(kinds):
        if mode == "const":
            meta["planes"].append({"mode": "const", "value": value})
        elif mode == "raw":
            meta["planes"].append({"mode": "raw"})
            sections[f"p{k}"] = planes[k, :n]
        else:
            meta["planes"].append({"mode": "rans", "tables": [_table_json(tables[value])]})
            sections[f"p{k}"] = streams[value]
            sections[f"p{k}.len"] = lens[value]
    return meta, sections


def _encode_streams(planes: torch.Tensor, coded: list[int], tables: list, n: int, chunk: int, n_chunks: int):
    """Encode every chunk of the coded planes; returns (one int16 CUDA tensor of words per coded
    plane, one int32 CUDA tensor of its chunk streams' lengths in words: the format-3 sections)."""
    from kvcodec.lossless.cuda import planes_codec as pc

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
    return streams, list(lens.to(torch.int32).view(len(coded), n_chunks).unbind(0))


def gpu_decodable(meta) -> bool:
    """Whether the GPU kernels take a planes codec meta: format 2 or 3 (32 lanes), one table per plane."""
    if not isinstance(meta, dict) or meta.get("v") not in (2, FORMAT_VERSION) or meta.get("lanes") != LANES:
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
    Format 3 (chunk lengths in a section): the stream descriptors are made and the lengths checked
    on the device (``planes_codec.stream_desc``; a bad length gives its chunk a bad status), so the
    host reads no payload byte. Format 2: from the offsets in the meta, on the host. The decode
    tables are made on the device too (``stream_desc``, from the checked frequencies).
    ``reuse``: a dict that keeps the launch inputs (host arrays, decode tables, the launch's device
    arrays) for the next decode of the same bytes (filled when empty; ``device_container.BlobCache``)."""
    from kvcodec.entropy.cuda import rans as gr
    from kvcodec.lossless.cuda import planes_codec as pc

    if not gpu_decodable(meta):
        return None
    dtype, shape = _dtype_shape(meta)
    layout, itemsize, chunk, n_chunks, info, lanes = PlaneCodec()._prepare(meta, sections, dtype, shape, device=True)
    n = math.prod(shape)
    blob = next(iter(sections.values())).blob if sections else None
    row = n if len(info) == 1 else pc.row_stride(n)  # decoded planes' rows: 16-byte aligned for the merge
    got = reuse.get("planes streams") if reuse is not None else None
    if got is None:
        got = launch_inputs(meta["v"] == FORMAT_VERSION, sections, info, n, chunk, n_chunks, row)
    coded, pdesc, table_of, tables, jobs, freqs = got
    out = torch.empty(n * itemsize, dtype=torch.uint8, device=device)
    alone = len(info) == 1 and coded  # one coded plane (1-byte elements): decoded straight into out
    decoded = out.view(1, n) if alone else torch.empty((max(len(coded), 1), row), dtype=torch.uint8, device=device)
    P = len(table_of)
    device_rows = pdesc is None
    if not device_rows:
        status = torch.empty(P, dtype=torch.int32, device=device)  # the kernel writes every entry
    else:  # the payload rows pc_stream_desc writes and the statuses, in one allocation
        rows = torch.empty(4 * P + -(-P // 2), dtype=torch.int64, device=device)
        pdesc, status = rows[: 4 * P].view(P, 4), rows[4 * P:].view(torch.int32)[:P]
    if coded:
        # the launch's device arrays (blocks, table descriptors, the jobs and frequencies of pc_stream_desc)
        # come up in one upload, once per blob tensor: a decode again reuses them (they hold nothing of the
        # blob: offsets, not addresses); pc_stream_desc writes the tables' words (and the rows in format 3)
        plan = reuse.get("planes plan") if reuse is not None else None
        fresh = plan is None
        if fresh:
            plan = gr.LaunchPlan.build(pdesc, table_of, tables, device, also=[jobs, freqs])
        elif device_rows:
            plan = dataclasses.replace(plan, pdesc=pdesc)
        if fresh or device_rows:  # the tables once per plan
            pc.stream_desc(blob, plan.also[0], len(coded), n_chunks if device_rows else 0, chunk, n, plan.pdesc,
                           plan.also[1], (1 << rans_lanes.PRECISION) if fresh else 0, plan.table_data)
        plan.launch(blob, decoded, status)
        if reuse is not None:
            reuse["planes streams"], reuse["planes plan"] = got, plan
    if not alone:
        planes = [p[1] if p[0] == "const" else sections[f"p{k}"].bytes if p[0] == "raw" else decoded[coded.index(k), :n]
                  for k, p in enumerate(info)]
        pc.merge(planes, layout, itemsize, n, out)
    return out.view(dtype).reshape(shape), status


def launch_inputs(lengths_section: bool, sections, info, n: int, chunk: int, n_chunks: int, row: int):
    """(coded plane indices, payload rows or None, each payload's table, the tables, the jobs, the
    frequencies) of a checked planes blob (``PlaneCodec._prepare(..., device=True)``'s ``info``) for
    ``planes_codec.stream_desc``: the tables are ``rans.device_table``s (their words made on the device
    from ``freqs`` [coded planes, 256] int32); ``jobs`` [coded planes, DESC_JOB] int64: byte offsets of
    each coded plane's lengths and stream in the blob, the stream's words, the byte offset of its decoded
    row, of its table in the plan's table bytes, its lowest symbol. Payload rows [P, 4] come from the
    host (:func:`stream_descriptors`) for offsets in the meta (format 2), else None: the device makes
    them from the length section (``lengths_section``, format 3)."""
    from kvcodec.entropy.cuda import rans as gr
    from kvcodec.lossless.cuda import planes_codec as pc

    coded = [k for k, p in enumerate(info) if p[0] == "rans"]
    freqs = np.array([info[k][3][0] for k in coded], np.int32).reshape(-1, 256)
    tables = [gr.device_table(f, rans_lanes.PRECISION) for f in freqs]
    table_of = np.repeat(np.arange(len(coded), dtype=np.int32), n_chunks)
    jobs = np.zeros((len(coded), pc.DESC_JOB), np.int64)
    jobs[:, 3] = np.arange(len(coded)) * row
    jobs[:, 4] = gr.table_offsets(tables)
    jobs[:, 5] = [tb.lo for tb in tables]
    if not lengths_section:
        return coded, stream_descriptors(sections, info, n, chunk, n_chunks, row), table_of, tables, jobs, freqs
    for j, k in enumerate(coded):
        jobs[j, :3] = info[k][2].offset, sections[f"p{k}"].offset, sections[f"p{k}"].shape[0]
    return coded, None, table_of, tables, jobs, freqs


def stream_descriptors(sections, info, n: int, chunk: int, n_chunks: int, row: int | None = None) -> np.ndarray:
    """The rANS kernel's payload rows [P, 4] of the coded planes of ``info`` whose entries hold host
    chunk offsets (in words): byte offset of chunk c's stream in the blob, its length, output
    offset in the [coded planes, row] buffer (``row`` >= n, default n), symbols; what
    ``planes_codec.stream_desc`` makes on the device from a length section."""
    coded = [k for k, p in enumerate(info) if p[0] == "rans"]
    starts = np.arange(n_chunks, dtype=np.int64) * chunk
    counts = np.minimum(chunk, n - starts)
    pdesc = [np.zeros((0, 4), np.int64)]
    for j, k in enumerate(coded):
        off = np.asarray(info[k][2], np.int64)
        pdesc.append(np.stack([sections[f"p{k}"].offset + 2 * off[:-1], 2 * np.diff(off), j * (row or n) + starts,
                               counts], 1))
    return np.concatenate(pdesc)
