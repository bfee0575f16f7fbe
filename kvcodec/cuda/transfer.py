"""Small host-to-device uploads that do not stall the host.

Why: ``torch.from_numpy(a).to("cuda")`` copies from pageable memory, which waits until the GPU has
drained the stream's earlier work, so every launch descriptor uploaded between two kernels
serializes host and device. Here the arrays of one launch are packed into one pinned buffer (torch's
caching host allocator: no cudaHostAlloc per call, and the block is not reused before its copy has
run) and copied asynchronously in stream order.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16
_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16,
          np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


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
    offsets, total = [], 0
    for a in flat:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    hv = host.numpy()
    for a, o in zip(flat, offsets):
        hv[o: o + a.nbytes] = a.view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[o: o + a.nbytes].view(_TORCH[a.dtype]) for a, o in zip(flat, offsets)]
