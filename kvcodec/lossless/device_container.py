"""Containers (``kvcodec.container``'s format, byte for byte) written and read on a CUDA device.

Why: a GPU codec that must hand its blob to the host, or parse it there, is bound by PCIe and host
memory copies, not by its kernels. Here the payloads stay on the device: only the JSON header
crosses (a few KB), section checksums are computed by ``kvcodec.device.crc32`` and compared on the
device, so a decode costs one small synchronization at the end.

- :func:`assemble`: header (built by ``container.header_bytes``, the CPU writer's own code) +
  sections placed at their 64-byte aligned offsets, zero padding, as one uint8 CUDA tensor.
- :func:`read_header` / :func:`sections`: the checks of ``container.loads`` that need only the
  header (magic, version, header crc, strict JSON, descriptors, canonical offsets, no trailing
  bytes), with each section returned as a :class:`DeviceSection` view of the blob.
- :class:`Checks`: the checks that need the payloads (section crc32s and zero padding launched
  as soon as the sections are known, the decoded buffers' crc32s at the end), flagged on the
  device by ``kvcodec.device.crc32.check_many`` and read with the decoder's stream statuses in one
  synchronization.
- :class:`BlobCache`: the parsed header and the codec's plan of a blob tensor decoded before, reused
  by its next decode (a reused prefix's KV blocks) while the device checks still run every time.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec import checksum, container
from kvcodec.device.transfer import download, upload
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


def _download(blob: torch.Tensor, end: int, start: int = 0) -> np.ndarray:
    return download(blob[start:end])


def read_header(blob: torch.Tensor) -> tuple[dict, int]:
    """Verify and parse the prefix and JSON header of a device blob (only they are copied to the
    host); returns (header, byte offset where the header ends). CorruptStreamError if bad."""
    header, end, _, _ = read_front(blob, _HEAD_GUESS)
    return header, end


_FRONT_MAX = 8 << 20  # bytes: a bigger model section is read on its own (the front is kept with a cached plan)


def read_front(blob: torch.Tensor, window: int = _HEAD_GUESS) -> tuple[dict, int, int, np.ndarray]:
    """:func:`read_header`, from one read-back of the blob's first ``window`` bytes (a decoder passes
    ``BlobCache.front_window``; more when the header is longer): (header, header end, zlib crc32 of the bytes up
    to the header's end, the bytes read, uint8 in pinned memory). A decoder takes what else it needs from
    the front bytes (a kvctx blob's model section) without a second read-back and sync."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise CorruptStreamError("a device blob must be a 1-D uint8 tensor")
    n = blob.numel()
    head = _download(blob, min(n, window))
    if len(head) >= container.PREFIX.size:
        hlen = container.PREFIX.unpack_from(head, 0)[3]
        if len(head) < container.PREFIX.size + hlen <= min(n, container.PREFIX.size + container.MAX_HEADER_BYTES):
            head = np.concatenate([head, _download(blob, container.PREFIX.size + hlen, len(head))])  # the rest
    header, mv = container.read_header(head)
    end = container.PREFIX.size + container.PREFIX.unpack_from(mv, 0)[3]
    return header, end, checksum.crc32(head[:end]), head


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


def unbound(secs: dict[str, DeviceSection], gaps) -> tuple:
    """:func:`sections`' result without the blob (what a :class:`BlobCache` entry may keep): :func:`bound`
    gives it back for the same blob tensor without checking the descriptors again."""
    return tuple((name, s.offset, s.nbytes, s.dtype, s.shape, s.crc32) for name, s in secs.items()), tuple(gaps)


def bound(kept: tuple, blob: torch.Tensor) -> tuple[dict[str, DeviceSection], list[tuple[int, int]]]:
    """The inverse of :func:`unbound` on ``blob``."""
    secs, gaps = kept
    return {name: DeviceSection(blob, *rest) for name, *rest in secs}, list(gaps)


@dataclass
class Failed:
    """Which checks of a device decode failed (:meth:`Checks.read`), by name: ``sections`` the names of
    sections whose crc32 differs; ``extra`` / ``early`` one flag per pair given (in order); ``padding``
    nonzero bytes between sections; ``stream`` a decode kernel's nonzero status; ``header_changed`` the
    header is not the one a cached plan was built from."""

    sections: list[str]
    extra: list[bool]
    early: list[bool]
    padding: bool
    stream: bool
    header_changed: bool


class Checks:
    """The checks of a device blob that need its payloads, launched in two parts: the section crc32s
    and the zero padding when made, on a side stream (``side_stream``: beside torch's stream, where the
    SMs have room, instead of in series on it; the blob is marked as in use there), and
    the decoded buffers' crc32s in :meth:`read`, on torch's stream after it has waited for the side
    stream's checks; :meth:`read` then synchronizes once. ``header``: (end, crc32) of header bytes read
    earlier (a :class:`BlobCache` entry's), checked to be the blob's still. ``early``: (tensor, crc32)
    pairs that are ready already (a decode's prediction), checked on the side stream with the sections.
    ``after``: a CUDA event on torch's stream recorded once the blob and ``early`` are written (a decode
    records it just before its kernel's launch): the side stream waits for it, not for all of torch's
    stream, so the checks run beside a kernel queued after it rather than after that kernel.

    Flag slots on the device: ``[sections (n) | padding | header (with one) | early (e)]``."""

    def __init__(self, blob: torch.Tensor, secs: dict[str, DeviceSection], gaps, header: tuple[int, int] | None = None,
                 early=(), after=None):
        from kvcodec.device.crc32 import check_many

        early = list(early)
        n = len(secs)
        self._names = list(secs)
        self.sections = slice(0, n)
        self.padding = n
        self.header = n + 1 if header is not None else None
        self.early = slice(n + 1 + (header is not None), n + 1 + (header is not None) + len(early))
        slots = self.early.stop
        bufs = [s.bytes for s in secs.values()] + [blob[a:b] for a, b in gaps]
        expected = [s.crc32 for s in secs.values()] + [None] * len(gaps)  # None: the bytes must be zeros
        where = list(range(n)) + [self.padding] * len(gaps)
        if header is not None:
            bufs, expected, where = bufs + [blob[:header[0]]], expected + [header[1]], where + [self.header]
        bufs += [t.reshape(-1).view(torch.uint8) for t, _ in early]
        expected += [int(c) for _, c in early]
        where += range(self.early.start, slots)
        self._done = None
        if not bufs:
            self.flags = torch.zeros(slots, dtype=torch.int32, device=blob.device)
        elif blob.is_cuda:
            side = side_stream(blob.device)
            if after is not None:
                side.wait_event(after)
            else:
                side.wait_stream(torch.cuda.current_stream(blob.device))  # the blob's bytes are written
            with torch.cuda.stream(side):
                self.flags = check_many(bufs, expected, where, slots)
                self._done = side.record_event()
            for t in [blob] + [t for t, _ in early]:
                t.record_stream(side)  # its memory is not reused before these checks have read it
        else:
            self.flags = check_many(bufs, expected, where, slots)

    def read(self, extra=(), status: torch.Tensor | None = None) -> Failed:
        """What failed (:class:`Failed`) among the sections' crc32s, the ``extra`` (tensor, crc32) pairs' crc32s
        (computed here), the ``early`` pairs', the padding, ``status`` (the decode kernels' stream statuses,
        any nonzero entry) and the header given. The one synchronization of a device decode."""
        from kvcodec.device.crc32 import check_many

        if self._done is not None:
            torch.cuda.current_stream(self.flags.device).wait_event(self._done)
        parts = [self.flags]
        k = len(extra)
        if extra:
            parts.append(check_many([t.reshape(-1).view(torch.uint8) for t, _ in extra], [int(c) for _, c in extra],
                                    range(k), k))
        if status is not None:
            parts.append(status.reshape(-1).to(torch.int32))
        got = torch.cat(parts).cpu().numpy() != 0
        slots = self.early.stop
        return Failed(sections=[name for name, bad in zip(self._names, got[self.sections]) if bad],
                      extra=got[slots: slots + k].tolist(), early=got[self.early].tolist(),
                      padding=bool(got[self.padding]), stream=bool(got[slots + k:].any()),
                      header_changed=self.header is not None and bool(got[self.header]))


_side_streams: dict = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """A device's stream for work beside torch's (one per device, made once): the section checks of
    :class:`Checks`, the GPU encoder's checksums and raw bits (``kvctx_device_encode._Side``)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


class BlobCache:
    """What decodes learned from device blobs: per blob, its header and host-side plan (the parsed header,
    the codec's plan and device inputs), kept for the next decode of the same blob tensor: a KV cache
    block decoded again (a reused prefix) skips the header read-back, JSON parse and plan; across blobs,
    how much of a blob's front a first decode copies (:meth:`front_window`).

    An entry belongs to one tensor object (weakly referenced: dropped when the tensor dies) at one
    ``_version`` (torch's in-place writes bump it), address and size. Writes that torch does not see
    (through CuPy or a raw pointer) are caught by the device checks: a decode from an entry checks
    the header's crc32 with the sections' (:class:`Checks`) and redoes the decode without the entry
    when the header changed; the sections' crc32s cover everything else the plan was built from.
    Entries are stored only after a decode that passed every check; they must hold nothing that
    references the blob (else it never dies)."""

    MAX_ENTRIES = 16

    def __init__(self):
        self._entries: dict[int, tuple] = {}
        self.front_share = 1 / 128  # of a blob's bytes, the first read-back's: what the previous decode needed

    def front_window(self, n: int) -> int:
        """Bytes of an ``n``-byte blob a first decode copies in its one read-back (:func:`read_front`): at
        least ``_HEAD_GUESS``, else the share of its blob the previous decode needed (:meth:`note_front`;
        first 1/128: a kvctx blob's header and model section at 256 tokens a row take ~0.65%), at most
        ``_FRONT_MAX``."""
        return min(n, max(_HEAD_GUESS, min(_FRONT_MAX, int(n * self.front_share))))

    def note_front(self, n: int, needed: int) -> None:
        """Remember that a decode of an ``n``-byte blob needed its first ``needed`` bytes on the host (the
        header, and a kvctx / predictive blob's model section): the next blobs' :meth:`front_window`.
        Why: the blobs a process decodes are mostly alike (one cache's blocks), and one read-back of 1 MB
        costs ~0.04 ms where a second read-back and sync cost more. Blobs under 16 x ``_HEAD_GUESS`` teach
        nothing (their header is most of them), and the share stays at most 1/16."""
        if n >= 16 * _HEAD_GUESS:
            self.front_share = min(1 / 16, needed * 1.02 / n)

    @staticmethod
    def _state(blob: torch.Tensor) -> tuple:
        return blob._version, blob.data_ptr(), blob.numel(), blob.device

    def get(self, blob: torch.Tensor):
        hit = self._entries.get(id(blob))
        if hit is None or hit[0]() is not blob or hit[1] != self._state(blob):
            return None
        return hit[2]

    def put(self, blob: torch.Tensor, entry) -> None:
        key = id(blob)
        entries = self._entries
        if len(entries) >= self.MAX_ENTRIES and key not in entries:
            entries.pop(next(iter(entries)), None)  # the oldest
        ref = weakref.ref(blob, lambda r, key=key: entries.pop(key, None) if entries.get(key, (None,))[0] is r else None)
        entries[key] = (ref, self._state(blob), entry)

    def drop(self, blob: torch.Tensor) -> None:
        self._entries.pop(id(blob), None)

    def clear(self) -> None:
        self._entries.clear()
