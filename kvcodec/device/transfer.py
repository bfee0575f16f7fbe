"""Host <-> device copies: small uploads that do not stall the host, and big blobs at PCIe speed.

Why: ``torch.from_numpy(a).to("cuda")`` copies from pageable memory, which waits until the GPU has
drained the stream's earlier work, so every launch descriptor uploaded between two kernels
serializes host and device. Here the arrays of one launch are packed into one pinned buffer (torch's
caching host allocator: no cudaHostAlloc per call, and the block is not reused before its copy has
run) and copied asynchronously in stream order.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.threads import resolve_threads

_ALIGN = 16
_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16,
          np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class Staging:
    """Host arrays of one upload in one buffer (pinned for a CUDA device: torch's caching host allocator),
    each at a 16-byte aligned offset and written in place by the caller, then copied to the device in one
    asynchronous copy (:meth:`to`). Why: every array copied or uploaded on its own is another host step
    of ~0.01-0.05 ms before a kernel's launch; the device reads each piece by address
    (``device_base + offsets[name]``)."""

    def __init__(self, sizes: dict, pin: bool):
        self.offsets, total = {}, 0
        for name, nbytes in sizes.items():
            self.offsets[name] = total
            total += -(-int(nbytes) // _ALIGN) * _ALIGN
        self.sizes = dict(sizes)
        self.host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
        self._bytes = self.host.numpy()

    def view(self, name, dtype, shape=-1) -> np.ndarray:
        """The piece ``name`` as a writable numpy array of ``dtype`` (and ``shape``)."""
        o = self.offsets[name]
        return self._bytes[o: o + self.sizes[name]].view(dtype).reshape(shape)

    def to(self, device) -> torch.Tensor:
        """The whole buffer on ``device`` (uint8), copied asynchronously on torch's current stream (a CPU
        device: the buffer itself)."""
        return self.host.to(device, non_blocking=True)


def upload(arrays, device) -> list[torch.Tensor]:
    """The numpy arrays (uint8, int8/16/32/64; unsigned ones of 2-8 bytes travel as the signed type
    of their size) as 1-D tensors on ``device``, in one asynchronous copy on torch's current stream."""
    device = torch.device(device)
    flat = []
    for a in arrays:
        a = np.ascontiguousarray(a).reshape(-1)
        if a.dtype.kind == "u" and a.itemsize > 1:
            a = a.view(np.dtype(f"i{a.itemsize}"))
        if a.dtype not in _TORCH:
            raise ValueError(f"cannot upload {a.dtype}")
        flat.append(a)
    st = Staging({k: a.nbytes for k, a in enumerate(flat)}, pin=device.type == "cuda")
    for k, a in enumerate(flat):
        st.view(k, np.uint8)[:] = a.view(np.uint8)
    dev = st.to(device)
    return [dev[o: o + a.nbytes].view(_TORCH[a.dtype]) for a, o in zip(flat, st.offsets.values())]


# ------------------------------------------------------------------------------------- big blobs
# Why: a compressed blob crosses PCIe once per call, and the obvious code (``t.cpu().numpy().tobytes()``,
# ``torch.frombuffer(b).to("cuda")``) copies through pageable memory twice on one core, each copy
# faulting in fresh pages: measured 1.2 GB/s for a 185 MB blob on an H200 host. Here the bytes go
# through a ring of pinned staging slots: the DMA engine moves slot-sized pieces at PCIe speed while
# worker threads (``ctypes.memmove`` releases the GIL) copy the previous pieces between the slots
# and the ``bytes`` object, so page faults and copies run on several cores and overlap the transfer.
# A new ``bytes`` object is fresh memory: its pages fault in as they are first written (measured
# ~1 GB/s per thread on the H200 host, a VM), so its range is advised as transparent huge pages
# (where the kernel has them: 512x fewer faults) before the workers write it. Measured there
# (benchmarks/gpu_lossless.py transfer rows, 116-186 MB blobs): download 7.7-9.1 GB/s without the
# advice, 16.5-21.8 with it; uploads 8-15% faster with 8 workers than with 16, downloads as fast or
# faster with 16.
STAGE_BYTES = 4 << 20  # one slot
DIRECT_BELOW = 8 << 20  # smaller buffers take the plain one-copy path
DOWNLOAD_WORKERS = 16  # at most, and at most the cores this process may use
UPLOAD_WORKERS = 8
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14

_pools: dict[int, object] = {}


def _pool(workers: int):
    from concurrent.futures import ThreadPoolExecutor

    pool = _pools.get(workers)
    if pool is None:
        pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="kvcodec-transfer")
    return pool


