"""The per-layer block store: [sink | compressed blocks | full-precision window], in token order.

New tokens always enter the full-precision window (after the optional ``sink`` first tokens, which
stay exact for good). ``compact`` moves the oldest window tokens into compressed blocks of
``block_size`` tokens once the window holds ``residual + block_size`` tokens or more, so the most
recent ``residual`` tokens are always exact and no token is ever compressed twice (the cache is
never re-quantized as a whole). Encodings whose packed form concatenates (quantizers, exact) keep a
single growing block per layer, so attention makes two quantizer calls per layer and step, and
the first compaction (normally the prompt) fits the layer's side data on all of its tokens.

The exact tokens (sink and window) live in one buffer ``exact_k``/``exact_v`` = [sink | window]:
appending a step's tokens costs one ``cat`` as before, and the decode path attends both parts with
one matmul instead of one per part (``sink_k``/``win_k`` are views of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Block:
    """Keys and values of ``length`` consecutive tokens, each held by its encoding."""

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

    def __init__(self, key_encoding, value_encoding, *, residual: int, block_size: int, sink: int):
        self.key_encoding = key_encoding
        self.value_encoding = value_encoding
        self.residual = residual
        self.block_size = block_size
        self.sink = sink
        self.dtype = None  # the model's K/V dtype, fixed by the first append
        self.clear()

    def clear(self) -> None:
        self.key_encoding.reset()
        self.value_encoding.reset()
        self.exact_k = self.exact_v = None  # [sink | window], [B, H_kv, sink_len + window_len, D]
        self.sink_len = 0
        self.blocks: list[Block] = []

    # ------------------------------------------------------------------ exact parts (views of one buffer)
    @property
    def sink_k(self) -> torch.Tensor | None:
        return _rows(self.exact_k, 0, self.sink_len)

    @property
    def sink_v(self) -> torch.Tensor | None:
        return _rows(self.exact_v, 0, self.sink_len)

    @property
    def win_k(self) -> torch.Tensor | None:
        return _rows(self.exact_k, self.sink_len, None)

    @property
    def win_v(self) -> torch.Tensor | None:
        return _rows(self.exact_v, self.sink_len, None)

    def set_exact(self, sink_k=None, sink_v=None, win_k=None, win_v=None) -> None:
        """Replace the sink and the window (each pair may be None): truncation and loading."""
        self.sink_len = 0 if sink_k is None else sink_k.shape[-2]
        ks, vs = [t for t in (sink_k, win_k) if t is not None], [t for t in (sink_v, win_v) if t is not None]
        self.exact_k = torch.cat(ks, dim=-2) if ks else None
        self.exact_v = torch.cat(vs, dim=-2) if vs else None

    # ------------------------------------------------------------------ sizes
    @property
    def window_len(self) -> int:
        return 0 if self.exact_k is None else self.exact_k.shape[-2] - self.sink_len

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
        if not self.blocks and self.window_len == 0:  # the sink is still filling up
            self.sink_len += min(max(self.sink - self.sink_len, 0), k.shape[-2])
        if k.shape[-2]:
            self.exact_k = _cat(self.exact_k, k)
            self.exact_v = _cat(self.exact_v, v)

    def compact(self) -> int:
        """Compress whole blocks out of the window's oldest end; returns how many tokens moved."""
        n_blocks = (self.window_len - self.residual) // self.block_size
        if n_blocks <= 0:
            return 0
        moved = n_blocks * self.block_size
        kc, vc = self.key_encoding, self.value_encoding
        win_k, win_v = self.win_k, self.win_v
        if kc.mergeable and vc.mergeable:
            # one encode for everything that leaves the window, appended to the layer's single block
            new = Block(kc.encode(win_k[..., :moved, :]), vc.encode(win_v[..., :moved, :]), moved)
            if self.blocks:
                old = self.blocks[-1]
                new = Block(kc.cat(old.key, new.key), vc.cat(old.value, new.value), old.length + moved)
                self.blocks[-1] = new
            else:
                self.blocks.append(new)
        else:
            for i in range(n_blocks):
                a, b = i * self.block_size, (i + 1) * self.block_size
                self.blocks.append(Block(kc.encode(win_k[..., a:b, :]), vc.encode(win_v[..., a:b, :]), b - a))
        a, b = self.sink_len, self.sink_len + moved
        self.exact_k, self.exact_v = _drop_rows(self.exact_k, a, b), _drop_rows(self.exact_v, a, b)
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
                ks.append(self.key_encoding.decode(seg.key))
                vs.append(self.value_encoding.decode(seg.value))
        dtype = dtype or ks[0].dtype
        return torch.cat([k.to(dtype) for k in ks], dim=-2), torch.cat([v.to(dtype) for v in vs], dim=-2)

    # ------------------------------------------------------------------ edits
    def drop_front(self, n: int) -> int:
        """Forget the oldest ``n`` tokens (a sliding-window layer's past), or fewer where a grouped
        encoding can only cut at a group edge; returns how many went. The store must hold no sink."""
        if self.sink_len:
            raise ValueError("drop_front: a store with a sink keeps its first tokens")
        kc, vc = self.key_encoding, self.value_encoding
        multiple = max(kc.token_multiple, vc.token_multiple)
        dropped = 0
        while self.blocks and dropped < n:
            b, rest = self.blocks[0], n - dropped
            if b.length <= rest:
                self.blocks.pop(0)
                dropped += b.length
                continue
            cut = rest - rest % multiple
            if cut:
                self.blocks[0] = Block(kc.drop(b.key, cut), vc.drop(b.value, cut), b.length - cut)
                dropped += cut
            return dropped
        cut = min(n - dropped, self.window_len)
        if cut > 0:
            self.exact_k, self.exact_v = _drop_rows(self.exact_k, 0, cut), _drop_rows(self.exact_v, 0, cut)
            dropped += cut
        return dropped

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (speculative / assisted decoding roll-back)."""
        if n >= len(self):
            return
        if n <= self.sink_len:
            self.blocks = []
            self.set_exact(*((self.sink_k[..., :n, :], self.sink_v[..., :n, :]) if n else ()))
            return
        keep = n - self.sink_len
        blocks, tail = [], None
        for b in self.blocks:
            if keep <= 0:
                break
            if b.length <= keep:
                blocks.append(b)
            else:
                cut = keep - keep % max(self.key_encoding.token_multiple, self.value_encoding.token_multiple)
                if cut < keep:  # a grouped encoding can only be cut at a group edge: the rest goes back,
                    tail = self._decoded(b, cut, keep)  # decoded, to the front of the window
                if cut:
                    blocks.append(Block(self.key_encoding.truncate(b.key, cut), self.value_encoding.truncate(b.value, cut), cut))
            keep -= min(b.length, keep)
        self.blocks = blocks
        win = [tail] if tail is not None else []
        if keep > 0:
            win.append((self.win_k[..., :keep, :], self.win_v[..., :keep, :]))
        win_k = torch.cat([k for k, _ in win], dim=-2) if win else None
        win_v = torch.cat([v for _, v in win], dim=-2) if win else None
        self.set_exact(self.sink_k, self.sink_v, win_k, win_v)

    def _decoded(self, block: Block, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.key_encoding.decode(self.key_encoding.view(block.key, start, stop))
        v = self.value_encoding.decode(self.value_encoding.view(block.value, start, stop))
        return k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous()

    def select_batch(self, idx: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows ``idx`` everywhere (beam search, batch filtering)."""
        if self.exact_k is not None:
            self.exact_k = self.exact_k.index_select(0, idx.to(self.exact_k.device))
            self.exact_v = self.exact_v.index_select(0, idx.to(self.exact_v.device))
        self.blocks = [
            Block(self.key_encoding.select(b.key, idx), self.value_encoding.select(b.value, idx), b.length)
            for b in self.blocks
        ]
        self.key_encoding.select_side(idx)
        self.value_encoding.select_side(idx)

    @property
    def batch_size(self) -> int | None:
        return None if self.exact_k is None else self.exact_k.shape[0]

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict:
        """Bytes held, by part (every tensor and blob this layer keeps alive)."""
        def dense(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        return {
            "sink": dense(self.sink_k, self.sink_v),
            "window": dense(self.win_k, self.win_v),
            "compressed_keys": sum(self.key_encoding.nbytes(b.key) for b in self.blocks),
            "compressed_values": sum(self.value_encoding.nbytes(b.value) for b in self.blocks),
            "side": self.key_encoding.side_nbytes() + self.value_encoding.side_nbytes(),
        }


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b.contiguous() if a is None else torch.cat([a, b], dim=-2)


def _rows(t: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    """Tokens [start, stop) of t as a view, or None when there are none."""
    if t is None:
        return None
    stop = t.shape[-2] if stop is None else stop
    return t[..., start:stop, :] if stop > start else None


def _drop_rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
    """t without tokens [start, stop), in a fresh buffer (so the dropped tokens are freed)."""
    if start == 0:
        return t[..., stop:, :].contiguous() if stop < t.shape[-2] else None
    return torch.cat([t[..., :start, :], t[..., stop:, :]], dim=-2)
