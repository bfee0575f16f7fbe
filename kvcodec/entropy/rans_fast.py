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
states give the CPU independent dependency chains to overlap. With one table
(:func:`encode_table`) it codes a group of N symbols at a time: the N states' arithmetic in
loops the compiler vectorises, the division as an exact float multiply (see ``_DIV_EPS``,
:func:`table_kernel`), and only the renormalisation words' placement serial (~1.25x faster).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import njit

from kvcodec.kernel_inputs import readonly
from kvcodec.entropy.rans_unrolled import MAIN_LOOPS
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


def _check_decode_tables(freq_tables, precision: int, out_dtype) -> tuple[np.ndarray, np.dtype]:
    """(checked tables, output dtype) for decoding (ValueError)."""
    t = _check_tables(freq_tables, precision)
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError("out_dtype must be uint8 or uint16")
    if t.shape[1] > np.iinfo(out_dtype).max + 1 and np.any(t[:, np.iinfo(out_dtype).max + 1 :]):
        raise ValueError(f"symbols with nonzero frequency do not fit in {out_dtype}")
    return t, out_dtype


def decode_tables(freq_tables, precision: int, out_dtype=np.uint8):
    """Slot lookup tables ``(symbol[C, M], packed[C, M])`` used by the decoders.

    ``packed[slot] = (freq - 1) << 16 | (slot - cum)`` (uint32). Build once and pass to
    :func:`decode_prepared` when decoding many payloads with the same tables.
    """
    t, out_dtype = _check_decode_tables(freq_tables, precision, out_dtype)
    m = 1 << int(precision)
    sym = np.empty((t.shape[0], m), dtype=out_dtype)
    packed = np.empty((t.shape[0], m), dtype=np.uint32)
    _fill_decode_tables(t, sym, packed)
    return sym, packed


@njit(cache=True, nogil=True)
def _fill_decode_tables(freq, sym, packed):
    """:func:`decode_tables`' slots, one pass (rows checked to sum to the slot count; numpy's
    repeat-and-gather took a small stream's decode ~0.06 ms)."""
    for k in range(freq.shape[0]):
        slot = 0
        for s in range(freq.shape[1]):
            f = np.int64(freq[k, s])
            for r in range(f):
                sym[k, slot] = s
                packed[k, slot] = ((f - 1) << 16) | r
                slot += 1


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


# exact x // f as a float multiply: x < 2**32, f <= 2**16 (precision <= 16), so x * (1 / f) is within
# 2**-20 of x / f, and x / f is an integer or at least 1 / f >= 2**-16 away from one: adding 2**-18
# before truncating gives floor(x / f) in every case.
_DIV_EPS = 2.0 ** -18


def reciprocals(freqs: np.ndarray) -> np.ndarray:
    """1 / f (float64) per frequency (1 where f == 0): :func:`table_kernel`'s divisors."""
    return 1.0 / np.maximum(np.asarray(freqs, np.float64), 1.0)


