"""Entropy coding of the quantized coefficients with kvcodec's own rANS coder.

The symbols of one code class (``quantize.classes``: its components back to back, each a row of M
token values) are shifted to start at 0 and split into chunks; every chunk is an independent,
self-describing 32-state rANS stream (``kvcodec.entropy`` format, own frequency table, CRCs), so
the tables adapt to each chunk's statistics and the same bytes decode on the CPU
(``kvcodec.entropy.decode``, numba) or on the GPU (``kvcodec.entropy.cuda.rans.decode_batch``, one warp
per stream).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError

STATES = 32  # the GPU decoder's layout: one warp lane per state


@dataclass(frozen=True)
class ClassInfo:
    """One code class in a blob: its id, the symbol offset (smallest value), the symbol width in
    bytes (1 or 2), how many components it holds and how many chunk streams code them."""

    cls: int
    offset: int
    width: int
    n_components: int
    n_streams: int

    def to_json(self) -> list:
        return [self.cls, self.offset, self.width, self.n_components, self.n_streams]


def encode_classes(q_rows: np.ndarray, cls: np.ndarray, chunk: int, workers: int | None = None):
    """q_rows [R, M] int32, cls [R] uint8 -> (list[ClassInfo], list of stream bytes in class order)."""
    from kvcodec.entropy.cuda.rans import encode_chunks

    infos, streams = [], []
    for c in np.unique(cls):
        if c == 0:
            continue
        data = q_rows[cls == c].reshape(-1)
        lo, hi = int(data.min()), int(data.max())
        dt = np.uint8 if hi - lo <= 0xFF else np.uint16
        sym = (data - lo).astype(dt)
        blobs = encode_chunks(sym, chunk, workers=workers)
        infos.append(ClassInfo(int(c), lo, np.dtype(dt).itemsize, int((cls == c).sum()), len(blobs)))
        streams.extend(blobs)
    return infos, streams


def expected_streams(n_symbols: int, chunk: int) -> int:
    return max(1, math.ceil(n_symbols / chunk))


def check_decoded(sym, info: ClassInfo, expect_n: int, i: int):
    if sym.dtype.itemsize != info.width or sym.shape[0] != expect_n:
        raise CorruptStreamError(f"class {info.cls} stream {i}: {sym.shape[0]} symbols of {sym.dtype.itemsize} "
                                 f"byte(s), expected {expect_n} of {info.width}")


def chunk_lengths(total: int, chunk: int, n_streams: int) -> list[int]:
    return [min(chunk, total - k * chunk) for k in range(n_streams)] if total else [0]


def decode_coefficients_cpu(infos, streams, M: int, chunk: int, rows, steps: np.ndarray, out: np.ndarray,
                            threads: int = 1) -> None:
    """Decode every class's streams on the CPU (numba rANS) straight into the coefficient rows:
    ``out[rows[k]]`` (float32 [R, M]) for class k, dequantized with ``steps`` [R]."""
    from kvcodec import entropy
    from kvcodec.transform.quantize import dequantize_into

    jobs = []
    k = 0
    for info, r in zip(infos, rows):
        start = 0
        for n in chunk_lengths(info.n_components * M, chunk, info.n_streams):
            jobs.append((info, r, start, n, k, streams[k]))
            start += n
            k += 1

    def run(job):
        info, r, start, n, i, blob = job
        sym = entropy.decode(blob, max_symbols=n)
        check_decoded(sym, info, n, i)
        dequantize_into(sym, info.offset, r, start, M, steps, out)

    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(run, jobs))
    else:
        for j in jobs:
            run(j)


def decode_classes_gpu(infos, batch, M: int, chunk: int) -> list[torch.Tensor]:
    """The same as ``decode_classes_cpu`` with one rANS kernel launch on the device of ``batch``
    (a ``kvcodec.entropy.cuda.rans.RansBatch`` of the blob's streams, uploaded once)."""
    out_buf, status = batch.launch()
    batch.check(status)
    parts = batch.split(out_buf)
    out, k = [], 0
    for info in infos:
        lens = chunk_lengths(info.n_components * M, chunk, info.n_streams)
        chunks = []
        for j, n in enumerate(lens):
            t = parts[k + j]
            width = 2 if t.dtype == torch.uint16 else 1
            if width != info.width or t.numel() != n:
                raise CorruptStreamError(f"class {info.cls} stream {k + j}: {t.numel()} symbols of {width} "
                                         f"byte(s), expected {n} of {info.width}")
            chunks.append(t.view(torch.int16).to(torch.int32) & 0xFFFF if width == 2 else t.to(torch.int32))
        k += info.n_streams
        out.append((torch.cat(chunks) + info.offset).view(info.n_components, M))
    return out
