"""Format 2 of the predictive / kvctx streams: bins, per-class tables and the 32-lane rANS.

The model is format 1's (location ``m``, gain ``c``, previous-token coefficient ``a`` per channel,
fitted by :func:`params.fit_params`); what changed is how a value's probability is found: not by
evaluating a CDF at its bin edges but by the bins of :mod:`bins` and a table lookup
(:mod:`tables`), which is what makes it faster. Stored per channel (the fields and the tables in
one :func:`kvcodec.entropy.encode` stream, so a field of similar values costs a few bits a channel):

- ``level``: the scale as floor(4 * log2(s / step)), only its quarter octave matters (bins and class);
- ``mq``: the location in units of the channel's bin width ``2**es`` steps (round(m / 2**es));
- ``c``, ``a``: int8 / 64, as in format 1 (only the fields the source does not fix).

Stream: meta adds ``lanes`` (8 or 32) to format 1's fields, and ``mparts`` when the model bytes
are coded in parts (:func:`code_model`); sections ``model`` (uint8: u32 length,
then the parameter fields' offsets and widths (5 bytes a field) and one ``entropy.encode`` stream
of the fields' bytes followed by the tables' bytes, or ``mparts`` rANS payloads of its slices with
one shared table (:func:`code_model`); then per chunk the u32 rANS word count and the
u32 raw-bit word count), ``payload`` (uint16: the chunks' rANS streams in order, each ``rans_lanes``' layout) and
``bits`` (uint32: the chunks' raw bits in order). Chunks: :func:`chunk_layout`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np

from kvcodec import entropy
from kvcodec.entropy import rans_fast, rans_lanes
from kvcodec.entropy.freq import count_symbols, quantize_frequencies
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive.binned import decode_chunks, gather_words, symbolise, write_chunks
from kvcodec.lossless.predictive.bins import EP_MAX, N_CLASSES, BinGrid, bin_exponent, scale_levels
from kvcodec.lossless.predictive.params import Q, ChannelParams, stored_fields
from kvcodec.lossless.predictive.tables import decode_tables, fit_tables, table_bytes, tables_from_bytes

CHUNK_VALUES = 1 << 16  # about this many values per independently decodable chunk
MODEL_PART_BYTES = 1 << 16  # model bytes (fields + tables) per independently coded part (meta "mparts")
MAX_MODEL_PARTS = 64
MODEL_PRECISION = 14  # the parts' shared table: probabilities in 2**-14
MODEL_STREAMS = 8  # interleaved rANS states per part
WIDE_LANES_FROM = 1 << 14  # chunks this large use 32 lanes (the GPU warp), smaller ones 8
_LEVEL_LO, _LEVEL_HI = -64, 4 * EP_MAX + 15
_MQ_MAX = 32767


def _blocks(g: int, tt: int, d: int, tb: int, unit: int) -> tuple[int, int]:
    """(leading indices per chunk, chunks per unit of ``unit`` leading indices)."""
    gb = max(1, min(unit, CHUNK_VALUES // max(tb * d, 1)))
    return gb, -(-unit // gb)


def chunk_count(g: int, tt: int, d: int, tb: int, unit: int) -> int:
    """How many chunks :func:`chunk_layout` lists (without building it: a forged shape must be
    checked against the stream before anything is sized by it)."""
    gb, per_unit = _blocks(g, tt, d, tb, unit)
    return (g // unit) * per_unit * -(-tt // tb)


def chunk_layout(g: int, tt: int, d: int, tb: int, unit: int):
    """(first g, g count, first token, token count) per chunk, int64 arrays: blocks of ``tb``
    tokens x as many consecutive leading indices as fill ~CHUNK_VALUES, never crossing a multiple
    of ``unit`` (a layer, for the neighbour-layer predictor); g-major."""
    gb, per_unit = _blocks(g, tt, d, tb, unit)
    k = np.arange(per_unit, dtype=np.int64) * gb
    gs = (np.arange(0, g, unit, dtype=np.int64)[:, None] + k[None, :]).reshape(-1)
    ng = np.tile(np.minimum(gb, unit - k), g // unit)
    ts = np.arange(0, tt, tb, dtype=np.int64)
    nt = np.minimum(tb, tt - ts)
    return np.repeat(gs, ts.size), np.repeat(ng, ts.size), np.tile(ts, gs.size), np.tile(nt, gs.size)


@dataclass
class BinParams:
    """Format 2's per-channel parameters [Gp, D] (see the module docstring)."""

    level: np.ndarray
    mq: np.ndarray
    c: np.ndarray  # int8, value / Q
    a: np.ndarray  # int8, value / Q
    shared: bool

    @classmethod
    def from_channel(cls, p: ChannelParams, grid: BinGrid) -> "BinParams":
        s_v = np.asarray(p.s, np.float64) * 2.0 ** -grid.eoff
        level = np.clip(scale_levels(s_v), _LEVEL_LO, _LEVEL_HI)
        step = 2.0 ** (bin_exponent(level) + grid.eoff)
        with np.errstate(all="ignore"):
            mq = np.clip(np.nan_to_num(np.round(np.asarray(p.m, np.float64) / step)), -_MQ_MAX, _MQ_MAX)
        return cls(level=level.astype(np.int64), mq=mq.astype(np.int64), c=p.c.astype(np.int8),
                   a=p.a.astype(np.int8), shared=p.shared)

    def kernel_args(self, grid: BinGrid):
        """(m, c, a, es, level): float64 location / gain / coefficient, int64 bin exponent and level."""
        es = bin_exponent(self.level).astype(np.int64)
        m = self.mq.astype(np.float64) * 2.0 ** (es + grid.eoff).astype(np.float64)
        return m, self.c.astype(np.float64) / Q, self.a.astype(np.float64) / Q, es, self.level

    def field_bytes(self, source: str) -> tuple[bytes, np.ndarray]:
        """(header, bytes) of the stored fields: each as non-negative integers (level - its
        minimum, zigzag mq, int8 bytes) in one byte (or a low and a high byte plane); the header
        has per field the 4-byte offset and the width (1 or 2)."""
        head, body = b"", []
        for f in stored_fields(source):  # every value fits 16 bits (levels and |mq| are clipped)
            if f == "s":
                lo = int(self.level.min())
                arr = self.level - lo
            elif f == "m":
                lo, arr = 0, (self.mq << 1) ^ (self.mq >> 63)  # zigzag
            else:
                lo, arr = 0, getattr(self, f).view(np.uint8)
            arr = arr.reshape(-1)
            width = 1 if int(arr.max()) < 256 else 2
            head += lo.to_bytes(4, "little", signed=True) + bytes([width])
            if width == 1:
                body.append(arr.astype(np.uint8, copy=False))
            else:
                planes = arr.astype("<u2").view(np.uint8).reshape(-1, 2)
                body += [planes[:, 0], planes[:, 1]]
        return head, np.concatenate(body)

    @classmethod
    def from_bytes(cls, head: bytes, raw: np.ndarray, source: str, gp: int, d: int,
                   shared: bool) -> tuple["BinParams", np.ndarray]:
        """Inverse of :func:`field_bytes`: (params, the bytes after them)."""
        fields, rest = StoredFields.read(head, raw, source, gp, d)
        return fields.params(shared), rest


