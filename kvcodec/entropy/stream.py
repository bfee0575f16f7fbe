"""Self-describing entropy stream: header pack/parse (the byte layout is in docs/format.md).

A stream is ``header | payload``. The header names the coder and its parameters, the symbol
dtype and count and the quantized frequency table, and carries CRC-32s of itself and of the
payload, so ``decode`` needs nothing but the bytes. Parsing is defensive: every read is
bounds-checked, the header CRC is verified before its contents are trusted, and a declared
symbol count is checked against a hard cap and against what the payload could possibly encode
before anything of that size is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from kvcodec import checksum, magics
from kvcodec.kernel_inputs import readonly
from kvcodec.errors import CorruptStreamError

MAGIC = magics.STREAM
VERSION = 1
CODER_IDS = {"rans": 1, "tans": 2, "arith": 3}
CODER_NAMES = {v: k for k, v in CODER_IDS.items()}
DTYPE_IDS = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2}
DTYPE_BY_ID = {v: k for k, v in DTYPE_IDS.items()}
#: Hard cap on the symbol count of one stream (split bigger arrays): a header declaring more is
#: rejected before anything is allocated.
MAX_SYMBOLS = 1 << 31
_FIXED = len(MAGIC) + 5  # magic, version, coder, dtype, param, streams
_TABLE_DENSE = 0
_TABLE_BITMAP = 1
_TABLE_GAPS = 2
_TABLE_RUNS = 3
_TABLE_RUNS_RICE = 4


@dataclass(frozen=True)
class StreamHeader:
    """The parsed header of an entropy stream."""

    coder: str
    dtype: np.dtype
    n: int
    param: int  # probability precision (rans, arith) or table log (tans); 0 when n == 0
    streams: int  # interleaved rANS states; 1 for other coders; 0 when n == 0
    freqs: np.ndarray | None  # uint32 over the whole alphabet, None when n == 0
    header_len: int
    payload_len: int


# ------------------------------------------------------------------------------- varints
def _put_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _get_varint(buf, pos: int, what: str) -> tuple[int, int]:
    v = shift = 0
    for _ in range(10):
        if pos >= len(buf):
            raise CorruptStreamError(f"stream header ends inside {what}")
        b = int(buf[pos])
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            if b == 0 and shift:  # a writer never pads a varint with a zero byte
                raise CorruptStreamError(f"{what} is an overlong varint")
            return v, pos
        shift += 7
    raise CorruptStreamError(f"{what} is not a valid varint")


def _varint_array(v: np.ndarray) -> bytes:
    """LEB128 varints of a uint array (values < 2**28), vectorized."""
    v = v.astype(np.int64)
    k = 1 + (v >= 1 << 7) + (v >= 1 << 14) + (v >= 1 << 21)
    starts = np.cumsum(k) - k
    idx = np.arange(int(k.sum())) - np.repeat(starts, k)
    b = (np.repeat(v, k) >> (7 * idx)) & 0x7F
    more = idx != np.repeat(k - 1, k)
    return (b | (more << 7)).astype(np.uint8).tobytes()


@njit(cache=True, nogil=True)
def _varints(buf, pos, max_bytes, out):
    """Fill ``out`` with the varints at ``buf[pos:]``, reading no further than ``out.size *
    max_bytes`` bytes; the position after them, or (checked in this order, over all values) -1:
    fewer values end there, -2: one is longer than ``max_bytes``, -3: one ends in a padding zero."""
    stop = min(buf.size, pos + out.size * max_bytes)
    k, start, v, shift = 0, pos, 0, 0
    oversized = overlong = False
    i = pos
    while k < out.size and i < stop:
        b = np.int64(buf[i])
        if shift < 56:
            v |= (b & 0x7F) << shift
        shift += 7
        i += 1
        if b < 0x80:
            n = i - start
            oversized |= n > max_bytes
            overlong |= n > 1 and b == 0
            out[k] = v
            k, start, v, shift = k + 1, i, 0, 0
    if k < out.size:
        return -1
    if oversized:
        return -2
    if overlong:
        return -3
    return i


# ------------------------------------------------------------------------------- pack
def pack(coder: str, dtype, n: int, param: int, streams: int, freqs, payload) -> bytes:
    """Header + payload as one bytes object (``freqs`` over the whole alphabet; ignored if n == 0;
    ``payload``: bytes-like or a uint8 array)."""
    dtype = np.dtype(dtype)
    head = bytearray(MAGIC)
    head += bytes([VERSION, CODER_IDS[coder], DTYPE_IDS[dtype], param if n else 0, streams if n else 0])
    _put_varint(head, n)
    if n:
        head += _pack_freqs(np.asarray(freqs))
    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload, dtype=np.uint8)
    payload = memoryview(payload).cast("B")
    _put_varint(head, len(payload))
    head += checksum.crc32(head).to_bytes(4, "little")
    head += checksum.crc32(payload).to_bytes(4, "little")
    return b"".join((head, payload))  # one copy of the payload


def _pack_freqs(freqs: np.ndarray) -> bytes:
    nz = np.flatnonzero(freqs)
    lo, hi = int(nz[0]), int(nz[-1])
    span = freqs[lo : hi + 1]
    out = bytearray()
    _put_varint(out, lo)
    _put_varint(out, hi - lo + 1)
    mask = span != 0
    nz_vals = _varint_array(span[mask])
    used = np.flatnonzero(mask)
    gaps = bytearray()
    _put_varint(gaps, used.size)
    gaps += _varint_array(np.diff(used) - 1) + nz_vals  # first used symbol is lo: no gap stored
    edges = np.diff(mask.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    runs = bytearray()
    _put_varint(runs, starts.size)
    runs += _varint_array(starts - np.r_[0, ends[:-1]]) + _varint_array(ends - starts - 1) + nz_vals
    rice = runs[: len(runs) - len(nz_vals)] + _rice_pack(span[mask].astype(np.int64) - 1)
    options = [
        (_TABLE_DENSE, _varint_array(span)),
        (_TABLE_BITMAP, np.packbits(mask, bitorder="little").tobytes() + nz_vals),
        (_TABLE_GAPS, bytes(gaps)),
        (_TABLE_RUNS, bytes(runs)),
        (_TABLE_RUNS_RICE, bytes(rice)),
    ]
    mode, body = min(options, key=lambda o: len(o[1]))  # ties: the first (dense) wins
    out.append(mode)
    out += body
    return bytes(out)


def _rice_pack(v: np.ndarray) -> bytes:
    """``u8 k`` then Rice codes of v >= 0 (quotient in unary as ones ended by a zero, then k
    low bits), LSB-first, zero-padded to a byte; k minimizes the size."""
    costs = [int(np.sum((v >> k) + 1 + k)) for k in range(17)]
    k = int(np.argmin(costs))
    out = np.zeros((costs[k] + 7) // 8, dtype=np.uint8)
    _rice_write(v, k, out)
    return bytes([k]) + out.tobytes()


@njit(cache=True, nogil=True)
def _rice_write(v, k, out):
    bit = 0
    for x in v:
        q = x >> k
        for _ in range(q):
            out[bit >> 3] |= 1 << (bit & 7)
            bit += 1
        bit += 1  # the terminating zero
        for j in range(k):
            if (x >> j) & 1:
                out[bit >> 3] |= 1 << (bit & 7)
            bit += 1


@njit(cache=True, nogil=True)
def _rice_read(buf, pos, count, k, out):
    """Returns the byte position after the codes, or -1 if they are malformed."""
    nbits = 8 * (buf.size - pos)
    qmax = 65535 >> k  # frequencies are <= 2**16, so v = f - 1 < 2**16
    bit = 0
    for i in range(count):
        q = 0
        while True:
            if bit >= nbits:
                return -1
            b = (buf[pos + (bit >> 3)] >> (bit & 7)) & 1
            bit += 1
            if b == 0:
                break
            q += 1
            if q > qmax:
                return -1
        if bit + k > nbits:
            return -1
        r = 0
        for j in range(k):
            r |= np.int64((buf[pos + (bit >> 3)] >> (bit & 7)) & 1) << j
            bit += 1
        out[i] = (q << k) | r
    return pos + (bit + 7) // 8


# ------------------------------------------------------------------------------- parse
def parse(blob, max_symbols: int | None = None) -> tuple[StreamHeader, memoryview]:
    """Parse and verify a stream; returns the header and the payload (CRC-checked).

    Raises CorruptStreamError for anything malformed, truncated, inconsistent or corrupted,
    and for symbol counts over ``MAX_SYMBOLS`` (or ``max_symbols``) or over what the payload
    could encode.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ValueError("a stream must be bytes, bytearray or memoryview")
    mv = memoryview(blob).cast("B") if isinstance(blob, memoryview) else memoryview(blob)
    buf = np.frombuffer(mv, dtype=np.uint8)
    if len(mv) < _FIXED or bytes(mv[:4]) != MAGIC:
        raise CorruptStreamError("not a kvcodec entropy stream (bad magic or too short)")
    version, coder_id, dtype_id, param, streams = (int(b) for b in mv[4:_FIXED])
    if version != VERSION:
        raise CorruptStreamError(f"unsupported entropy stream version {version}")
    if coder_id not in CODER_NAMES or dtype_id not in DTYPE_BY_ID:
        raise CorruptStreamError("unknown coder or symbol dtype in stream header")
    coder, dtype = CODER_NAMES[coder_id], DTYPE_BY_ID[dtype_id]
    n, pos = _get_varint(mv, _FIXED, "symbol count")
    freqs = None
    if n:
        freqs, pos = _parse_freqs(buf, pos, 256 if dtype == np.uint8 else 65536)
    payload_len, pos = _get_varint(mv, pos, "payload length")
    if pos + 8 > len(mv):
        raise CorruptStreamError("stream header is truncated")
    if checksum.crc32(mv[:pos]) != int.from_bytes(mv[pos : pos + 4], "little"):
        raise CorruptStreamError("stream header checksum mismatch")
    payload_crc = int.from_bytes(mv[pos + 4 : pos + 8], "little")
    header_len = pos + 8
    if len(mv) - header_len != payload_len:
        raise CorruptStreamError(
            f"stream length mismatch: header says {payload_len} payload bytes, found {len(mv) - header_len}"
        )
    payload = mv[header_len:]
    _check_semantics(coder, n, param, streams, freqs, payload_len, max_symbols)
    if checksum.crc32(payload) != payload_crc:
        raise CorruptStreamError("stream payload checksum mismatch")
    header = StreamHeader(coder, dtype, n, param, streams, freqs, header_len, payload_len)
    return header, payload


