"""Codecs backed by the vector quantizers of ``kvcodec.quant`` (TurboQuant, QJL, KIVI).

A block is a ``kvcodec.quant.QuantizedTensor`` [B, H, T, D]; attention reads it through the
quantizer's ``scores`` / ``weighted_sum`` (rotated-domain math on the packed codes, no dense K/V).

Side data (per-head preconditioners fitted on the layer's first compressed block) is computed
once per layer and shared by every later block (``precond=``), so it is held, and counted by
``side_nbytes``, once; ``nbytes(block)`` counts the block's own codes, norms and scales.
"""

from __future__ import annotations

import functools
import math

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant import KIVI, QJL, ChannelPreconditioner, QuantizedTensor, TurboQuantMSE, TurboQuantOutlier, TurboQuantProd


def layer_seed(seed: int, layer_idx: int, part: int) -> int:
    """Independent, reproducible seeds per (cache seed, layer, key/value)."""
    return (seed * 1_000_003 + layer_idx * 2 + part) % (2**31 - 1)


KIVI_GROUP = 32


def make_quantizers(spec, layer_idx: int):
    """(key quantizer, value quantizer) of one layer, as chosen by the cache spec.

    turboquant: TurboQuantMSE keys (TurboQuantProd with key_mode="prod") with per-channel "scale"
    preconditioning by default (real keys have outlier channels), TurboQuantMSE values; with
    ``outliers=k`` both use the paper's outlier split (k channels at bits+1, the rest at bits).
    qjl: QJL keys with m = key_bits * head_dim sign bits, TurboQuantMSE values.
    kivi: keys per-channel and values per-token, groups of 32 (the KIVI paper's layout)."""
    d = spec.head_dim
    ks, vs = layer_seed(spec.seed, layer_idx, 0), layer_seed(spec.seed, layer_idx, 1)
    if spec.method == "kivi":
        return (KIVI(spec.key_bits, group_size=KIVI_GROUP, axis="channel", dim=d),
                KIVI(spec.value_bits, group_size=KIVI_GROUP, axis="token", dim=d))
    if spec.outliers:
        values = _outlier(d, spec.outliers, spec.value_bits, vs, spec.value_precondition)
    else:
        values = TurboQuantMSE(d, spec.value_bits, seed=vs, precondition=spec.value_precondition)
    if spec.method == "qjl":
        return QJL(d, m=spec.key_bits * d, seed=ks), values
    if spec.key_mode == "prod":
        if spec.key_bits < 2:
            raise ValueError("key_mode='prod' needs key_bits >= 2 (bits-1 MSE bits + 1 QJL bit)")
        if spec.outliers:
            raise ValueError("outliers is supported with key_mode='mse' only")
        return TurboQuantProd(d, spec.key_bits, seed=ks, precondition=spec.key_precondition), values
    if spec.outliers:
        return _outlier(d, spec.outliers, spec.key_bits, ks, spec.key_precondition), values
    return TurboQuantMSE(d, spec.key_bits, seed=ks, precondition=spec.key_precondition), values


def _outlier(dim, k, bits, seed, precondition):
    if bits >= 8:
        raise ValueError("with outliers, bits must be <= 7 (outlier channels get bits + 1)")
    pre = "none" if precondition == "none" else "center"  # the split supports centering only
    return TurboQuantOutlier(dim, k, bits + 1, bits, seed=seed, precondition=pre)


def make_quant_codecs(spec, layer_idx: int):
    kq, vq = make_quantizers(spec, layer_idx)
    return QuantCodec(kq), QuantCodec(vq)


