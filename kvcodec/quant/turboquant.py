"""TurboQuant (Zandieh et al. 2025): rotate, quantize every coordinate with a Lloyd-Max codebook.

TurboQuantMSE(dim, bits): x' = precondition(x); keep ||x'|| (fp16, bf16 if out of range);
y = (x'/||x'||) @ rotation.T; codes = b-bit index of the nearest centroid of every y_j, bit-packed.
TurboQuantProd(dim, bits): TurboQuantMSE at bits-1, then 1-bit QJL on the residual r (rotated
space): sign bits of S r and ||r||, so <q, x_hat> is an unbiased estimate of <q, x>.

Attention runs on the packed form, chunked over tokens: the query is preconditioned and rotated
once (<q, R^T c> = <R q, c>), outputs are accumulated in rotated space and rotated back once.
precondition="none", norm_correction=False is the paper's algorithm exactly (the fidelity
tests use it); the defaults (per-channel centering, norm correction) win on real KV, see
precondition.py, _encode_mse and docs/quant.md for the measurements.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant import base, turboquant_fast
from kvcodec.quant.base import KVQuantizer
from kvcodec.quant.codebooks import lloyd_max_codebook
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.packed import PackedKV
from kvcodec.quant.packing import (
    lookup_group,
    pack_bits,
    pack_signs,
    packed_width,
    unpack_bits,
    unpack_values,
    value_table,
)
from kvcodec.quant.precondition import ChannelPreconditioner, calibrate, check_mode
from kvcodec.quant.rotations import haar_orthogonal, resolve_kind, rng_for, rotation_matrix

_PURPOSE_QJL = 0x514A4C  # "QJL"
SQRT_PI_OVER_2 = math.sqrt(math.pi / 2)


def qjl_matrix(dim: int, m: int, seed: int, orthogonal: bool = True) -> torch.Tensor:
    """The float32 [m, dim] QJL sketch S, normalized so sqrt(pi/2)/m * <S q, sign(S r)> * ||r|| is unbiased.

    orthogonal=False: iid N(0, 1) entries (E|<s, r_hat>| = sqrt(2/pi)).
    orthogonal=True: rows of Haar orthogonal blocks (independent blocks when m > dim), each row
    scaled to length sqrt(2/pi) / E|u_1| (u uniform on the unit sphere), which gives exactly the same
    E[sign(<s, r>) <s, q>] = sqrt(2/pi) <q, r>/||r|| as Gaussian rows, with less variance.
    """
    rng = rng_for(seed, _PURPOSE_QJL + m, dim)
    if not orthogonal:
        return torch.from_numpy(rng.standard_normal((m, dim)).astype(np.float32))
    blocks, left = [], m
    while left > 0:
        q = haar_orthogonal(dim, rng)
        blocks.append(q[: min(left, dim)])
        left -= dim
    e_abs_u1 = math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)
    s = np.concatenate(blocks) * (math.sqrt(2 / math.pi) / e_abs_u1)
    return torch.from_numpy(s.astype(np.float32))


def resolve_precond(quantizer, x: torch.Tensor, precond) -> ChannelPreconditioner:
    """None: calibrate on x with the quantizer's mode; a QuantizedTensor: reuse its side data."""
    if precond is None:
        return calibrate(x, quantizer.precondition)
    if isinstance(precond, QuantizedTensor):
        precond = ChannelPreconditioner.from_side(precond.side)
    if not isinstance(precond, ChannelPreconditioner):
        raise ValueError("precond must be None, a ChannelPreconditioner or a QuantizedTensor")
    want = {"none": set(), "center": {"center"}, "scale": {"center", "scale"}}[quantizer.precondition]
    if set(precond.side_fields()) != want:
        raise ValueError(f"precond holds {sorted(precond.side_fields())}, precondition={quantizer.precondition!r} needs {sorted(want)}")
    for t in precond.side_fields().values():
        if t.shape[-1] != x.shape[-1] or t.ndim != x.ndim or any(
                s not in (1, l) for s, l in zip(t.shape[:-2], x.shape[:-2])):
            raise ValueError(f"preconditioner shape {tuple(t.shape)} does not fit x {tuple(x.shape)}")
    return precond.to(x.device)


