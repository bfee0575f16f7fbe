"""The one parser for the dtype and shape a tensor blob declares, and the output cap.

Every lossless decoder reads a dtype name and a shape from metadata that anyone can forge (a
checksum is not a signature). They are checked here, before anything is allocated: the dtype
against the container's allow-list (never ``getattr(torch, name)``), the shape for type, rank and
sign, and the byte count (an exact Python integer, so no product overflows) against
``max_output_bytes``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcodec import container
from kvcodec.errors import CorruptStreamError

#: Default cap on the bytes one decode may produce (4 GiB). A constant tensor legitimately
#: compresses to a few hundred bytes whatever its size, so untrusted input needs a cap; callers
#: that expect bigger tensors pass ``max_output_bytes`` explicitly (``None`` = no cap).
DEFAULT_MAX_OUTPUT_BYTES = 4 << 30


def dtype_from_name(name, what: str = "tensor blob") -> torch.dtype:
    """The torch dtype an allow-listed name stands for; CorruptStreamError for anything else."""
    dtypes = container.torch_dtypes()
    if not isinstance(name, str) or name not in dtypes:
        raise CorruptStreamError(f"{what} names an unknown dtype {name!r}"[:200])
    return dtypes[name]


def checked_shape(shape, what: str = "tensor blob") -> tuple[int, ...]:
    """A stored shape as a tuple of non-negative ints (at most ``container.MAX_NDIM`` axes)."""
    if not isinstance(shape, list) or len(shape) > container.MAX_NDIM or any(
        type(d) is not int or d < 0 for d in shape
    ):
        raise CorruptStreamError(f"{what} has a bad shape")
    return tuple(shape)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype (exact: Python integers do not overflow)."""
    return math.prod(shape) * dtype.itemsize


def check_output_cap(n_bytes: int, max_output_bytes: int | None, what: str = "blob") -> None:
    """CorruptStreamError if a declared output of ``n_bytes`` is over the cap (``None``: no cap)."""
    if max_output_bytes is None:
        return
    if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes < 0:
        raise ValueError(f"max_output_bytes must be a non-negative int or None, got {max_output_bytes!r}")
    if n_bytes > max_output_bytes:
        raise CorruptStreamError(
            f"{what} declares {n_bytes} output bytes, over max_output_bytes={max_output_bytes}"
        )


def int_list(v, lo: int, hi: int, what: str, max_len: int | None = None) -> np.ndarray:
    """A stored list of ints, each in ``[lo, hi]``, as int64 (checked before numpy sees a value, so
    a huge or non-int entry is a CorruptStreamError, never an OverflowError)."""
    if (not isinstance(v, list) or (max_len is not None and len(v) > max_len)
            or any(type(x) is not int or not lo <= x <= hi for x in v)):
        raise CorruptStreamError(f"{what} is not a list of ints in [{lo}, {hi}]")
    return np.array(v, np.int64)
