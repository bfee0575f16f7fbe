"""The dtype and shape a tensor blob declares, read one way by every lossless decoder.

Every lossless decoder reads a dtype name and a shape from metadata that anyone can forge (a
checksum is not a signature). The dtype comes from the container's allow-list (never
``getattr(torch, name)``); shapes, products and the output cap use the library-wide checks of
:mod:`kvcodec.validate`, so anything a writer never produces is a CorruptStreamError before any
allocation.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec import container, validate
from kvcodec.errors import CorruptStreamError


def dtype_from_name(name, what: str = "tensor blob") -> torch.dtype:
    """The torch dtype an allow-listed name stands for; CorruptStreamError for anything else."""
    return validate.lookup(name, container.torch_dtypes(), f"{what} dtype")


def checked_shape(shape, what: str = "tensor blob") -> tuple[int, ...]:
    """A stored shape (a JSON list) as a tuple of non-negative ints that can exist in memory."""
    if not isinstance(shape, list):
        raise CorruptStreamError(f"{what} has a bad shape")
    return validate.check_shape(shape, what, max_ndim=container.MAX_NDIM)


def int_list(v, lo: int, hi: int, what: str, max_len: int | None = None) -> np.ndarray:
    """A stored list of ints, each in ``[lo, hi]``, as int64 (checked before numpy sees a value, so
    a huge or non-int entry is a CorruptStreamError, never an OverflowError)."""
    bad = CorruptStreamError(f"{what} is not a list of ints in [{lo}, {hi}]")
    if not isinstance(v, list) or (max_len is not None and len(v) > max_len) or (v and not set(map(type, v)) <= {int}):
        raise bad
    try:
        a = np.array(v, np.int64)  # exact for ints (bools were refused above), OverflowError beyond int64
    except OverflowError:
        raise bad from None
    if a.size and (a.min() < lo or a.max() > hi):
        raise bad
    return a
