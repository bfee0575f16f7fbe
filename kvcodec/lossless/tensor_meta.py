"""A tensor blob's metadata, written and read one way by every lossless encoder and decoder.

A blob of ``kvcodec.compress`` is a container of kind :data:`KIND` whose meta records the codec name,
the dtype, shape and original device, the crc32 of the tensor's bytes, whether a prediction was used,
and the codec's own metadata (:func:`blob_meta`: the CPU and both GPU encoders build it here).

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

KIND = "kvcodec.tensor"
META_KEYS = frozenset({"codec", "dtype", "shape", "device", "crc32", "uses_prediction", "codec_meta"})


def blob_meta(codec: str, dtype: torch.dtype, shape, device, crc32: int, uses_prediction: bool,
              codec_meta: dict) -> dict:
    """The meta of a tensor blob (plain JSON): what :func:`checked_meta` reads back."""
    return {"codec": codec, "dtype": container.torch_dtype_name(dtype), "shape": list(shape), "device": str(device),
            "crc32": int(crc32), "uses_prediction": bool(uses_prediction), "codec_meta": codec_meta}


def checked_meta(meta) -> dict:
    """A tensor blob's meta with every field checked (types, dtype allow-list, shape, the codec's own
    dtype and shape equal to the outer ones); CorruptStreamError otherwise."""
    if not isinstance(meta, dict) or set(meta) != META_KEYS:
        raise CorruptStreamError("tensor blob meta has the wrong keys")
    dtype_from_name(meta["dtype"])
    checked_shape(meta["shape"])
    if type(meta["crc32"]) is not int or not isinstance(meta["device"], str):
        raise CorruptStreamError("tensor blob has a bad crc32 or device")
    if not isinstance(meta["uses_prediction"], bool) or not isinstance(meta["codec_meta"], dict):
        raise CorruptStreamError("tensor blob has bad codec fields")
    if not isinstance(meta["codec"], str):
        raise CorruptStreamError("tensor blob has a bad codec name")
    # The codec's own dtype/shape drive its allocations: they must be the ones checked above.
    inner = meta["codec_meta"]
    for key in ("dtype", "shape"):
        if key in inner and inner[key] != meta[key]:
            raise CorruptStreamError(f"tensor blob's codec meta declares another {key}")
    return meta


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