# the stored fields' order in StoredFields.layout, and their names in params.stored_fields
FIELD_ORDER = ("level", "mq", "c", "a")
_FIELD_OF = {"s": "level", "m": "mq", "c": "c", "a": "a"}


@dataclass(frozen=True)
class StoredFields:
    """Format 2's per-channel fields as stored, checked but not expanded: the entropy-decoded byte
    planes ``raw`` and per field (``FIELD_ORDER``) a row of ``layout`` int64 [4, 3]: offset of its
    low byte plane in ``raw`` (the high plane, if any, follows ``n`` bytes later), width in bytes (0:
    not stored) and a value (the level's stored minimum; c's / a's fixed value when not stored).

    Why: a stream holds up to ~10**6 channels; expanding them into float64 arrays costs more than
    the GPU decode of the whole tensor, so the GPU kernel reads these bytes as they are
    (kvcodec/cuda/kvctx_decode.cu ``kx_params``) and only the CPU decoder expands them
    (:meth:`params`)."""

    raw: np.ndarray
    layout: np.ndarray
    n: int  # channels: Gp * D
    shape: tuple[int, int]  # (Gp, D)

    @classmethod
    def read(cls, head: bytes, raw: np.ndarray, source: str, gp: int, d: int) -> tuple["StoredFields", np.ndarray]:
        """(fields, the bytes after them) of a field header and the decoded bytes; every field's
        values checked against its range with a few whole-array operations (no per-channel loop)."""
        n = gp * d
        layout = np.zeros((4, 3), np.int64)
        layout[FIELD_ORDER.index("c"), 2] = Q if source == "external" else 0
        layout[FIELD_ORDER.index("a"), 2] = Q
        pos = 0
        for k, f in enumerate(stored_fields(source)):
            lo = int.from_bytes(head[5 * k:5 * k + 4], "little", signed=True)
            width = head[5 * k + 4]
            bad = width not in (1, 2) or (f != "s" and lo) or (width == 2 and f in ("a", "c"))
            if bad or pos + width * n > raw.size:
                raise CorruptStreamError("predictive stream has a malformed parameter field")
            planes = raw[pos:pos + width * n]
            if f == "s":
                top = int(planes.max(initial=0)) if width == 1 else int(_u16_planes(planes, n).max(initial=0))
                if lo < _LEVEL_LO or n and lo + top > _LEVEL_HI:
                    raise CorruptStreamError("predictive stream has a scale level out of range")
            elif f == "m" and width == 2 and np.any((planes[:n] & planes[n:]) == 0xFF):  # zigzag 65535
                raise CorruptStreamError("predictive stream has a location out of range")
            layout[FIELD_ORDER.index(_FIELD_OF[f])] = (pos, width, lo)
            pos += width * n
        return cls(raw=raw[:pos], layout=layout, n=n, shape=(gp, d)), raw[pos:]

    def values(self, name: str) -> np.ndarray:
        """int64 [Gp, D] of one field (``FIELD_ORDER``)."""
        off, width, value = (int(v) for v in self.layout[FIELD_ORDER.index(name)])
        if width == 0:
            return np.full(self.shape, value, np.int64)
        planes = self.raw[off:off + width * self.n]
        arr = (planes.astype(np.int64) if width == 1 else _u16_planes(planes, self.n).astype(np.int64)).reshape(self.shape)
        if name == "level":
            return arr + value
        if name == "mq":
            return (arr >> 1) ^ -(arr & 1)
        return arr.astype(np.uint8).view(np.int8).astype(np.int64)

    def params(self, shared: bool) -> BinParams:
        """The fields expanded (the CPU decoder's arrays)."""
        return BinParams(level=self.values("level"), mq=self.values("mq"), c=self.values("c").astype(np.int8),
                         a=self.values("a").astype(np.int8), shared=shared)


