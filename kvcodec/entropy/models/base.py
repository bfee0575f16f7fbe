"""What every probability model offers the range coders.

A model knows probabilities, a coder knows bits. For symbol i the model turns a value
into one or more coding steps ``(cum, freq, bits)``: an interval ``[cum, cum+freq)`` out
of a total of ``2**bits`` (raw bits are steps with ``freq = 1``). The pure-Python
reference coder drives these methods; the numba coder runs the same integer functions
inside its own loop (see ``kvcodec.entropy.range_coder_fast``).
"""

from __future__ import annotations

import numpy as np


class Model:
    """Base class: per-symbol integer distributions over a bounded alphabet."""

    #: number of symbols the per-symbol parameters describe (None: any count, all scalar)
    size: int | None = None
    #: dtype of decoded symbols
    dtype: np.dtype = np.dtype(np.int64)

    def check_count(self, n: int) -> None:
        """Raise ValueError unless the model can describe ``n`` symbols."""
        if n < 0:
            raise ValueError(f"symbol count must be >= 0, got {n}")
        if self.size is not None and self.size != n:
            raise ValueError(f"model describes {self.size} symbols, asked for {n}")

    def steps(self, i: int, x: int) -> list[tuple[int, int, int]]:
        """Coding steps for value ``x`` at position ``i``; ValueError if x is outside the alphabet."""
        raise NotImplementedError

    def decode_symbol(self, i: int, dec) -> int:
        """Decode position ``i`` from a reference ``RangeDecoder`` (target/consume/raw calls)."""
        raise NotImplementedError

    def symbol_bits(self, symbols) -> np.ndarray:
        """Ideal code length in bits of each symbol under the model's own integer distribution."""
        raise NotImplementedError

    def ideal_bits(self, symbols) -> float:
        """Sum of -log2 q(x): what a perfect coder would spend on ``symbols``."""
        return float(np.sum(self.symbol_bits(symbols)))


def raw_steps(value: int, nbits: int) -> list[tuple[int, int, int]]:
    """Split an ``nbits`` raw value into uniform steps of at most 16 bits, high chunk first."""
    out = []
    while nbits > 16:
        nbits -= 16
        out.append(((value >> nbits) & 0xFFFF, 1, 16))
    if nbits > 0:
        out.append((value & ((1 << nbits) - 1), 1, nbits))
    return out


def decode_raw(dec, nbits: int) -> int:
    """Inverse of ``raw_steps`` on a reference decoder."""
    value = 0
    while nbits > 0:
        take = 16 if nbits > 16 else nbits
        nbits -= take
        v = dec.target(take)
        dec.consume(v, 1, take)
        value = (value << take) | v
    return value
