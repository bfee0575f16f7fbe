"""Seeded random rotations for TurboQuant, as explicit float32 [D, D] matrices (y = x @ R.T).

Kinds:
- ``"qr"``: Haar-uniform random orthogonal matrix (QR of a Gaussian, signs of R's diagonal
  folded into Q so the law is exactly Haar). Any dimension. The rotated coordinates follow the
  exact law the Lloyd-Max codebook is built for, whatever the input.
- ``"hadamard"``: one randomized Hadamard, R = H diag(s) / sqrt(D) (power-of-two D only).
  A one-hot input comes out perfectly flat (every |y_i| = 1/sqrt(D)), which a Lloyd-Max
  codebook quantizes about 2x worse than a random vector at 2 bits (measured in the tests).
- ``"hadamard2"`` (default for power-of-two D): two rounds, R = H diag(s2) H diag(s1) / D.
  The second round turns the flat vector into a sum of D random signs, so sparse, flat,
  constant and Hadamard-row inputs all behave like random ones.
For non-power-of-two D (80, 96, ...) the default is ``"qr"``: a block Hadamard would need a
dense random mix anyway, and kvcodec applies the rotation as a D x D matmul (the kernels rotate
the query once per step), so the fast transform would buy nothing.
Randomness comes from numpy's PCG64 seeded with (seed, purpose, D): identical on every platform.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

ROTATION_KINDS = ("auto", "qr", "hadamard", "hadamard2")
_PURPOSE_ROTATION = 0x524F54  # "ROT"


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def rng_for(seed: int, purpose: int, dim: int) -> np.random.Generator:
    """A deterministic generator for one (seed, purpose, dim)."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return np.random.Generator(np.random.PCG64([int(seed), purpose, int(dim)]))


def sylvester_hadamard(dim: int) -> np.ndarray:
    """The unnormalized Sylvester Hadamard matrix H_D (entries +-1), D a power of two."""
    if not is_power_of_two(dim):
        raise ValueError(f"Hadamard needs a power-of-two dimension, got {dim}")
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return h


def haar_orthogonal(dim: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-distributed orthogonal matrix (float64)."""
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    return q * np.sign(np.diag(r))[None, :]


def resolve_kind(kind: str, dim: int) -> str:
    if kind not in ROTATION_KINDS:
        raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {kind!r}")
    if kind == "auto":
        return "hadamard2" if is_power_of_two(dim) else "qr"
    if kind.startswith("hadamard") and not is_power_of_two(dim):
        raise ValueError(f"rotation {kind!r} needs a power-of-two dim, got {dim}; use 'qr' or 'auto'")
    return kind


def hadamard_signs(dim: int, seed: int, kind: str) -> tuple[np.ndarray, ...]:
    """The sign vectors of a Hadamard rotation: (s1,) for "hadamard", (s1, s2) for "hadamard2"
    (float64 +-1). R = H diag(s1) / sqrt(D), or H diag(s2) H diag(s1) / D; a fast Walsh-Hadamard
    transform applies the same R without the matrix (``kvcodec.quant.turboquant_rows``)."""
    if kind not in ("hadamard", "hadamard2") or not is_power_of_two(dim):
        raise ValueError(f"no Hadamard signs for rotation {kind!r} at dim {dim}")
    rng = rng_for(seed, _PURPOSE_ROTATION, dim)
    s1 = rng.choice([-1.0, 1.0], size=dim)
    return (s1,) if kind == "hadamard" else (s1, rng.choice([-1.0, 1.0], size=dim))


@lru_cache(maxsize=256)
def _rotation_np(dim: int, seed: int, kind: str) -> np.ndarray:
    if kind == "qr":
        return haar_orthogonal(dim, rng_for(seed, _PURPOSE_ROTATION, dim))
    h = sylvester_hadamard(dim)
    signs = hadamard_signs(dim, seed, kind)
    if kind == "hadamard":
        return h * signs[0][None, :] / np.sqrt(dim)
    return (h * signs[1][None, :]) @ (h * signs[0][None, :]) / dim


def rotation_matrix(dim: int, seed: int = 0, kind: str = "auto") -> torch.Tensor:
    """The float32 [dim, dim] orthogonal matrix R of this (dim, seed, kind); rotate with x @ R.T."""
    if not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    kind = resolve_kind(kind, int(dim))
    return torch.from_numpy(_rotation_np(int(dim), int(seed), kind).astype(np.float32))
