"""CRC-32 (zlib's polynomial, initial value and final xor) for every tier: the one checksum kvcodec stores.

- host: :func:`crc32` (ISA-L's pclmul implementation where python-isal is installed, about 6x zlib's;
  zlib otherwise: the same values), :func:`crc32_combine` and :func:`crc32_parallel` (pieces on threads);
- compiled loops: :func:`isal_crc32_fn`, ISA-L's C function as a ctypes pointer numba code can call
  (``lossless.predictive.codec`` checksums a widened form of its input block by block with it);
- device: ``kvcodec.device.crc32`` (a CUDA kernel; its numpy model of the kernel is tested equal to
  :func:`crc32`).
"""

from __future__ import annotations

import zlib
from functools import cache

try:  # ISA-L's crc32 is the same CRC-32 as zlib's, about 6x faster (pclmul); zlib is the fallback
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32


def crc32(data, value: int = 0) -> int:
    """Standard CRC-32 (zlib's polynomial and values) of a bytes-like object, fast where ISA-L is installed."""
    return _crc32(data, value)


_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order), as in zlib's crc32_combine."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc1 = crc32(A), crc2 = crc32(B) and len(B): lets chunks be checksummed in parallel."""
    p, n, k = 1 << 31, len2, 3  # x^(8 * len2)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def crc32_parallel(data, threads: int = 1, min_piece: int = 4 << 20) -> int:
    """crc32 of a large buffer computed in pieces on ``threads`` threads (the crc releases the GIL)."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    pieces = min(threads, n // min_piece)
    if pieces <= 1:
        return crc32(mv)
    from concurrent.futures import ThreadPoolExecutor

    bounds = [n * i // pieces for i in range(pieces + 1)]
    with ThreadPoolExecutor(pieces) as ex:
        crcs = list(ex.map(lambda i: crc32(mv[bounds[i] : bounds[i + 1]]), range(pieces)))
    out = crcs[0]
    for i in range(1, pieces):
        out = crc32_combine(out, crcs[i], bounds[i + 1] - bounds[i])
    return out


@cache
def isal_crc32_fn():
    """ISA-L's ``crc32_gzip_refl(crc, buf, len)`` (zlib's crc32) as a ctypes function numba can call, or None."""
    try:
        import ctypes

        from isal import isal_zlib

        fn = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64], ctypes.c_uint32
    return fn
