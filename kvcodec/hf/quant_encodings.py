"""Codecs backed by the vector quantizers of ``kvcodec.quant`` (TurboQuant, QJL, KIVI).

A block is a ``kvcodec.quant.QuantizedTensor`` [B, H, T, D]; attention reads it through the
quantizer's ``attention_scores`` / ``attention_weighted_sum`` (rotated-domain math on the packed codes,
no dense K/V; the cache made the block, so no argument checks) or, on CUDA, through ``packed`` and the
fused kernel (``kvcodec.quant.cuda.quantized``).

Side data (per-head preconditioners fitted on the layer's first compressed block) is computed
once per layer and shared by every later block (``precond=``), so it is held, and counted by
``side_nbytes``, once; ``nbytes(block)`` counts the block's own codes, norms and scales.
"""

from __future__ import annotations

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.hf import fitted
from kvcodec.quant import KIVI, QJL, QuantizedTensor, TurboQuantMSE, TurboQuantOutlier, TurboQuantProd


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
    d, dv = spec.head_dim, spec.value_dim
    ks, vs = layer_seed(spec.seed, layer_idx, 0), layer_seed(spec.seed, layer_idx, 1)
    if spec.method == "kivi":
        return (KIVI(spec.key_bits, group_size=KIVI_GROUP, axis="channel", dim=d),
                KIVI(spec.value_bits, group_size=KIVI_GROUP, axis="token", dim=dv))
    if spec.outliers:
        values = _outlier(dv, spec.outliers, spec.value_bits, vs, spec.value_precondition)
    else:
        values = TurboQuantMSE(dv, spec.value_bits, seed=vs, precondition=spec.value_precondition)
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


def make_quant_encodings(spec, layer_idx: int):
    """The layer's two encodings; with ``spec.calibration`` (kvcodec.hf.fitted) TurboQuant-MSE parts take
    its fitted codebooks and "scale"-preconditioned keys its query-aware channel scales."""
    kq, vq = make_quantizers(spec, layer_idx)
    name = getattr(spec, "calibration", None)
    if not name:
        return QuantEncoding(kq), QuantEncoding(vq)
    fit = fitted.lookup(name)
    fitted.check_shape(fit, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    for part, q in (("key", kq), ("value", vq)):
        if type(q) is TurboQuantMSE:
            fitted.apply_codebook(q, fit.codebook(part, q.bits))
    use_q = fit.query_rms is not None and type(kq) is TurboQuantMSE and kq.precondition == "scale"
    return QuantEncoding(kq, query_rms=fit.query_rms[layer_idx] if use_q else None), QuantEncoding(vq)


class QuantEncoding:
    """Adapter from a ``kvcodec.quant`` quantizer to the cache's codec interface (see codecs.py)."""

    decoded_attention = False
    mergeable = True  # packed codes concatenate along tokens: one block per layer, two calls per step

    def __init__(self, quantizer, query_rms: torch.Tensor | None = None):
        self.q = quantizer
        self.query_rms = query_rms  # [H, D]: fit the key scales query-aware (kvcodec.hf.fitted)
        self.name = type(quantizer).__name__
        # KIVI keys are grouped along tokens: compressed runs may only be cut / joined at group edges
        self.token_multiple = getattr(quantizer, "group_size", 1) if getattr(quantizer, "method", "") == "kivi" else 1
        self.precond = None  # zero-token QuantizedTensor carrying the layer's shared side data

    # ------------------------------------------------------------------ blocks
    def encode(self, x: torch.Tensor):
        if self.precond is None:
            pre = None
            if self.query_rms is not None:  # one "query" per head holding the channel RMS: its RMS is the RMS
                q = self.query_rms.to(x.device)[..., None, :].expand(*x.shape[:-2], 1, x.shape[-1])
                pre = self.q.calibrate(x, queries=q)
            c = self.q.quantize(x, precond=pre)
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
        return self.q.attention_scores(block, q)

    def weighted_sum(self, block, w: torch.Tensor) -> torch.Tensor:
        return self.q.attention_weighted_sum(block, w)

    def length(self, block) -> int:
        return block.num_tokens

    def truncate(self, block, n: int):
        t = block.slice_tokens(0, n)  # own copies of the kept codes, so the dropped ones are freed
        t.token = {k: v.clone() for k, v in t.token.items()}
        t.grouped = {k: v.clone() for k, v in t.grouped.items()}
        return t  # side tensors stay shared with the layer

    def drop(self, block, n: int):
        """The block without its first ``n`` tokens, in copies of its own (the dropped codes are freed)."""
        t = block.slice_tokens(n, block.num_tokens)
        t.token = {k: v.clone() for k, v in t.token.items()}
        t.grouped = {k: v.clone() for k, v in t.grouped.items()}
        return t

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