def _workers(threads: int, cap: int) -> int:
    """Workers of a transfer: ``threads`` when given, else (0) every core up to ``cap``."""
    return max(1, resolve_threads(threads) if threads else min(cap, resolve_threads(0)))


def _address(buf) -> int:
    """Address of a bytes-like object's first byte (read-only buffers too)."""
    return np.frombuffer(buf, np.uint8).ctypes.data


def _advise_huge_pages(addr: int, n: int, advise: bool = True) -> None:
    """madvise(MADV_HUGEPAGE) on the 2 MiB pages inside [addr, addr + n) (Linux; errors ignored:
    only an advice, as glibc's own ``glibc.malloc.hugetlb`` tunable gives it)."""
    import ctypes
    import sys

    start, end = -(-addr // _HUGE) * _HUGE, (addr + n) // _HUGE * _HUGE
    if not advise or end <= start or not sys.platform.startswith("linux"):
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise(start, end - start, _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def _memmove_after(event, dst: int, src: int, n: int) -> None:
    import ctypes

    if event is not None:
        event.synchronize()  # releases the GIL
    ctypes.memmove(dst, src, n)


def device_to_bytes(t: torch.Tensor, threads: int = 0, huge_pages: bool = True) -> bytes:
    """The bytes of the contiguous tensor ``t`` as a new ``bytes`` object; a CUDA tensor crosses
    through the pinned ring (``threads`` workers, 0 = all cores up to DOWNLOAD_WORKERS), into a
    bytes object advised MADV_HUGEPAGE (``huge_pages=False``: not, for comparisons)."""
    src = t.detach().reshape(-1).view(torch.uint8)
    n = src.numel()
    if src.device.type != "cuda" or n < DIRECT_BELOW:
        return src.cpu().numpy().tobytes()
    workers = _workers(threads, DOWNLOAD_WORKERS)
    out = bytes(n)  # calloc'd: pages are mapped (and faulted) only as the workers write them
    dst = _address(out)  # written before anyone else sees ``out`` (as C code fills a new bytes object)
    _advise_huge_pages(dst, n, huge_pages)
    slots = workers + 2
    stage = torch.empty((slots, STAGE_BYTES), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream(src.device)
    pool, pending = _pool(workers), []
    for j, a in enumerate(range(0, n, STAGE_BYTES)):
        if j >= slots:
            pending[j - slots].result()  # that slot's bytes have left it
        m = min(STAGE_BYTES, n - a)
        slot = stage[j % slots, :m]
        slot.copy_(src[a: a + m], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        pending.append(pool.submit(_memmove_after, done, dst + a, slot.data_ptr(), m))
    for f in pending:
        f.result()
    return out


def bytes_to_device(buf, device, threads: int = 0) -> torch.Tensor:
    """A bytes-like object as a new 1-D uint8 tensor on ``device`` (for CUDA: through the pinned
    ring, copies on ``threads`` workers (0 = all cores up to UPLOAD_WORKERS) overlapping the
    transfers, on torch's current stream)."""
    import warnings

    mv = memoryview(buf).cast("B")
    n = mv.nbytes
    device = torch.device(device)
    if device.type != "cuda" or n < DIRECT_BELOW:
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: the tensor is only copied from
            return torch.frombuffer(mv, dtype=torch.uint8).to(device, copy=True)
    workers = _workers(threads, UPLOAD_WORKERS)
    src = _address(mv)
    out = torch.empty(n, dtype=torch.uint8, device=device)
    slots = workers + 2
    stage = torch.empty((slots, STAGE_BYTES), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream(device)
    starts = list(range(0, n, STAGE_BYTES))
    pool = _pool(workers)

    def fill(j, after):
        m = min(STAGE_BYTES, n - starts[j])
        return pool.submit(_memmove_after, after, stage[j % slots].data_ptr(), src + starts[j], m)

    filling = {j: fill(j, None) for j in range(min(slots, len(starts)))}
    for j, a in enumerate(starts):
        filling.pop(j).result()
        m = min(STAGE_BYTES, n - a)
        out[a: a + m].copy_(stage[j % slots, :m], non_blocking=True)
        if j + slots < len(starts):
            sent = torch.cuda.Event()
            sent.record(stream)
            filling[j + slots] = fill(j + slots, sent)  # the slot is refilled once its copy has run
    return out


def download(t: torch.Tensor) -> np.ndarray:
    """A device tensor's bytes on the host (uint8): through a pinned buffer (torch's caching host
    allocator) on CUDA, one direct DMA instead of pageable staging; synchronizes with torch's current
    stream. A CPU tensor's bytes are viewed, not copied."""
    if t.device.type != "cuda":
        return t.reshape(-1).view(torch.uint8).numpy()
    host = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
    host.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()
