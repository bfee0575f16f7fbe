"""What every probability model offers the range coders.

A model knows probabilities, a coder knows bits. For symbol i the model turns a value
into one or more coding steps ``(cum, freq, total)``: an interval ``[cum, cum+freq)`` out
of ``total`` (``2**precision`` for model steps; any count <= 2**16 for the uniform index
steps that follow an escape or a bucket). The pure-Python
reference coder drives these methods; the numba coder runs the same integer functions
inside its own loop (see ``kvcodec.entropy.range_coder_fast``): a model hands it its
distributions through ``fast_form`` in one of the forms that coder's kernels take
(``CumulativeTables`` or ``QuantizedFamily``), so a new model needs no edit of the coder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class CumulativeTables:
    """Explicit integer distributions: ``freqs`` [rows, A] and ``cum`` [rows, A+1] (int32), one row
    shared by every symbol or one per symbol, each out of ``2**precision``; decoded as ``dtype``."""

    freqs: np.ndarray
    cum: np.ndarray
    precision: int
    alphabet: int
    dtype: np.dtype


@dataclass(frozen=True, eq=False)
class QuantizedFamily:
    """Per-symbol float parameters of a quantized continuous family over the integers [lo, hi]:
    the coder quantizes them per symbol and evaluates the family's integer CDF with the very
    functions of ``models._qmath`` (``family``: GAUSSIAN or LAPLACE; ``weight_q``: Q16 weight of
    the uniform component). Arrays have one entry, or one per symbol."""

    mean_f: np.ndarray
    scale_bits: np.ndarray
    weight_q: np.ndarray
    lo: int
    hi: int
    family: int
    dtype: np.dtype


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
        """Coding steps ``(cum, freq, total)`` for value ``x`` at position ``i``; ValueError if x is outside the alphabet."""
        raise NotImplementedError

    def decode_symbol(self, i: int, dec) -> int:
        """Decode position ``i`` from a reference ``RangeDecoder`` (target/consume/raw calls)."""
        raise NotImplementedError

    def symbol_bits(self, symbols) -> np.ndarray:
        """Ideal code length in bits of each symbol under the model's own integer distribution."""
        raise NotImplementedError

    def fast_form(self) -> CumulativeTables | QuantizedFamily:
        """The model's distributions in a form the numba coder runs; NotImplementedError: none
        (then only the reference coder can code with it)."""
        raise NotImplementedError(f"{type(self).__name__} has no form the fast range coder takes")

    def ideal_bits(self, symbols) -> float:
        """Sum of -log2 q(x): what a perfect coder would spend on ``symbols``."""
        return float(np.sum(self.symbol_bits(symbols)))


UNIFORM_CHUNK = 1 << 16


def uniform_steps(value: int, count: int) -> list[tuple[int, int, int]]:
    """Code ``value`` in [0, count) uniformly: one step, or (high, low) when count > 2**16.

    Steps are ``(value, 1, total)``; the probabilities multiply to exactly one over [0, count).
    """
    if count <= 1:
        return []
    if count <= UNIFORM_CHUNK:
        return [(value, 1, count)]
    high = value >> 16
    n_high = (count + UNIFORM_CHUNK - 1) >> 16
    return [(high, 1, n_high), (value & 0xFFFF, 1, min(UNIFORM_CHUNK, count - (high << 16)))]


def decode_uniform(dec, count: int) -> int:
    """Inverse of ``uniform_steps`` on a reference decoder."""
    if count <= 1:
        return 0
    if count <= UNIFORM_CHUNK:
        v = dec.target(count)
        dec.consume(v, 1, count)
        return v
    n_high = (count + UNIFORM_CHUNK - 1) >> 16
    high = dec.target(n_high)
    dec.consume(high, 1, n_high)
    n_low = min(UNIFORM_CHUNK, count - (high << 16))
    low = dec.target(n_low)
    dec.consume(low, 1, n_low)
    return (high << 16) | low
