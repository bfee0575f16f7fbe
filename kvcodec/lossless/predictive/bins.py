"""Bins: how the fast (format 2) predictive coder splits a float bit pattern into a symbol and raw bits.

Why: evaluating a continuous CDF at every symbol's rounding-bin edges (format 1) costs ~50 ns per
value. Format 2 instead cuts the real line into bins of a power-of-two width ``q = 2**ep`` aligned
at multiples of q, codes *which bin* a value lies in relative to the bin of its predicted location
``mu`` (one byte symbol, a table lookup with the 32-lane rANS of ``kvcodec.entropy.rans_lanes``)
and codes *where in the bin* with raw bits, which is exact because the patterns of one bin are an
aligned block of magnitude patterns of equal width (all in one binade), so a uniform density in
the bin is uniform over them.

Units: ``V``, the value in units of the format's smallest step (``value = V * 2**eoff``): a
magnitude pattern ``mag = ef << mb | mf`` has ``V = mf`` (ef = 0) or ``(2**mb + mf) << (ef - 1)``;
exact integers, the same structure for bf16, fp16 and every fp8 format.

Per value (``ep``, ``centre``, ``cls`` from :func:`locate`; the rest from :func:`encode_value`):

- ``ep = max(es, eu)``: ``es`` = the channel's scale level (bins about s/8 to s/16 wide), ``eu`` =
  the exponent of one grid step at ``mu`` (bins never finer than the grid where the value lies);
- bin index ``J = u`` (``x >= 0``) or ``-1 - u`` (sign bit set, so -0.0 has its own bin),
  ``u = floor(|V| / 2**ep)``; symbol ``J - centre + 127`` in 0..254, or ESC (255) when out of range,
  not finite, or too deep in bin 0: then the whole pattern follows in the raw bits;
- raw bits: bin ``u >= 1`` holds ``2**nb`` patterns (``nb = mb - floor(log2 u)``, or one pattern when
  the bin is finer than the grid): the low ``nb`` bits of mag. Bin ``u = 0`` spans every binade below
  ``2**ep``: uniform density in value halves the probability per binade down, so its depth ``d`` is
  coded in unary (``d`` zero bits then a one; the last level, which holds the subnormals, needs no
  terminator) followed by the mantissa;
- class ``cls``: which frequency table codes the symbol: the scale-to-bin ratio in quarter
  octaves, and for bins wider than s/8 (coarse grids: fp8, or small residuals) also where ``mu``
  lies inside its bin.

Every operation is integer arithmetic or an exact float64 operation (a product by a power of two,
a floor), so both sides compute the same ``ep``, ``centre`` and ``cls`` on any IEEE machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from numba import njit, types
from numba.extending import intrinsic

ESC = 255  # symbol: the bit pattern follows verbatim in the raw bits
CENTRE = 127  # symbol of the value's own predicted bin
DEPTH_MAX = 20  # bin 0: binade depths from here on are escaped (keeps every raw code <= 32 bits)
N_FINE = 4  # classes for bins of s/8 .. s/16 (one per quarter octave of s)
LVL_LO = -4  # coarser bins: quarter-octave levels 11 down to LVL_LO (s/q from 2**2.75 to 2**-1)
N_FRAC = 4  # ... each split by where mu lies in its bin
N_CLASSES = N_FINE + (12 - LVL_LO) * N_FRAC
EP_MAX = 600  # bin exponents are clamped here (V of a 16-bit float is below 2**270)
MU_MAX = 2.0 ** 400  # |location| in V units beyond this is taken as 0 (keeps bins < 2**(mb + 1))
_LOG2_TABLE = 4096  # floor(log2 u) by table for bin indices u below this (larger u never occur)

# (exponent bits, mantissa bits, has a sign bit) of every 8-/16-bit float dtype this torch has
_LAYOUTS = {getattr(torch, name): layout for name, layout in {
    "bfloat16": (8, 7, True), "float16": (5, 10, True), "float8_e4m3fn": (4, 3, True),
    "float8_e5m2": (5, 2, True), "float8_e4m3fnuz": (4, 3, True), "float8_e5m2fnuz": (5, 2, True),
    "float8_e8m0fnu": (8, 0, False),
}.items() if hasattr(torch, name)}


@dataclass(frozen=True)
class BinGrid:
    """The bit layout of an 8- or 16-bit float dtype as the binned coder sees it.

    ``escape[pattern]`` is 1 for patterns always sent verbatim (NaN, Inf); ``unit[ef]`` is the value
    of one mantissa step in exponent field ``ef`` (``2**(eoff + max(ef, 1) - 1)``), so a pattern's
    value is ``(mant) * unit[ef]``; ``maxmag`` is the largest finite magnitude pattern.
    """

    width: int
    sign: int
    mb: int
    eoff: int
    maxmag: int
    escape: np.ndarray
    unit: np.ndarray


@lru_cache(maxsize=None)
def bin_grid(dtype: torch.dtype) -> BinGrid | None:
    """The layout of an 8-/16-bit float dtype, or None for any other dtype."""
    if dtype not in _LAYOUTS:
        return None
    eb, mb, signed = _LAYOUTS[dtype]
    width = 8 * dtype.itemsize
    n = 1 << width
    pats = np.arange(n, dtype=np.int64)
    signed_np = np.int8 if width == 8 else np.int16
    vals = torch.from_numpy(pats.astype(signed_np)).view(dtype).to(torch.float64).numpy()
    finite = np.isfinite(vals)
    sign = (1 << (width - 1)) if signed else 0
    mags = pats & (n - 1 - sign)
    eoff = int(np.frexp(vals[1])[1]) - 1  # pattern 1 is V = 1
    unit = np.array([2.0 ** (eoff + max(ef, 1) - 1) for ef in range(1 << eb)])
    maxmag = int(mags[finite & ((pats & sign) == 0)].max())
    return BinGrid(width=width, sign=sign, mb=mb, eoff=eoff, maxmag=maxmag,
                   escape=(~finite).astype(np.uint8), unit=unit)


LOG2_FLOOR = np.zeros(_LOG2_TABLE, np.int64)
for _k in range(1, 13):
    LOG2_FLOOR[1 << _k:] += 1


def scale_levels(s_v: np.ndarray) -> np.ndarray:
    """floor(4 * log2(s_v)) exactly (s_v > 0, finite), from frexp and exact threshold compares
    (no log: a libm log may differ across machines in the last bit)."""
    mant, ex = np.frexp(np.asarray(s_v, np.float64))
    m2 = 2.0 * mant  # in [1, 2)
    quarter = (m2 >= 1.189207115002721).astype(np.int64) + (m2 >= 1.4142135623730951) + (m2 >= 1.6817928305074290)
    return 4 * (ex.astype(np.int64) - 1) + quarter


def bin_exponent(level: np.ndarray) -> np.ndarray:
    """es of a scale level: bins 2**es wide, s/16 < 2**es <= s/8 (at least one step: es >= 0)."""
    return np.clip(np.floor_divide(level, 4) - 3, 0, EP_MAX)


@intrinsic
def float64_bits(typingctx, x):
    """The IEEE bits of a float64 as an int64 (a register bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.int64))
    return types.int64(types.float64), codegen


