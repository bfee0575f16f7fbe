"""Static tANS (FSE-style), pure-Python reference. This file is the specification.

The numba fast path (``tans_fast``) must produce exactly these bytes; tests check it.

Tables (table log R, 5 <= R <= 16, M = 2**R; ``freqs`` sum to M, ``cum`` is their prefix sum)
    Spread: walk the symbols in increasing order and place each one ``freqs[s]`` times at
    ``pos``, then ``pos = (pos + step) % M`` with FSE's ``step = M/2 + M/8 + 3`` (odd, so every
    slot is visited once).
    Encoder: the k-th slot u (in increasing u) holding s gives ``next_state[cum[s] + k] = M + u``.
    Decoder: slot u holding s, its k-th occurrence, has ``nxt = freqs[s] + k``,
    ``nbits = R - floor(log2(nxt))`` and ``base = (nxt << nbits) - M``.
Coding (two interleaved states, like zstd's FSE decoder, so a CPU overlaps two chains)
    Symbol i uses state ``i % 2``. Encoder states X live in [M, 2M) and start at M. Symbols are
    encoded from last to first: for symbol s (f = freqs[s]) take the smallest ``nb`` with
    ``X >> nb < 2f``, output the low ``nb`` bits of X, then
    ``X = next_state[cum[s] + (X >> nb) - f]``.
    Decoding walks forward from ``u = X_final - M`` per state: symbol = spread[u], then
    ``u = base[u] + read(nbits[u])``; after the last symbol both u must be 0 again (X = M).
Payload (little endian)
    u16 x 2: the decoders' first states ``X_final - M`` (state 0, state 1); then the output bits
    in the order the decoder reads them (symbol 0's bits first), packed LSB-first: bit j of the
    stream is bit ``j % 8`` of byte ``j // 8``; each chunk is written least significant bit
    first. The last byte is padded with zero bits; a decoder checks that it consumed every byte
    and that the padding is zero.
"""

from __future__ import annotations

import numpy as np

from kvcodec.errors import CorruptStreamError

N_STATES = 2
MIN_TABLE_LOG = 5
MAX_TABLE_LOG = 16


def spread(freqs, table_log: int) -> list[int]:
    """FSE symbol spread: the symbol held by each of the 2**table_log slots."""
    m = 1 << table_log
    step = (m >> 1) + (m >> 3) + 3
    table = [0] * m
    pos = 0
    for s, f in enumerate(freqs):
        for _ in range(int(f)):
            table[pos] = s
            pos = (pos + step) & (m - 1)
    return table


def _check(freqs, table_log: int) -> list[int]:
    if not MIN_TABLE_LOG <= table_log <= MAX_TABLE_LOG:
        raise ValueError(f"tANS table_log must be in [{MIN_TABLE_LOG}, {MAX_TABLE_LOG}], got {table_log}")
    freqs = [int(f) for f in freqs]
    if any(f < 0 for f in freqs) or sum(freqs) != 1 << table_log:
        raise ValueError(f"frequencies must be non-negative and sum to 2**{table_log}")
    return freqs


def encode(symbols, freqs, table_log: int) -> bytes:
    """Encode ``symbols`` (ints); returns the payload bytes."""
    freqs = _check(freqs, table_log)
    m = 1 << table_log
    table = spread(freqs, table_log)
    cum = [0]
    for f in freqs[:-1]:
        cum.append(cum[-1] + f)
    next_state = [0] * m
    seen = [0] * len(freqs)
    for u, s in enumerate(table):
        next_state[cum[s] + seen[s]] = m + u
        seen[s] += 1
    states = [m] * N_STATES
    chunks = []  # (value, nbits), from the last symbol to the first
    for i in range(len(symbols) - 1, -1, -1):
        x = states[i % N_STATES]
        s = int(symbols[i])
        f = freqs[s] if s < len(freqs) else 0
        if f == 0:
            raise ValueError(f"symbol {s} at position {i} has frequency 0")
        nb = 0
        while x >> nb >= 2 * f:
            nb += 1
        chunks.append((x & ((1 << nb) - 1), nb))
        states[i % N_STATES] = next_state[cum[s] + (x >> nb) - f]
    out = bytearray()
    for x in states:
        out += (x - m).to_bytes(2, "little")
    acc = nacc = 0
    for value, nb in reversed(chunks):
        acc |= value << nacc
        nacc += nb
        while nacc >= 8:
            out.append(acc & 0xFF)
            acc >>= 8
            nacc -= 8
    if nacc:
        out.append(acc)
    return bytes(out)


def decode(payload: bytes, freqs, table_log: int, n: int) -> list[int]:
    """Decode ``n`` symbols coded by :func:`encode`; raises CorruptStreamError on bad input."""
    freqs = _check(freqs, table_log)
    m = 1 << table_log
    table = spread(freqs, table_log)
    nbits, base = [0] * m, [0] * m
    nxt = list(freqs)
    for u, s in enumerate(table):
        k = nxt[s]
        nxt[s] += 1
        nbits[u] = table_log - (k.bit_length() - 1)
        base[u] = (k << nbits[u]) - m
    payload = bytes(payload)
    if len(payload) < 2 * N_STATES:
        raise CorruptStreamError("tANS payload too short")
    states = [int.from_bytes(payload[2 * j : 2 * j + 2], "little") for j in range(N_STATES)]
    if any(u >= m for u in states):
        raise CorruptStreamError("tANS initial state out of range")
    pos, acc, nacc = 2 * N_STATES, 0, 0
    out = []
    for i in range(n):
        u = states[i % N_STATES]
        out.append(table[u])
        nb = nbits[u]
        while nacc < nb:
            if pos >= len(payload):
                raise CorruptStreamError("tANS payload ends early")
            acc |= payload[pos] << nacc
            pos += 1
            nacc += 8
        states[i % N_STATES] = base[u] + (acc & ((1 << nb) - 1))
        acc >>= nb
        nacc -= nb
    if any(states) or pos != len(payload) or acc != 0:
        raise CorruptStreamError("tANS payload does not end where its symbols do")
    return out