def _fold_gqa(c: QuantizedTensor, x: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    """GQA: ``x`` [..., Hq, R, W] against a compressed [..., Hkv, T, D] with Hq a multiple of Hkv
    becomes [..., Hkv, (Hq // Hkv) * R, W]: query head h reads KV head h // (Hq // Hkv), as in
    Hugging Face models. Returns (x, group); shapes that broadcast already come back with group 1.
    Any other head count is a ValueError."""
    lead, kv = tuple(x.shape[:-2]), tuple(c.lead_shape)
    try:
        torch.broadcast_shapes(lead, kv)
        return x, 1
    except RuntimeError:
        pass
    if len(lead) == len(kv) and kv and kv[-1] > 0 and lead[-1] % kv[-1] == 0:
        group = lead[-1] // kv[-1]
        folded = x.reshape(*lead[:-1], kv[-1], group * x.shape[-2], x.shape[-1])
        try:
            torch.broadcast_shapes(folded.shape[:-2], kv)
            return folded, group
        except RuntimeError:
            pass
    raise ValueError(
        f"{what} shaped {tuple(x.shape)} do not fit compressed keys/values with leading shape {kv}: "
        "the leading dims must broadcast, or the head axis (just before the last two) must be a "
        "multiple of the KV heads (GQA)"
    )


def _unfold_gqa(out: torch.Tensor, group: int) -> torch.Tensor:
    """[..., Hkv, group * R, W] -> [..., Hkv * group, R, W] (undoes :func:`_fold_gqa`)."""
    return out.reshape(*out.shape[:-3], out.shape[-3] * group, out.shape[-2] // group, out.shape[-1])


class TurboQuantMSE(KVQuantizer):
    """MSE-optimal TurboQuant: b bits per coordinate + one fp16 norm per vector.

    dim: head_dim (>= 4; any value, power-of-two dims get a randomized Hadamard rotation).
    bits: 1..8. seed: selects the rotation. rotation: "auto" | "qr" | "hadamard" | "hadamard2".
    precondition: "center" (default: subtract the per-channel mean of the calibration block),
    "scale" (also divide by per-channel scales, best for keys with calibrate(keys, queries)) or
    "none". norm_correction (default True) stores ||x'||/<y, c> instead of ||x'||.
    precondition="none", norm_correction=False is the paper's algorithm exactly.
    """

    method = "turboquant_mse"

    def __init__(self, dim: int, bits: int, seed: int = 0, rotation: str = "auto", precondition: str = "center",
                 norm_correction: bool = True):
        self.dim = base.check_dim(dim)
        self.norm_correction = bool(norm_correction)
        self.bits = base.check_bits(bits)
        self.seed = int(seed)
        self.rotation_kind = resolve_kind(rotation, self.dim)
        self.precondition = check_mode(precondition)
        self.rotation = rotation_matrix(self.dim, self.seed, self.rotation_kind)
        self.codebook = torch.from_numpy(lloyd_max_codebook(self.dim, self._mse_bits).astype(np.float32))
        # codes unpack straight to codebook values by table lookup where the bit width allows
        self._lookup = lookup_group(self._mse_bits, packed_width(self.dim, self._mse_bits))
        self._dev = {}

    _mse_bits = property(lambda self: self.bits)

    def config(self) -> dict:
        return {"method": self.method, "dim": self.dim, "bits": self.bits, "seed": self.seed,
                "rotation": self.rotation_kind, "precondition": self.precondition,
                "norm_correction": self.norm_correction}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.config().items() if k != 'method')})"

    # ------------------------------------------------------------------ device constants
    def _consts(self, device) -> dict:
        device = torch.device(device)
        key = str(device)
        if key not in self._dev:
            cb = self.codebook.to(device)
            self._dev[key] = {"rot": self.rotation.to(device), "cb": cb, "thr": (cb[1:] + cb[:-1]) / 2,
                              **self._extra_consts(device)}
            if self._lookup:
                values = tuple(float(x) for x in self.codebook.tolist())
                self._dev[key]["tab"] = value_table(values, self._mse_bits, self._lookup, key)
        return self._dev[key]

    def _extra_consts(self, device) -> dict:
        return {}

    def calibrate(self, x: torch.Tensor, queries: torch.Tensor | None = None, batch_dims: tuple = ()) -> ChannelPreconditioner:
        """Per-channel statistics for this quantizer's precondition mode (see precondition.calibrate)."""
        base.check_input(x, self.dim)
        return calibrate(x, self.precondition, queries=queries, batch_dims=batch_dims)

    # ------------------------------------------------------------------ encode
    def _encode_mse(self, xp: torch.Tensor, k: dict):
        """-> (unit rotated y, centroid indices, ||x'||, the scale to store in ``norms``).

        With norm_correction the stored scale is ||x'|| / <y, c> (c = the chosen centroids), so
        <x', x_hat'> = ||x'||^2 exactly: a Lloyd-Max reconstruction is shrunk by about (1 - D_b),
        which shrinks every attention logit by the same factor (a temperature error that hurts
        peaked heads); the correction removes it at no storage cost.
        """
        norms = base.row_norms(xp, check=False)  # checked once per encode (quantize: settle_norms)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        y = (xp / safe.unsqueeze(-1)) @ k["rot"].T
        idx, chosen = turboquant_fast.bucketize(y, k["thr"], k["cb"])  # compiled on the CPU, same indices
        scale = norms
        if self.norm_correction:
            dot = (y * chosen).sum(-1)
            scale = torch.where(dot > 0, norms / torch.where(dot > 0, dot, torch.ones_like(dot)), norms)
        return y, idx, norms, scale

    def quantize(self, x: torch.Tensor, precond=None) -> QuantizedTensor:
        """x [..., N, dim] (fp16/bf16/fp32, any device) -> packed QuantizedTensor.

        precond: None (calibrate on x when preconditioning is on), a ChannelPreconditioner, or an
        earlier QuantizedTensor whose side data to reuse (so the two can be concatenated).
        """
        base.check_input(x, self.dim, finite=False)  # the values: with the norms, at the end
        pre = resolve_precond(self, x, precond)
        k = self._consts(x.device)
        lead, T = tuple(x.shape[:-2]), x.shape[-2]
        # chunk over tokens so the float temporaries stay bounded for long prefills
        n_lead = max(1, math.prod(lead))
        step = max(1, base.chunk_elements(x.device) // (n_lead * self.dim * (self._mse_bits + 4)))
        parts = {"codes": [], "norms": [], "qjl": [], "rnorms": []}
        for t0 in range(0, max(T, 1), step):
            xp = pre.apply(x[..., t0:t0 + step, :].float())
            y, idx, norms, scale = self._encode_mse(xp, k)
            parts["codes"].append(pack_bits(idx, self._mse_bits))
            parts["norms"].append(scale)
            extra = self._encode_extra(y, idx, norms, scale, k)
            if extra:
                parts["qjl"].append(extra["qjl"])
                parts["rnorms"].append(extra["rnorms"])
        token = {name: torch.cat(v, dim=-2 if name in ("codes", "qjl") else -1) for name, v in parts.items() if v}
        dt = base.settle_norms(x, token["norms"], *([token["rnorms"]] if "rnorms" in token else []))
        token["norms"] = token["norms"].to(dt)
        if "rnorms" in token:
            token["rnorms"] = token["rnorms"].to(dt)
        return QuantizedTensor(config=self.config(), lead_shape=lead, num_tokens=T,
                               dim=self.dim, token=token, side=pre.side_fields())

    def _encode_extra(self, y, idx, norms, scale, k) -> dict:
        return {}

    # ------------------------------------------------------------------ decode
    def _rotated_chunk(self, c: QuantizedTensor, t0: int, t1: int, k: dict) -> torch.Tensor:
        """MSE reconstruction of tokens [t0, t1) in rotated, preconditioned space: [..., n, D] float32."""
        codes = c.token["codes"][..., t0:t1, :]
        if "tab" in k:
            vals = unpack_values(codes, k["tab"], self._lookup, self.dim)
        else:
            vals = k["cb"][unpack_bits(codes, self._mse_bits, self.dim)]
        return vals * c.token["norms"][..., t0:t1].float().unsqueeze(-1)

    def dequantize(self, c: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reconstruction x_hat [..., N, dim] (materializes everything; attention should use scores/weighted_sum)."""
        self._own(c)
        k = self._consts(c.device)
        pre = ChannelPreconditioner.from_side(c.side)
        rot = self._rotated_chunk(c, 0, c.num_tokens, k) + self._residual_rotated(c, 0, c.num_tokens, k)
        return pre.invert(rot @ k["rot"]).to(dtype)

    def _residual_rotated(self, c, t0, t1, k):
        return 0.0

    def scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        """queries [..., Q, dim] -> [..., Q, N] estimates of queries @ x.T from the packed form.
        GQA: queries [B, Hq, Q, dim] against keys [B, Hkv, N, dim], Hq a multiple of Hkv."""
        self._own(c)
        q = base.check_queries(c, queries, self.dim)
        q, group = _fold_gqa(c, q, "queries")
        if group > 1:  # GQA: each KV head scores its group of query heads as one block of queries
            return _unfold_gqa(self.scores(c, q), group)
        return self._scores(c, q, base.token_chunk(c, self.dim + self._extra_width()))

    def attention_scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        """``scores`` for a caller that made ``c`` and bounds its length itself (the HF cache): no
        argument checks (they synchronize with the device) and no chunking."""
        return self._scores(c, queries.float(), max(c.num_tokens, 1))

    def _scores(self, c: QuantizedTensor, q: torch.Tensor, step: int) -> torch.Tensor:
        k = self._consts(c.device)
        pre = ChannelPreconditioner.from_side(c.side)
        q_rot = pre.scale_queries(q) @ k["rot"].T
        q_side = self._query_side(q_rot, k)
        parts = []
        for t0 in range(0, c.num_tokens, step):
            t1 = min(t0 + step, c.num_tokens)
            s = q_rot @ self._rotated_chunk(c, t0, t1, k).transpose(-1, -2)
            parts.append(self._add_residual_scores(s, q_side, c, t0, t1, k))
        out = base.cat_scores(parts, q, c)
        off = pre.query_offset(q) if parts else None
        return out if off is None else out + off

    def weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        """weights [..., Q, N] -> weights @ x_hat [..., Q, dim], accumulated in rotated space.
        GQA: weights [B, Hq, Q, N] against values [B, Hkv, N, dim], Hq a multiple of Hkv."""
        self._own(c)
        w = base.check_weights(c, weights)
        w, group = _fold_gqa(c, w, "weights")
        if group > 1:  # GQA, as in scores
            return _unfold_gqa(self.weighted_sum(c, w), group)
        return self._weighted_sum(c, w, base.token_chunk(c, self.dim + self._extra_width()))

    def attention_weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        """``weighted_sum`` without argument checks or chunking (see attention_scores)."""
        return self._weighted_sum(c, weights.float(), max(c.num_tokens, 1))

    def _weighted_sum(self, c: QuantizedTensor, w: torch.Tensor, step: int) -> torch.Tensor:
        k = self._consts(c.device)
        pre = ChannelPreconditioner.from_side(c.side)
        lead = torch.broadcast_shapes(w.shape[:-2], c.lead_shape)
        acc = w.new_zeros((*lead, w.shape[-2], self.dim))
        acc_side = None
        for t0 in range(0, c.num_tokens, step):
            t1 = min(t0 + step, c.num_tokens)
            wc = w[..., t0:t1]
            acc = acc + wc @ self._rotated_chunk(c, t0, t1, k)
            acc_side = self._accumulate_residual(acc_side, wc, c, t0, t1, k)
        if acc_side is not None:
            acc = acc + acc_side @ k["S"]
        out = pre.scale_queries(acc @ k["rot"])  # undo the channel scale: multiply by scale
        off = pre.output_offset(w)
        return out if off is None else out + off

    # hooks for the QJL residual (TurboQuantProd)
    def _extra_width(self) -> int:
        return 0

    def _query_side(self, q_rot, k):
        return None

    def _add_residual_scores(self, s, q_side, c, t0, t1, k):
        return s

    def _accumulate_residual(self, acc, wc, c, t0, t1, k):
        return acc

    # ------------------------------------------------------------------ checks
    def validate(self, c: QuantizedTensor) -> None:
        """Raise CorruptStreamError unless c has exactly the fields and shapes this quantizer makes."""
        if c.config != self.config():
            raise CorruptStreamError("config mismatch")
        if c.dim != self.dim or c.grouped:
            raise CorruptStreamError("dim mismatch or unexpected grouped fields")
        T = c.num_tokens
        base.expect(c, "token", "codes", torch.uint8, (T, packed_width(self.dim, self._mse_bits)))
        norms = base.expect(c, "token", "norms", (torch.float16, torch.bfloat16), (T,))
        if norms.numel() and bool((norms < 0).any()):
            raise CorruptStreamError("negative norms")
        want_tok = {"codes", "norms"} | self._extra_fields()
        if set(c.token) != want_tok:
            raise CorruptStreamError(f"token fields {sorted(c.token)}, expected {sorted(want_tok)}")
        if "rnorms" in want_tok:
            base.expect(c, "token", "qjl", torch.uint8, (T, self.m // 8))
            r = base.expect(c, "token", "rnorms", norms.dtype, (T,))
            if r.numel() and bool((r < 0).any()):
                raise CorruptStreamError("negative residual norms")
        want_side = {"none": set(), "center": {"center"}, "scale": {"center", "scale"}}[self.precondition]
        if set(c.side) != want_side:
            raise CorruptStreamError(f"side fields {sorted(c.side)}, expected {sorted(want_side)}")
        for name in want_side:
            base.expect(c, "side", name, torch.float16, (1, self.dim))
        if "scale" in c.side and bool((c.side["scale"] <= 0).any()):
            raise CorruptStreamError("non-positive channel scale")

    def _extra_fields(self) -> set:
        return set()

    # ------------------------------------------------------------------ kernels
    def packed(self, c: QuantizedTensor) -> PackedKV:
        """c (made by this quantizer) as the fused attention kernel reads it: its codes, norms and side
        data with this quantizer's rotation and codebook (the same tensors, no copies)."""
        return PackedKV(c.token["codes"], c.token["norms"], self._mse_bits, self.rotation, self.codebook,
                        scale=c.side.get("scale"), center=c.side.get("center"), **self._packed_extra(c))

    def _packed_extra(self, c: QuantizedTensor) -> dict:
        return {}


class TurboQuantProd(TurboQuantMSE):
    """Inner-product TurboQuant: TurboQuantMSE at bits-1 plus a 1-bit QJL sketch of the residual.

    The QJL term of a score is rnorms[t] * sqrt(pi/2)/m * <S q_rot, signs[t]> with S =
    ``self.qjl_matrix`` [m, dim] (see qjl_matrix for its normalization); the estimate of q.x is
    unbiased. m defaults to dim (the paper) and must be a multiple of 8. bits: 2..9.
    """

    method = "turboquant_prod"

    def __init__(self, dim: int, bits: int, seed: int = 0, m: int | None = None, rotation: str = "auto",
                 precondition: str = "center", norm_correction: bool = True, orthogonal: bool = True):
        base.check_bits(bits, 2, 9)
        d = base.check_dim(dim)
        self.m = d if m is None else m
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 8 or self.m % 8:
            raise ValueError(f"m must be a positive multiple of 8, got {m!r}")
        self.orthogonal = bool(orthogonal)
        self._bits_total = bits
        super().__init__(d, bits - 1, seed, rotation, precondition, norm_correction)
        self.bits = bits
        self.qjl_matrix = qjl_matrix(self.dim, self.m, self.seed, self.orthogonal)

    _mse_bits = property(lambda self: self._bits_total - 1)

    def config(self) -> dict:
        cfg = super().config()
        cfg.update(m=self.m, orthogonal=self.orthogonal)
        return cfg

    def _extra_consts(self, device) -> dict:
        return {"S": self.qjl_matrix.to(device), "signs": value_table((-1.0, 1.0), 1, 1, str(torch.device(device)))}

    def _extra_fields(self) -> set:
        return {"qjl", "rnorms"}

    def _extra_width(self) -> int:
        return self.m

    def _packed_extra(self, c: QuantizedTensor) -> dict:
        return {"qjl": c.token["qjl"], "rnorms": c.token["rnorms"], "qjl_matrix": self.qjl_matrix}

    def _encode_extra(self, y, idx, norms, scale, k) -> dict:
        # residual in rotated space, against the scale as it will be stored
        dt = base.storage_dtype(scale)
        n_st = scale.to(dt).float().unsqueeze(-1)
        r = y * norms.unsqueeze(-1) - k["cb"][idx] * n_st
        return {"qjl": pack_signs(r @ k["S"].T), "rnorms": base.row_norms(r, check=False)}

    def _coef(self, c, t0, t1):
        return c.token["rnorms"][..., t0:t1].float() * (SQRT_PI_OVER_2 / self.m)

    def _signs(self, c, t0, t1, k):
        """The QJL sign bits of tokens [t0, t1) as +-1.0 [..., n, m] (table lookup, like the codes)."""
        return unpack_values(c.token["qjl"][..., t0:t1, :], k["signs"], 1, self.m)

    def _residual_rotated(self, c, t0, t1, k):
        return (self._signs(c, t0, t1, k) @ k["S"]) * self._coef(c, t0, t1).unsqueeze(-1)

    def _query_side(self, q_rot, k):
        return q_rot @ k["S"].T

    def _add_residual_scores(self, s, q_side, c, t0, t1, k):
        signs = self._signs(c, t0, t1, k)
        return s + (q_side @ signs.transpose(-1, -2)) * self._coef(c, t0, t1).unsqueeze(-2)

    def _accumulate_residual(self, acc, wc, c, t0, t1, k):
        signs = self._signs(c, t0, t1, k)
        part = (wc * self._coef(c, t0, t1).unsqueeze(-2)) @ signs
        return part if acc is None else acc + part
