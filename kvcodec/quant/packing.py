"""Bit packing of b-bit indices along the last axis ("tq layout v1").

Coordinate j of a row occupies bits [j*b, (j+1)*b) of the row's bit stream; stream bit i is
bit (i % 8) of byte i // 8. Read as little-endian uint32 words the row is the same stream, so a
GPU thread can fetch 32 bits at a time. Works on any torch device, fully vectorized.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def packed_width(n: int, bits: int) -> int:
    """Bytes per row holding n values of ``bits`` bits."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


@lru_cache(maxsize=64)
def _unpack_plan(n: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    offs = torch.arange(n, dtype=torch.int64) * bits
    return offs // 8, offs % 8


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer values in [0, 2^bits) along the last axis into uint8 [..., ceil(n*bits/8)]."""
    _check_bits(bits)
    if values.dtype == torch.bool or values.is_floating_point():
        raise ValueError("pack_bits expects an integer tensor")
    n = values.shape[-1]
    width = packed_width(n, bits)
    from kvcodec.quant import turboquant_fast  # compiled CPU path, same bytes

    fast = turboquant_fast.pack_bits(values, bits, width)
    if fast is not None:
        return fast
    if bits == 8:
        return values.to(torch.uint8).contiguous()
    v = values.to(torch.int32)
    shifts = torch.arange(bits, device=v.device, dtype=torch.int32)
    stream = ((v.unsqueeze(-1) >> shifts) & 1).reshape(*v.shape[:-1], n * bits)
    pad = width * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, device=v.device, dtype=torch.int32))
    packed = (stream.reshape(*v.shape[:-1], width, 8) * weights).sum(-1)
    return packed.to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., width] -> int64 [..., n]."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_width(n, bits):
        raise ValueError(f"packed rows have {packed.shape[-1]} bytes, expected {packed_width(n, bits)} for n={n}, bits={bits}")
    if bits == 8:
        return packed.to(torch.int64)
    byte_idx, shift = _unpack_plan(n, bits)
    byte_idx = byte_idx.to(packed.device)
    shift = shift.to(packed.device)
    p = packed.to(torch.int32)
    p = torch.nn.functional.pad(p, (0, 1))  # a value may straddle into the next byte
    lo = p.index_select(-1, byte_idx)
    hi = p.index_select(-1, byte_idx + 1)
    return (((lo | (hi << 8)) >> shift) & ((1 << bits) - 1)).to(torch.int64)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack sign bits (1 where x >= 0, i.e. +1) along the last axis."""
    return pack_bits((x >= 0).to(torch.int32), 1)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed sign bits -> +-1 values of ``dtype``."""
    return unpack_bits(packed, 1, n).to(dtype) * 2 - 1


def lookup_group(bits: int, width: int) -> int | None:
    """Bytes per table-lookup unit for ``unpack_values`` (1: byte-aligned codes, 3: 24-bit words read
    as two 12-bit halves), or None when codes of ``bits`` bits in rows of ``width`` bytes have none."""
    if 8 % bits == 0:
        return 1
    if 24 % bits == 0 and width % 3 == 0:
        return 3
    return None


@lru_cache(maxsize=64)
def value_table(values: tuple, bits: int, group: int, device: str) -> torch.Tensor:
    """float32 [2^unit, codes per unit]: ``values[code]`` of every code packed in one lookup unit."""
    cb = torch.tensor(values, dtype=torch.float32)
    unit = 8 if group == 1 else 12
    per = unit // bits
    v = torch.arange(1 << unit)
    idx = torch.stack([(v >> (i * bits)) & ((1 << bits) - 1) for i in range(per)], dim=-1)
    return cb[idx].to(device)


def unpack_values(packed: torch.Tensor, table: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """uint8 [..., width] packed codes -> float32 [..., n] table values, one lookup (``embedding``) per
    unit: the same values as ``values[unpack_bits(packed, bits, n)]``, without per-bit shifts."""
    from kvcodec.quant import turboquant_fast  # compiled CPU path, same values

    fast = turboquant_fast.unpack_values(packed, table, group, n)
    if fast is not None:
        return fast
    lead = packed.shape[:-1]
    if group == 1:
        units = packed.long()
    else:
        b = packed.reshape(*lead, packed.shape[-1] // 3, 3).long()
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        units = torch.stack([word & 0xFFF, word >> 12], dim=-1).reshape(*lead, 2 * b.shape[-2])
    values = torch.nn.functional.embedding(units, table)  # [..., units, codes per unit]
    return values.reshape(*lead, units.shape[-1] * table.shape[-1])[..., :n]
