"""Format 2 of the predictive / kvctx streams: bins, per-class tables and the 32-lane rANS.

The model is format 1's (location ``m``, gain ``c``, previous-token coefficient ``a`` per channel,
fitted by :func:`params.fit_params`); what changed is how a value's probability is found: not by
evaluating a CDF at its bin edges but by the bins of :mod:`bins` and a table lookup
(:mod:`tables`), which is what makes it faster. Stored per channel (the fields and the tables in
one rANS stream, :func:`lanes_model`, so a field of similar values costs a few bits a channel):

- ``level``: the scale as floor(4 * log2(s / step)), only its quarter octave matters (bins and class);
- ``mq``: the location in units of the channel's bin width ``2**es`` steps (round(m / 2**es));
- ``c``, ``a``: int8 / 64, as in format 1 (only the fields the source does not fix).

Stream: meta adds ``lanes`` (8 or 32) to format 1's fields, ``mag`` (1: symbols and classes counted
by magnitude, :func:`bins.magnitude_symbol`; absent or 0: by value, the streams written before), and ``mfields`` (or, written before,
``mparts``) when the model bytes are coded in parts, or ``mlanes`` when in one ``rans_lanes`` stream
(:func:`code_model`); sections ``model`` (uint8: u32 length, then the parameter fields' offsets and
widths (5 bytes a field) and the fields' bytes followed by the tables' bytes as one stream
(:func:`lanes_model`; written before: one ``entropy.encode`` stream), or the parts of :func:`code_model`; then per chunk the u32 rANS word count and the u32 raw-bit word count), ``payload`` (uint16: the chunks' rANS streams in order, each ``rans_lanes``' layout) and
``bits`` (uint32: the chunks' raw bits in order). Chunks: :func:`chunk_layout`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache

import numpy as np
from numba import njit

from kvcodec import entropy
from kvcodec.entropy import rans_fast, rans_lanes
from kvcodec.entropy.rans_fast import table_args, table_kernel
from kvcodec.kernel_inputs import readonly
from kvcodec.entropy.freq import count_symbols, quantize_frequencies
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive.binned import decode_chunks, gather_words, symbolise, write_chunks
from kvcodec.lossless.predictive.bins import EP_MAX, N_CLASSES, BinGrid, bin_exponent, pow2, scale_levels
from kvcodec.lossless.predictive.params import Q, ChannelParams, stored_fields
from kvcodec.lossless.predictive.tables import (compact_tables, decode_tables, fit_tables, row_decode_table,
                                                table_bytes, tables_from_bytes)

CHUNK_VALUES = 1 << 16  # about this many values per independently decodable chunk
MODEL_PART_BYTES = 1 << 16  # model bytes (fields + tables) up to this: one stream (mlanes); more: "mfields" parts
MAX_MODEL_PARTS = 64  # "mparts" (read only)
MODEL_PRECISION = 14  # "mparts" (read only): the parts' shared table, probabilities in 2**-14
MODEL_STREAMS = 8  # interleaved rANS states per "mparts" part
FIELD_PART_BYTES = 1 << 14  # "mfields": field bytes per part (one GPU warp each: kvcodec/entropy/cuda/rans_decode.cu)
MAX_FIELD_PARTS = 1 << 12
FIELD_STATES = 32  # "mfields": interleaved rANS states per part (the warp layout)
FIELD_PRECISION = 12  # "mfields": the parts' shared table, in the decode-table layout of rans_lanes
WIDE_LANES_FROM = 1 << 14  # chunks this large use 32 lanes (the GPU warp), smaller ones 8
POOL_TASK_SYMBOLS = 1 << 17  # model parts are decoded on the thread pool in tasks of at least this many symbols
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


@lru_cache(maxsize=64)
def chunk_layout(g: int, tt: int, d: int, tb: int, unit: int):
    """(first g, g count, first token, token count) per chunk, int64 arrays: blocks of ``tb``
    tokens x as many consecutive leading indices as fill ~CHUNK_VALUES, never crossing a multiple
    of ``unit`` (a layer, for the neighbour-layer predictor); g-major. Kept per shape and shared
    between calls (a cache's tensors share a few shapes, and building them was ~0.015 ms a decode), so
    read-only: numba types a read-only array apart from a writable one, so the kernels get these, and
    :func:`decode` a selection's copies, as read-only arrays (one compile each)."""
    gb, per_unit = _blocks(g, tt, d, tb, unit)
    k = np.arange(per_unit, dtype=np.int64) * gb
    gs = (np.arange(0, g, unit, dtype=np.int64)[:, None] + k[None, :]).reshape(-1)
    ng = np.tile(np.minimum(gb, unit - k), g // unit)
    ts = np.arange(0, tt, tb, dtype=np.int64)
    nt = np.minimum(tb, tt - ts)
    columns = (np.repeat(gs, ts.size), np.repeat(ng, ts.size), np.tile(ts, gs.size), np.tile(nt, gs.size))
    for x in columns:
        x.flags.writeable = False
    return columns


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
    (kvcodec/lossless/cuda/kvctx_decode.cu ``kx_params``) and only the CPU decoder expands them
    (:meth:`kernel_args`)."""

    raw: np.ndarray
    layout: np.ndarray
    n: int  # channels: Gp * D
    shape: tuple[int, int]  # (Gp, D)

    @classmethod
    def read(cls, head: bytes, raw: np.ndarray, source: str, gp: int, d: int) -> tuple["StoredFields", np.ndarray]:
        """(fields, the bytes after them) of a field header and the decoded bytes; every field's
        values checked against its range with a few whole-array operations (no per-channel loop)."""
        layout, size = field_layout(head, source, gp, d)
        if size > raw.size:
            raise CorruptStreamError("predictive stream has a malformed parameter field")
        check_field_values(raw, layout, gp * d)
        return cls(raw=raw[:size], layout=layout, n=gp * d, shape=(gp, d)), raw[size:]

    def kernel_args(self, grid: BinGrid) -> tuple:
        """``BinParams.kernel_args(grid)`` of the params these fields were written from, in one compiled
        pass over the field bytes (the ~20 numpy calls of expanding them first were ~0.04 ms of a small
        tensor's decode)."""
        gp, d = self.shape
        m, c, a = (np.empty(self.shape, np.float64) for _ in range(3))
        es, level = np.empty(self.shape, np.int64), np.empty(self.shape, np.int64)
        _expand_fields(self.raw, self.layout, grid.eoff, m.reshape(-1), c.reshape(-1), a.reshape(-1),
                       es.reshape(-1), level.reshape(-1))
        return m, c, a, es, level


@njit(cache=True, nogil=True)
def _expand_fields(raw, layout, eoff, m, c, a, es, level):
    """:meth:`StoredFields.kernel_args`' arrays from the field bytes: the stored values (level + its
    minimum, zigzag mq, int8 c / a; a field not stored: its fixed value) through ``BinParams.kernel_args`` (es = clip(level // 4 - 3, 0, EP_MAX),
    m = mq * 2**(es + eoff), c and a over Q)."""
    n = m.size
    lv, mq, cq, aq = _field(raw, layout, 0, n), _field(raw, layout, 1, n), _field(raw, layout, 2, n), \
        _field(raw, layout, 3, n)
    for k in range(n):
        e = min(max(lv[k] // 4 - 3, 0), EP_MAX)
        level[k], es[k] = lv[k], e
        m[k] = np.float64(mq[k]) * pow2(e + eoff)
        c[k] = np.float64(cq[k]) / Q
        a[k] = np.float64(aq[k]) / Q


@njit(cache=True)
def _field(raw, layout, f, n):
    """Field ``f``'s (``FIELD_ORDER``) n values (int64): level + its minimum, zigzag mq decoded, int8 c / a."""
    off, width, value = layout[f, 0], layout[f, 1], layout[f, 2]
    out = np.empty(n, np.int64)
    if width == 0:
        out[:] = value
        return out
    for k in range(n):
        out[k] = raw[off + k]
    if width == 2:
        for k in range(n):
            out[k] |= np.int64(raw[off + n + k]) << 8
    for k in range(n):
        v = out[k]
        out[k] = v + value if f == 0 else ((v >> 1) ^ -(v & 1) if f == 1 else v - ((v & 0x80) << 1))
    return out


def field_layout(head: bytes, source: str, gp: int, d: int) -> tuple[np.ndarray, int]:
    """(``StoredFields.layout``, byte size of the fields) of a field header (5 bytes a field), its
    widths and stored minima checked (CorruptStreamError); the values are checked by
    :func:`check_field_values` (or, decoded on a GPU, by ``kvcodec/lossless/cuda/kvctx_plan.cu``)."""
    n = gp * d
    layout = np.zeros((4, 3), np.int64)
    layout[FIELD_ORDER.index("c"), 2] = Q if source == "external" else 0
    layout[FIELD_ORDER.index("a"), 2] = Q
    pos = 0
    for k, f in enumerate(stored_fields(source)):
        lo = int.from_bytes(head[5 * k:5 * k + 4], "little", signed=True)
        width = head[5 * k + 4]
        if width not in (1, 2) or (f != "s" and lo) or (width == 2 and f in ("a", "c")):
            raise CorruptStreamError("predictive stream has a malformed parameter field")
        if f == "s" and (lo < _LEVEL_LO or n and lo > _LEVEL_HI):
            raise CorruptStreamError("predictive stream has a scale level out of range")
        layout[FIELD_ORDER.index(_FIELD_OF[f])] = (pos, width, lo)
        pos += width * n
    return layout, pos


def level_limit(layout: np.ndarray) -> int:
    """The largest stored level value (above the stored minimum) a stream may hold."""
    return _LEVEL_HI - int(layout[FIELD_ORDER.index("level"), 2])


def check_field_values(raw: np.ndarray, layout: np.ndarray, n: int) -> None:
    """CorruptStreamError unless every stored level lies in range and no zigzag location is 65535
    (the encoder clips |mq| to 32767); ``raw``: the field bytes of ``layout``."""
    err = _field_value_errors(raw, layout, n, level_limit(layout))
    if err == 3:
        raise CorruptStreamError("predictive stream has a malformed parameter field")
    if err == 1:
        raise CorruptStreamError("predictive stream has a scale level out of range")
    if err == 2:
        raise CorruptStreamError("predictive stream has a location out of range")


@njit(cache=True, nogil=True)
def _field_value_errors(raw, layout, n, limit):
    """:func:`check_field_values`' checks in one pass: 1 a level over ``limit``, 2 a 2-byte zigzag
    location of 65535, 3 fewer bytes than the fields need, else 0."""
    for f in range(2):
        if layout[f, 0] + layout[f, 1] * n > raw.size:
            return 3
    off, width = layout[0, 0], layout[0, 1]  # FIELD_ORDER: level, mq, c, a
    for k in range(n if width else 0):
        v = np.int64(raw[off + k]) | (np.int64(raw[off + n + k]) << 8 if width == 2 else 0)
        if v > limit:
            return 1
    off, width = layout[1, 0], layout[1, 1]
    for k in range(n if width == 2 else 0):
        if raw[off + k] & raw[off + n + k] == 0xFF:
            return 2
    return 0


def _grid_args(grid: BinGrid):
    return (grid.width, grid.sign, grid.mb, grid.maxmag, grid.escape, grid.unit, 2.0 ** -grid.eoff)


def encode(pats: np.ndarray, pred, model: ChannelParams, grid: BinGrid, tb: int, unit: int,
           source: str, mag: bool = False) -> tuple[dict, dict]:
    """Code bit patterns ``pats`` [G, T, D] (uint8/uint16) with ``model``: (meta fields, sections).
    ``mag``: count symbols and classes by magnitude (meta ``"mag": 1``; ``bins.magnitude_symbol``).
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
    symbolise(pats, p, has_pred, m, c, a, es, level, bp.shared, int(mag), cg0, cng, ct0, cnt, coff, *_grid_args(grid),
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
    body, mparts = code_model(fields, table_bytes(freq))
    head = fields_head + body
    model_blob = np.concatenate([np.frombuffer(len(head).to_bytes(4, "little") + head, np.uint8), counts])
    payload = gather_words(words, wstart, wcap)
    flag = {"mag": 1} if mag else {}
    return {"shared": bp.shared, "lanes": lanes, **mparts, **flag}, {"model": model_blob, "payload": payload, "bits": bits}


_POOL_THREADS = min(MAX_MODEL_PARTS, os.cpu_count() or 1)


@cache
def _pool() -> ThreadPoolExecutor:
    """Threads for the model's parts (the rANS kernels release the GIL)."""
    return ThreadPoolExecutor(max_workers=_POOL_THREADS)


def _decode_parts(buf: np.ndarray, spans, tables, precision: int, streams: int) -> np.ndarray:
    """The concatenated symbols of rANS payloads ``buf[start:end]`` (``spans``: (start, end, symbols))
    sharing ``tables`` (CorruptStreamError): in tasks of at least ``POOL_TASK_SYMBOLS`` symbols on the
    thread pool, or here when there are fewer (a hand-off to the pool costs about a part's decode)."""
    spans = list(spans)
    ranges = _task_ranges(len(spans), sum(n for _, _, n in spans) // POOL_TASK_SYMBOLS)

    def run(r: tuple[int, int]) -> list:
        return [rans_fast.decode_prepared(buf[a:b], tables, precision, n, streams) for a, b, n in spans[r[0]:r[1]]]

    return np.concatenate([p for task in _run_tasks(run, ranges) for p in task])


def _task_ranges(items: int, tasks: int) -> list[tuple[int, int]]:
    """(first, end) ranges of ``items`` for ``tasks`` pool tasks (at least 1, at most the pool's threads)."""
    n = max(1, min(_POOL_THREADS, tasks))
    cuts = np.linspace(0, items, n + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


def _run_tasks(fn, ranges: list) -> list:
    """``[fn(r) for r in ranges]``, on the thread pool when there is more than one (a hand-off to the
    pool costs about a small task)."""
    return [fn(ranges[0])] if len(ranges) == 1 else list(_pool().map(fn, ranges))


def _part_sizes(n: int, parts: int) -> np.ndarray:
    """Symbols per part: ``np.array_split``'s sizes of n symbols in ``parts`` parts."""
    sizes = np.full(parts, n // parts, np.int64)
    sizes[:n % parts] += 1
    return sizes


def code_model(fields: np.ndarray, tables: np.ndarray) -> tuple[bytes, dict]:
    """(bytes, meta fields) of the model bytes: the parameter fields' bytes and the tables' bytes.
    At most ``MODEL_PART_BYTES`` bytes together: one 8-lane ``rans_lanes`` stream of both (meta
    ``mlanes``: :func:`lanes_model`; before it, one ``entropy.encode`` stream, no meta field). More: meta ``mfields`` = K, the fields in K parts
    (``np.array_split``), each an independent ``FIELD_STATES``-state rANS payload
    (``rans_fast.encode_table``) of one shared table, coded in parallel, and the tables' bytes as
    they are: u32 field bytes, u32 table bytes, 256 x u16 frequencies (summing to
    2**FIELD_PRECISION), K x u32 payload lengths, the payloads, the table bytes.

    Why: a stream of ~10**6 channels has megabytes of fields; their entropy decode was the GPU
    decoder's largest host cost. In parts of 32 states, a GPU decodes them (one warp a part:
    ``kvcodec/entropy/cuda/rans_decode.cu``); the host reads the table bytes (~1 KB) as they are.
    The CPU encoder runs it in three rounds on the thread pool (histogram, coding, placing the parts
    in the one output buffer), no per-part Python work; the GPU encoder codes the parts on the device
    (``kvctx_device_encode._FieldParts``) and calls this for small models only."""
    fields = np.ascontiguousarray(fields)
    if fields.size + tables.size <= MODEL_PART_BYTES:
        return lanes_model(np.concatenate([fields, tables])), {"mlanes": MODEL_LANES}
    parts = max(1, min(MAX_FIELD_PARTS, -(-fields.size // FIELD_PART_BYTES)))
    bounds = np.concatenate([[0], np.cumsum(_part_sizes(fields.size, parts))])
    groups = _task_ranges(parts, parts // 8)  # at least ~8 parts (~130 KB) a task: hand-offs stay small
    run = lambda fn: _run_tasks(fn, groups)  # noqa: E731
    counts = sum(run(lambda g: count_symbols(fields[bounds[g[0]]:bounds[g[1]]])))
    freqs = quantize_frequencies(counts, FIELD_PRECISION).astype("<u2")
    f, cum, inv = table_args(freqs)
    words = np.empty(fields.size, np.uint16)
    states = np.empty((parts, FIELD_STATES), np.uint64)
    first = np.empty(parts, np.int64)
    run(lambda g: _encode_parts(fields, bounds, f, cum, inv, FIELD_PRECISION, words, states, first, *g))
    lens = 4 * FIELD_STATES + 2 * (bounds[1:] - first)
    start = 8 + 2 * freqs.size + 4 * parts
    offs = start + np.concatenate([[0], np.cumsum(lens)])
    out = np.empty(int(offs[-1]) + tables.size, np.uint8)
    out[:start] = field_parts_head(fields.size, tables.size, freqs, lens)
    sbytes = states.astype("<u4").view(np.uint8)
    run(lambda g: _place_parts(words.view(np.uint8), sbytes, bounds, first, offs, out, *g))
    out[offs[-1]:] = tables
    return out.tobytes(), {"mfields": parts}


def lanes_model(raw: np.ndarray) -> bytes:
    """Model bytes ``raw`` (uint8) as one ``MODEL_LANES``-lane ``rans_lanes`` stream of one table
    (meta ``mlanes``): u32 symbol count, u16 length of the table's bytes, the table
    (:func:`tables.table_bytes` of one row), the stream's uint16 words. Why: the single-state
    ``entropy`` stream it replaces took ~60 us to decode ~8 KB (a serial state, byte-wise renormalisation
    and its own header), ~25% of a small tensor's fixed decode cost; the lanes decode in ~15 us."""
    freq = quantize_frequencies(count_symbols(raw), rans_lanes.PRECISION).astype(np.int64).reshape(1, 256)
    fbytes = table_bytes(freq)
    words = np.empty(raw.size + 2 * MODEL_LANES, np.uint16)
    start = rans_lanes.encode(raw, 0, max(raw.size, 1), _ONE_ROW, freq, rans_lanes.cumulative(freq), MODEL_LANES,
                              words)
    head = raw.size.to_bytes(4, "little") + fbytes.size.to_bytes(2, "little")
    return head + fbytes.tobytes() + words[start:].astype("<u2").tobytes()


def _lanes_model_symbols(lanes, buf: np.ndarray, max_symbols: int) -> np.ndarray:
    """The model bytes of a :func:`lanes_model` stream ``buf`` (uint8; CorruptStreamError)."""
    if type(lanes) is not int or lanes not in rans_lanes.LANES:
        raise CorruptStreamError("predictive stream has a bad model lane count")
    if buf.size < 6:
        raise CorruptStreamError("predictive stream model is truncated")
    n = int(buf[:4].view("<u4")[0])
    nt = int(buf[4]) | int(buf[5]) << 8
    if n > max_symbols or 6 + nt > buf.size or (buf.size - 6 - nt) % 2:
        raise CorruptStreamError("predictive stream has a malformed model")
    tabs = row_decode_table(buf[6:6 + nt])
    words = np.frombuffer(buf[6 + nt:].tobytes(), "<u2")  # (a copy: aligned, so the decoder compiles once)
    out = np.empty(n, np.uint8)
    if rans_lanes.decode(words, 0, max(n, 1), _ONE_ROW, tabs, lanes, out):
        raise CorruptStreamError("predictive stream model is corrupted (rANS check failed)")
    return out


MODEL_LANES = 8  # lanes of a small model's one rANS stream (lanes_model)
_ONE_ROW = readonly(np.zeros(1, np.uint8))  # the one table of every value


def field_parts_head(n_fields: int, n_tables: int, freqs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The bytes of an ``mfields`` model (:func:`code_model`) before its payloads (uint8): u32 field
    bytes, u32 table bytes, the 256 u16 frequencies, each part's u32 payload length in bytes. Also
    written by the GPU encoder, which codes the parts on the device."""
    return np.concatenate([np.array([n_fields, n_tables], "<u4").view(np.uint8),
                           np.asarray(freqs).astype("<u2").view(np.uint8),
                           np.asarray(lens).astype("<u4").view(np.uint8)])


_code_field_part = table_kernel(FIELD_STATES)


@njit(cache=True, nogil=True)
def _encode_parts(fields, bounds, freq, cum, inv, precision, words, states, first, k0, k1):
    """``rans_fast.encode_table`` of parts ``k0 .. k1 - 1`` (``fields[bounds[k]:bounds[k + 1]]``) in one
    call without the GIL (per-call overhead made ~100 separate calls cost more than their coding):
    part k's final states in ``states[k]``, its words ``words[first[k]:bounds[k + 1]]``."""
    for k in range(k0, k1):
        first[k] = _code_field_part(fields, bounds[k], bounds[k + 1], freq, cum, inv, precision, words, states[k])


@njit(cache=True, nogil=True)
def _place_parts(wbytes, sbytes, bounds, first, offs, out, k0, k1):
    """Part k's payload (its states' bytes ``sbytes[k]``, then its words' bytes) at ``out[offs[k]:]``."""
    for k in range(k0, k1):
        p = offs[k]
        out[p:p + sbytes.shape[1]] = sbytes[k]
        p += sbytes.shape[1]
        out[p:p + 2 * (bounds[k + 1] - first[k])] = wbytes[2 * first[k]:2 * bounds[k + 1]]


@dataclass(frozen=True)
class FieldParts:
    """The coded field parts of an ``mfields`` model (:func:`code_model`): payload ``p`` is bytes
    ``start[p] : start[p] + length[p]`` of the model section and decodes to ``count[p]`` symbols
    with ``freqs`` (``FIELD_STATES`` states); ``size`` field bytes in all. The host decodes them with
    :meth:`decode`, a GPU in place (``kvcodec.lossless.cuda.kvctx_plan``)."""

    freqs: np.ndarray  # int64 [256], summing to 2**FIELD_PRECISION
    start: np.ndarray
    length: np.ndarray
    count: np.ndarray
    size: int

    def decode(self, model: np.ndarray) -> np.ndarray:
        """The field bytes (uint8 [size]) from the model section's bytes, parts on the thread pool."""
        spans = zip(self.start.tolist(), (self.start + self.length).tolist(), self.count.tolist())
        return _decode_parts(model, spans, rans_fast.decode_tables(self.freqs, FIELD_PRECISION), FIELD_PRECISION,
                             FIELD_STATES)


def read_field_parts(meta: dict, model: np.ndarray, start: int, end: int,
                     max_symbols: int) -> tuple[FieldParts, np.ndarray]:
    """(the field parts, the table bytes) of an ``mfields`` model whose coded bytes are
    ``model[start:end]`` (CorruptStreamError); nothing is decoded."""
    parts = meta.get("mfields")
    if type(parts) is not int or not 1 <= parts <= MAX_FIELD_PARTS:
        raise CorruptStreamError("predictive stream has a bad model part count")
    n_head = 8 + 512 + 4 * parts
    if end - start < n_head:
        raise CorruptStreamError("predictive stream model parts are truncated")
    head = model[start:start + n_head]
    nf, nt = (int(v) for v in head[:8].view("<u4"))
    freqs = head[8:520].view("<u2").astype(np.int64)
    lens = head[520:].view("<u4").astype(np.int64)
    if nf + nt > max_symbols or nf < parts or int(freqs.sum()) != 1 << FIELD_PRECISION \
            or n_head + int(lens.sum()) + nt != end - start:
        raise CorruptStreamError("predictive stream has malformed model parts")
    offsets = start + n_head + np.concatenate([[0], np.cumsum(lens)])
    fp = FieldParts(freqs=freqs, start=offsets[:-1], length=lens, count=_part_sizes(nf, parts), size=nf)
    return fp, model[end - nt:end]


def decode_model(meta: dict, body: bytes, max_symbols: int) -> np.ndarray:
    """The model bytes (uint8) of ``body`` coded as one ``rans_lanes`` stream (``mlanes``: what
    encoders write up to ``MODEL_PART_BYTES``), or as one entropy stream or in ``mparts`` parts (the
    layouts written before; CorruptStreamError)."""
    if "mlanes" in meta:
        return _lanes_model_symbols(meta["mlanes"], np.frombuffer(body, np.uint8), max_symbols)
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
    ends = n_head + np.cumsum(lens)
    spans = [(int(e - k), int(e), int(m)) for e, k, m in zip(ends, lens, _part_sizes(n, parts))]
    return _decode_parts(buf, spans, rans_fast.decode_tables(freqs, MODEL_PRECISION), MODEL_PRECISION, MODEL_STREAMS)


@dataclass(frozen=True)
class Parsed2:
    """A format 2 stream's fields, each checked against the others. The parameter fields of an
    ``mfields`` stream are decoded, and their values checked, on first use of :attr:`fields` (the
    GPU decoder decodes ``field_parts`` on the device instead); the decode tables likewise."""

    layout: np.ndarray  # StoredFields.layout
    field_shape: tuple[int, int]  # (Gp, D)
    decoded_fields: StoredFields | None  # None: in field_parts, not decoded yet
    field_parts: FieldParts | None
    model: np.ndarray  # the model section's bytes (what field_parts points into)
    freq: np.ndarray  # int64 [N_CLASSES, 256]: the decode tables' frequencies
    grid: BinGrid
    shared: bool
    lanes: int
    chunks: tuple  # chunk_layout()
    wstart: np.ndarray
    wlen: np.ndarray
    bstart: np.ndarray
    blen: np.ndarray
    words: np.ndarray
    bits: np.ndarray
    mag: int = 0  # meta "mag": symbols and classes counted by magnitude (bins.magnitude_symbol)

    @cached_property
    def fields(self) -> StoredFields:
        """The stored fields, checked (CorruptStreamError); decoded from the parts on first use."""
        if self.decoded_fields is not None:
            return self.decoded_fields
        gp, d = self.field_shape
        raw = self.field_parts.decode(self.model)
        check_field_values(raw, self.layout, gp * d)
        return StoredFields(raw=raw, layout=self.layout, n=gp * d, shape=self.field_shape)

    @cached_property
    def tabs(self) -> np.ndarray:
        """uint32 [N_CLASSES * 4096]: the rANS decode tables (``tables.decode_tables``)."""
        return decode_tables(self.freq)

    @cached_property
    def compact(self) -> np.ndarray:
        """uint8: the two-level decode tables the CPU decoder reads (``tables.compact_tables``)."""
        return compact_tables(self.freq)

    @cached_property
    def margs(self) -> tuple:
        """BinParams.kernel_args(): the CPU decoder's per-channel arrays (expanded on first use)."""
        return self.fields.kernel_args(self.grid)


def parse(meta: dict, sections: dict, section, grid: BinGrid, g: int, tt: int, d: int, tb: int, unit: int,
          source: str) -> Parsed2:
    """Check a format 2 stream's fields and section sizes (CorruptStreamError); ``section`` reads
    a typed section. The field values of an ``mfields`` stream are checked when decoded
    (:attr:`Parsed2.fields`)."""
    shared, lanes = meta.get("shared"), meta.get("lanes")
    if not isinstance(shared, bool) or lanes not in rans_lanes.LANES or type(lanes) is not int:
        raise CorruptStreamError("predictive stream has a bad sharing or lane field")
    mag = meta.get("mag", 0)
    if type(mag) is not int or mag not in (0, 1):
        raise CorruptStreamError("predictive stream has a bad symbol direction field (mag)")
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
    if k < n_head:
        raise CorruptStreamError("predictive stream model section is too short")
    head = blob[4:4 + n_head].tobytes()
    max_symbols = 2 * 4 * gp * d + 3 * 260 * N_CLASSES
    if "mfields" in meta:
        parts, rest = read_field_parts(meta, blob, 4 + n_head, 4 + k, max_symbols)
        layout, size = field_layout(head, source, gp, d)
        if size != parts.size:
            raise CorruptStreamError("predictive stream has a malformed parameter field")
        fields = None
    else:
        raw = decode_model(meta, blob[4 + n_head:4 + k].tobytes(), max_symbols)
        fields, rest = StoredFields.read(head, raw, source, gp, d)
        parts, layout = None, fields.layout
    freq = tables_from_bytes(rest)
    words = section(sections, "payload", np.uint16)
    bits = section(sections, "bits", np.uint32)
    wlen, blen, wstart, bstart = (np.empty(nc, np.int64) for _ in range(4))
    sums = _chunk_counts(readonly(blob[4 + k:]), chunks[1], chunks[3], d, wlen, blen, wstart, bstart)
    if sums[0] != words.size or sums[2] < 2 * lanes or sums[1] != bits.size:
        raise CorruptStreamError("predictive stream chunk sizes do not add up to its payload")
    if sums[3]:  # at most 64 raw bits per value
        raise CorruptStreamError("predictive stream has a chunk with too many raw bits")
    bits = bits if bits.size else np.zeros(1, np.uint32)  # the kernel's branch-free reads need one word
    return Parsed2(layout, (gp, d), fields, parts, blob, freq, grid, shared, lanes, chunks, wstart, wlen, bstart,
                   blen, words, bits, mag)


@njit(cache=True, nogil=True)
def _chunk_counts(tail, cng, cnt, d, wlen, blen, wstart, bstart):
    """Per chunk the rANS word and raw-bit word counts (u32 each, ``tail``: all word counts, then all
    bit-word counts) and where each chunk's words start; returns (word total, bit-word total, fewest
    words of a chunk, 1 if a chunk has over 64 raw bits a value). One pass instead of ~10 numpy calls."""
    nc = wlen.size
    wsum = bsum = over = 0
    wmin = np.int64(1) << 62
    for i in range(nc):
        w = np.int64(_u32_at(tail, 4 * i))
        b = np.int64(_u32_at(tail, 4 * (nc + i)))
        wlen[i], blen[i], wstart[i], bstart[i] = w, b, wsum, bsum
        wsum += w
        bsum += b
        wmin = min(wmin, w)
        over |= b > 2 * cng[i] * cnt[i] * d
    return wsum, bsum, wmin, over


@njit(inline="always", cache=True)
def _u32_at(b, i):
    return np.uint32(b[i]) | (np.uint32(b[i + 1]) << 8) | (np.uint32(b[i + 2]) << 16) | (np.uint32(b[i + 3]) << 24)


def decode(ps: Parsed2, grid: BinGrid, select, out: np.ndarray, out_t0: int, pred, pred_g0: int,
           pred_t0: int, layer_g: int = 0) -> np.ndarray:
    """Decode chunks ``select`` (sorted distinct indices, or a ``range`` of them) into ``out`` [G, T', D]
    (its token 0 is ``out_t0``); the prediction's [0, 0] is (pred_g0, pred_t0). Returns the per-chunk
    error flags. Run inside the caller's thread-count context. A run of consecutive chunks is passed
    to the kernel as views (copies of the chunk arrays were most of a small call's Python time).

    ``layer_g`` > 0: a neighbour-layer stream of bf16 patterns (``pred`` None), layers of ``layer_g``
    leading indices, each predicted by the layer before as decoded into ``out`` (layer 0 by 0), in one
    kernel call (``binned.decode_chunks``' rounds; chunks never cross a layer)."""
    cols = (*ps.chunks, ps.wstart, ps.wlen, ps.bstart, ps.blen)
    n = len(select)
    if n != ps.wlen.size:
        if isinstance(select, range) or (n and int(select[-1]) - int(select[0]) == n - 1):
            part = slice(int(select[0]), int(select[0]) + n) if n else slice(0, 0)
        else:
            part = select
        cols = tuple(x[part] for x in cols)
    cg0, cng, ct0, cnt = (readonly(x) for x in cols[:4])  # as chunk_layout's
    wstart, wlen, bstart, blen = cols[4:]
    err = np.zeros(n, np.int32)
    rounds = None
    if layer_g:
        pred, pred_g0, pred_t0 = out, layer_g, out_t0
        rounds = np.searchsorted(cg0, np.arange(out.shape[0] // layer_g + 1) * layer_g).astype(np.int64)
    has_pred = pred is not None
    decode_chunks(ps.words, wstart, wlen, ps.bits, bstart, blen, cg0, cng, ct0, cnt, pred if has_pred else _NO_PRED,
                  has_pred, pred_g0, pred_t0, *ps.margs, ps.shared, ps.compact, ps.lanes, *_grid_args(grid), out, 0,
                  out_t0, err, rounds, bool(layer_g), ps.mag)
    return err


# never read; uint16 (writable), the type of a bf16 prediction's bit patterns, so a decoder compiled for streams
# without a prediction also serves those with a bf16 one (each kernel signature costs seconds to compile)
_NO_PRED = np.zeros((1, 1, 1), np.uint16)
