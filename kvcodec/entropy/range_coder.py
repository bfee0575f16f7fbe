"""Range coder, pure-Python reference: the specification the numba coder must match byte for byte.

LZMA-style carry handling: ``low`` is 64-bit (32 bits plus a 33rd carry bit), ``range``
is 32-bit and is renormalised a byte at a time while below 2**24; bytes that might still
receive a carry wait as a cached byte plus a count of pending 0xFF bytes. A step codes an
interval ``[cum, cum + freq)`` out of ``total`` (<= 2**16; model steps use 2**precision):
``r = range // total; low += r*cum; range = r*freq``.

Payload format (raw, no header): LZMA's stream without its always-zero first byte, ended
by the value in the final interval with the most trailing zero bits, with trailing zero
bytes stripped (the decoder reads bytes past the end as zeros). A decoder that finds a
target outside ``[0, total)``, a symbol outside the model's support, or bytes left over
after the last symbol raises ``CorruptStreamError``.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptStreamError
from .models.base import Model
from .models.categorical import Categorical, check_precision, symbol_dtype

TOP = 1 << 24
MASK32 = (1 << 32) - 1
MAX_TOTAL = 1 << 16


class RangeEncoder:
    """Accumulates coding steps; ``finish()`` returns the payload."""

    def __init__(self):
        self.low, self.range = 0, MASK32
        self.cache, self.pending = 0, 0
        self.out = bytearray()
        self.first = True  # LZMA's first output byte is always zero: it is not written
        self.carries = 0  # statistics for tests: carries taken, longest 0xFF run held back
        self.max_pending = 0

    def encode(self, cum: int, freq: int, total: int) -> None:
        if not (0 <= cum and 0 < freq and cum + freq <= total <= MAX_TOTAL):
            raise ValueError(f"bad coding step cum={cum} freq={freq} total={total}")
        r = self.range // total
        self.low += r * cum
        self.range = r * freq
        while self.range < TOP:
            self.range <<= 8
            self._shift_low()

    def _shift_low(self) -> None:
        if self.low < 0xFF000000 or self.low > MASK32:
            carry = self.low >> 32
            self.carries += carry
            self.max_pending = max(self.max_pending, self.pending)
            if not self.first:
                self.out.append((self.cache + carry) & 0xFF)
            self.first = False
            self.out.extend(bytes([(0xFF + carry) & 0xFF]) * self.pending)
            self.pending = 0
            self.cache = (self.low >> 24) & 0xFF
        else:
            self.pending += 1
        self.low = (self.low & 0x00FFFFFF) << 8

    def finish(self) -> bytes:
        hi = self.low + self.range - 1
        for k in range(32, -1, -1):  # the value in [low, hi] with the most trailing zeros
            v = (self.low + (1 << k) - 1) >> k << k
            if v <= hi:
                self.low = v
                break
        for _ in range(5):
            self._shift_low()
        return bytes(self.out).rstrip(b"\x00")


class RangeDecoder:
    """Mirror of RangeEncoder: ``target(total)`` then ``consume(cum, freq, total)``."""

    def __init__(self, payload):
        self.buf = bytes(payload)
        self.pos = 0
        self.range = MASK32
        self.code = 0
        for _ in range(4):
            self.code = (self.code << 8) | self._byte()

    def _byte(self) -> int:
        b = self.buf[self.pos] if self.pos < len(self.buf) else 0
        self.pos += 1
        return b

    def corrupt(self, why: str):
        raise CorruptStreamError(f"range coder payload is corrupt: {why}")

    def target(self, total: int) -> int:
        v = self.code // (self.range // total)
        if v >= total:
            self.corrupt("target beyond the total frequency")
        return v

    def consume(self, cum: int, freq: int, total: int) -> None:
        r = self.range // total
        self.code -= r * cum
        self.range = r * freq
        while self.range < TOP:
            self.range <<= 8
            self.code = (self.code << 8) | self._byte()

    def finish(self) -> None:
        if self.pos < len(self.buf):
            self.corrupt(f"{len(self.buf) - self.pos} bytes left after the last symbol")


def encode(symbols, model: Model) -> bytes:
    """Code ``symbols`` (1-D integers), symbol i under the model's distribution i."""
    sym = np.asarray(symbols).reshape(-1)
    if sym.size and not np.issubdtype(sym.dtype, np.integer):
        raise ValueError(f"symbols must be integers, got {sym.dtype}")
    model.check_count(sym.shape[0])
    enc = RangeEncoder()
    for i, x in enumerate(sym.tolist()):
        for step in model.steps(i, x):
            enc.encode(*step)
    return enc.finish()


def decode(payload, model: Model, n: int) -> np.ndarray:
    """Decode ``n`` symbols; CorruptStreamError if the payload cannot come from ``encode``."""
    model.check_count(n)
    dec = RangeDecoder(payload)
    out = np.empty(n, dtype=model.dtype)
    for i in range(n):
        out[i] = model.decode_symbol(i, dec)
    dec.finish()
    return out


def static_model(freqs, precision_bits: int) -> Categorical:
    """The shared-row model behind encode_static/decode_static (uint32 freqs summing to 2**P)."""
    check_precision(precision_bits)
    f = np.asarray(freqs)
    if f.ndim != 1 or f.shape[0] < 1 or f.shape[0] > 65536:
        raise ValueError("freqs must be a 1-D table over an alphabet of 1..65536 symbols")
    return Categorical.from_freqs(f, precision_bits)


def encode_static(symbols, freqs, precision_bits: int) -> bytes:
    """Code all symbols with one shared frequency table (the front door's coder="arith")."""
    return encode(symbols, static_model(freqs, precision_bits))


def decode_static(payload, freqs, precision_bits: int, n: int) -> np.ndarray:
    """Inverse of encode_static; uint8 output for alphabets <= 256, else uint16."""
    model = static_model(freqs, precision_bits)
    out = decode(payload, model, n)
    return out.astype(symbol_dtype(model.alphabet), copy=False)
