"""A weight tensor as a ``planes`` blob, and its CPU decoder into a caller's buffer.

Why the ``planes`` codec: it already is a just-in-time weight format. For bf16 the exponent byte
(``(u >> 7) & 0xFF``, ~2.6 bits of entropy in weights) is one 32-lane rANS stream per 64 KiB chunk
and the sign + 7 mantissa bits are a raw byte plane; fp16 codes its 5 exponent + 3 top mantissa
bits the same way; fp8 codes its one byte. Every chunk decodes alone (one GPU warp, one 4096-entry
table per plane), and ``kvcodec.lossless.planes_device`` decodes the same bytes on a GPU. Every bit
pattern survives (the planes are bit shuffles; NaN payloads, -0.0, subnormals, Inf included).

The blob is ``kvcodec.compress(t, codec="planes", max_classes=1, chunk_bytes=64 KiB)``: one table per
plane (what the GPU decoder reads) and chunks small enough to give a GPU thousands of warps. The CPU
decoder here parses and checks the blob once (:class:`HostWeight`), then decodes all chunks, or only
some (the rows an embedding lookup needs), in one numba call per thread into a reused buffer.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from kvcodec import checksum
from kvcodec.entropy import rans_lanes
from kvcodec.errors import CorruptStreamError
from kvcodec.kernel_inputs import readonly
from kvcodec.lossless import api
from kvcodec.lossless.planes import _EXP_HIGH, _SIGN_LOW, PlaneCodec
from kvcodec.lossless.tensor_meta import dtype_from_name
from kvcodec.threads import resolve_threads

CHUNK_BYTES = 64 << 10  # input bytes per chunk: 64 KiB, the GPU encoder's default (one warp each)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)

_MERGED = rans_lanes._DECODERS[32, True]  # exponent stream + raw sign/mantissa byte -> 16-bit words
_PLAIN = rans_lanes._DECODERS[32, False]  # one coded byte plane (fp8)


def encode(t: torch.Tensor, threads: int = 0) -> bytes | torch.Tensor:
    """The weight blob of ``t``: bytes for a CPU tensor, a uint8 tensor on the device for a CUDA one
    (encoded there by the GPU planes encoder: the same bytes)."""
    if t.dtype not in DTYPES:
        raise ValueError(f"weights of dtype {t.dtype} are not compressed (supported: {DTYPES})")
    if t.is_cuda:
        return api.compress_device(t, codec="planes", threads=threads, chunk_bytes=CHUNK_BYTES, max_classes=1)
    return api.compress(t, codec="planes", threads=threads, gpu=False, chunk_bytes=CHUNK_BYTES, max_classes=1)


@njit(nogil=True, cache=True)
def _decode_merged_chunks(words, off, chunks, chunk, n, tabs, side, hi, lo, out16):
    """Chunks ``chunks`` of a 16-bit tensor (coded exponent plane, raw side plane) into ``out16``;
    the first failing chunk, or -1."""
    ctx = np.zeros(1, np.uint8)
    for c in chunks:
        a = c * chunk
        b = min(n, a + chunk)
        if _MERGED(words[off[c]:off[c + 1]], a, max(n, 1), ctx, tabs, out16[a:b], side[a:b], hi, lo):
            return c
    return -1


@njit(nogil=True, cache=True)
def _decode_plain_chunks(words, off, chunks, chunk, n, tabs, out):
    """Chunks ``chunks`` of a tensor of one coded byte plane (fp8) into ``out``; failing chunk or -1."""
    ctx = np.zeros(1, np.uint8)
    side = np.zeros(0, np.uint8)
    lut = np.zeros(1, np.uint16)
    for c in chunks:
        a = c * chunk
        b = min(n, a + chunk)
        if _PLAIN(words[off[c]:off[c + 1]], a, max(n, 1), ctx, tabs, out[a:b], side, lut, lut):
            return c
    return -1


_pool: list = [None, 0]


def _executor(workers: int) -> ThreadPoolExecutor:
    """One pool for every decode (a decode per layer per token: a pool per call would cost more)."""
    if _pool[0] is None or _pool[1] != workers:
        _pool[0], _pool[1] = ThreadPoolExecutor(workers, thread_name_prefix="kvcodec-weights"), workers
    return _pool[0]


class HostWeight:
    """A weight blob held in host memory, parsed and checked once, decoded on demand.

    Construction runs every check of ``kvcodec.decompress`` (container, section crc32s, codec meta,
    then one full decode against the tensor's crc32: ``verify``), so a damaged blob raises
    CorruptStreamError here; later decodes still check each rANS stream's end state.
    """

    def __init__(self, blob, verify: bool = True):
        self.blob = blob if isinstance(blob, (bytes, bytearray, memoryview)) else api._host_bytes(blob)
        meta, sections = api._load(self.blob, None)
        if meta["codec"] != "planes" or meta["uses_prediction"]:
            raise CorruptStreamError("a weight blob must be a planes blob without prediction")
        self.dtype = dtype_from_name(meta["dtype"])
        self.shape = tuple(meta["shape"])
        self.numel = math.prod(self.shape)
        self.crc32 = meta["crc32"]
        codec = PlaneCodec()
        codec.validate(meta["codec_meta"], sections)
        self._codec = codec
        self._prep = codec._prepare(meta["codec_meta"], sections, self.dtype, self.shape)
        layout, _, self.chunk, self.n_chunks, info, lanes = self._prep
        self._fast = None
        if lanes == 32 and info[0][0] == "rans" and info[0][4].size == 1:
            _, words, off, tabs, _, _ = info[0]
            if layout == "f16" and info[1][0] == "raw":
                self._fast = ("merged", readonly(words), off, readonly(tabs), readonly(info[1][1]))
            elif layout == "bytes" and len(info) == 1:
                self._fast = ("plain", readonly(words), off, readonly(tabs))
        if verify:
            out = np.empty(self.nbytes_decoded, np.uint8)
            self.decode_into(out)
            if checksum.crc32(out) != self.crc32:
                raise CorruptStreamError("decoded weight fails its checksum")

    @property
    def nbytes(self) -> int:
        """Bytes held: the blob."""
        return memoryview(self.blob).nbytes

    @property
    def nbytes_decoded(self) -> int:
        return self.numel * self.dtype.itemsize

    def chunks_of_rows(self, rows: np.ndarray, row_len: int) -> np.ndarray:
        """The chunks holding rows ``rows`` (each ``row_len`` elements) of the flat tensor."""
        rows = np.unique(np.asarray(rows, np.int64))
        first = rows * row_len // self.chunk
        last = ((rows + 1) * row_len - 1) // self.chunk
        span = int((last - first).max()) if rows.size else 0
        return np.unique((first[:, None] + np.arange(span + 1)[None, :]).clip(max=last[:, None]))

    def decode_into(self, out: np.ndarray, chunks: np.ndarray | None = None, threads: int = 0) -> None:
        """Decode into the uint8 array ``out`` (``nbytes_decoded`` bytes): every chunk, or only
        ``chunks`` (the other bytes of ``out`` are left as they were). CorruptStreamError on a bad stream."""
        if self.numel == 0:
            return
        if chunks is None:
            chunks = np.arange(self.n_chunks, dtype=np.int64)
        workers = min(resolve_threads(threads), len(chunks))
        parts = np.array_split(chunks, workers) if workers > 1 else [chunks]
        if self._fast is None:
            def run(cs):
                return self._slow(cs, out)
        elif self._fast[0] == "merged":
            _, words, off, tabs, side = self._fast
            out16 = out.view(np.uint16)

            def run(cs):
                return _decode_merged_chunks(words, off, cs, self.chunk, self.numel, tabs, side, _EXP_HIGH_R,
                                             _SIGN_LOW_R, out16)
        else:
            _, words, off, tabs = self._fast

            def run(cs):
                return _decode_plain_chunks(words, off, cs, self.chunk, self.numel, tabs, out)

        bad = [run(parts[0])] if len(parts) == 1 else list(_executor(workers).map(run, parts))
        failed = [c for c in bad if c >= 0]
        if failed:
            raise CorruptStreamError(f"weight blob: rANS stream of chunk {failed[0]} is corrupt")

    def _slow(self, chunks, out: np.ndarray) -> int:
        """Blobs without a fused path (float32, planes stored const or coded): the codec's chunk decoder."""
        itemsize = self.dtype.itemsize
        for c in chunks:
            a, b = c * self.chunk, min(self.numel, (c + 1) * self.chunk)
            self._codec._decode_range(self._prep, int(c), self.numel, out[a * itemsize: b * itemsize])
        return -1

    def decode(self, threads: int = 0) -> torch.Tensor:
        """A new tensor (for restoring a model; the just-in-time path decodes into a reused buffer)."""
        out = np.empty(self.nbytes_decoded, np.uint8)
        self.decode_into(out, threads=threads)
        return torch.from_numpy(out).view(self.dtype).reshape(self.shape)


_EXP_HIGH_R = readonly(_EXP_HIGH)
_SIGN_LOW_R = readonly(_SIGN_LOW)