def _parse_freqs(buf: np.ndarray, pos: int, alphabet: int) -> tuple[np.ndarray, int]:
    """(uint32 frequencies over the alphabet, position after the table) of the table at
    ``buf[pos:]``, in one compiled pass (:func:`_freq_table`: the numpy version's ~30 small calls
    were most of a small stream's parse); CorruptStreamError."""
    freqs = np.zeros(alphabet, dtype=np.uint32)
    end, err = _freq_table(readonly(buf), pos, freqs)  # one compile for any buffer
    if err:
        raise CorruptStreamError(_FREQ_ERRORS[err] if err != _E_MODE else f"unknown frequency table mode {end}")
    return freqs, end


_E_MODE = 15
_FREQ_ERRORS = {1: "stream header ends inside frequency table", 2: "frequency table is an overlong varint",
                3: "frequency table is not a valid varint", 4: "frequency table range is outside the alphabet",
                5: "frequency table is truncated", 6: "frequency table holds an oversized value",
                7: "frequency table holds an overlong varint", 8: "frequency out of range",
                9: "frequency table symbol count out of range", 10: "frequency table symbol outside its range",
                11: "frequency table run count out of range", 12: "frequency table run outside its range",
                13: "bad Rice parameter in frequency table", 14: "frequency table codes are truncated or malformed",
                16: "frequency table range does not start and end at used symbols"}
