"""Static interleaved rANS, numba fast path: the same bytes as ``rans`` (the spec), fast.

Low-level building blocks with no header and no per-symbol Python: other codecs call these
directly. All functions take frequency tables that sum to ``2**precision`` (1 <= precision <=
16), and N = ``n_streams`` interleaved states (1..32); the payload layout is documented in
``kvcodec.entropy.rans``.

Decoding is safe on corrupt payloads: every read is bounds-checked inside the kernels (once per
group of N symbols in the main loops, per symbol in the tail), the loops run exactly ``n`` steps, and any inconsistency (payload too short, leftover bytes, final
states not equal to L) raises CorruptStreamError.

Speed notes: the decoder uses two tables indexed by the slot ``x % M``: the symbol, and a packed
``(freq - 1) << 16 | (slot - cum)`` word, so a symbol costs two independent loads, a multiply
and a branch-free renormalisation; the main loops keep all N states in registers (see below).
The encoder divides by the frequency (one integer division); N > 1
states give the CPU independent dependency chains to overlap.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcodec.errors import CorruptStreamError

RANS_L = 1 << 16
MAX_STREAMS = 32

_U64 = np.uint64
_L = np.uint64(RANS_L)
_MASK16 = np.uint64(0xFFFF)
_SH16 = np.uint64(16)
_SH8 = np.uint64(8)
_ONE = np.uint64(1)

# Kernel status codes (0 = ok).
_ERR_SHORT = 1
_ERR_STATE = 2
_ERR_END = 3
_ERR_CTX = 4


# ----------------------------------------------------------------------------------- tables
def _check_tables(freq_tables, precision: int) -> np.ndarray:
    """Validate and return frequency tables as a C-contiguous uint64 [C, A] array."""
    if not isinstance(precision, (int, np.integer)) or not 1 <= int(precision) <= 16:
        raise ValueError(f"rANS precision must be an int in [1, 16], got {precision!r}")
    t = np.asarray(freq_tables)
    if t.ndim == 1:
        t = t[None, :]
    if t.ndim != 2 or t.shape[1] == 0 or t.shape[0] == 0:
        raise ValueError("frequency tables must be a non-empty 1-D or 2-D array")
    if t.dtype.kind not in "iu" or (t.dtype.kind == "i" and t.size and t.min() < 0):
        raise ValueError("frequencies must be non-negative integers")
    if t.shape[1] > 65536:
        raise ValueError("alphabets are limited to 65536 symbols")
    t = np.ascontiguousarray(t, dtype=np.uint64)
    sums = t.sum(axis=1)
    if np.any(sums != (1 << int(precision))):
        raise ValueError(f"every frequency table must sum to 2**{precision}")
    return t


def _check_streams(n_streams) -> int:
    if not isinstance(n_streams, (int, np.integer)) or not 1 <= int(n_streams) <= MAX_STREAMS:
        raise ValueError(f"n_streams must be an int in [1, {MAX_STREAMS}], got {n_streams!r}")
    return int(n_streams)


def _cum(t: np.ndarray) -> np.ndarray:
    c = np.zeros_like(t)
    np.cumsum(t[:, :-1], axis=1, out=c[:, 1:])
    return c


def decode_tables(freq_tables, precision: int, out_dtype=np.uint8):
    """Slot lookup tables ``(symbol[C, M], packed[C, M])`` used by the decoders.

    ``packed[slot] = (freq - 1) << 16 | (slot - cum)`` (uint32). Build once and pass to
    :func:`decode_prepared` when decoding many payloads with the same tables.
    """
    t = _check_tables(freq_tables, precision)
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("out_dtype must be uint8 or uint16")
    if t.shape[1] > np.iinfo(out_dtype).max + 1 and np.any(t[:, np.iinfo(out_dtype).max + 1 :]):
        raise ValueError(f"symbols with nonzero frequency do not fit in {out_dtype}")
    m = 1 << int(precision)
    c_tab = _cum(t)
    sym = np.empty((t.shape[0], m), dtype=out_dtype)
    packed = np.empty((t.shape[0], m), dtype=np.uint32)
    slots = np.arange(m, dtype=np.uint64)
    alphabet = np.arange(t.shape[1])
    for k in range(t.shape[0]):
        s = np.repeat(alphabet, t[k].astype(np.int64))
        sym[k] = s
        packed[k] = ((t[k][s] - 1) << np.uint64(16)) | (slots - c_tab[k][s])
    return sym, packed


# ---------------------------------------------------------------------------------- kernels
@njit(cache=True, nogil=True)
def _encode_kernel(symbols, ctx, freq, cum, precision, n_streams, words, states):
    """Returns the index in ``words`` where the payload words start, or -(i+1) if symbol i has
    frequency 0 (or is outside the alphabet), or -(n+1) - i if ctx[i] is out of range."""
    n = symbols.size
    n_ctx = freq.shape[0]
    alphabet = freq.shape[1]
    prec = _U64(precision)
    top_shift = _U64(32 - precision)
    st = np.full(n_streams, _L, dtype=np.uint64)  # local: ``words`` stores cannot alias it
    wpos = n
    j = (n - 1) % n_streams if n > 0 else 0
    use_ctx = ctx.size > 0
    for i in range(n - 1, -1, -1):
        k = 0
        if use_ctx:
            k = ctx[i]
            if k < 0 or k >= n_ctx:
                return -(n + 1) - i
        s = symbols[i]
        if s >= alphabet:
            return -(i + 1)
        f = freq[k, s]
        if f == 0:
            return -(i + 1)
        x = st[j]
        # Branch-free renormalisation: always store the low word, keep it only if needed
        # (wpos - 1 >= i >= 0 here: at most one word per symbol coded so far).
        need = x >= (f << top_shift)
        words[wpos - 1] = x & _MASK16
        wpos -= need
        x = (x >> _SH16) if need else x
        q = x // f
        st[j] = (q << prec) + (x - q * f) + cum[k, s]
        j -= 1
        if j < 0:
            j = n_streams - 1
    states[:] = st
    return wpos


@njit(cache=True, nogil=True)
def _read_states(payload, states):
    """Load the N initial states; returns 0 or an error code."""
    n_streams = states.size
    nbytes = payload.size
    head = 4 * n_streams
    if nbytes < head or (nbytes - head) % 2 != 0:
        return _ERR_SHORT
    for j in range(n_streams):
        b = 4 * j
        x = (
            _U64(payload[b])
            | (_U64(payload[b + 1]) << _SH8)
            | (_U64(payload[b + 2]) << _U64(16))
            | (_U64(payload[b + 3]) << _U64(24))
        )
        if x < _L:
            return _ERR_STATE
        states[j] = x
    return 0


@njit(cache=True, nogil=True)
def _decode_kernel(payload, ctx, sym_tab, packed_tab, precision, out, states, i0, pos):
    """Decode symbols i0.. of ``out`` from word position ``pos`` on, one at a time, every read
    checked, then verify the end state. Returns 0 or an error code. Never reads out of bounds."""
    n_streams = states.size
    nbytes = payload.size
    n_ctx = sym_tab.shape[0]
    prec = _U64(precision)
    mask = (_ONE << prec) - _ONE
    use_ctx = ctx.size > 0
    n = out.size
    j = i0 % n_streams
    for i in range(i0, n):
        k = 0
        if use_ctx:
            k = ctx[i]
            if k < 0 or k >= n_ctx:
                return _ERR_CTX
        x = states[j]
        slot = x & mask
        out[i] = sym_tab[k, slot]
        d = _U64(packed_tab[k, slot])
        x = ((d >> _SH16) + _ONE) * (x >> prec) + (d & _MASK16)
        if pos + 2 <= nbytes:  # predictable: false only once the words are used up
            w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
            need = x < _L
            x = ((x << _SH16) | w) if need else x  # branch-free renormalisation
            pos += 2 * need
        elif x < _L:
            return _ERR_SHORT
        states[j] = x
        j += 1
        if j == n_streams:
            j = 0
    if pos != nbytes:
        return _ERR_END
    for j in range(n_streams):
        if states[j] != _L:
            return _ERR_END
    return 0


@njit(cache=True, nogil=True)
def _decode_kernel_1(payload, sym_tab, packed_tab, precision, out):
    """Single-state, single-table decoder: the state lives in a register."""
    nbytes = payload.size
    if nbytes < 4 or (nbytes - 4) % 2 != 0:
        return _ERR_SHORT
    x = (
        _U64(payload[0])
        | (_U64(payload[1]) << _SH8)
        | (_U64(payload[2]) << _U64(16))
        | (_U64(payload[3]) << _U64(24))
    )
    if x < _L:
        return _ERR_STATE
    prec = _U64(precision)
    mask = (_ONE << prec) - _ONE
    pos = 4
    for i in range(out.size):
        slot = x & mask
        out[i] = sym_tab[slot]
        d = _U64(packed_tab[slot])
        x = ((d >> _SH16) + _ONE) * (x >> prec) + (d & _MASK16)
        if pos + 2 <= nbytes:  # predictable: false only once the words are used up
            w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
            need = x < _L
            x = ((x << _SH16) | w) if need else x  # branch-free renormalisation
            pos += 2 * need
        elif x < _L:
            return _ERR_SHORT
    if pos != nbytes or x != _L:
        return _ERR_END
    return 0


# ------------------------------------------------------------------- unrolled main loops
# The hot loop keeps all N states in registers (numba cannot do that for a runtime-sized
# state array), so the common single-table cases N = 4, 8 and 32 (the GPU warp layout) have
# their own main loops (each costs compile time: a few seconds for N = 32, once per machine),
# generated by ``_unrolled_source`` (a test checks the text below still matches it). Each main
# loop decodes whole groups of N symbols while the payload surely holds a group's words
# (<= 2N bytes): N decode steps, then the N renormalisations in lane order. It returns
# (next symbol index, next byte position) and leaves the states in ``states``;
# ``_decode_kernel`` then finishes the tail with every read checked. Other N (and context
# switching) use ``_main_loop_generic``.


def _unrolled_source(n_streams: int) -> str:
    """Source of the single-table main loop for ``n_streams`` states (see above)."""
    lines = [
        f"def _main_loop_{n_streams}(payload, ctx, sym_tab, packed_tab, precision, states, out):",
        "    nbytes = payload.size",
        "    n = out.size",
        "    prec = _U64(precision)",
        "    mask = (_ONE << prec) - _ONE",
        f"    pos = {4 * n_streams}",
        "    i = 0",
    ]
    lines += [f"    x{j} = states[{j}]" for j in range(n_streams)]
    lines.append(f"    while i + {n_streams} <= n and pos + {2 * n_streams} <= nbytes:")
    for j in range(n_streams):
        lines.append(f"        s{j} = x{j} & mask")
        lines.append(f"        out[i + {j}] = sym_tab[s{j}]")
        lines.append(f"        d{j} = _U64(packed_tab[s{j}])")
        lines.append(f"        x{j} = ((d{j} >> _SH16) + _ONE) * (x{j} >> prec) + (d{j} & _MASK16)")
    for j in range(n_streams):
        lines.append("        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)")
        lines.append(f"        need = x{j} < _L")
        lines.append(f"        x{j} = ((x{j} << _SH16) | w) if need else x{j}")
        lines.append("        pos += 2 * need")
    lines.append(f"        i += {n_streams}")
    lines += [f"    states[{j}] = x{j}" for j in range(n_streams)]
    lines.append("    return i, pos")
    return "\n".join(lines) + "\n"


@njit(cache=True, nogil=True)
def _main_loop_generic(payload, ctx, sym_tab, packed_tab, precision, states, out):
    """Any N, optional contexts: groups of N symbols, states in a small array."""
    n_streams = states.size
    nbytes = payload.size
    n = out.size
    prec = _U64(precision)
    mask = (_ONE << prec) - _ONE
    use_ctx = ctx.size > 0
    pos = 4 * n_streams
    i = 0
    st = states.copy()  # a fresh array: the compiler knows ``out`` stores cannot alias it
    while i + n_streams <= n and pos + 2 * n_streams <= nbytes:
        for j in range(n_streams):
            k = 0
            if use_ctx:
                k = ctx[i + j]  # range-checked by the caller
            x = st[j]
            slot = x & mask
            out[i + j] = sym_tab[k, slot]
            d = _U64(packed_tab[k, slot])
            st[j] = ((d >> _SH16) + _ONE) * (x >> prec) + (d & _MASK16)
        for j in range(n_streams):
            x = st[j]
            w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
            need = x < _L
            st[j] = ((x << _SH16) | w) if need else x
            pos += 2 * need
        i += n_streams
    states[:] = st
    return i, pos


# BEGIN GENERATED by _unrolled_source(n) for n = 4, 8, 32
@njit(cache=True, nogil=True)
def _main_loop_4(payload, ctx, sym_tab, packed_tab, precision, states, out):
    nbytes = payload.size
    n = out.size
    prec = _U64(precision)
    mask = (_ONE << prec) - _ONE
    pos = 16
    i = 0
    x0 = states[0]
    x1 = states[1]
    x2 = states[2]
    x3 = states[3]
    while i + 4 <= n and pos + 8 <= nbytes:
        s0 = x0 & mask
        out[i + 0] = sym_tab[s0]
        d0 = _U64(packed_tab[s0])
        x0 = ((d0 >> _SH16) + _ONE) * (x0 >> prec) + (d0 & _MASK16)
        s1 = x1 & mask
        out[i + 1] = sym_tab[s1]
        d1 = _U64(packed_tab[s1])
        x1 = ((d1 >> _SH16) + _ONE) * (x1 >> prec) + (d1 & _MASK16)
        s2 = x2 & mask
        out[i + 2] = sym_tab[s2]
        d2 = _U64(packed_tab[s2])
        x2 = ((d2 >> _SH16) + _ONE) * (x2 >> prec) + (d2 & _MASK16)
        s3 = x3 & mask
        out[i + 3] = sym_tab[s3]
        d3 = _U64(packed_tab[s3])
        x3 = ((d3 >> _SH16) + _ONE) * (x3 >> prec) + (d3 & _MASK16)
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x0 < _L
        x0 = ((x0 << _SH16) | w) if need else x0
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x1 < _L
        x1 = ((x1 << _SH16) | w) if need else x1
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x2 < _L
        x2 = ((x2 << _SH16) | w) if need else x2
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x3 < _L
        x3 = ((x3 << _SH16) | w) if need else x3
        pos += 2 * need
        i += 4
    states[0] = x0
    states[1] = x1
    states[2] = x2
    states[3] = x3
    return i, pos


@njit(cache=True, nogil=True)
def _main_loop_8(payload, ctx, sym_tab, packed_tab, precision, states, out):
    nbytes = payload.size
    n = out.size
    prec = _U64(precision)
    mask = (_ONE << prec) - _ONE
    pos = 32
    i = 0
    x0 = states[0]
    x1 = states[1]
    x2 = states[2]
    x3 = states[3]
    x4 = states[4]
    x5 = states[5]
    x6 = states[6]
    x7 = states[7]
    while i + 8 <= n and pos + 16 <= nbytes:
        s0 = x0 & mask
        out[i + 0] = sym_tab[s0]
        d0 = _U64(packed_tab[s0])
        x0 = ((d0 >> _SH16) + _ONE) * (x0 >> prec) + (d0 & _MASK16)
        s1 = x1 & mask
        out[i + 1] = sym_tab[s1]
        d1 = _U64(packed_tab[s1])
        x1 = ((d1 >> _SH16) + _ONE) * (x1 >> prec) + (d1 & _MASK16)
        s2 = x2 & mask
        out[i + 2] = sym_tab[s2]
        d2 = _U64(packed_tab[s2])
        x2 = ((d2 >> _SH16) + _ONE) * (x2 >> prec) + (d2 & _MASK16)
        s3 = x3 & mask
        out[i + 3] = sym_tab[s3]
        d3 = _U64(packed_tab[s3])
        x3 = ((d3 >> _SH16) + _ONE) * (x3 >> prec) + (d3 & _MASK16)
        s4 = x4 & mask
        out[i + 4] = sym_tab[s4]
        d4 = _U64(packed_tab[s4])
        x4 = ((d4 >> _SH16) + _ONE) * (x4 >> prec) + (d4 & _MASK16)
        s5 = x5 & mask
        out[i + 5] = sym_tab[s5]
        d5 = _U64(packed_tab[s5])
        x5 = ((d5 >> _SH16) + _ONE) * (x5 >> prec) + (d5 & _MASK16)
        s6 = x6 & mask
        out[i + 6] = sym_tab[s6]
        d6 = _U64(packed_tab[s6])
        x6 = ((d6 >> _SH16) + _ONE) * (x6 >> prec) + (d6 & _MASK16)
        s7 = x7 & mask
        out[i + 7] = sym_tab[s7]
        d7 = _U64(packed_tab[s7])
        x7 = ((d7 >> _SH16) + _ONE) * (x7 >> prec) + (d7 & _MASK16)
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x0 < _L
        x0 = ((x0 << _SH16) | w) if need else x0
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x1 < _L
        x1 = ((x1 << _SH16) | w) if need else x1
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x2 < _L
        x2 = ((x2 << _SH16) | w) if need else x2
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x3 < _L
        x3 = ((x3 << _SH16) | w) if need else x3
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x4 < _L
        x4 = ((x4 << _SH16) | w) if need else x4
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x5 < _L
        x5 = ((x5 << _SH16) | w) if need else x5
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x6 < _L
        x6 = ((x6 << _SH16) | w) if need else x6
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x7 < _L
        x7 = ((x7 << _SH16) | w) if need else x7
        pos += 2 * need
        i += 8
    states[0] = x0
    states[1] = x1
    states[2] = x2
    states[3] = x3
    states[4] = x4
    states[5] = x5
    states[6] = x6
    states[7] = x7
    return i, pos


@njit(cache=True, nogil=True)
def _main_loop_32(payload, ctx, sym_tab, packed_tab, precision, states, out):
    nbytes = payload.size
    n = out.size
    prec = _U64(precision)
    mask = (_ONE << prec) - _ONE
    pos = 128
    i = 0
    x0 = states[0]
    x1 = states[1]
    x2 = states[2]
    x3 = states[3]
    x4 = states[4]
    x5 = states[5]
    x6 = states[6]
    x7 = states[7]
    x8 = states[8]
    x9 = states[9]
    x10 = states[10]
    x11 = states[11]
    x12 = states[12]
    x13 = states[13]
    x14 = states[14]
    x15 = states[15]
    x16 = states[16]
    x17 = states[17]
    x18 = states[18]
    x19 = states[19]
    x20 = states[20]
    x21 = states[21]
    x22 = states[22]
    x23 = states[23]
    x24 = states[24]
    x25 = states[25]
    x26 = states[26]
    x27 = states[27]
    x28 = states[28]
    x29 = states[29]
    x30 = states[30]
    x31 = states[31]
    while i + 32 <= n and pos + 64 <= nbytes:
        s0 = x0 & mask
        out[i + 0] = sym_tab[s0]
        d0 = _U64(packed_tab[s0])
        x0 = ((d0 >> _SH16) + _ONE) * (x0 >> prec) + (d0 & _MASK16)
        s1 = x1 & mask
        out[i + 1] = sym_tab[s1]
        d1 = _U64(packed_tab[s1])
        x1 = ((d1 >> _SH16) + _ONE) * (x1 >> prec) + (d1 & _MASK16)
        s2 = x2 & mask
        out[i + 2] = sym_tab[s2]
        d2 = _U64(packed_tab[s2])
        x2 = ((d2 >> _SH16) + _ONE) * (x2 >> prec) + (d2 & _MASK16)
        s3 = x3 & mask
        out[i + 3] = sym_tab[s3]
        d3 = _U64(packed_tab[s3])
        x3 = ((d3 >> _SH16) + _ONE) * (x3 >> prec) + (d3 & _MASK16)
        s4 = x4 & mask
        out[i + 4] = sym_tab[s4]
        d4 = _U64(packed_tab[s4])
        x4 = ((d4 >> _SH16) + _ONE) * (x4 >> prec) + (d4 & _MASK16)
        s5 = x5 & mask
        out[i + 5] = sym_tab[s5]
        d5 = _U64(packed_tab[s5])
        x5 = ((d5 >> _SH16) + _ONE) * (x5 >> prec) + (d5 & _MASK16)
        s6 = x6 & mask
        out[i + 6] = sym_tab[s6]
        d6 = _U64(packed_tab[s6])
        x6 = ((d6 >> _SH16) + _ONE) * (x6 >> prec) + (d6 & _MASK16)
        s7 = x7 & mask
        out[i + 7] = sym_tab[s7]
        d7 = _U64(packed_tab[s7])
        x7 = ((d7 >> _SH16) + _ONE) * (x7 >> prec) + (d7 & _MASK16)
        s8 = x8 & mask
        out[i + 8] = sym_tab[s8]
        d8 = _U64(packed_tab[s8])
        x8 = ((d8 >> _SH16) + _ONE) * (x8 >> prec) + (d8 & _MASK16)
        s9 = x9 & mask
        out[i + 9] = sym_tab[s9]
        d9 = _U64(packed_tab[s9])
        x9 = ((d9 >> _SH16) + _ONE) * (x9 >> prec) + (d9 & _MASK16)
        s10 = x10 & mask
        out[i + 10] = sym_tab[s10]
        d10 = _U64(packed_tab[s10])
        x10 = ((d10 >> _SH16) + _ONE) * (x10 >> prec) + (d10 & _MASK16)
        s11 = x11 & mask
        out[i + 11] = sym_tab[s11]
        d11 = _U64(packed_tab[s11])
        x11 = ((d11 >> _SH16) + _ONE) * (x11 >> prec) + (d11 & _MASK16)
        s12 = x12 & mask
        out[i + 12] = sym_tab[s12]
        d12 = _U64(packed_tab[s12])
        x12 = ((d12 >> _SH16) + _ONE) * (x12 >> prec) + (d12 & _MASK16)
        s13 = x13 & mask
        out[i + 13] = sym_tab[s13]
        d13 = _U64(packed_tab[s13])
        x13 = ((d13 >> _SH16) + _ONE) * (x13 >> prec) + (d13 & _MASK16)
        s14 = x14 & mask
        out[i + 14] = sym_tab[s14]
        d14 = _U64(packed_tab[s14])
        x14 = ((d14 >> _SH16) + _ONE) * (x14 >> prec) + (d14 & _MASK16)
        s15 = x15 & mask
        out[i + 15] = sym_tab[s15]
        d15 = _U64(packed_tab[s15])
        x15 = ((d15 >> _SH16) + _ONE) * (x15 >> prec) + (d15 & _MASK16)
        s16 = x16 & mask
        out[i + 16] = sym_tab[s16]
        d16 = _U64(packed_tab[s16])
        x16 = ((d16 >> _SH16) + _ONE) * (x16 >> prec) + (d16 & _MASK16)
        s17 = x17 & mask
        out[i + 17] = sym_tab[s17]
        d17 = _U64(packed_tab[s17])
        x17 = ((d17 >> _SH16) + _ONE) * (x17 >> prec) + (d17 & _MASK16)
        s18 = x18 & mask
        out[i + 18] = sym_tab[s18]
        d18 = _U64(packed_tab[s18])
        x18 = ((d18 >> _SH16) + _ONE) * (x18 >> prec) + (d18 & _MASK16)
        s19 = x19 & mask
        out[i + 19] = sym_tab[s19]
        d19 = _U64(packed_tab[s19])
        x19 = ((d19 >> _SH16) + _ONE) * (x19 >> prec) + (d19 & _MASK16)
        s20 = x20 & mask
        out[i + 20] = sym_tab[s20]
        d20 = _U64(packed_tab[s20])
        x20 = ((d20 >> _SH16) + _ONE) * (x20 >> prec) + (d20 & _MASK16)
        s21 = x21 & mask
        out[i + 21] = sym_tab[s21]
        d21 = _U64(packed_tab[s21])
        x21 = ((d21 >> _SH16) + _ONE) * (x21 >> prec) + (d21 & _MASK16)
        s22 = x22 & mask
        out[i + 22] = sym_tab[s22]
        d22 = _U64(packed_tab[s22])
        x22 = ((d22 >> _SH16) + _ONE) * (x22 >> prec) + (d22 & _MASK16)
        s23 = x23 & mask
        out[i + 23] = sym_tab[s23]
        d23 = _U64(packed_tab[s23])
        x23 = ((d23 >> _SH16) + _ONE) * (x23 >> prec) + (d23 & _MASK16)
        s24 = x24 & mask
        out[i + 24] = sym_tab[s24]
        d24 = _U64(packed_tab[s24])
        x24 = ((d24 >> _SH16) + _ONE) * (x24 >> prec) + (d24 & _MASK16)
        s25 = x25 & mask
        out[i + 25] = sym_tab[s25]
        d25 = _U64(packed_tab[s25])
        x25 = ((d25 >> _SH16) + _ONE) * (x25 >> prec) + (d25 & _MASK16)
        s26 = x26 & mask
        out[i + 26] = sym_tab[s26]
        d26 = _U64(packed_tab[s26])
        x26 = ((d26 >> _SH16) + _ONE) * (x26 >> prec) + (d26 & _MASK16)
        s27 = x27 & mask
        out[i + 27] = sym_tab[s27]
        d27 = _U64(packed_tab[s27])
        x27 = ((d27 >> _SH16) + _ONE) * (x27 >> prec) + (d27 & _MASK16)
        s28 = x28 & mask
        out[i + 28] = sym_tab[s28]
        d28 = _U64(packed_tab[s28])
        x28 = ((d28 >> _SH16) + _ONE) * (x28 >> prec) + (d28 & _MASK16)
        s29 = x29 & mask
        out[i + 29] = sym_tab[s29]
        d29 = _U64(packed_tab[s29])
        x29 = ((d29 >> _SH16) + _ONE) * (x29 >> prec) + (d29 & _MASK16)
        s30 = x30 & mask
        out[i + 30] = sym_tab[s30]
        d30 = _U64(packed_tab[s30])
        x30 = ((d30 >> _SH16) + _ONE) * (x30 >> prec) + (d30 & _MASK16)
        s31 = x31 & mask
        out[i + 31] = sym_tab[s31]
        d31 = _U64(packed_tab[s31])
        x31 = ((d31 >> _SH16) + _ONE) * (x31 >> prec) + (d31 & _MASK16)
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x0 < _L
        x0 = ((x0 << _SH16) | w) if need else x0
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x1 < _L
        x1 = ((x1 << _SH16) | w) if need else x1
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x2 < _L
        x2 = ((x2 << _SH16) | w) if need else x2
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x3 < _L
        x3 = ((x3 << _SH16) | w) if need else x3
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x4 < _L
        x4 = ((x4 << _SH16) | w) if need else x4
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x5 < _L
        x5 = ((x5 << _SH16) | w) if need else x5
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x6 < _L
        x6 = ((x6 << _SH16) | w) if need else x6
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x7 < _L
        x7 = ((x7 << _SH16) | w) if need else x7
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x8 < _L
        x8 = ((x8 << _SH16) | w) if need else x8
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x9 < _L
        x9 = ((x9 << _SH16) | w) if need else x9
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x10 < _L
        x10 = ((x10 << _SH16) | w) if need else x10
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x11 < _L
        x11 = ((x11 << _SH16) | w) if need else x11
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x12 < _L
        x12 = ((x12 << _SH16) | w) if need else x12
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x13 < _L
        x13 = ((x13 << _SH16) | w) if need else x13
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x14 < _L
        x14 = ((x14 << _SH16) | w) if need else x14
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x15 < _L
        x15 = ((x15 << _SH16) | w) if need else x15
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x16 < _L
        x16 = ((x16 << _SH16) | w) if need else x16
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x17 < _L
        x17 = ((x17 << _SH16) | w) if need else x17
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x18 < _L
        x18 = ((x18 << _SH16) | w) if need else x18
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x19 < _L
        x19 = ((x19 << _SH16) | w) if need else x19
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x20 < _L
        x20 = ((x20 << _SH16) | w) if need else x20
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x21 < _L
        x21 = ((x21 << _SH16) | w) if need else x21
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x22 < _L
        x22 = ((x22 << _SH16) | w) if need else x22
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x23 < _L
        x23 = ((x23 << _SH16) | w) if need else x23
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x24 < _L
        x24 = ((x24 << _SH16) | w) if need else x24
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x25 < _L
        x25 = ((x25 << _SH16) | w) if need else x25
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x26 < _L
        x26 = ((x26 << _SH16) | w) if need else x26
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x27 < _L
        x27 = ((x27 << _SH16) | w) if need else x27
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x28 < _L
        x28 = ((x28 << _SH16) | w) if need else x28
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x29 < _L
        x29 = ((x29 << _SH16) | w) if need else x29
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x30 < _L
        x30 = ((x30 << _SH16) | w) if need else x30
        pos += 2 * need
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x31 < _L
        x31 = ((x31 << _SH16) | w) if need else x31
        pos += 2 * need
        i += 32
    states[0] = x0
    states[1] = x1
    states[2] = x2
    states[3] = x3
    states[4] = x4
    states[5] = x5
    states[6] = x6
    states[7] = x7
    states[8] = x8
    states[9] = x9
    states[10] = x10
    states[11] = x11
    states[12] = x12
    states[13] = x13
    states[14] = x14
    states[15] = x15
    states[16] = x16
    states[17] = x17
    states[18] = x18
    states[19] = x19
    states[20] = x20
    states[21] = x21
    states[22] = x22
    states[23] = x23
    states[24] = x24
    states[25] = x25
    states[26] = x26
    states[27] = x27
    states[28] = x28
    states[29] = x29
    states[30] = x30
    states[31] = x31
    return i, pos
# END GENERATED


# ------------------------------------------------------------------------------- public API
_MAIN_LOOPS = {4: _main_loop_4, 8: _main_loop_8, 32: _main_loop_32}
_EMPTY_CTX = np.zeros(0, dtype=np.int64)
_MESSAGES = {
    _ERR_SHORT: "rANS payload ends early or has a bad length",
    _ERR_STATE: "rANS initial state out of range",
    _ERR_END: "rANS payload does not end where its symbols do",
    _ERR_CTX: "context index out of range",
}


def _as_symbols(symbols) -> np.ndarray:
    s = np.asarray(symbols)
    if s.ndim != 1 or s.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("symbols must be a 1-D uint8 or uint16 array")
    return np.ascontiguousarray(s)


def _as_ctx(ctx, n: int) -> np.ndarray:
    c = np.asarray(ctx)
    if c.ndim != 1 or c.size != n or (c.size and c.dtype.kind not in "iu"):
        raise ValueError("ctx must be a 1-D integer array with one entry per symbol")
    return np.ascontiguousarray(c, dtype=np.int64)


def _encode(symbols, ctx, freq_tables, precision, n_streams) -> np.ndarray:
    t = _check_tables(freq_tables, precision)
    n_streams = _check_streams(n_streams)
    n = symbols.size
    words = np.empty(n, dtype=np.uint16)
    states = np.empty(n_streams, dtype=np.uint64)
    wpos = _encode_kernel(symbols, ctx, t, _cum(t), int(precision), n_streams, words, states)
    if wpos < 0:
        if wpos >= -n:
            i = -wpos - 1
            raise ValueError(f"symbol {int(symbols[i])} at position {i} has frequency 0")
        raise ValueError(f"ctx[{-wpos - n - 1}] is out of range")
    out = np.empty(4 * n_streams + 2 * (n - wpos), dtype=np.uint8)
    out[: 4 * n_streams] = states.astype("<u4").view(np.uint8)
    out[4 * n_streams :] = words[wpos:].astype("<u2", copy=False).view(np.uint8)
    return out


def encode_table(symbols, freqs, precision: int, n_streams: int = 1) -> np.ndarray:
    """rANS-encode a uint8/uint16 array with one frequency table; returns the payload (uint8)."""
    s = _as_symbols(symbols)
    return _encode(s, _EMPTY_CTX, freqs, precision, n_streams)


def encode_ctx(symbols, ctx, freq_tables, precision: int, n_streams: int = 1) -> np.ndarray:
    """rANS-encode symbol i with ``freq_tables[ctx[i]]`` (tables: [C, A]); returns the payload."""
    s = _as_symbols(symbols)
    return _encode(s, _as_ctx(ctx, s.size), freq_tables, precision, n_streams)


def _payload(payload) -> np.ndarray:
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 1:
            raise ValueError("payload must be bytes or a 1-D uint8 array")
        return np.ascontiguousarray(payload)
    return np.frombuffer(payload, dtype=np.uint8)


def _check_n(n) -> int:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    return int(n)


def decode_prepared(payload, tables, precision: int, n: int, n_streams: int = 1, ctx=None) -> np.ndarray:
    """Decode with tables from :func:`decode_tables` (skips rebuilding them on every call)."""
    sym, packed = tables
    n = _check_n(n)
    n_streams = _check_streams(n_streams)
    p = _payload(payload)
    out = np.empty(n, dtype=sym.dtype)
    if ctx is None and n_streams == 1:
        status = _decode_kernel_1(p, sym[0], packed[0], int(precision), out)
    else:
        c = _EMPTY_CTX if ctx is None else _as_ctx(ctx, n)
        if c.size and (c.min() < 0 or c.max() >= sym.shape[0]):
            raise ValueError("context index out of range")
        states = np.empty(n_streams, dtype=np.uint64)
        status = _read_states(p, states)
        if not status:
            main_loop = _MAIN_LOOPS.get(n_streams) if ctx is None else None
            if main_loop is not None:
                i0, pos = main_loop(p, c, sym[0], packed[0], int(precision), states, out)
            else:
                i0, pos = _main_loop_generic(p, c, sym, packed, int(precision), states, out)
            status = _decode_kernel(p, c, sym, packed, int(precision), out, states, i0, pos)
    if status:
        raise CorruptStreamError(_MESSAGES[status])
    return out


def decode_table(payload, freqs, precision: int, n: int, n_streams: int = 1, out_dtype=np.uint8) -> np.ndarray:
    """Decode ``n`` symbols of a payload from :func:`encode_table` (CorruptStreamError if bad)."""
    return decode_prepared(payload, decode_tables(freqs, precision, out_dtype), precision, n, n_streams)


def decode_ctx(payload, ctx, freq_tables, precision: int, n_streams: int = 1, out_dtype=np.uint8) -> np.ndarray:
    """Decode ``len(ctx)`` symbols of a payload from :func:`encode_ctx`."""
    tables = decode_tables(freq_tables, precision, out_dtype)
    ctx = _as_ctx(ctx, np.asarray(ctx).size)
    return decode_prepared(payload, tables, precision, ctx.size, n_streams, ctx)
