"""KV encodings: how a layer holds one block of keys or values [B, H, T, D] (exact, lossless or
quantized; see docs/glossary.md: an *encoding* here, a *codec* is a lossless tensor codec).

Every encoding answers the same few questions about a block it encoded, so the cache and the
attention function never look inside a block:

* ``encode(x)`` -> block, ``decode(block)`` -> float32 [B, H, T, D];
* ``scores(block, q)`` -> q @ k^T [B, H, Q, T] and ``weighted_sum(block, w)`` -> w @ v
  [B, H, Q, D], both float32 and computed from the compressed form where the encoding can;
* ``nbytes(block)``, ``length(block)``, ``truncate(block, n)`` (keep the first n tokens, for
  ``crop``), ``select(block, idx)`` (batch rows, for beam search and batch filtering);
* ``state(block)`` / ``restore(meta, tensors)`` for saving a cache (persist.py);
* ``packed(block)``: the block as the fused attention kernel reads it (a
  :class:`~kvcodec.quant.packed.PackedKV`), or None when the codec has no such layout.

``decoded_attention`` tells the attention function to attend over decoded K/V with SDPA instead
(lossless and full-precision encodings: their decode is exact, so this reproduces DynamicCache
bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import api as lossless_api


class NoSideData:
    """Encodings that keep no per-layer side data (no fitted scales): nothing to count, select or save."""

    def side_nbytes(self) -> int:
        return 0

    def select_side(self, idx: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        pass

    def side_state(self) -> tuple[dict, dict]:
        return {}, {}

    def load_side_state(self, meta: dict, tensors: dict) -> None:
        pass


class ExactEncoding(NoSideData):
    """Keeps blocks uncompressed in the model dtype: the reference the others are measured against."""

    name = "none"
    decoded_attention = True
    mergeable = True  # blocks concatenate cheaply: the store keeps one block per layer
    token_multiple = 1  # compressed runs can be cut at any token

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    def decode(self, block: torch.Tensor) -> torch.Tensor:
        return block

    def scores(self, block: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q @ block.float().transpose(-1, -2)

    def weighted_sum(self, block: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w @ block.float()

    def nbytes(self, block: torch.Tensor) -> int:
        return block.numel() * block.element_size()

    def length(self, block: torch.Tensor) -> int:
        return block.shape[-2]

    def truncate(self, block: torch.Tensor, n: int) -> torch.Tensor:
        return block[..., :n, :].contiguous()

    def drop(self, block: torch.Tensor, n: int) -> torch.Tensor:
        return block[..., n:, :].contiguous()

    def cat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=-2)

    def view(self, block: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return block[..., start:stop, :]

    def select(self, block: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return block.index_select(0, idx.to(block.device))

    def packed(self, block: torch.Tensor) -> None:
        return None

    def state(self, block: torch.Tensor) -> tuple[dict, dict]:
        return {}, {"x": block}

    def restore(self, meta: dict, tensors: dict) -> torch.Tensor:
        x = _require(tensors, "x")
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or not x.is_floating_point():
            raise CorruptStreamError("saved exact KV block must be a 4-D floating-point tensor")
        return x


@dataclass
class LosslessBlock:
    """One bit-exact compressed blob per batch row (so beam reorders only permute blobs)."""

    blobs: list
    length: int
    device: torch.device


class LosslessEncoding(NoSideData):
    """Bit-exact blocks through ``kvcodec.lossless.api`` (entropy-coded bf16/fp16 KV)."""

    name = "lossless"
    decoded_attention = True
    mergeable = False  # one entropy-coded blob per block and batch row
    token_multiple = 1

    def encode(self, x: torch.Tensor) -> LosslessBlock:
        cpu = x.detach().to("cpu").contiguous()
        blobs = [lossless_api.compress(cpu[b : b + 1].contiguous(), layout="kv") for b in range(cpu.shape[0])]
        return LosslessBlock(blobs, x.shape[-2], x.device)

    def decode(self, block: LosslessBlock) -> torch.Tensor:
        # no per-row cap: the blobs are this encoder's output, or rows of a saved cache whose declared
        # [1, H, length, D] kvcodec.hf.persist charged to load's max_output_bytes (None: no cap)
        rows = [lossless_api.decompress(blob, max_output_bytes=None) for blob in block.blobs]
        return torch.cat([torch.as_tensor(r) for r in rows], dim=0).to(block.device)

    def scores(self, block: LosslessBlock, q: torch.Tensor) -> torch.Tensor:
        return q @ self.decode(block).float().transpose(-1, -2)

    def weighted_sum(self, block: LosslessBlock, w: torch.Tensor) -> torch.Tensor:
        return w @ self.decode(block).float()

    def nbytes(self, block: LosslessBlock) -> int:
        return sum(len(b) for b in block.blobs)

    def length(self, block: LosslessBlock) -> int:
        return block.length

    def truncate(self, block: LosslessBlock, n: int) -> LosslessBlock:
        return self.encode(self.decode(block)[..., :n, :])

    def drop(self, block: LosslessBlock, n: int) -> LosslessBlock:
        return self.encode(self.decode(block)[..., n:, :])

    def select(self, block: LosslessBlock, idx: torch.Tensor) -> LosslessBlock:
        order = [int(i) for i in idx.tolist()]
        return LosslessBlock([block.blobs[i] for i in order], block.length, block.device)

    def packed(self, block: LosslessBlock) -> None:
        return None

    def state(self, block: LosslessBlock) -> tuple[dict, dict]:
        tensors = {f"row{i}": b for i, b in enumerate(block.blobs)}
        return {"rows": len(block.blobs), "length": block.length}, tensors

    def restore(self, meta: dict, tensors: dict) -> LosslessBlock:
        rows = _int(meta, "rows")
        blobs = [bytes(_require(tensors, f"row{i}")) for i in range(rows)]
        block = LosslessBlock(blobs, _int(meta, "length"), torch.device("cpu"))
        try:
            x = self.decode(block)
        except CorruptStreamError:
            raise
        except Exception as exc:  # a blob kvcodec.lossless cannot parse is a corrupt cache file
            raise CorruptStreamError(f"lossless KV block does not decode: {exc}") from exc
        if x.ndim != 4 or x.shape[-2] != block.length:
            raise CorruptStreamError("lossless KV block has the wrong shape")
        return block


def _require(tensors: dict, name: str):
    if name not in tensors:
        raise CorruptStreamError(f"saved KV block lacks section {name!r}")
    return tensors[name]


def _int(meta: dict, name: str) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptStreamError(f"saved KV block has a bad {name!r}: {value!r}")
    return value