class QuantCodec:
    """Adapter from a ``kvcodec.quant`` quantizer to the cache's codec interface (see codecs.py)."""

    decoded_attention = False
    mergeable = True  # packed codes concatenate along tokens: one block per layer, two calls per step

    def __init__(self, quantizer):
        self.q = quantizer
        self.name = type(quantizer).__name__
        # KIVI keys are grouped along tokens: compressed runs may only be cut / joined at group edges
        self.token_multiple = getattr(quantizer, "group_size", 1) if getattr(quantizer, "method", "") == "kivi" else 1
        self.precond = None  # zero-token QuantizedTensor carrying the layer's shared side data
        self.fast = FastTurboQuant(quantizer) if FastTurboQuant.applies(quantizer) else None

    # ------------------------------------------------------------------ blocks
    def encode(self, x: torch.Tensor):
        if self.precond is None:
            c = self.q.quantize(x)
            self._keep_side(c)
            return c
        return self.q.quantize(x, precond=self.precond)

    def _keep_side(self, c) -> None:
        p = c.slice_tokens(0, 0)
        p.token = {k: v.clone() for k, v in p.token.items()}  # empty, so the precond pins no token storage
        p.grouped = {k: v.clone() for k, v in p.grouped.items()}
        self.precond = p

    def decode(self, block) -> torch.Tensor:
        return self.q.dequantize(block)

    def scores(self, block, q: torch.Tensor) -> torch.Tensor:
        return self.fast.scores(block, q) if self.fast else self.q.scores(block, q)

    def weighted_sum(self, block, w: torch.Tensor) -> torch.Tensor:
        return self.fast.weighted_sum(block, w) if self.fast else self.q.weighted_sum(block, w)

    def length(self, block) -> int:
        return block.num_tokens

    def truncate(self, block, n: int):
        t = block.slice_tokens(0, n)  # own copies of the kept codes, so the dropped ones are freed
        t.token = {k: v.clone() for k, v in t.token.items()}
        t.grouped = {k: v.clone() for k, v in t.grouped.items()}
        return t  # side tensors stay shared with the layer

    def cat(self, a, b):
        return type(a).cat([a, b])

    def view(self, block, start: int, stop: int):
        return block.slice_tokens(start, stop)

    def select(self, block, idx: torch.Tensor):
        return block.index_select(0, idx)

    def packed(self, block):
        """The block as the fused attention kernel reads it, or None (quantizers without that layout)."""
        return self.q.packed(block)

    def select_side(self, idx: torch.Tensor) -> None:
        """Batch rows of the shared side data follow a beam reorder / batch filter."""
        if self.precond is not None:
            self.precond = self.precond.index_select(0, idx)

    def reset(self) -> None:
        self.precond = None

    # ------------------------------------------------------------------ accounting
    def _side_ptrs(self) -> set:
        return set() if self.precond is None else {t.data_ptr() for t in self.precond.side.values()}

    def nbytes(self, block) -> int:
        """The block's own bytes; side tensors shared with the layer's precond are counted in side_nbytes."""
        shared = self._side_ptrs()
        return sum(
            t.numel() * t.element_size()
            for name, t in block.tensors().items()
            if not (name.startswith("side.") and t.data_ptr() in shared)
        )

    def side_nbytes(self) -> int:
        if self.precond is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.precond.side.values())

    # ------------------------------------------------------------------ persistence
    def state(self, block) -> tuple[dict, dict]:
        d = block.to_dict()
        return d["meta"], d["tensors"]

    def restore(self, meta: dict, tensors: dict):
        block = QuantizedTensor.from_dict({"meta": meta, "tensors": tensors})
        if block.config != self.q_config():
            raise CorruptStreamError("saved block was quantized with another configuration than this cache's")
        if self.precond is None:
            self._keep_side(block)
        elif block.side.keys() == self.precond.side.keys() and all(
            torch.equal(block.side[k], self.precond.side[k]) for k in block.side
        ):
            block.side = dict(self.precond.side)  # share, as it was before saving
        return block

    def q_config(self) -> dict:
        cfg = getattr(self.q, "config", None)
        return cfg() if callable(cfg) else cfg

    def side_state(self) -> tuple[dict, dict]:
        return {}, {}

    def load_side_state(self, meta: dict, tensors: dict) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Fast CPU/GPU path for TurboQuant blocks: unpack codes straight to codebook values with a table
# lookup (``F.embedding``) instead of per-bit shifts, then the same rotated-domain math as
# kvcodec.quant (query rotated once, outputs rotated back once). Bit-for-bit the same codes; the
# tests compare it with the quantizer's own dequantize.

_SQRT_PI_OVER_2 = math.sqrt(math.pi / 2)