def table_args(freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(freq, cum, inv) of one frequency table: the arrays :func:`table_kernel` takes (int64
    frequencies, their exclusive cumulative sums, :func:`reciprocals`)."""
    f = np.asarray(freqs).astype(np.int64)
    return f, _cum(f[None])[0], reciprocals(f)


@njit(inline="always")
def _code_group(symbols, base, m, freq, cum, inv, precision, words, wpos, x, fs, cs, iv):
    """Code symbols ``base .. base + m - 1`` on states 0 .. m-1 (:func:`table_kernel`); returns the new
    wpos, or -(i+1) for the group's last symbol i with frequency 0 (or outside the alphabet)."""
    top = 32 - precision
    for j in range(m - 1, -1, -1):
        s = symbols[base + j]
        if s >= freq.size or freq[s] == 0:
            return -(base + j + 1)
        fs[j] = freq[s]
        cs[j] = cum[s]
        iv[j] = inv[s]
    for j in range(m - 1, -1, -1):
        need = x[j] >= (fs[j] << top)
        words[wpos - 1] = x[j] & 0xFFFF
        wpos -= need
    for j in range(m):
        xj = x[j]
        xj = xj >> (16 if xj >= (fs[j] << top) else 0)
        q = np.int64(xj * iv[j] + _DIV_EPS)
        x[j] = (q << precision) + xj - q * fs[j] + cs[j]
    return wpos


@cache
def table_kernel(n_streams: int):
    """:func:`_encode_kernel` with one table (``freq``, ``cum``: int64 [A], ``inv``: :func:`reciprocals`)
    for N = ``n_streams`` (a compile-time constant, so the group loops vectorise) of
    ``symbols[lo:hi]`` into ``words[lo:hi]`` (whole arrays and bounds, not slices: a slice made in
    compiled code is a non-contiguous array type, and the loops would not vectorise): the same words
    and states, symbol lo + i on state i % N, in groups of N symbols (last group first): gather the
    group's table entries, place its renormalisation words (states N-1 .. 0: the serial part), then
    update the N states without branches or divisions. Returns where the words start in ``words``,
    or -(i+1) for the last symbol i with frequency 0 (or outside the alphabet)."""
    lanes = n_streams

    @njit(cache=True, nogil=True)
    def kernel(symbols, lo, hi, freq, cum, inv, precision, words, states):
        x = np.full(lanes, RANS_L, np.int64)
        fs = np.empty(lanes, np.int64)
        cs = np.empty(lanes, np.int64)
        iv = np.empty(lanes, np.float64)
        wpos = hi
        full = lo + (hi - lo) // lanes * lanes
        if full < hi:  # the last, partial group first
            wpos = _code_group(symbols, full, hi - full, freq, cum, inv, precision, words, wpos, x, fs, cs, iv)
        for base in range(full - lanes, lo - 1, -lanes):
            if wpos < 0:
                return wpos
            wpos = _code_group(symbols, base, lanes, freq, cum, inv, precision, words, wpos, x, fs, cs, iv)
        if wpos < 0:
            return wpos
        for j in range(lanes):
            states[j] = x[j]
        return wpos

    return kernel


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


@njit(inline="always")
def _renormalise(x, payload, pos, nbytes):
    """(state, word position, False if the payload ended before a state that needs a word) after
    a decode step: read the next word while the state is below 2**16."""
    if pos + 2 <= nbytes:  # predictable: false only once the words are used up
        w = _U64(payload[pos]) | (_U64(payload[pos + 1]) << _SH8)
        need = x < _L
        x = ((x << _SH16) | w) if need else x  # branch-free renormalisation
        return x, pos + 2 * need, True
    return x, pos, x >= _L


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
        x, pos, ok = _renormalise(x, payload, pos, nbytes)
        if not ok:
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


def _single_state_decoder(by_symbol: bool):
    """The single-state, single-table decoder (the state lives in a register). ``by_symbol``:
    ``packed_tab`` holds ``(freq - 1) << 16 | cum`` per symbol (:func:`_symbol_tables`, ~M bytes
    to build instead of 5 M) rather than :func:`decode_tables`' per slot entries."""

    @njit(cache=True, nogil=True)
    def kernel(payload, sym_tab, packed_tab, precision, out):
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
            s = sym_tab[slot]
            out[i] = s
            if by_symbol:
                d = _U64(packed_tab[s])
                x = ((d >> _SH16) + _ONE) * (x >> prec) + slot - (d & _MASK16)
            else:
                d = _U64(packed_tab[slot])
                x = ((d >> _SH16) + _ONE) * (x >> prec) + (d & _MASK16)
            x, pos, ok = _renormalise(x, payload, pos, nbytes)
            if not ok:
                return _ERR_SHORT
        if pos != nbytes or x != _L:
            return _ERR_END
        return 0

    return kernel


_decode_kernel_1 = _single_state_decoder(False)
_decode_kernel_1_by_symbol = _single_state_decoder(True)


def _symbol_tables(freqs, precision: int, out_dtype) -> tuple[np.ndarray, np.ndarray]:
    """(symbol per slot [M], ``(freq - 1) << 16 | cum`` per symbol) of the first table of ``freqs``
    (``decode_prepared`` without contexts reads only that one too) for ``_decode_kernel_1_by_symbol``;
    ValueError as :func:`_check_decode_tables`. One unsigned 1-D table (a stream header's) is checked in
    the compiled fill itself: the general checks' ~10 numpy calls were most of a small stream's decode."""
    t = freqs if isinstance(freqs, np.ndarray) else np.asarray(freqs)
    dt = np.dtype(out_dtype)
    if t.ndim != 1 or t.dtype.kind != "u" or t.dtype.itemsize > 4 or not 0 < t.size <= 65536 or dt not in (np.dtype(np.uint8), np.dtype(
            np.uint16)) or not isinstance(precision, (int, np.integer)) or not 1 <= int(precision) <= 16:
        t, dt = _check_decode_tables(freqs, precision, out_dtype)
        t = t[0]
    sym = np.empty(1 << int(precision), dt)
    per_symbol = np.empty(t.size, np.uint32)
    err = _fill_symbol_tables(t, sym, per_symbol, np.iinfo(dt).max)
    if err == 1:
        raise ValueError(f"every frequency table must sum to 2**{precision}")
    if err == 2:
        raise ValueError(f"symbols with nonzero frequency do not fit in {dt}")
    return sym, per_symbol


@njit(cache=True, nogil=True)
def _fill_symbol_tables(freq, sym, per_symbol, max_symbol):
    """:func:`_symbol_tables`' fill; 1 (nothing written) unless ``freq`` sums to the slot count, 2 if
    a symbol over ``max_symbol`` has a frequency, else 0."""
    cum = 0
    over = False
    for s in range(freq.size):
        cum += np.int64(freq[s])
        over |= s > max_symbol and freq[s] != 0
    if cum != sym.size:
        return 1
    if over:
        return 2
    cum = 0
    for s in range(freq.size):
        f = np.int64(freq[s])
        sym[cum:cum + f] = s
        per_symbol[s] = ((f - 1) << 16) | cum if f else 0
        cum += f
    return 0


# ------------------------------------------------------------------- unrolled main loops
# The hot loop keeps all N states in registers (numba cannot do that for a runtime-sized
# state array), so the common single-table cases N = 4, 8 and 32 (the GPU warp layout) have
# their own main loops (each costs compile time: a few seconds for N = 32, once per machine),
# generated by ``_unrolled_source`` into ``rans_unrolled.py`` (``write_unrolled_module()``
# rewrites it; a test checks the file still equals its generator's output). Each main
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


UNROLLED_LANES = (4, 8, 32)
UNROLLED_MODULE = "rans_unrolled.py"


def unrolled_module_source() -> str:
    """The full text of ``rans_unrolled.py`` (the generated main loops)."""
    head = (
        '"""GENERATED by kvcodec.entropy.rans_fast.unrolled_module_source(): do not edit.\n\n'
        "Regenerate with ``python -c \"from kvcodec.entropy import rans_fast; rans_fast.write_unrolled_module()\"``;\n"
        "tests/test_entropy_static.py checks that this file equals its generator's output. The single-table\n"
        "rANS decode main loops with all N states in registers (see ``rans_fast``).\n"
        '"""\n\n'
        "import numpy as np\nfrom numba import njit\n\n"
        "_U64 = np.uint64\n_L = np.uint64(1 << 16)\n_MASK16 = np.uint64(0xFFFF)\n"
        "_SH16 = np.uint64(16)\n_SH8 = np.uint64(8)\n_ONE = np.uint64(1)\n"
    )
    loops = "".join(f"\n\n@njit(cache=True, nogil=True)\n{_unrolled_source(n)}" for n in UNROLLED_LANES)
    table = ", ".join(f"{n}: _main_loop_{n}" for n in UNROLLED_LANES)
    return f"{head}{loops}\n\nMAIN_LOOPS = {{{table}}}\n"


def write_unrolled_module() -> None:
    """Rewrite ``rans_unrolled.py`` from the generator (after changing ``_unrolled_source``)."""
    from pathlib import Path

    from kvcodec.safe_write import write_bytes

    # atomically: an interrupted rewrite never leaves a torn module that every import would fail on
    write_bytes(Path(__file__).parent / UNROLLED_MODULE, unrolled_module_source().encode(), overwrite=True)


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




# ------------------------------------------------------------------------------- public API
_MAIN_LOOPS = MAIN_LOOPS
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
    if ctx.size == 0 and t.shape[0] == 1:
        wpos = table_kernel(n_streams)(symbols, 0, n, *table_args(t[0]), int(precision), words, states)
    else:
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
        return readonly(np.ascontiguousarray(payload))
    return readonly(np.frombuffer(payload, dtype=np.uint8))  # one compiled decoder for any buffer


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
    """Decode ``n`` symbols of a payload from :func:`encode_table` (CorruptStreamError if bad).
    A short single-state payload (fewer than ``2**precision`` symbols, e.g. a codec's model
    bytes) decodes with per-symbol tables: building the per-slot ones cost more than its decode."""
    if n_streams != 1 or not isinstance(n, (int, np.integer)) or n >= 1 << int(precision):
        return decode_prepared(payload, decode_tables(freqs, precision, out_dtype), precision, n, n_streams)
    sym, per_symbol = _symbol_tables(freqs, precision, out_dtype)
    out = np.empty(_check_n(n), dtype=sym.dtype)
    status = _decode_kernel_1_by_symbol(_payload(payload), sym, per_symbol, int(precision), out)
    if status:
        raise CorruptStreamError(_MESSAGES[status])
    return out


def decode_ctx(payload, ctx, freq_tables, precision: int, n_streams: int = 1, out_dtype=np.uint8) -> np.ndarray:
    """Decode ``len(ctx)`` symbols of a payload from :func:`encode_ctx`."""
    tables = decode_tables(freq_tables, precision, out_dtype)
    ctx = _as_ctx(ctx, np.asarray(ctx).size)
    return decode_prepared(payload, tables, precision, ctx.size, n_streams, ctx)
