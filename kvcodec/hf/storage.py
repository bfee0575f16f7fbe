"""The per-layer block store: [sink | compressed blocks | full-precision window], in token order.

New tokens always enter the full-precision window (after the optional ``sink`` first tokens, which
stay exact for good). ``compact`` moves the oldest window tokens into compressed blocks of
``block_size`` tokens once the window holds ``residual + block_size`` tokens or more, so the most
recent ``residual`` tokens are always exact and no token is ever compressed twice (the cache is
never re-quantized as a whole). Codecs whose packed form concatenates (quantizers, exact) keep a
single growing block per layer, so attention makes two quantizer calls per layer and step, and
the first compaction (normally the prompt) fits the layer's side data on all of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Block:
    """Keys and values of ``length`` consecutive tokens, each held by its codec."""

    key: Any
    value: Any
    length: int


@dataclass
class Segment:
    """A run of tokens the attention function reads: exact tensors, or a compressed block."""

    start: int
    length: int
    key: Any
    value: Any
    exact: bool


class LayerStore:
    """All K/V of one attention layer. Tensors are [B, H_kv, T, D]."""

    def __init__(self, key_codec, value_codec, *, residual: int, block_size: int, sink: int):
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.residual = residual
        self.block_size = block_size
        self.sink = sink
        self.dtype = None  # the model's K/V dtype, fixed by the first append
        self.clear()

    def clear(self) -> None:
        self.key_codec.reset()
        self.value_codec.reset()
        self.sink_k = self.sink_v = None
        self.blocks: list[Block] = []
        self.win_k = self.win_v = None

    # ------------------------------------------------------------------ sizes
    @property
    def sink_len(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[-2]

    @property
    def window_len(self) -> int:
        return 0 if self.win_k is None else self.win_k.shape[-2]

    @property
    def compressed_len(self) -> int:
        return sum(b.length for b in self.blocks)

    def __len__(self) -> int:
        return self.sink_len + self.compressed_len + self.window_len

    # ------------------------------------------------------------------ growth
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add new tokens: first into the sink until it holds ``sink`` tokens, the rest to the window."""
        if self.dtype is None:
            self.dtype = k.dtype
        take = min(max(self.sink - self.sink_len, 0), k.shape[-2]) if not self.blocks and self.window_len == 0 else 0
        if take:
            self.sink_k = _cat(self.sink_k, k[..., :take, :])
            self.sink_v = _cat(self.sink_v, v[..., :take, :])
            k, v = k[..., take:, :], v[..., take:, :]
        if k.shape[-2]:
            self.win_k = _cat(self.win_k, k)
            self.win_v = _cat(self.win_v, v)

    def compact(self) -> int:
        """Compress whole blocks out of the window's oldest end; returns how many tokens moved."""
        n_blocks = (self.window_len - self.residual) // self.block_size
        if n_blocks <= 0:
            return 0
        moved = n_blocks * self.block_size
        kc, vc = self.key_codec, self.value_codec
        if kc.mergeable and vc.mergeable:
            # one encode for everything that leaves the window, appended to the layer's single block
            new = Block(kc.encode(self.win_k[..., :moved, :]), vc.encode(self.win_v[..., :moved, :]), moved)
            if self.blocks:
                old = self.blocks[-1]
                new = Block(kc.cat(old.key, new.key), vc.cat(old.value, new.value), old.length + moved)
                self.blocks[-1] = new
            else:
                self.blocks.append(new)
        else:
            for i in range(n_blocks):
                a, b = i * self.block_size, (i + 1) * self.block_size
                self.blocks.append(Block(kc.encode(self.win_k[..., a:b, :]), vc.encode(self.win_v[..., a:b, :]), b - a))
        self.win_k = self.win_k[..., moved:, :].contiguous()
        self.win_v = self.win_v[..., moved:, :].contiguous()
        return moved

    # ------------------------------------------------------------------ reading
    def segments(self) -> list[Segment]:
        out, pos = [], 0
        if self.sink_len:
            out.append(Segment(pos, self.sink_len, self.sink_k, self.sink_v, True))
            pos += self.sink_len
        for b in self.blocks:
            out.append(Segment(pos, b.length, b.key, b.value, False))
            pos += b.length
        if self.window_len:
            out.append(Segment(pos, self.window_len, self.win_k, self.win_v, True))
        return out

    def materialize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All K/V decoded to dense tensors (fallback attention, lossless and tests)."""
        ks, vs = [], []
        for seg in self.segments():
            if seg.exact:
                ks.append(seg.key)
                vs.append(seg.value)
            else:
                ks.append(self.key_codec.decode(seg.key))
                vs.append(self.value_codec.decode(seg.value))
        dtype = dtype or ks[0].dtype
        return torch.cat([k.to(dtype) for k in ks], dim=-2), torch.cat([v.to(dtype) for v in vs], dim=-2)

    # ------------------------------------------------------------------ edits
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (speculative / assisted decoding roll-back)."""
        if n >= len(self):
            return
        if n <= self.sink_len:
            self.sink_k = self.sink_k[..., :n, :] if n else None
            self.sink_v = self.sink_v[..., :n, :] if n else None
            self.blocks, self.win_k, self.win_v = [], None, None
            return
        keep = n - self.sink_len
        blocks, tail = [], None
        for b in self.blocks:
            if keep <= 0:
                break
            if b.length <= keep:
                blocks.append(b)
            else:
                cut = keep - keep % max(self.key_codec.token_multiple, self.value_codec.token_multiple)
                if cut < keep:  # a grouped codec can only be cut at a group edge: the rest goes back,
                    tail = self._decoded(b, cut, keep)  # decoded, to the front of the window
                if cut:
                    blocks.append(Block(self.key_codec.truncate(b.key, cut), self.value_codec.truncate(b.value, cut), cut))
            keep -= min(b.length, keep)
        self.blocks = blocks
        if keep <= 0:
            self.win_k = self.win_v = None
        else:
            self.win_k = self.win_k[..., :keep, :].contiguous()
            self.win_v = self.win_v[..., :keep, :].contiguous()
        if tail is not None:
            self.win_k = tail[0] if self.win_k is None else torch.cat([tail[0], self.win_k], dim=-2)
            self.win_v = tail[1] if self.win_v is None else torch.cat([tail[1], self.win_v], dim=-2)

    def _decoded(self, block: Block, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.key_codec.decode(self.key_codec.view(block.key, start, stop))
        v = self.value_codec.decode(self.value_codec.view(block.value, start, stop))
        return k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous()

    def select_batch(self, idx: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows ``idx`` everywhere (beam search, batch filtering)."""
        if self.sink_k is not None:
            self.sink_k = self.sink_k.index_select(0, idx.to(self.sink_k.device))
            self.sink_v = self.sink_v.index_select(0, idx.to(self.sink_v.device))
        if self.win_k is not None:
            self.win_k = self.win_k.index_select(0, idx.to(self.win_k.device))
            self.win_v = self.win_v.index_select(0, idx.to(self.win_v.device))
        self.blocks = [
            Block(self.key_codec.select(b.key, idx), self.value_codec.select(b.value, idx), b.length)
            for b in self.blocks
        ]
        self.key_codec.select_side(idx)
        self.value_codec.select_side(idx)

    @property
    def batch_size(self) -> int | None:
        for t in (self.sink_k, self.win_k):
            if t is not None:
                return t.shape[0]
        return None

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict:
        """Bytes held, by part (every tensor and blob this layer keeps alive)."""
        def dense(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        return {
            "sink": dense(self.sink_k, self.sink_v),
            "window": dense(self.win_k, self.win_v),
            "compressed_keys": sum(self.key_codec.nbytes(b.key) for b in self.blocks),
            "compressed_values": sum(self.value_codec.nbytes(b.value) for b in self.blocks),
            "side": self.key_codec.side_nbytes() + self.value_codec.side_nbytes(),
        }


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b.contiguous() if a is None else torch.cat([a, b], dim=-2)
