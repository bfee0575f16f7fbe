"""Static interleaved rANS, pure-Python reference. This file is the specification.

The numba fast path (``rans_fast``) must produce exactly these bytes and decode exactly
these symbols; tests check it byte for byte.

Parameters
    M = 2**precision (precision 1..16) is the probability scale; ``freqs`` are integers summing
    to M and ``cum[s] = freqs[0] + ... + freqs[s-1]``.
State
    Each of the N interleaved states x is a 32-bit integer kept in [L, 2**32), L = 2**16.
Renormalisation (16-bit words, as in DietGPU)
    Encode symbol s (f = freqs[s], c = cum[s]): if x >= f << (32 - precision), emit the low
    16 bits of x and shift x right by 16 (at most once: precision <= 16); then
    ``x = (x // f) * M + c + x % f``.
    Decode: ``slot = x % M``; s is the symbol with cum[s] <= slot < cum[s] + f;
    ``x = f * (x >> precision) + slot - c``; if x < L, ``x = (x << 16) | next_word`` (at most
    one word per symbol, so a decoder never loops).
Interleaving
    Symbol i is coded by state ``i % N``. The encoder walks i = n-1 .. 0 and the decoder
    i = 0 .. n-1, so the decoder reads words strictly in symbol order: in a group of N
    consecutive symbols, the ones that renormalise read consecutive words in lane order. A GPU
    warp (N = 32) decodes a group in one step: ballot the lanes that need a word, and lane k
    reads word ``pos + popcount(ballot & lanes_below_k)``.
Payload layout (little endian)
    N final encoder states (uint32 each, state 0 first), then the 16-bit words in the order the
    decoder reads them. Encoders start every state at L; a decoder checks that every state ends
    at L and that every word was consumed (cheap integrity check).
Context switching
    ``encode_ctx``/``decode_ctx`` code symbol i with frequency table ``freq_tables[ctx[i]]``
    (all tables share one precision); the plain functions are the one-table case.
"""

from __future__ import annotations

import numpy as np

from kvcodec.errors import CorruptStreamError

RANS_L = 1 << 16
WORD_BITS = 16
MAX_STREAMS = 32


def encode(symbols, freqs, precision: int, n_streams: int = 1) -> bytes:
    """Encode ``symbols`` (ints) with one frequency table; returns the payload bytes."""
    symbols = np.asarray(symbols)
    return encode_ctx(symbols, np.zeros(len(symbols), dtype=np.int64), [freqs], precision, n_streams)


def decode(payload: bytes, freqs, precision: int, n: int, n_streams: int = 1) -> list[int]:
    """Decode ``n`` symbols coded by :func:`encode`; raises CorruptStreamError on bad input."""
    return decode_ctx(payload, [0] * n, [freqs], precision, n_streams)


def encode_ctx(symbols, ctx, freq_tables, precision: int, n_streams: int = 1) -> bytes:
    """Encode symbol i with table ``freq_tables[ctx[i]]``; returns the payload bytes."""
    tables = [_cumulative(t, precision) for t in freq_tables]
    _check_streams(n_streams)
    states = [RANS_L] * n_streams
    words = []
    for i in range(len(symbols) - 1, -1, -1):
        freqs, cum = tables[int(ctx[i])]
        s = int(symbols[i])
        f = freqs[s] if s < len(freqs) else 0
        if f == 0:
            raise ValueError(f"symbol {s} at position {i} has frequency 0")
        x = states[i % n_streams]
        if x >= f << (32 - precision):
            words.append(x & 0xFFFF)
            x >>= WORD_BITS
        states[i % n_streams] = (x // f << precision) + cum[s] + x % f
    out = bytearray()
    for x in states:
        out += x.to_bytes(4, "little")
    for w in reversed(words):
        out += w.to_bytes(2, "little")
    return bytes(out)


def decode_ctx(payload: bytes, ctx, freq_tables, precision: int, n_streams: int = 1) -> list[int]:
    """Decode ``len(ctx)`` symbols coded by :func:`encode_ctx`."""
    tables = [_cumulative(t, precision) for t in freq_tables]
    slot_to_symbol = [np.repeat(np.arange(len(f)), f).tolist() for f, _ in tables]
    _check_streams(n_streams)
    payload = bytes(payload)
    if len(payload) < 4 * n_streams or (len(payload) - 4 * n_streams) % 2:
        raise CorruptStreamError("rANS payload has a bad length")
    states = [int.from_bytes(payload[4 * j : 4 * j + 4], "little") for j in range(n_streams)]
    if any(x < RANS_L for x in states):
        raise CorruptStreamError("rANS initial state out of range")
    pos = 4 * n_streams
    mask = (1 << precision) - 1
    out = []
    for i in range(len(ctx)):
        k = int(ctx[i])
        freqs, cum = tables[k]
        x = states[i % n_streams]
        slot = x & mask
        s = slot_to_symbol[k][slot]
        x = freqs[s] * (x >> precision) + slot - cum[s]
        if x < RANS_L:
            if pos + 2 > len(payload):
                raise CorruptStreamError("rANS payload ends early")
            x = (x << WORD_BITS) | int.from_bytes(payload[pos : pos + 2], "little")
            pos += 2
        states[i % n_streams] = x
        out.append(s)
    if pos != len(payload) or any(x != RANS_L for x in states):
        raise CorruptStreamError("rANS payload does not end where its symbols do")
    return out


def _cumulative(freqs, precision: int):
    if not 1 <= precision <= 16:
        raise ValueError(f"rANS precision must be in [1, 16], got {precision}")
    freqs = [int(f) for f in freqs]
    if any(f < 0 for f in freqs) or sum(freqs) != 1 << precision:
        raise ValueError(f"frequencies must be non-negative and sum to 2**{precision}")
    cum = [0]
    for f in freqs[:-1]:
        cum.append(cum[-1] + f)
    return freqs, cum


def _check_streams(n_streams: int) -> None:
    if not 1 <= n_streams <= MAX_STREAMS:
        raise ValueError(f"n_streams must be in [1, {MAX_STREAMS}], got {n_streams}")