def _u16_planes(planes: np.ndarray, n: int) -> np.ndarray:
    """uint16 values of a low byte plane followed by a high byte plane."""
    return planes[:n].astype(np.uint16) | (planes[n:2 * n].astype(np.uint16) << 8)


def _grid_args(grid: BinGrid):
    return (grid.width, grid.sign, grid.mb, grid.maxmag, grid.escape, grid.unit, 2.0 ** -grid.eoff)


def encode(pats: np.ndarray, pred, model: ChannelParams, grid: BinGrid, tb: int, unit: int,
           source: str) -> tuple[dict, dict]:
    """Code bit patterns ``pats`` [G, T, D] (uint8/uint16) with ``model``: (meta fields, sections).
    Run inside the caller's thread-count context."""
    g, tt, d = pats.shape
    bp = BinParams.from_channel(model, grid)
    m, c, a, es, level = bp.kernel_args(grid)
    cg0, cng, ct0, cnt = chunk_layout(g, tt, d, tb, unit)
    sizes = cng * cnt * d
    coff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = int(coff[-1])
    packed = np.empty(n, np.int64)
    chunk_bits = np.zeros(cg0.size, np.int64)
    hist = np.zeros((cg0.size, N_CLASSES, 256), np.int32)
    has_pred = pred is not None
    p = pred if has_pred else np.zeros((1, 1, 1), np.float32)
    symbolise(pats, p, has_pred, m, c, a, es, level, bp.shared, cg0, cng, ct0, cnt, coff, *_grid_args(grid),
              packed, chunk_bits, hist)
    freq = fit_tables(hist.sum(axis=0, dtype=np.int64))
    lanes = 32 if sizes.max() >= WIDE_LANES_FROM else 8
    bwords = (chunk_bits + 31) // 32
    bstart = np.concatenate([[0], np.cumsum(bwords)]).astype(np.int64)
    bits = np.zeros(int(bstart[-1]), np.uint32)
    wcap = np.concatenate([[0], np.cumsum(sizes + 2 * lanes)]).astype(np.int64)
    words = np.empty(int(wcap[-1]), np.uint16)
    wstart = np.empty(cg0.size, np.int64)
    write_chunks(packed, coff, freq, rans_lanes.cumulative(freq), lanes, wcap, words, wstart,
                 bstart, bits)
    wlen = wcap[1:] - wstart
    counts = np.concatenate([wlen, bwords]).astype("<u4").view(np.uint8)
    fields_head, fields = bp.field_bytes(source)
    body, mparts = code_model(np.concatenate([fields, table_bytes(freq)]))
    head = fields_head + body
    model_blob = np.concatenate([np.frombuffer(len(head).to_bytes(4, "little") + head, np.uint8), counts])
    payload = gather_words(words, wstart, wcap)
    return {"shared": bp.shared, "lanes": lanes, **mparts}, {"model": model_blob, "payload": payload, "bits": bits}


