"""Float grids and the shape table: what the predictive model's CDF is built from.

A :class:`FloatGrid` lists every bit pattern of an 8- or 16-bit float dtype by value, with the
rounding bin of each (the symbols are ranks on this grid). The shape table is the stored,
piecewise-linear CDF ``G`` of the normalised residual ``z = (x - mu) / s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError

SHAPE_BINS = 256  # the shape CDF G is piecewise linear on [-ZMAX, ZMAX] in SHAPE_BINS steps
ZMAX = 16.0  # (bin width 1/8 of the scale)


@dataclass(frozen=True)
class FloatGrid:
    """Every bit pattern of an 8- or 16-bit float dtype, sorted by value.

    ``k_of_bits[bits]`` is the pattern's rank (NaN patterns last), ``bits_of_k`` the inverse,
    ``edges[k]`` the lower edge of rank k's rounding bin (midpoint with the previous value; -inf /
    +inf at the ends and around infinities, so those patterns get only the floor probability),
    ``valf[k]`` the value (0 where not finite) and ``finite[k]`` whether it is finite.
    """

    n: int
    bits_np: type
    bits_np_signed: type
    bits_torch: torch.dtype
    k_of_bits: np.ndarray
    bits_of_k: np.ndarray
    edges: np.ndarray
    valf: np.ndarray
    finite: np.ndarray
    rank_of_bf16: np.ndarray  # int32[65536]: rank of the bin holding each bf16 value (a decode guess)


@lru_cache(maxsize=None)
def grid_for(dtype: torch.dtype) -> FloatGrid | None:
    """The grid of an 8-/16-bit float dtype, or None for any other dtype."""
    if not dtype.is_floating_point or dtype.itemsize not in (1, 2):
        return None
    n = 1 << (8 * dtype.itemsize)
    bits_np, signed, bits_torch = (
        (np.uint8, np.uint8, torch.uint8) if n == 256 else (np.uint16, np.int16, torch.int16)
    )
    patterns = np.arange(n, dtype=bits_np)
    vals = torch.from_numpy(patterns.view(signed).copy()).view(dtype).to(torch.float64).numpy()
    nan = np.isnan(vals)
    unsigned = str(dtype) == "torch.float8_e8m0fnu"  # by name: older torch has no such attribute
    neg = 0 * patterns if unsigned else (patterns >> (8 * dtype.itemsize - 1)) & 1
    ok = np.flatnonzero(~nan)
    # by value, -0.0 before +0.0; NaN patterns after everything, in pattern order
    order = np.concatenate([ok[np.lexsort((1 - neg[ok], vals[ok]))], np.flatnonzero(nan)])
    val_k = vals[order]
    n_ok = ok.size
    edges = np.full(n + 1, np.inf)
    edges[0] = -np.inf
    lo, hi = val_k[: n_ok - 1], val_k[1:n_ok]
    mid = np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, np.where(np.isneginf(lo), -np.inf, np.inf))
    edges[1:n_ok] = mid
    finite = np.isfinite(val_k)
    k_of_bits = np.empty(n, np.int32)
    k_of_bits[order] = np.arange(n, dtype=np.int32)
    bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf16_vals = bf16.to(torch.float64).numpy()
    rank_of = np.clip(np.searchsorted(edges, bf16_vals, side="right") - 1, 0, n - 1)
    rank_of_bf16 = np.empty(65536, np.int32)
    rank_of_bf16[np.arange(-32768, 32768) & 0xFFFF] = np.where(np.isnan(bf16_vals), n - 1, rank_of)
    return FloatGrid(
        n=n, bits_np=bits_np, bits_np_signed=signed, bits_torch=bits_torch,
        k_of_bits=k_of_bits, bits_of_k=order.astype(bits_np), edges=edges,
        valf=np.where(finite, val_k, 0.0), finite=finite, rank_of_bf16=rank_of_bf16,
    )


def value_table(grid: FloatGrid) -> np.ndarray:
    """float32 value of every rank (non-finite as 0): what a decoded layer predicts the next with."""
    return grid.valf.astype(np.float32)


def masses_from_counts(counts: np.ndarray) -> np.ndarray:
    """Shape masses (uint16[SHAPE_BINS], summing to 2**16, each >= 1) from a z histogram."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum()
    free = (1 << 16) - SHAPE_BINS
    if total == 0:
        masses = np.full(SHAPE_BINS, 1 << 8, np.int64)
    else:
        masses = 1 + np.floor(counts * (free / total)).astype(np.int64)
        masses[np.argmax(masses)] += (1 << 16) - int(masses.sum())
    return masses.astype(np.uint16)


def shape_cdf(masses: np.ndarray) -> np.ndarray:
    """int64[SHAPE_BINS + 1] CDF in units of 2**-32 from stored masses (validated)."""
    masses = np.asarray(masses)
    if masses.shape != (SHAPE_BINS,) or int(masses.astype(np.int64).sum()) != 1 << 16:
        raise CorruptStreamError("predictive stream has a bad shape table")
    return np.concatenate([[0], np.cumsum(masses.astype(np.int64))]) << 16



def inverse_shape_index(cdf: np.ndarray) -> np.ndarray:
    """int64[4097]: for each top-12-bit value j of G, the shape bin holding j * 2**20."""
    return np.clip(np.searchsorted(cdf, np.arange(4097, dtype=np.int64) << 20, side="right") - 1,
                   0, SHAPE_BINS - 1).astype(np.int64)