@intrinsic
def bits_float64(typingctx, x):
    """The float64 whose IEEE bits are the int64 ``x`` (a register bit cast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))
    return types.float64(types.int64), codegen


@njit(inline="always", cache=True)
def pow2(k):
    """2.0 ** k, exact, for -1022 <= k <= 1023 (built from the exponent bits: no table, no libm)."""
    return bits_float64((np.int64(1023) + k) << 52)


@njit(inline="always", cache=True)
def locate(mu_v, es, level, mb, mag):
    """(ep, centre, cls) of a value predicted at ``mu_v`` (V units, finite, below MU_MAX) in a
    channel with bin exponent ``es`` and scale level ``level``: ``centre`` = the bin coordinate
    (see :func:`bin_of`) holding ``mu_v``. Branch-free and table-free (data-dependent branches here
    cost more than everything else, and this form vectorises over channels): the exponent comes
    from the float64 bits, a negative ``mu_v`` (or -0.0) flips the bin. ``mag`` (a stream's "mag"
    flag, 0 or 1): where ``mu`` lies in its bin is measured towards larger magnitudes, not values
    (as :func:`magnitude_symbol` counts the symbols)."""
    bits = float64_bits(mu_v)
    ex = ((bits >> 52) & 0x7FF) - 1023  # floor(log2 |mu_v|) (negative below 1: no step there)
    ep = min(es, EP_MAX)
    av = abs(mu_v)
    eu = max(ex - mb, 0)  # exponent of one grid step at mu (< 400 - mb: |mu_v| < MU_MAX)
    # below 2**(ep + mb) the coordinate is V / 2**ep; above, one unit per grid step
    y = av * pow2(-ep)
    if eu > ep:
        y = (eu - ep) * (1 << mb) + av * pow2(-eu)
    u = np.int64(y)
    neg = bits >> 63  # -1 or 0
    centre = u ^ neg  # u, or -1 - u
    f = y - u
    if neg & (mag - 1):  # (neg and not mag) without a branch on mag
        f = f + (1.0 - 2.0 * f)  # where mu lies in its bin, in the direction of increasing value
    lvl = level - 4 * max(ep, eu)  # scale / local bin width, in quarter octaves
    fine = min(lvl, 15) - 12
    coarse = N_FINE + (11 - max(lvl, LVL_LO)) * N_FRAC + min(np.int64(f * N_FRAC), N_FRAC - 1)
    return ep, centre, (fine if lvl >= 12 else coarse)


@njit(inline="always", cache=True)
def magnitude_symbol(sym, centre, mag):
    """The symbol as coded: with ``mag`` set and mu's bin negative (``centre < 0``), counted in the
    direction of increasing magnitude (``254 - sym``; ESC stays ESC), else ``sym``. Its own inverse.

    Why: fp8 bins narrow towards zero, so the symbols' distribution is skewed towards larger
    magnitudes; counted by value, a negative mu's mirrors a positive one's and one class table
    mixes both shapes (benchmarks/fp8_symbol_direction.py: fp8 KV with a prediction 2.13 -> 1.75
    bits a key)."""
    return 254 - sym if (mag != 0) & (centre < 0) & (sym != ESC) else sym


@njit(inline="always", cache=True)
def bin_of(mag, ep, mb):
    """The bin coordinate of a magnitude pattern: ``V >> ep`` where grid steps are finer than a
    bin (exponent field <= ep: below 2**mb), else one unit per pattern (``mag - ep * 2**mb``,
    continuing the count), so no bin is ever empty."""
    ef = mag >> mb
    if ef > ep:
        return mag - (np.int64(ep) << mb)
    if ef == 0:
        return mag >> ep if ep < 62 else 0
    sh = ep + 1 - ef
    return ((np.int64(1) << mb) | (mag & ((1 << mb) - 1))) >> sh if sh < 62 else 0


@njit(inline="always", cache=True)
def encode_value(pat, ep, centre, width, sign, mb, escaped):
    """(symbol, raw code, raw bit count) of bit pattern ``pat`` in the bins of (ep, centre);
    ``escaped``: the grid's ``escape[pat]`` (NaN, Inf: always verbatim)."""
    if escaped:
        return ESC, np.int64(pat), width
    mag = pat & ~sign & ((1 << width) - 1)
    u = bin_of(mag, ep, mb)
    j = u ^ -np.int64((pat & sign) != 0)  # u, or -1 - u (branch-free: the sign is a coin flip)
    r = j - centre
    if r < -CENTRE or r > CENTRE:
        return ESC, np.int64(pat), width
    sym = r + CENTRE
    if u >= (1 << mb):  # one pattern per bin
        return sym, np.int64(0), 0
    if u == 0:
        if ep <= mb + 1:
            return sym, np.int64(mag), ep
        last = ep - mb - 1  # the level holding both exponent fields 0 and 1
        ef = mag >> mb
        d = last if ef <= 1 else ep - mb - ef
        if d >= DEPTH_MAX:
            return ESC, np.int64(pat), width
        if d == last:
            return sym, np.int64(mag) << d, d + mb + 1
        return sym, ((np.int64(mag) & ((1 << mb) - 1)) << (d + 1)) | (np.int64(1) << d), d + 1 + mb
    big_e = LOG2_FLOOR[u] + ep  # 1 <= u < 2**mb: a bin of 2**nb patterns in one binade
    nb = ep - (big_e - mb if big_e > mb else 0)
    return sym, np.int64(mag) & ((np.int64(1) << nb) - 1), nb


@njit(inline="always", cache=True)
def value_of(pat, sign, mb, eoff):
    """The value (float64) of a finite bit pattern: ``mant * 2**(eoff + max(ef, 1) - 1)``, the scale
    built from exponent bits (no table: vectorises)."""
    mag = pat & ~sign & 0xFFFF
    ef = mag >> mb
    v = ((mag & ((np.int64(1) << mb) - 1)) | (np.int64(ef > 0) << mb)) * pow2(eoff + max(ef, 1) - 1)
    return 0.0 - v if pat & sign else v