_HUGE = 1 << 60  # a varint of more than 56 bits: larger than any alphabet or count


@njit(cache=True, nogil=True)
def _varint_at(buf, pos):
    """(value, position after it, error) of one varint, as :func:`_get_varint` reads it (a value
    over 56 bits as ``_HUGE``); errors 1-3 of ``_FREQ_ERRORS``."""
    v, shift = 0, 0
    for _ in range(10):
        if pos >= buf.size:
            return 0, pos, 1
        b = np.int64(buf[pos])
        pos += 1
        if shift < 56:
            v |= (b & 0x7F) << shift
        elif b & 0x7F:
            v = _HUGE
        if b < 0x80:
            if b == 0 and shift:
                return 0, pos, 2
            return v, pos, 0
        shift += 7
    return 0, pos, 3


@njit(cache=True, nogil=True)
def _varints_at(buf, pos, count, max_bytes=3):
    """(values, position after them, error) of ``count`` varints of at most ``max_bytes`` bytes
    (errors 5-7 of ``_FREQ_ERRORS``)."""
    vals = np.empty(count, np.int64)
    if count == 0:
        return vals, pos, 0
    end = _varints(buf, pos, max_bytes, vals)
    return vals, end, (0 if end >= 0 else 4 - end)


@njit(cache=True, nogil=True)
def _freq_table(buf, pos, freqs):
    """(position after the table, error code of ``_FREQ_ERRORS``: 0 = none; ``_E_MODE``: the mode
    byte in place of the position) of a frequency table (:func:`_pack_freqs`' modes), read into
    ``freqs``; the checks and their order are the reader's before it was compiled."""
    lo, pos, err = _varint_at(buf, pos)
    if err:
        return pos, err
    span, pos, err = _varint_at(buf, pos)
    if err:
        return pos, err
    if span < 1 or lo + span > freqs.size:
        return pos, 4
    if pos >= buf.size:
        return pos, 5
    mode = np.int64(buf[pos])
    pos += 1
    if mode == _TABLE_DENSE:
        vals, pos, err = _varints_at(buf, pos, span)
        if err:
            return pos, err
        idx = np.arange(span)
    elif mode == _TABLE_BITMAP:
        nbytes = (span + 7) // 8
        if pos + nbytes > buf.size:
            return pos, 5
        idx = np.empty(span, np.int64)
        k = 0
        for i in range(span):
            if (buf[pos + (i >> 3)] >> (i & 7)) & 1:
                idx[k] = i
                k += 1
        idx = idx[:k]
        vals, pos, err = _varints_at(buf, pos + nbytes, k)
        if err:
            return pos, err
    elif mode == _TABLE_GAPS:
        k, pos, err = _varint_at(buf, pos)
        if err:
            return pos, err
        if not 1 <= k <= span:
            return pos, 9
        gaps, pos, err = _varints_at(buf, pos, k - 1)
        if err:
            return pos, err
        idx = np.zeros(k, np.int64)
        for i in range(1, k):
            idx[i] = idx[i - 1] + gaps[i - 1] + 1
        if idx[k - 1] >= span:
            return pos, 10
        vals, pos, err = _varints_at(buf, pos, k)
        if err:
            return pos, err
    elif mode == _TABLE_RUNS or mode == _TABLE_RUNS_RICE:
        k, pos, err = _varint_at(buf, pos)
        if err:
            return pos, err
        if not 1 <= k <= span:
            return pos, 11
        gaps, pos, err = _varints_at(buf, pos, k)
        if err:
            return pos, err
        lens, pos, err = _varints_at(buf, pos, k)
        if err:
            return pos, err
        end = total = 0
        for r in range(k):
            end += gaps[r] + lens[r] + 1
            total += lens[r] + 1
        if end > span:
            return pos, 12
        idx = np.empty(total, np.int64)
        end = q = 0
        for r in range(k):
            end += gaps[r]
            for _ in range(lens[r] + 1):
                idx[q] = end
                q += 1
                end += 1
        if mode == _TABLE_RUNS:
            vals, pos, err = _varints_at(buf, pos, total)
            if err:
                return pos, err
        else:
            if pos >= buf.size:
                return pos, 5
            rice_k = np.int64(buf[pos])
            if rice_k > 16:
                return pos, 13
            vals = np.empty(total, np.int64)
            pos = _rice_read(buf, pos + 1, total, rice_k, vals)
            if pos < 0:
                return pos, 14
            vals += 1
    else:
        return mode, _E_MODE
    for v in vals:
        if v > 1 << 16:
            return pos, 8
    for i in range(vals.size):
        freqs[lo + idx[i]] = vals[i]
    if freqs[lo] == 0 or freqs[lo + span - 1] == 0:  # a writer's range starts and ends at used symbols
        return pos, 16
    return pos, 0