def _byte_groups(bits: int, width: int) -> int | None:
    """Bytes per lookup group (1: byte-aligned codes, 3: 24-bit words) or None (no fast path)."""
    if 8 % bits == 0:
        return 1
    if 24 % bits == 0 and width % 3 == 0:
        return 3
    return None


@functools.lru_cache(maxsize=64)
def _value_table(codebook: tuple, bits: int, group: int, device: str) -> torch.Tensor:
    """Table [2^(8*group/..)] -> codebook values of every code packed in one lookup unit."""
    cb = torch.tensor(codebook, dtype=torch.float32)
    unit = 8 if group == 1 else 12  # 3-byte groups are looked up as two 12-bit halves
    per = unit // bits
    v = torch.arange(1 << unit)
    idx = torch.stack([(v >> (i * bits)) & ((1 << bits) - 1) for i in range(per)], dim=-1)
    return cb[idx].to(device)


def _lookup(packed: torch.Tensor, table: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """uint8 [..., width] packed codes -> table values [..., n] (float32)."""
    lead = packed.shape[:-1]
    if group == 1:
        units = packed.long()
    else:
        b = packed.reshape(*lead, -1, 3).long()
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        units = torch.stack([word & 0xFFF, word >> 12], dim=-1).reshape(*lead, -1)
    return torch.nn.functional.embedding(units, table).reshape(*lead, -1)[..., :n]


class FastTurboQuant:
    """scores / weighted_sum of a TurboQuantMSE or TurboQuantProd block via table lookups."""

    def __init__(self, quantizer):
        self.q = quantizer
        self.bits = quantizer._mse_bits
        self.dim = quantizer.dim
        self.prod = quantizer.method == "turboquant_prod"
        width = (self.dim * self.bits + 7) // 8
        self.group = _byte_groups(self.bits, width)
        self._cb = tuple(float(x) for x in quantizer.codebook.tolist())
        self._dev: dict = {}

    @staticmethod
    def applies(quantizer) -> bool:
        method = getattr(quantizer, "method", "")
        if method not in ("turboquant_mse", "turboquant_prod"):
            return False
        width = (quantizer.dim * quantizer._mse_bits + 7) // 8
        return _byte_groups(quantizer._mse_bits, width) is not None

    def _consts(self, device) -> dict:
        key = str(device)
        if key not in self._dev:
            c = {"rot": self.q.rotation.to(device, torch.float32),
                 "tab": _value_table(self._cb, self.bits, self.group, key)}
            if self.prod:
                c["S"] = self.q.qjl_matrix.to(device, torch.float32)
                c["signs"] = _value_table((-1.0, 1.0), 1, 1, key)
            self._dev[key] = c
        return self._dev[key]

    def _rotated(self, c, k) -> torch.Tensor:
        vals = _lookup(c.token["codes"], k["tab"], self.group, self.dim)
        return vals * c.token["norms"].float().unsqueeze(-1)

    def _signs(self, c, k) -> tuple[torch.Tensor, torch.Tensor]:
        signs = _lookup(c.token["qjl"], k["signs"], 1, self.q.m)
        coef = c.token["rnorms"].float() * (_SQRT_PI_OVER_2 / self.q.m)
        return signs, coef

    def scores(self, c, queries: torch.Tensor) -> torch.Tensor:
        k = self._consts(c.device)
        pre = _precond(c)
        q = queries.float()
        q_rot = pre.scale_queries(q) @ k["rot"].T
        s = q_rot @ self._rotated(c, k).transpose(-1, -2)
        if self.prod:
            signs, coef = self._signs(c, k)
            s = s + ((q_rot @ k["S"].T) @ signs.transpose(-1, -2)) * coef.unsqueeze(-2)
        off = pre.query_offset(q)
        return s if off is None else s + off

    def weighted_sum(self, c, weights: torch.Tensor) -> torch.Tensor:
        k = self._consts(c.device)
        pre = _precond(c)
        w = weights.float()
        acc = w @ self._rotated(c, k)
        if self.prod:
            signs, coef = self._signs(c, k)
            acc = acc + ((w * coef.unsqueeze(-2)) @ signs) @ k["S"]
        out = pre.scale_queries(acc @ k["rot"])
        off = pre.output_offset(w)
        return out if off is None else out + off


def _precond(c):
    return ChannelPreconditioner.from_side(c.side)
