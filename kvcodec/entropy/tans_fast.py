"""Static tANS (FSE-style), numba fast path: the same bytes as ``tans`` (the spec), fast.

Encoding is two passes: walk the symbols backwards through the state machine recording each
pre-state (2 bytes/symbol), then walk forwards packing the output bits in decoder order. The bit
count uses FSE's ``deltaNbBits`` trick: ``nb = (X + delta[s]) >> 16``.

Decoding keeps a 64-bit bit buffer refilled 32 bits at a time; every byte read is
bounds-checked, the loop runs exactly ``n`` iterations, and a stream that runs dry, leaves bytes
over, has nonzero padding or does not return to the start state raises CorruptStreamError.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from kvcodec.kernel_inputs import readonly
from kvcodec.entropy.tans import MAX_TABLE_LOG, MIN_TABLE_LOG
from kvcodec.errors import CorruptStreamError

if sys.byteorder != "little":  # the encoder flushes native uint32 words
    raise ImportError("kvcodec.entropy.tans_fast needs a little-endian CPU; use impl='reference'")

_ERR_SHORT = 1
_ERR_STATE = 2
_ERR_END = 3
_MESSAGES = {
    _ERR_SHORT: "tANS payload ends early",
    _ERR_STATE: "tANS initial state out of range",
    _ERR_END: "tANS payload does not end where its symbols do",
}


def _check(freqs, table_log) -> np.ndarray:
    if not isinstance(table_log, (int, np.integer)) or not MIN_TABLE_LOG <= table_log <= MAX_TABLE_LOG:
        raise ValueError(f"tANS table_log must be an int in [{MIN_TABLE_LOG}, {MAX_TABLE_LOG}], got {table_log!r}")
    f = np.asarray(freqs)
    if f.ndim != 1 or f.size == 0 or f.size > 65536 or f.dtype.kind not in "iu":
        raise ValueError("freqs must be a 1-D integer array of at most 65536 entries")
    if f.dtype.kind == "i" and f.min() < 0:
        raise ValueError("frequencies must be non-negative")
    f = f.astype(np.int64)
    if int(f.sum()) != 1 << int(table_log):
        raise ValueError(f"frequencies must sum to 2**{table_log}")
    return f


@njit(cache=True, nogil=True)
def _spread(freqs, table_log, sym_out):
    m = 1 << table_log
    step = (m >> 1) + (m >> 3) + 3
    pos = 0
    for s in range(freqs.size):
        for _ in range(freqs[s]):
            sym_out[pos] = s
            pos = (pos + step) & (m - 1)


@njit(cache=True, nogil=True)
def _build_decode(freqs, table_log, spread, packed):
    """packed[u] = nbits << 16 | base (base < M <= 2**16)."""
    m = 1 << table_log
    nxt = freqs.copy()
    for u in range(m):
        s = spread[u]
        k = nxt[s]
        nxt[s] += 1
        hb = 0
        while (k >> (hb + 1)) != 0:
            hb += 1
        nb = table_log - hb
        packed[u] = (nb << 16) | ((k << nb) - m)


@njit(cache=True, nogil=True)
def _build_encode(freqs, table_log, spread, next_state, delta_nb, delta_find):
    m = 1 << table_log
    a = freqs.size
    cum = np.zeros(a + 1, dtype=np.int64)
    for s in range(a):
        cum[s + 1] = cum[s] + freqs[s]
    seen = cum[:a].copy()
    for u in range(m):
        s = spread[u]
        next_state[seen[s]] = m + u
        seen[s] += 1
    for s in range(a):
        f = freqs[s]
        if f == 1:
            delta_nb[s] = (table_log << 16) - m
        elif f > 1:
            hb = 0
            while ((f - 1) >> (hb + 1)) != 0:
                hb += 1
            mbo = table_log - hb
            delta_nb[s] = (mbo << 16) - (f << mbo)
        delta_find[s] = cum[s] - f


@njit(cache=True, nogil=True)
def _encode_kernel(symbols, freqs, table_log, next_state, delta_nb, delta_find, pre, out, out32):
    """Returns the payload length, or -(i+1) if symbol i cannot be coded.

    ``out32`` is a uint32 view of ``out[4:]`` (room for every 32-bit flush)."""
    n = symbols.size
    m = 1 << table_log
    a = freqs.size
    for i in range(n):  # validate first, so the state-machine loop has no checks
        s = symbols[i]
        if s >= a or freqs[s] == 0:
            return -(i + 1)
    x0 = m  # state of even symbols
    x1 = m  # state of odd symbols
    i = n - 1
    if i >= 0 and i & 1:  # make the pair loop start on an even symbol
        s = symbols[i]
        pre[i] = x1 - m
        x1 = next_state[delta_find[s] + (x1 >> ((x1 + delta_nb[s]) >> 16))]
        i -= 1
    while i >= 1:  # symbols i (even) and i - 1 (odd), two independent chains
        s0 = symbols[i]
        s1 = symbols[i - 1]
        pre[i] = x0 - m
        pre[i - 1] = x1 - m
        x0 = next_state[delta_find[s0] + (x0 >> ((x0 + delta_nb[s0]) >> 16))]
        x1 = next_state[delta_find[s1] + (x1 >> ((x1 + delta_nb[s1]) >> 16))]
        i -= 2
    if i == 0:
        s = symbols[0]
        pre[0] = x0 - m
        x0 = next_state[delta_find[s] + (x0 >> ((x0 + delta_nb[s]) >> 16))]
    out[0] = (x0 - m) & 0xFF
    out[1] = (x0 - m) >> 8
    out[2] = (x1 - m) & 0xFF
    out[3] = (x1 - m) >> 8
    word = 0
    acc = np.uint64(0)
    nacc = 0
    for i in range(n):
        xi = pre[i] + m
        nb = (xi + delta_nb[symbols[i]]) >> 16
        acc |= np.uint64(xi & ((1 << nb) - 1)) << np.uint64(nacc)
        nacc += nb
        # Branch-free flush: always store the low 32 bits, keep them only once 32 are ready.
        out32[word] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        full = nacc >= 32
        word += full
        acc >>= np.uint64(32 * full)
        nacc -= 32 * full
    pos = 4 + 4 * word
    while nacc > 0:
        out[pos] = acc & np.uint64(0xFF)
        acc >>= np.uint64(8)
        pos += 1
        nacc -= 8
    return pos


@njit(cache=True, nogil=True)
def _decode_kernel(payload, sym_tab, packed_tab, table_log, out):
    nbytes = payload.size
    if nbytes < 4:
        return _ERR_SHORT
    m = 1 << table_log
    u0 = np.int64(payload[0]) | (np.int64(payload[1]) << 8)
    u1 = np.int64(payload[2]) | (np.int64(payload[3]) << 8)
    if u0 >= m or u1 >= m:
        return _ERR_STATE
    pos = 4
    acc = np.uint64(0)
    nacc = 0
    n = out.size
    i = 0
    # Fast path: two symbols (<= 32 bits) per step; after the refill at least 32 bits are
    # buffered, so the step needs no bounds check.
    while i + 2 <= n and pos + 4 <= nbytes:
        if nacc < 32:
            w = (
                np.uint64(payload[pos])
                | (np.uint64(payload[pos + 1]) << np.uint64(8))
                | (np.uint64(payload[pos + 2]) << np.uint64(16))
                | (np.uint64(payload[pos + 3]) << np.uint64(24))
            )
            acc |= w << np.uint64(nacc)
            nacc += 32
            pos += 4
        out[i] = sym_tab[u0]
        out[i + 1] = sym_tab[u1]
        d0 = packed_tab[u0]
        d1 = packed_tab[u1]
        nb0 = d0 >> 16
        nb1 = d1 >> 16
        u0 = (d0 & 0xFFFF) + np.int64(acc & ((np.uint64(1) << np.uint64(nb0)) - np.uint64(1)))
        acc >>= np.uint64(nb0)
        u1 = (d1 & 0xFFFF) + np.int64(acc & ((np.uint64(1) << np.uint64(nb1)) - np.uint64(1)))
        acc >>= np.uint64(nb1)
        nacc -= nb0 + nb1
        i += 2
    # Tail: one symbol at a time, bytes read one by one, every step checked.
    while i < n:
        while pos < nbytes and nacc <= 56:
            acc |= np.uint64(payload[pos]) << np.uint64(nacc)
            nacc += 8
            pos += 1
        u = u1 if i & 1 else u0
        out[i] = sym_tab[u]
        d = packed_tab[u]
        nb = d >> 16
        if nb > nacc:
            return _ERR_SHORT
        u = (d & 0xFFFF) + np.int64(acc & ((np.uint64(1) << np.uint64(nb)) - np.uint64(1)))
        acc >>= np.uint64(nb)
        nacc -= nb
        if i & 1:
            u1 = u
        else:
            u0 = u
        i += 1
    while pos < nbytes and nacc <= 56:
        acc |= np.uint64(payload[pos]) << np.uint64(nacc)
        nacc += 8
        pos += 1
    if u0 != 0 or u1 != 0 or pos != nbytes or nacc >= 8 or acc != 0:
        return _ERR_END
    return 0


# ------------------------------------------------------------------------------- public API
def decode_tables(freqs, table_log: int, out_dtype=np.uint8):
    """Decoder tables ``(symbol[M], packed[M])`` with ``packed = nbits << 16 | base``."""
    f = _check(freqs, table_log)
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("out_dtype must be uint8 or uint16")
    if np.any(f[np.iinfo(out_dtype).max + 1 :]):
        raise ValueError(f"symbols with nonzero frequency do not fit in {out_dtype}")
    m = 1 << int(table_log)
    spread = np.empty(m, dtype=np.int64)
    _spread(f, int(table_log), spread)
    packed = np.empty(m, dtype=np.int64)
    _build_decode(f, int(table_log), spread, packed)
    return spread.astype(out_dtype), packed.astype(np.int32)


def encode_table(symbols, freqs, table_log: int) -> np.ndarray:
    """tANS-encode a 1-D uint8/uint16 array; returns the payload (uint8 array)."""
    s = np.asarray(symbols)
    if s.ndim != 1 or s.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("symbols must be a 1-D uint8 or uint16 array")
    s = np.ascontiguousarray(s)
    f = _check(freqs, table_log)
    r = int(table_log)
    m = 1 << r
    spread = np.empty(m, dtype=np.int64)
    _spread(f, r, spread)
    next_state = np.empty(m, dtype=np.int64)
    delta_nb = np.zeros(f.size, dtype=np.int64)
    delta_find = np.zeros(f.size, dtype=np.int64)
    _build_encode(f, r, spread, next_state, delta_nb, delta_find)
    pre = np.empty(s.size, dtype=np.uint16)
    words = (s.size * r + 31) // 32 + 2
    out = np.empty(4 + 4 * words, dtype=np.uint8)
    out32 = out[4:].view(np.uint32)  # little-endian machines (as everywhere in kvcodec)
    size = _encode_kernel(s, f, r, next_state, delta_nb, delta_find, pre, out, out32)
    if size < 0:
        i = -size - 1
        raise ValueError(f"symbol {int(s[i])} at position {i} has frequency 0")
    return out[:size].copy()


def decode_prepared(payload, tables, table_log: int, n: int) -> np.ndarray:
    """Decode ``n`` symbols with tables from :func:`decode_tables`."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    sym, packed = tables
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1:
            raise ValueError("payload must be bytes or a 1-D uint8 array")
        p = np.ascontiguousarray(payload)
    else:
        p = np.frombuffer(payload, dtype=np.uint8)
    out = np.empty(int(n), dtype=sym.dtype)
    status = _decode_kernel(readonly(p), sym, packed, int(table_log), out)  # one compile for any buffer
    if status:
        raise CorruptStreamError(_MESSAGES[status])
    return out


def decode_table(payload, freqs, table_log: int, n: int, out_dtype=np.uint8) -> np.ndarray:
    """Decode ``n`` symbols of a payload from :func:`encode_table` (CorruptStreamError if bad)."""
    return decode_prepared(payload, decode_tables(freqs, table_log, out_dtype), table_log, n)
