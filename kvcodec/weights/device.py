"""A weight blob held in CUDA memory and decoded there by the ``planes`` GPU decoder.

Why: the blob never leaves the device; a decode is one rANS kernel launch over every 64 KiB chunk (one
warp each) plus the plane merge (``kvcodec.lossless.planes_device``), queued without a host sync so
it can run on a side stream while the previous layer computes. The full checks (container, section
crc32s, streams, the tensor's crc32) run once, when the weight is made; a decode afterwards trusts
the checked bytes (its rANS status stays on the device: :meth:`DeviceWeight.check` reads it).
"""

from __future__ import annotations

import math

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import api, device_container, planes_device
from kvcodec.lossless import tensor_meta
from kvcodec.lossless.tensor_meta import dtype_from_name


class DeviceWeight:
    """A planes blob (1-D uint8 CUDA tensor) that decodes to a new CUDA tensor on the current stream."""

    def __init__(self, blob: torch.Tensor, verify: bool = True):
        if not (isinstance(blob, torch.Tensor) and blob.is_cuda and blob.dtype == torch.uint8 and blob.dim() == 1):
            raise ValueError("a device weight blob is a 1-D uint8 CUDA tensor")
        self.blob = blob.contiguous()
        if verify:
            api.decompress(self.blob, max_output_bytes=None)  # every check, on the device
        header, end = device_container.read_header(self.blob)
        meta = tensor_meta.checked_meta(header["meta"])
        if meta["codec"] != "planes" or meta["uses_prediction"] or not planes_device.gpu_decodable(meta["codec_meta"]):
            raise CorruptStreamError("a device weight blob must be a planes blob the GPU decodes")
        self.dtype = dtype_from_name(meta["dtype"])
        self.shape = tuple(meta["shape"])
        self.numel = math.prod(self.shape)
        self._meta = meta["codec_meta"]
        self._secs, _ = device_container.sections(self.blob, header, end)
        self._reuse: dict = {}
        self.last_status: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.blob.numel()

    @property
    def nbytes_decoded(self) -> int:
        return self.numel * self.dtype.itemsize

    def decode(self) -> torch.Tensor:
        """The weight, decoded on the current stream (no host sync)."""
        res = planes_device.decode(self._meta, self._secs, self.blob.device, self._reuse)
        if res is None:  # checked at construction: cannot happen for a blob that passed
            raise CorruptStreamError("weight blob is not GPU decodable")
        out, self.last_status = res
        return out

    def check(self) -> None:
        """Raise CorruptStreamError if the last decode flagged a stream (synchronizes)."""
        if self.last_status is not None and bool((self.last_status != 0).any()):
            raise CorruptStreamError("weight blob: a rANS chunk stream is corrupt")
