"""Containers (``kvcodec.container``'s format, byte for byte) written and read on a CUDA device.

Why: a GPU codec that must hand its blob to the host, or parse it there, is bound by PCIe and host
memory copies, not by its kernels. Here the payloads stay on the device: only the JSON header
crosses (a few KB), section checksums are computed by ``kvcodec.cuda.crc32`` and compared on the
device, so a decode costs one small synchronization at the end.

- :func:`assemble`: header (built by ``container.header_bytes``, the CPU writer's own code) +
  sections placed at their 64-byte aligned offsets, zero padding, as one uint8 CUDA tensor.
- :func:`read_header` / :func:`sections`: the checks of ``container.loads`` that need only the
  header (magic, version, header crc, strict JSON, descriptors, canonical offsets, no trailing
  bytes), with each section returned as a :class:`DeviceSection` view of the blob.
- :func:`integrity_errors`: the checks that need the payloads (section crc32s, zero padding, and
  any extra buffers with known crc32s), as a small device tensor of error flags: nothing is
  synchronized, the caller reads it once with its own status flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcodec import container
from kvcodec.cuda.transfer import upload
from kvcodec.errors import CorruptStreamError

_HEAD_GUESS = 1 << 16  # bytes fetched first: the prefix and, usually, the whole header


def _dtype_name(t: torch.Tensor) -> str:
    return {1: "uint8", 2: "uint16", 4: "uint32"}[t.element_size()]


def assemble(kind: str, meta: dict, sections: dict[str, torch.Tensor], crcs: list[int], device) -> torch.Tensor:
    """The container of ``sections`` (1-D contiguous CUDA tensors of 1- or 2-byte elements, stored
    as numpy uint8 / uint16 sections, in this order) with their ``crcs``, as a uint8 CUDA tensor;
    equal to ``container.dumps(kind, meta, {name: the same arrays in numpy})``."""
    entries = [{"name": name, "type": "numpy", "dtype": _dtype_name(t), "shape": [t.numel()],
                "nbytes": t.numel() * t.element_size(), "crc32": int(c)} for (name, t), c in zip(sections.items(), crcs)]
    head = container.header_bytes(kind, meta, entries)
    total = entries[-1]["offset"] + entries[-1]["nbytes"] if entries else len(head)
    out = torch.empty(total, dtype=torch.uint8, device=device)
    out[: len(head)].copy_(upload([np.frombuffer(head, np.uint8)], device)[0])
    pos = len(head)
    for e, t in zip(entries, sections.values()):
        out[pos: e["offset"]].zero_()
        if e["nbytes"]:
            out[e["offset"]: e["offset"] + e["nbytes"]].copy_(t.reshape(-1).view(torch.uint8))
        pos = e["offset"] + e["nbytes"]
    return out


@dataclass(frozen=True)
class DeviceSection:
    """A numpy-typed section of a device blob: what the codecs' checks read (``dtype``, ``shape``,
    ``size``), and where its bytes are (``offset`` into ``blob``)."""

    blob: torch.Tensor
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    crc32: int
    device_section = True

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def bytes(self) -> torch.Tensor:
        """The section's bytes: a uint8 view of the blob."""
        return self.blob[self.offset: self.offset + self.nbytes]


def _download(blob: torch.Tensor, n: int) -> bytes:
    return blob[:n].cpu().numpy().tobytes()


def read_header(blob: torch.Tensor) -> tuple[dict, int]:
    """Verify and parse the prefix and JSON header of a device blob (only they are copied to the
    host); returns (header, byte offset where the header ends). CorruptStreamError if bad."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise CorruptStreamError("a device blob must be a 1-D uint8 tensor")
    n = blob.numel()
    head = _download(blob, min(n, _HEAD_GUESS))
    if len(head) >= container.PREFIX.size:
        hlen = container.PREFIX.unpack_from(head, 0)[3]
        if len(head) < container.PREFIX.size + hlen <= min(n, container.PREFIX.size + container.MAX_HEADER_BYTES):
            head = _download(blob, container.PREFIX.size + hlen)
    header, mv = container.read_header(head)
    return header, container.PREFIX.size + container.PREFIX.unpack_from(mv, 0)[3]


def sections(blob: torch.Tensor, header: dict, header_end: int) -> tuple[dict[str, DeviceSection], list[tuple[int, int]]]:
    """Check the section descriptors against the blob (``container.loads``'s rules) and return the
    sections and the padding ranges [(start, end)] that must hold zeros."""
    n = blob.numel()
    pos = header_end
    out: dict[str, DeviceSection] = {}
    gaps = []
    for desc in header["sections"]:
        name, typ, dtype, shape, offset, nbytes, crc = container._check_section(desc, pos, n)
        if name in out:
            raise CorruptStreamError(f"duplicate section name {name!r}")
        if typ != "numpy" or dtype == "bool":
            raise CorruptStreamError(f"section {name!r}: the device reader takes numpy sections of numbers")
        if offset > pos:
            gaps.append((pos, offset))
        out[name] = DeviceSection(blob, offset, nbytes, np.dtype(dtype), tuple(shape), crc)
        pos = offset + nbytes
    if pos != n:
        raise CorruptStreamError(f"container has {n - pos} trailing bytes")
    return out, gaps


def integrity_errors(blob: torch.Tensor, secs: dict[str, DeviceSection], gaps, extra=()) -> torch.Tensor:
    """int32 device tensor [len(secs) + len(extra) + 1]: 1 where a section's (then an extra
    (tensor, crc32) pair's) crc32 differs, last entry 1 if a padding byte is not zero. Asynchronous."""
    from kvcodec.cuda.crc32 import crc32_many

    bufs = [s.bytes for s in secs.values()] + [t.reshape(-1).view(torch.uint8) for t, _ in extra]
    expected = [s.crc32 for s in secs.values()] + [int(c) for _, c in extra]
    idx = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in gaps] + [np.zeros(1, np.int64)])
    want, idx = upload([np.asarray(expected, np.int64), idx], blob.device)  # the last index only pads
    flags = [(crc32_many(bufs) != want).to(torch.int32)] if bufs else []
    flags.append((blob[idx[:-1]] != 0).any().to(torch.int32).reshape(1))
    return torch.cat(flags)