@cache
def _pool() -> ThreadPoolExecutor:
    """Threads for the model's parts (the rANS kernels release the GIL)."""
    return ThreadPoolExecutor(max_workers=min(MAX_MODEL_PARTS, os.cpu_count() or 1))


def _part_sizes(n: int, parts: int) -> np.ndarray:
    """Symbols per part: ``np.array_split``'s sizes of n symbols in ``parts`` parts."""
    sizes = np.full(parts, n // parts, np.int64)
    sizes[:n % parts] += 1
    return sizes


def code_model(raw: np.ndarray) -> tuple[bytes, dict]:
    """(bytes, meta fields) of the model bytes (parameter fields + tables). At most
    ``MODEL_PART_BYTES`` bytes: one ``entropy.encode`` stream (no meta field: the original format 2
    layout). More: ``mparts`` parts (``np.array_split``) coded with one shared table, each an
    independent ``MODEL_STREAMS``-state rANS payload, coded (and decoded) in parallel:
    u32 symbol count, 256 x u16 frequencies (summing to 2**MODEL_PRECISION), per part the u32
    payload length, then the payloads (``rans_fast.encode_table``).

    Why: a stream of ~10**6 channels has megabytes of fields; one sequential entropy stream of them
    was the GPU decoder's largest host cost, and self-describing streams per part cost ~0.5 ms each."""
    parts = min(MAX_MODEL_PARTS, -(-raw.size // MODEL_PART_BYTES))
    if parts <= 1:
        return entropy.encode(raw, coder="rans"), {}
    freqs = quantize_frequencies(count_symbols(raw), MODEL_PRECISION).astype("<u2")
    payloads = list(_pool().map(lambda x: rans_fast.encode_table(x, freqs, MODEL_PRECISION, MODEL_STREAMS),
                                np.array_split(raw, parts)))
    head = np.concatenate([np.array([raw.size], "<u4").view(np.uint8), freqs.view(np.uint8),
                           np.array([p.size for p in payloads], "<u4").view(np.uint8)])
    return b"".join([head.tobytes(), *(p.tobytes() for p in payloads)]), {"mparts": parts}


def decode_model(meta: dict, body: bytes, max_symbols: int) -> np.ndarray:
    """Inverse of :func:`code_model`: the model bytes (uint8) of ``body`` (CorruptStreamError)."""
    parts = meta.get("mparts", 1)
    if "mparts" not in meta:
        raw = entropy.decode(body, max_symbols=max_symbols, max_output_bytes=None)
        if raw.dtype != np.uint8:
            raise CorruptStreamError("predictive stream has a malformed model")
        return raw
    if type(parts) is not int or not 2 <= parts <= MAX_MODEL_PARTS:
        raise CorruptStreamError("predictive stream has a bad model part count")
    n_head = 4 + 512 + 4 * parts
    if len(body) < n_head:
        raise CorruptStreamError("predictive stream model parts are truncated")
    buf = np.frombuffer(body, np.uint8)
    n = int(buf[:4].view("<u4")[0])
    freqs = buf[4:516].view("<u2").astype(np.int64)
    lens = buf[516:n_head].view("<u4").astype(np.int64)
    if n > max_symbols or n < parts or int(freqs.sum()) != 1 << MODEL_PRECISION \
            or n_head + int(lens.sum()) != buf.size:
        raise CorruptStreamError("predictive stream has malformed model parts")
    tables = rans_fast.decode_tables(freqs, MODEL_PRECISION)
    ends = n_head + np.cumsum(lens)
    spans = [(int(e - k), int(e), int(m)) for e, k, m in zip(ends, lens, _part_sizes(n, parts))]
    decoded = list(_pool().map(
        lambda s: rans_fast.decode_prepared(buf[s[0]:s[1]], tables, MODEL_PRECISION, s[2], MODEL_STREAMS), spans))
    return np.concatenate(decoded)


@dataclass(frozen=True)
class Parsed2:
    """A format 2 stream's fields, each checked against the others."""

    fields: StoredFields
    grid: BinGrid
    shared: bool
    tabs: np.ndarray
    lanes: int
    chunks: tuple  # chunk_layout()
    wstart: np.ndarray
    wlen: np.ndarray
    bstart: np.ndarray
    blen: np.ndarray
    words: np.ndarray
    bits: np.ndarray

    @cached_property
    def margs(self) -> tuple:
        """BinParams.kernel_args(): the CPU decoder's per-channel arrays (expanded on first use)."""
        return self.fields.params(self.shared).kernel_args(self.grid)


def parse(meta: dict, sections: dict, section, grid: BinGrid, g: int, tt: int, d: int, tb: int, unit: int,
          source: str) -> Parsed2:
    """Check a format 2 stream's fields and section sizes (CorruptStreamError); ``section`` reads
    a typed section."""
    shared, lanes = meta.get("shared"), meta.get("lanes")
    if not isinstance(shared, bool) or lanes not in rans_lanes.LANES or type(lanes) is not int:
        raise CorruptStreamError("predictive stream has a bad sharing or lane field")
    nc = chunk_count(g, tt, d, tb, unit)
    blob = section(sections, "model", np.uint8)
    if blob.size < 4:
        raise CorruptStreamError("predictive stream model section is too short")
    k = int.from_bytes(blob[:4].tobytes(), "little")
    if blob.size != 4 + k + 8 * nc:
        raise CorruptStreamError("predictive stream model section has the wrong size")
    chunks = chunk_layout(g, tt, d, tb, unit)
    gp = 1 if shared else g
    n_head = 5 * len(stored_fields(source))
    head = blob[4:4 + k].tobytes()
    if k < n_head:
        raise CorruptStreamError("predictive stream model section is too short")
    raw = decode_model(meta, head[n_head:], 2 * 4 * gp * d + 3 * 260 * N_CLASSES)
    fields, rest = StoredFields.read(head[:n_head], raw, source, gp, d)
    tabs = decode_tables(tables_from_bytes(rest))
    counts = blob[4 + k:].copy().view("<u4").astype(np.int64)
    wlen, blen = counts[:nc], counts[nc:]
    words = section(sections, "payload", np.uint16)
    bits = section(sections, "bits", np.uint32)
    if int(wlen.sum()) != words.size or wlen.min() < 2 * lanes or int(blen.sum()) != bits.size:
        raise CorruptStreamError("predictive stream chunk sizes do not add up to its payload")
    if np.any(blen > 2 * chunks[1] * chunks[3] * d):  # at most 64 raw bits per value
        raise CorruptStreamError("predictive stream has a chunk with too many raw bits")
    wstart = np.concatenate([[0], np.cumsum(wlen)[:-1]]).astype(np.int64)
    bstart = np.concatenate([[0], np.cumsum(blen)[:-1]]).astype(np.int64)
    bits = bits if bits.size else np.zeros(1, np.uint32)  # the kernel's branch-free reads need one word
    return Parsed2(fields, grid, shared, tabs, lanes, chunks, wstart, wlen, bstart, blen, words, bits)


def decode(ps: Parsed2, grid: BinGrid, select: np.ndarray, out: np.ndarray, out_t0: int, pred, pred_g0: int,
           pred_t0: int) -> np.ndarray:
    """Decode chunks ``select`` (indices) into ``out`` [G, T', D] (its token 0 is ``out_t0``); the
    prediction's [0, 0] is (pred_g0, pred_t0). Returns the per-chunk error flags. Run inside the
    caller's thread-count context."""
    cg0, cng, ct0, cnt = (x[select] for x in ps.chunks)
    err = np.zeros(select.size, np.int32)
    has_pred = pred is not None
    p = pred if has_pred else np.zeros((1, 1, 1), np.float32)
    decode_chunks(ps.words, ps.wstart[select], ps.wlen[select], ps.bits, ps.bstart[select], ps.blen[select],
                  cg0, cng, ct0, cnt, p, has_pred, pred_g0, pred_t0, *ps.margs, ps.shared, ps.tabs, ps.lanes,
                  *_grid_args(grid), out, 0, out_t0, err)
    return err