def _check_semantics(coder, n, param, streams, freqs, payload_len, max_symbols) -> None:
    cap = MAX_SYMBOLS if max_symbols is None else min(MAX_SYMBOLS, int(max_symbols))
    if n > cap:
        raise CorruptStreamError(f"stream declares {n} symbols, over the cap of {cap}")
    if n == 0:
        if param or streams or payload_len:
            raise CorruptStreamError("an empty stream must have no parameters and no payload")
        return
    lo_param, hi_param = (5, 16) if coder == "tans" else (1, 16)
    if not lo_param <= param <= hi_param:
        raise CorruptStreamError(f"{coder} parameter {param} out of range")
    if coder == "rans":
        if not 1 <= streams <= 32:
            raise CorruptStreamError(f"rANS stream count {streams} out of range")
    elif streams != 1:
        raise CorruptStreamError(f"{coder} streams must be 1, got {streams}")
    total, fmax = _sum_max(freqs)
    if total != 1 << param:
        raise CorruptStreamError("frequency table does not sum to 2**precision")
    bound = symbol_bound(coder, fmax, param, streams, payload_len)
    if bound is not None and n > bound:
        raise CorruptStreamError(f"stream declares {n} symbols but its payload can hold at most {bound}")


@njit(cache=True, nogil=True)
def _sum_max(freqs):
    """(sum, largest) of a frequency table in one pass (two numpy reductions cost more on a small stream)."""
    total = top = 0
    for f in freqs:
        total += np.int64(f)
        top = max(top, np.int64(f))
    return total, top


