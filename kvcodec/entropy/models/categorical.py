"""Categorical models: an explicit integer frequency row per symbol (or one shared row).

``Categorical(probs)`` turns an (n, A) float table into integer rows summing to
``2**precision`` with every symbol >= 1, deterministically on any machine: each row is
scaled by its max (exact IEEE division), truncated to 40-bit integers, and from there
the split is pure integer arithmetic (largest remainder, ties to the lower symbol).
"""

from __future__ import annotations

import numpy as np

from .base import CumulativeTables, Model

_WEIGHT_BITS = 40


def check_precision(precision_bits: int) -> int:
    p = int(precision_bits)
    if not 1 <= p <= 16:
        raise ValueError(f"precision_bits must be in [1, 16], got {precision_bits}")
    return p


def quantize_probs(probs, precision_bits: int = 16) -> np.ndarray:
    """(n, A) or (A,) nonnegative weights -> int64 frequencies, rows sum to 2**P, all >= 1."""
    p = check_precision(precision_bits)
    a = np.asarray(probs, dtype=np.float64)
    squeeze = a.ndim == 1
    a = np.atleast_2d(a)
    if a.ndim != 2 or a.shape[1] < 1:
        raise ValueError(f"probs must be (A,) or (n, A), got shape {np.shape(probs)}")
    n, alpha = a.shape
    if alpha > (1 << p):
        raise ValueError(f"alphabet {alpha} does not fit in 2**{p} with every frequency >= 1")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError("probs must be finite and >= 0")
    rowmax = a.max(axis=1, keepdims=True) if n else np.ones((0, 1))
    if np.any(rowmax <= 0):
        raise ValueError("every row of probs needs a positive entry")
    w = np.floor(a / rowmax * float(1 << _WEIGHT_BITS)).astype(np.int64)  # <= 2**40
    total = w.sum(axis=1, keepdims=True)  # exact integer sum, < 2**57 for A <= 2**16
    free = (1 << p) - alpha
    prod = w * free  # < 2**56
    freqs = 1 + prod // total
    rem = prod % total
    short = (1 << p) - freqs.sum(axis=1)  # in [0, A)
    order = np.argsort(-rem, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(alpha)[None, :].repeat(n, axis=0), axis=1)
    freqs += rank < short[:, None]
    return freqs[0] if squeeze else freqs


def check_freqs(freqs, precision_bits: int) -> np.ndarray:
    """Validate an integer frequency table (rows sum to 2**P, entries >= 0); returns int64."""
    p = check_precision(precision_bits)
    f = np.asarray(freqs)
    if f.ndim not in (1, 2) or f.shape[-1] < 1:
        raise ValueError(f"freqs must be (A,) or (n, A), got shape {f.shape}")
    if not np.issubdtype(f.dtype, np.integer):
        raise ValueError(f"freqs must be integers, got {f.dtype}")
    f = f.astype(np.int64)
    if np.any(f < 0) or np.any(f.sum(axis=-1) != (1 << p)):
        raise ValueError(f"every frequency row must be >= 0 and sum to 2**{p}")
    return f


def symbol_dtype(alphabet: int) -> np.dtype:
    if alphabet <= 256:
        return np.dtype(np.uint8)
    if alphabet <= 65536:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


class Categorical(Model):
    """Explicit distributions over symbols 0..A-1: one row per symbol, or one row shared by all."""

    def __init__(self, probs, precision_bits: int = 16):
        self._set(quantize_probs(probs, precision_bits), precision_bits)

    @classmethod
    def from_freqs(cls, freqs, precision_bits: int = 16) -> "Categorical":
        """Use stored integer frequencies as they are (zeros allowed: those symbols cannot be coded)."""
        self = cls.__new__(cls)
        self._set(check_freqs(freqs, precision_bits), precision_bits)
        return self

    def _set(self, freqs: np.ndarray, precision_bits: int) -> None:
        self.precision = check_precision(precision_bits)
        self.freqs = np.atleast_2d(freqs).astype(np.int32)
        self.size = None if freqs.ndim == 1 else self.freqs.shape[0]
        self.alphabet = self.freqs.shape[1]
        self.cum = np.zeros((self.freqs.shape[0], self.alphabet + 1), dtype=np.int32)
        np.cumsum(self.freqs, axis=1, out=self.cum[:, 1:])
        self.dtype = symbol_dtype(self.alphabet)

    def __repr__(self) -> str:
        return f"Categorical(size={self.size}, alphabet={self.alphabet}, precision={self.precision})"

    def fast_form(self) -> CumulativeTables:
        return CumulativeTables(self.freqs, self.cum, self.precision, self.alphabet, self.dtype)

    def _row(self, i: int) -> int:
        return i if self.freqs.shape[0] > 1 else 0

    def steps(self, i, x):
        x, r = int(x), self._row(i)
        if not 0 <= x < self.alphabet or self.freqs[r, x] == 0:
            raise ValueError(f"symbol {x} at position {i} has zero probability under the model")
        return [(int(self.cum[r, x]), int(self.freqs[r, x]), 1 << self.precision)]

    def decode_symbol(self, i, dec):
        r = self._row(i)
        v = dec.target(1 << self.precision)
        x = int(np.searchsorted(self.cum[r], v, side="right")) - 1
        dec.consume(int(self.cum[r, x]), int(self.freqs[r, x]), 1 << self.precision)
        return x

    def symbol_bits(self, symbols):
        sym = np.asarray(symbols).reshape(-1).astype(np.int64)
        self.check_count(sym.shape[0])
        if sym.size and (sym.min() < 0 or sym.max() >= self.alphabet):
            raise ValueError(f"symbols outside [0, {self.alphabet})")
        rows = np.arange(sym.shape[0]) if self.freqs.shape[0] > 1 else np.zeros(sym.shape[0], dtype=np.int64)
        f = self.freqs[rows, sym].astype(np.float64)
        with np.errstate(divide="ignore"):
            return self.precision - np.log2(f)
