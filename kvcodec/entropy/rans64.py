"""64-bit rANS for fine CDFs, pure-Python reference. This file is the specification.

Where :mod:`kvcodec.entropy.rans` codes symbols with static 12-16-bit tables, this coder takes a
probability *model* that may change at every symbol and resolves probabilities to 2**-28, so a
model over 65536 bit patterns of a 16-bit float can give every pattern a floor of one unit and
still put almost all of the mass on a few values. The numba fast path (``rans64_fast``) produces
exactly these words; tests check it word for word.

Model interface (a model knows probabilities, the coder knows bits)
    ``interval(i, s) -> (start, freq)``: symbol s at position i owns ``[start, start + freq)`` of
    ``[0, M)``, M = 2**PRECISION, 1 <= freq < M (so ``x * freq`` bounds fit in 63 bits); ``find(i, slot) -> (s, start, freq)``: the symbol whose
    interval holds ``slot``. The decoder calls ``find`` for positions 0, 1, 2, ... in order, so a
    model may depend on the symbols decoded before (the predictive codec's previous-token term).
    :class:`CdfModel` builds both from a cumulative function ``cdf(i, k)``.
State and words
    One state x in [L, 2**63), L = 2**31; 32-bit words move in and out.
    Encode (symbols n-1 .. 0): if ``x >= (L >> PRECISION << 32) * freq``, emit the low 32 bits of x
    and shift right by 32; then ``x = (x // freq << PRECISION) + x % freq + start``.
    Decode: ``slot = x % M``, ``(s, start, freq) = find(i, slot)``,
    ``x = freq * (x >> PRECISION) + slot - start``; if x < L, ``x = x << 32 | next word``.
Stream layout (uint32 words)
    The final encoder state (high word, low word), then the words in decode order. The encoder
    starts at L; the decoder checks that the state ends at L with every word consumed.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from kvcodec.errors import CorruptStreamError

PRECISION = 28
M = 1 << PRECISION
RANS_L = 1 << 31
_RENORM = (RANS_L >> PRECISION) << 32  # encoder: emit a word when x >= _RENORM * freq


class SymbolModel(Protocol):
    """What the coder asks a probability model (see the module docstring)."""

    def interval(self, i: int, s: int) -> tuple[int, int]: ...

    def find(self, i: int, slot: int) -> tuple[int, int, int]: ...


class CdfModel:
    """A model given by a cumulative function: ``cdf(i, k)`` is 0 at k = 0, M at k = n_symbols and
    strictly increasing in k (every symbol has frequency >= 1)."""

    def __init__(self, cdf: Callable[[int, int], int], n_symbols: int):
        self.cdf, self.n_symbols = cdf, n_symbols

    def interval(self, i: int, s: int) -> tuple[int, int]:
        if not 0 <= s < self.n_symbols:
            raise ValueError(f"symbol {s} is outside the alphabet")
        lo = self.cdf(i, s)
        return lo, self.cdf(i, s + 1) - lo

    def find(self, i: int, slot: int) -> tuple[int, int, int]:
        lo, hi = 0, self.n_symbols  # cdf(i, lo) <= slot < cdf(i, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.cdf(i, mid) <= slot:
                lo = mid
            else:
                hi = mid
        start = self.cdf(i, lo)
        return lo, start, self.cdf(i, lo + 1) - start


def encode_intervals(starts, freqs) -> np.ndarray:
    """Code the symbols whose intervals are ``(starts[i], freqs[i])``; returns the uint32 words."""
    x = RANS_L
    words = []
    for i in range(len(starts) - 1, -1, -1):
        f, c = int(freqs[i]), int(starts[i])
        if not (1 <= f < M and 0 <= c and c + f <= M):
            raise ValueError(f"bad interval ({c}, {f}) at position {i}")
        if x >= _RENORM * f:
            words.append(x & 0xFFFFFFFF)
            x >>= 32
        x = (x // f << PRECISION) + x % f + c
    words += [x & 0xFFFFFFFF, x >> 32]
    return np.array(words[::-1], np.uint32)


def encode(symbols, model: SymbolModel) -> np.ndarray:
    """Code ``symbols`` with ``model``; returns the uint32 words of the stream."""
    intervals = [model.interval(i, int(s)) for i, s in enumerate(symbols)]
    return encode_intervals([c for c, _ in intervals], [f for _, f in intervals])


def decode(words, n: int, model: SymbolModel) -> list[int]:
    """Decode ``n`` symbols; CorruptStreamError if the stream is malformed."""
    words = [int(w) for w in np.asarray(words, np.uint32)]
    if len(words) < 2:
        raise CorruptStreamError("rANS64 stream is too short")
    x = words[0] << 32 | words[1]
    if x < RANS_L:
        raise CorruptStreamError("rANS64 initial state out of range")
    pos, out = 2, []
    for i in range(n):
        slot = x & (M - 1)
        s, start, f = model.find(i, slot)
        x = f * (x >> PRECISION) + slot - start
        if x < RANS_L:
            if pos >= len(words):
                raise CorruptStreamError("rANS64 stream ends early")
            x = x << 32 | words[pos]
            pos += 1
        out.append(s)
    if x != RANS_L or pos != len(words):
        raise CorruptStreamError("rANS64 stream does not end where its symbols do")
    return out
