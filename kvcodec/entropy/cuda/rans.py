"""Batched GPU decoding of 32-state interleaved rANS streams (``rans_decode.cu``), bit-exact.

A stream from ``kvcodec.entropy.encode(x, coder="rans", streams=32)`` decodes on a GPU with one warp
per stream (lane k owns state k; see ``kvcodec/entropy/rans.py`` for the format). A GPU needs
thousands of warps, so decode *many* streams per call: ``encode_chunks`` splits a big array into
independent 32-state streams (64-256 KiB of symbols each) with the CPU encoder.

    blobs = encode_chunks(x, 1 << 16)                 # list of self-describing streams
    ys = decode_batch(blobs)                          # list of uint8/uint16 CUDA tensors
    y = decode_concat(blobs)                          # or one flat tensor, the chunks back to back

Headers are parsed (and CRC-checked) on the host with ``kvcodec.entropy.stream.parse``; the payloads
go to the device in one buffer, one decode table per distinct (dtype, precision, frequencies), and a
single kernel launch on torch's current stream decodes everything. Every payload gets a status; a bad
one raises ``CorruptStreamError`` naming the stream. ``RansBatch`` keeps the uploaded batch for
repeated launches (benchmarks) and also accepts payloads already on the device
(``RansBatch.from_device``).

Streams that are not rANS or not 32-state raise ``ValueError`` unless ``cpu_fallback=True`` (then
they decode with ``kvcodec.entropy.decode`` on the host and are copied to the device).
Decode tables (see the .cu file for the byte layouts): mode 0, one shared-memory u32 per slot, for
precision <= 12 and at most 256 used symbols (bf16 sign/exponent planes); mode 1, a shared-memory
slot -> symbol index table plus a per-symbol (freq, cum) table, when both fit in 40 KiB (bytes up to
precision 15, small uint16 alphabets; the other 8 KiB of the block's shared memory are its warps' word rings); mode 2, the same information as two slot-indexed arrays in
global memory (precision 16 bytes, big uint16 alphabets), read through L1/L2.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError

SOURCE = "kvcodec.entropy.cuda/rans_decode.cu"
WARPS = 4  # warps (payloads) per block
KERNEL = f"rans32_decode<{WARPS}>"
SIGNATURE = ("(const unsigned char*, const long long*, const int*, const int*, const long long*, "
             "const unsigned char*, unsigned char*, int*)")
STATES = 32
SMEM_MAX = 48 * 1024  # dynamic shared memory of a block: the warps' word rings + its table (no opt-in needed)
RING_BYTES = 2048  # per warp: RD_RING_WORDS 16-bit words (rans_decode.cu)
TABLE_SMEM_MAX = SMEM_MAX - WARPS * RING_BYTES  # shared-memory tables up to this size
HEAD = 4 * STATES
STATUS_TEXT = {
    1: "rANS payload has a bad length",
    2: "rANS initial state out of range",
    3: "rANS payload ends early",
    4: "rANS payload does not end where its symbols do",
}
_ALIGN = 16


def instance_declarations(warps=(WARPS,)) -> list[str]:
    """Explicit-instantiation declarations for the nvcc compile check."""
    return [f"__global__ void rans32_decode<{w}>{SIGNATURE}" for w in warps]


# ------------------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Table:
    """A decode table: its bytes (uploaded once per batch) and the fields of its tdesc row."""

    data: np.ndarray | None  # uint8, length a multiple of 16; None: a kernel writes it (:func:`device_table`)
    mode: int
    precision: int
    lo: int
    smem_words: int  # u32 words copied to shared memory (0 for mode 2)
    aux: int  # mode 1: byte offset of fc[]; mode 2: byte offset of sym[]
    symbytes: int

    @property
    def nbytes(self) -> int:
        return self.data.size if self.data is not None else 4 * self.smem_words


def build_table(freqs, precision: int, dtype, mode: int | None = None) -> Table:
    """The kernel's decode table for one frequency table (``freqs`` over the alphabet, summing to
    2**precision); the layouts are documented in rans_decode.cu. ``mode`` forces a layout (0, 1 or 2;
    for tests and benchmarks) where it is possible; None picks the first of 0, 1, 2 that fits."""
    f = np.asarray(freqs, dtype=np.int64)
    p = int(precision)
    m = 1 << p
    if not 1 <= p <= 16 or f.ndim != 1 or f.min(initial=0) < 0 or int(f.sum()) != m:
        raise ValueError("frequencies must be non-negative and sum to 2**precision (1..16)")
    symbytes = np.dtype(dtype).itemsize
    nz = np.flatnonzero(f)
    lo, hi = int(nz[0]), int(nz[-1])
    span = hi - lo + 1
    fs = f[lo: hi + 1]
    cum = np.cumsum(fs) - fs
    sym_t = np.uint8 if symbytes == 1 else np.uint16
    fits0 = p <= 12 and span <= 256
    fits1 = _align(m * symbytes, 4) + 4 * span <= TABLE_SMEM_MAX
    if mode is None:
        mode = 0 if fits0 else 1 if fits1 else 2
    if mode not in (0, 1, 2) or (mode == 0 and not fits0) or (mode == 1 and not fits1):
        raise ValueError(f"table mode {mode} does not fit precision {p} with {span} symbols")
    slots = np.arange(m, dtype=np.int64)
    if mode == 0:  # slot s of symbol lo + i: (i << 24) | ((f - 1) << 12) | (s - cum[i]), one repeat of per-symbol terms
        per_sym = (np.arange(span, dtype=np.int64) << 24) + ((fs - 1) << 12) - cum
        e = np.repeat(per_sym, fs) + slots
        body, aux = e.astype("<u4").tobytes(), 0
        return _table(body, mode, p, lo, aux, symbytes)
    idx = np.repeat(np.arange(span, dtype=np.int64), fs)  # slot -> sym - lo
    bias = slots - cum[idx]
    if mode == 1:
        aux = _align(m * symbytes, 4)
        fc = ((fs - 1) << 16) | cum
        body = idx.astype(sym_t).tobytes().ljust(aux, b"\0") + fc.astype("<u4").tobytes()
    else:
        e = ((fs[idx] - 1) << 16) | bias
        aux = 4 * m
        body = e.astype("<u4").tobytes() + (idx + lo).astype(sym_t).tobytes()
    return _table(body, mode, p, lo, aux, symbytes)


def device_table(freqs, precision: int) -> Table:
    """The mode-0 table of byte symbols that :func:`build_table` makes for ``freqs`` (checked: >= 0,
    summing to 2**precision <= 2**12, over at most 256 symbols), without its words: a kernel writes
    them on the device (``planes_codec.cu``'s pc_stream_desc; same words) at its place in the launch
    plan's ``table_data`` (:func:`table_offsets`)."""
    f = np.asarray(freqs)
    if not 1 <= precision <= 12 or f.ndim != 1 or f.size > 256:
        raise ValueError("a device-built table takes at most 256 byte symbols and precision <= 12")
    return Table(None, 0, int(precision), int(np.flatnonzero(f)[0]), 1 << precision, 0, 1)


def table_offsets(tables: list[Table]) -> list[int]:
    """Byte offset of each table in a launch plan's ``table_data`` (where a kernel writes the words of a
    :func:`device_table`)."""
    return np.concatenate(([0], np.cumsum([tb.nbytes for tb in tables[:-1]], dtype=np.int64))).tolist() if tables else []


def _table(body: bytes, mode: int, p: int, lo: int, aux: int, symbytes: int) -> Table:
    data = np.frombuffer(body.ljust(_align(len(body), _ALIGN), b"\0"), dtype=np.uint8)
    smem_words = 0 if mode == 2 else _align(len(body), 4) // 4
    return Table(data, mode, p, lo, smem_words, aux, symbytes)


def _align(v: int, a: int) -> int:
    return -(-v // a) * a


def _blocks(ts: np.ndarray, warps: int) -> np.ndarray:
    """The kernel's blocks [B, 4] int32 (table, first index into the order, payloads, 0) of payloads
    whose tables in launch order are ``ts``: each run of one table cut into blocks of ``warps``."""
    P = len(ts)
    cut = np.flatnonzero(np.diff(ts)) + 1
    run_lo, run_hi = np.concatenate(([0], cut)), np.concatenate((cut, [P]))
    per_run = -(-(run_hi - run_lo) // warps)
    first = (np.repeat(run_lo, per_run) + warps * (np.arange(int(per_run.sum())) - np.repeat(
        np.cumsum(per_run) - per_run, per_run))).astype(np.int64)
    count = np.minimum(warps, np.repeat(run_hi, per_run) - first)
    return np.stack([ts[first], first, count, np.zeros_like(first)], 1).astype(np.int32).reshape(-1, 4)


@lru_cache(maxsize=64)
def _grouped_blocks(runs: tuple[int, ...], warps: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, blocks) of payloads launched in their own order, ``runs[t]`` consecutive ones with
    table t (a planes blob's chunks: they depend on its chunk count alone, so blobs of one shape
    share them). Read-only arrays."""
    P = sum(runs)
    order = np.arange(P, dtype=np.int32)
    blocks = _blocks(np.repeat(np.arange(len(runs), dtype=np.int64), runs), warps)
    order.flags.writeable = blocks.flags.writeable = False
    return order, blocks


# ------------------------------------------------------------------------------------- batch
@dataclass
class _Item:
    index: int  # position in the caller's list
    n: int
    dtype: np.dtype
    table: int  # index into the batch's tables (-1: no GPU work)
    payload_len: int


@dataclass
class LaunchPlan:
    """The kernel's descriptors for a set of payloads, on the device: payloads grouped by table into
    blocks of WARPS (a block shares one table in shared memory), biggest first within a table."""

    pdesc: torch.Tensor
    order: torch.Tensor
    blocks: torch.Tensor
    tdesc: torch.Tensor
    table_data: torch.Tensor
    smem_bytes: int
    n_blocks: int
    also: list  # the caller's extra arrays of the same upload
    warps: int = WARPS

    @classmethod
    def build(cls, pdesc: np.ndarray, table_of: np.ndarray, tables: list[Table], device,
              also=(), warps: int | None = None) -> "LaunchPlan":
        """``pdesc`` [P, 4] int64: byte offset of payload p in the data buffer (even), its length,
        byte offset of its output, its symbol count; ``table_of`` [P]: index into ``tables``.
        ``pdesc`` may be a CUDA tensor a kernel fills before the launch (a planes blob's chunk
        lengths, checked on the device): the payloads are then launched in their order, which must
        group them by table (``table_of`` non-decreasing).
        ``also``: more arrays for the same upload (a caller's next launch), as ``plan.also``; ``warps``
        per block (default WARPS; 2 or 4 keep every table of ``build_table`` in shared memory)."""
        from kvcodec.device.transfer import upload

        warps = warps or WARPS
        P = len(table_of)
        on_device = isinstance(pdesc, torch.Tensor)
        if on_device:
            if P and not (table_of[1:] >= table_of[:-1]).all():
                raise ValueError("payloads described on the device must be grouped by table")
            order, blocks = _grouped_blocks(tuple(np.bincount(table_of).tolist()) if P else (), warps)
        else:
            sizes = pdesc[:, 3]
            if P and (table_of[1:] >= table_of[:-1]).all() and \
                    ((table_of[1:] > table_of[:-1]) | (sizes[1:] <= sizes[:-1])).all():
                order = np.arange(P, dtype=np.int32)  # already in that order (a planes blob's chunks)
            else:
                order = np.lexsort((-sizes, table_of)).astype(np.int32) if P else np.zeros(0, np.int32)
            blocks = _blocks(np.asarray(table_of, np.int64)[order], warps)
        toff = table_offsets(tables)
        tbytes = toff[-1] + tables[-1].nbytes if tables else 0
        tdesc = np.array([(o, tb.mode, tb.precision, tb.lo, tb.smem_words, tb.aux, tb.symbytes, 0)
                          for o, tb in zip(toff, tables)], dtype=np.int64).reshape(-1, 8)
        tab_host = np.zeros(max(tbytes, _ALIGN), dtype=np.uint8)
        for o, tb in zip(toff, tables):
            if tb.data is not None:
                tab_host[o: o + tb.data.size] = tb.data
        host_rows = [] if on_device else [np.ascontiguousarray(pdesc, np.int64)]
        got = upload(host_rows + [order, blocks, tdesc, tab_host, *also], device)
        pd = pdesc if on_device else got.pop(0)
        od, bd, td, tabd, *more = got
        return cls(pd.reshape(-1, 4), od, bd.reshape(-1, 4), td.reshape(-1, 8), tabd,
                   warps * RING_BYTES + max([4 * tb.smem_words for tb in tables] + [0]), len(blocks), more, warps)

    def launch(self, data: torch.Tensor, out: torch.Tensor, status: torch.Tensor) -> None:
        """Decode every payload of ``data`` into ``out``, statuses into ``status`` (int32, one per
        payload), on torch's current stream; no synchronization."""
        if not self.n_blocks:
            return
        from kvcodec.device import build

        fn = build.get_function(SOURCE, f"rans32_decode<{self.warps}>")
        with build.cupy_stream(data.device):
            fn((self.n_blocks,), (32 * self.warps,),
               (data.data_ptr(), self.pdesc.data_ptr(), self.order.data_ptr(), self.blocks.data_ptr(),
                self.tdesc.data_ptr(), self.table_data.data_ptr(), out.data_ptr(), status.data_ptr()),
               shared_mem=self.smem_bytes)


class RansBatch:
    """Streams parsed, tables built and everything uploaded once; ``launch`` decodes the whole batch
    with one kernel on torch's current stream (any number of times)."""

    def __init__(self, blobs, device="cuda", cpu_fallback: bool = False, table_mode: int | None = None,
                 max_output_bytes: int | None = None):
        from kvcodec.entropy import stream

        blobs = list(blobs)
        self.device = torch.device(device)
        headers, payloads, self._fallback = [], [], {}
        parsed = [stream.parse(blob) for blob in blobs]
        _check_output_cap([h for h, _ in parsed], max_output_bytes)
        for i, (blob, (h, payload)) in enumerate(zip(blobs, parsed)):
            if h.n and (h.coder != "rans" or h.streams != STATES):
                if not cpu_fallback:
                    raise ValueError(f"stream {i} is {h.coder} with {h.streams} state(s); the GPU decoder takes "
                                     f"rANS with {STATES} states (encode with streams=32, or cpu_fallback=True)")
                from kvcodec import entropy

                self._fallback[i] = entropy.decode(blob, max_output_bytes=None)  # capped above
            headers.append(h)
            payloads.append(payload)
        offsets = []
        total = 0
        gpu = [h.n > 0 and i not in self._fallback for i, h in enumerate(headers)]
        for h, g in zip(headers, gpu):
            offsets.append(total)
            if g:
                total += _align(h.payload_len, _ALIGN)
        host = np.zeros(max(total, _ALIGN), dtype=np.uint8)
        for h, pl, off, g in zip(headers, payloads, offsets, gpu):
            if g:
                host[off: off + h.payload_len] = np.frombuffer(pl, dtype=np.uint8)
        data = torch.from_numpy(host).to(self.device)
        self._setup(headers, data, offsets, table_mode)

    @classmethod
    def from_device(cls, data: torch.Tensor, offsets, headers, table_mode: int | None = None,
                    max_output_bytes: int | None = None) -> "RansBatch":
        """Payloads already on the device: ``data`` a uint8 CUDA tensor, ``offsets[i]`` the byte
        offset of payload i in it (its length is ``headers[i].payload_len``; the address must be
        even), ``headers`` the ``StreamHeader``s from ``kvcodec.entropy.stream.parse``."""
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_cuda:
            raise ValueError("data must be a 1-D uint8 CUDA tensor")
        headers = list(headers)
        _check_output_cap(headers, max_output_bytes)
        offsets = [int(o) for o in offsets]
        if len(offsets) != len(headers):
            raise ValueError("one offset per header")
        for h, o in zip(headers, offsets):
            if h.n and (h.coder != "rans" or h.streams != STATES):
                raise ValueError(f"the GPU decoder takes rANS streams with {STATES} states")
            if h.n and (o < 0 or o + h.payload_len > data.numel() or (data.data_ptr() + o) % 2):
                raise ValueError("each payload must lie inside data and start at an even address")
        self = cls.__new__(cls)
        self.device = data.device
        self._fallback = {}
        self._setup(headers, data, offsets, table_mode)
        return self

    def _setup(self, headers, data: torch.Tensor, offsets, table_mode: int | None = None) -> None:
        self.data = data
        self.items: list[_Item] = []
        tables: list[Table] = []
        table_ids: dict[tuple, int] = {}
        pdesc, out_off = [], 0
        self.out_offsets = []
        for i, h in enumerate(headers):
            if h.n == 0 or i in self._fallback:
                self.items.append(_Item(i, h.n, h.dtype, -1, 0))
                self.out_offsets.append(0)
                continue
            key = (h.dtype.itemsize, h.param, h.freqs.tobytes())
            t = table_ids.get(key)
            if t is None:
                t = table_ids[key] = len(tables)
                tables.append(build_table(h.freqs, h.param, h.dtype, table_mode))
            out_off = _align(out_off, h.dtype.itemsize)
            self.items.append(_Item(i, h.n, h.dtype, t, h.payload_len))
            self.out_offsets.append(out_off)
            pdesc.append((offsets[i], h.payload_len, out_off, h.n))
            out_off += h.n * h.dtype.itemsize
        self.out_bytes = out_off
        self.tables = tables
        work = [it for it in self.items if it.table >= 0]
        self.n_symbols = sum(it.n for it in work)
        self.n_payloads = len(work)
        self._pidx = {it.index: k for k, it in enumerate(work)}  # caller index -> payload id
        self.plan = LaunchPlan.build(np.array(pdesc, dtype=np.int64).reshape(-1, 4),
                                     np.array([it.table for it in work], dtype=np.int32), tables, self.device)
        self.compressed_bytes = sum(it.payload_len for it in work)

    # the launch descriptors (the emulation in tests/test_cuda_rans.py reads them)
    pdesc = property(lambda self: self.plan.pdesc)
    order = property(lambda self: self.plan.order)
    blocks = property(lambda self: self.plan.blocks)
    tdesc = property(lambda self: self.plan.tdesc)
    table_data = property(lambda self: self.plan.table_data)
    smem_bytes = property(lambda self: self.plan.smem_bytes)
    n_blocks = property(lambda self: self.plan.n_blocks)

    # ----------------------------------------------------------------------------- launching
    def launch(self, out: torch.Tensor | None = None, status: torch.Tensor | None = None):
        """Decode every payload into ``out`` (uint8, ``out_bytes`` long) on torch's current stream;
        returns (out, status [n_payloads] int32). Does not synchronize or check the status."""
        if out is None:
            out = torch.empty(max(self.out_bytes, 1), dtype=torch.uint8, device=self.device)
        if status is None:
            status = torch.empty(max(self.n_payloads, 1), dtype=torch.int32, device=self.device)
        self.plan.launch(self.data, out, status)
        return out, status

    def check(self, status: torch.Tensor) -> None:
        """Raise CorruptStreamError for the first payload whose status is not 0 (synchronizes)."""
        if not self.n_payloads:
            return
        st = status[: self.n_payloads].cpu().numpy()
        bad = np.flatnonzero(st)
        if bad.size:
            inv = {k: i for i, k in self._pidx.items()}
            k = int(bad[0])
            raise CorruptStreamError(f"stream {inv[k]}: {STATUS_TEXT.get(int(st[k]), f'status {int(st[k])}')}"
                                     + (f" ({bad.size} bad streams)" if bad.size > 1 else ""))

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Per-stream tensors (views of ``out``; CPU-fallback streams are separate tensors)."""
        res = []
        for it, off in zip(self.items, self.out_offsets):
            if it.index in self._fallback:
                a = self._fallback[it.index]
                t = torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a).to(self.device)
                res.append(t.view(torch.uint16) if it.dtype.itemsize == 2 else t)
                continue
            nb = it.n * it.dtype.itemsize
            v = out[off: off + nb]
            res.append(v.view(torch.uint16) if it.dtype.itemsize == 2 else v)
        return res


def _check_output_cap(headers, max_output_bytes) -> None:
    """CorruptStreamError if the streams together declare more than the cap (default: the
    library-wide ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES``), before any allocation."""
    from kvcodec import validate

    cap = validate.DEFAULT_MAX_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes
    validate.check_output(sum(h.n * h.dtype.itemsize for h in headers), cap, "rANS batch")


def decode_batch(blobs, device="cuda", cpu_fallback: bool = False,
                 max_output_bytes: int | None = None) -> list[torch.Tensor]:
    """Decode many 32-state rANS streams on the GPU with one kernel launch; returns one uint8/uint16
    tensor per stream (views into one output buffer), bit-exact with ``kvcodec.entropy.decode``.

    Raises CorruptStreamError for a malformed or inconsistent stream (header/CRC on the host,
    payload on the device) or a batch declaring more than ``max_output_bytes`` (default
    ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES``, checked before anything is allocated), and
    ValueError for streams the GPU path does not take (see module doc).
    """
    batch = RansBatch(blobs, device, cpu_fallback, max_output_bytes=max_output_bytes)
    out, status = batch.launch()
    batch.check(status)
    return batch.split(out)


def decode_concat(blobs, device="cuda", max_output_bytes: int | None = None) -> torch.Tensor:
    """Decode streams of one dtype into one flat tensor, the streams' symbols back to back (the
    inverse of ``encode_chunks``); ``max_output_bytes`` as in :func:`decode_batch`."""
    batch = RansBatch(blobs, device, max_output_bytes=max_output_bytes)
    dts = {it.dtype for it in batch.items if it.n}
    if len(dts) > 1:
        raise ValueError("decode_concat needs streams of one dtype")
    out, status = batch.launch()
    batch.check(status)
    dt = dts.pop() if dts else np.dtype(np.uint8)
    flat = out[: batch.out_bytes]
    return flat.view(torch.uint16) if dt.itemsize == 2 else flat


# ------------------------------------------------------------------------------------- encoding
def encode_chunks(x, chunk_symbols: int = 1 << 16, precision: int | None = None,
                  shared_table: bool = False, workers: int | None = None) -> list[bytes]:
    """Split a 1-D uint8/uint16 array into chunks of ``chunk_symbols`` symbols (the last may be
    shorter) and encode each as an independent 32-state rANS stream with the CPU (numba) encoder.

    shared_table: one frequency table from the whole array for every chunk (the GPU then uploads a
    single table; headers still carry it); otherwise each chunk gets its own (smaller output).
    workers: encoder threads (numba releases the GIL), default all cores.
    """
    from kvcodec import entropy
    from kvcodec.entropy import freq, rans_fast, stream

    x = np.ascontiguousarray(x)
    if x.ndim != 1 or x.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("x must be a 1-D uint8 or uint16 array")
    if not isinstance(chunk_symbols, (int, np.integer)) or chunk_symbols < 1:
        raise ValueError("chunk_symbols must be a positive int")
    starts = list(range(0, x.size, int(chunk_symbols))) or [0]
    chunks = [x[s: s + chunk_symbols] for s in starts]
    if shared_table and x.size:
        counts = freq.count_symbols(x)
        p = freq.choose_precision(int(np.count_nonzero(counts))) if precision is None else int(precision)
        freqs = freq.quantize_frequencies(counts, p)

        def enc(c):
            if c.size == 0:
                return stream.pack("rans", x.dtype, 0, 0, 0, None, b"")
            return stream.pack("rans", x.dtype, c.size, p, STATES, freqs, rans_fast.encode_table(c, freqs, p, STATES))
    else:
        def enc(c):
            return entropy.encode(c, coder="rans", streams=STATES, precision=precision)

    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(chunks) == 1:
        return [enc(c) for c in chunks]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(enc, chunks))


__all__ = ["LaunchPlan", "RansBatch", "build_table", "decode_batch", "decode_concat", "device_table", "encode_chunks"]