def symbol_bound(coder: str, fmax: int, param: int, streams: int, payload_len: int) -> int | None:
    """Most symbols a payload of this size could decode to, or None if there is no useful bound.

    rANS: a decode step without a read multiplies the state by less than
    ``(f/M) * (1 + 2**(precision-16))`` (the state is >= 2**16), a word read multiplies it by at
    most ``2**17``, states start below ``2**32`` and stay >= 1. So each symbol consumes at least
    ``log2(M/fmax) - log2(1 + 2**(precision-16))`` of a budget of ``32 N + 17 W`` bits.
    tANS: every decode step reads at least ``R - floor(log2(2 fmax - 1))`` bits of the payload
    (after its two 2-byte states).
    The range coder ("arith") gets only the hard cap.
    """
    m = 1 << param
    if coder == "rans":
        info = math.log2(m / fmax) - math.log2(1 + 2.0 ** (param - 16))
        if info < 1e-3:
            return None
        words = max(0, (payload_len - 4 * streams) // 2)
        return int((32 * streams + 17 * words) / info) + streams + 1
    if coder == "tans":
        nb_min = param - ((2 * fmax - 1).bit_length() - 1)
        if nb_min < 1:
            return None
        return (8 * max(0, payload_len - 4)) // nb_min + 2
    return None
