"""TurboQuant MSE on the CPU in one compiled pass per row: the stored-chunk codec's fast path.

Why: ``TurboQuantMSE.quantize`` runs a row through seven torch ops (norms, a D x D matmul for the
rotation, the centroid search, the norm correction, the bit packing), each over the whole chunk
with its own float32 temporaries; on one core of a 2-core AMD EPYC that is ~50 ms for an LMCache
chunk of SmolLM2 (30 layers x 256 tokens x 192 channels, K and V), 0.1 GB/s. Here each row is
normalised, rotated, searched, corrected and packed while it sits in L1, and Hadamard rotations
(the default for power-of-two head dims) are two fast Walsh-Hadamard transforms (12 adds per
value at D = 64, against 128 multiply-adds for the matmul). Rows are split over threads with the
GIL released (``turboquant_fast.workers``).

What it writes is an ordinary ``QuantizedTensor`` of the quantizer's format: every reader decodes
it, and ``dequantize`` here reads any of them. The floats are summed in another order than torch's
matmul, so a coordinate that lies within float32 rounding of a centroid boundary can take the
neighbouring code (the same kind of difference as the CUDA quantizer's) and a norm can differ in
its last bits before it is rounded to its storage dtype; tests/test_turboquant_rows.py bounds both
against the torch path.

Applies to ``TurboQuantMSE`` itself (not its QJL or outlier variants) with a Hadamard rotation, on CPU
tensors; anything else goes to the quantizer's own methods.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from kvcodec.quant import base, turboquant_fast
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.packing import packed_width
from kvcodec.quant.precondition import ChannelPreconditioner
from kvcodec.quant.rotations import hadamard_signs
from kvcodec.quant.turboquant import TurboQuantMSE, resolve_precond

# rotation kinds as the kernels see them
_HADAMARD, _HADAMARD2 = 1, 2


# sums may be reassociated (vector lanes) and multiply-adds fused; NaN and Inf keep their meaning
_FAST = {"reassoc", "contract"}
LANES = 16  # rows rotated together: a butterfly is one vector operation over these rows


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _fwht(v, m):  # pragma: no cover - compiled
    """In place, unnormalised, on the first m lanes of v [D, LANES]: v <- H v (Sylvester order)."""
    n = v.shape[0]
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                for r in range(m):
                    a = v[j, r]
                    b = v[j + h, r]
                    v[j, r] = a + b
                    v[j + h, r] = a - b
        h *= 2


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _hadamard_rounds(out, m, kind, s2):  # pragma: no cover - compiled
    """out <- H out, or H diag(s2) H out ("hadamard2"), on the first m lanes: the part R and R^T share."""
    _fwht(out, m)
    if kind == _HADAMARD2:
        for j in range(out.shape[0]):
            for r in range(m):
                out[j, r] *= s2[j]
        _fwht(out, m)


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _rotate(u, m, kind, s1, s2, post, out):  # pragma: no cover - compiled
    """out <- R u for the first m lanes of u [D, LANES]: H diag(s2) H diag(s1) u / D ("hadamard2") or
    H diag(s1) u / sqrt(D) ("hadamard")."""
    d = u.shape[0]
    for j in range(d):
        for r in range(m):
            out[j, r] = u[j, r] * s1[j]
    _hadamard_rounds(out, m, kind, s2)
    for j in range(d):
        for r in range(m):
            out[j, r] *= post


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _rotate_back(v, m, kind, s1, s2, post, out):  # pragma: no cover - compiled
    """out <- R^T v for the first m lanes of v [D, LANES] (the inverse rotation)."""
    d = v.shape[0]
    for j in range(d):
        for r in range(m):
            out[j, r] = v[j, r]
    _hadamard_rounds(out, m, kind, s2)
    for j in range(d):
        f = s1[j] * post
        for r in range(m):
            out[j, r] *= f


@njit(nogil=True, cache=True, fastmath=_FAST)
def _encode_rows(x, center, scale, per, kind, s1, s2, post, thr, cb, bits, correct, codes, scales):  # pragma: no cover
    """Per row of x [n, D] float32: codes [n, width] (tq layout v1) and the stored scale (||x'|| / <y, c>
    with the norm correction, else ||x'||; NaN when the row holds NaN or Inf), x' = (x - center) / scale
    with the preconditioner row of the row's leading index (``per`` rows each; zeros and ones without
    one: an exact no-op). Rows go LANES at a time: the rotation runs across the block's rows (transposed),
    everything else along each row."""
    n, d = x.shape
    u = np.empty((d, LANES), np.float32)
    y = np.empty((d, LANES), np.float32)
    xp = np.empty(d, np.float32)
    yr = np.empty(d, np.float32)
    count = np.empty(d, np.int64)
    idx = np.empty(d, np.int64)
    vals = np.empty(d, np.float32)
    norm = np.empty(LANES, np.float32)
    for r0 in range(0, n, LANES):
        m = min(LANES, n - r0)
        for r in range(m):  # row by row (vectorized along the row): precondition, norm, unit row
            row = x[r0 + r]
            lead = (r0 + r) // per
            c, sc = center[lead], scale[lead]
            amax = np.float32(0.0)
            for j in range(d):
                xp[j] = (row[j] - c[j]) / sc[j]
                a = abs(xp[j])
                amax = a if a > amax else amax  # a NaN is skipped here and caught by the sum below
            safe = amax if amax > 0 else np.float32(1.0)
            ss = np.float32(0.0)
            for j in range(d):
                t = xp[j] / safe
                ss += t * t
            nr = np.float32(math.sqrt(ss)) * amax
            norm[r] = nr
            inv = nr if nr > 0 else np.float32(1.0)
            for j in range(d):
                u[j, r] = xp[j] / inv
        _rotate(u, m, kind, s1, s2, post, y)  # across the block's rows
        for r in range(m):  # row by row again: centroid search, norm correction, packing
            for j in range(d):
                yr[j] = y[j, r]
            turboquant_fast.bucketize_row(yr, thr, cb, count, idx, vals)
            dot = np.float32(0.0)
            for j in range(d):
                dot += yr[j] * vals[j]
            turboquant_fast.pack_row(idx, bits, codes[r0 + r])
            nr = norm[r]
            scales[r0 + r] = nr / dot if correct and dot > 0 else nr


@njit(nogil=True, cache=True, inline="always")
def _bf16_bits(x, u):  # pragma: no cover - compiled
    """The bfloat16 bits of float32 ``x`` (``u``: its bits) rounded as torch rounds, to nearest even (a NaN
    gives 0x7FC0)."""
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(0x7FC0) if x != x else np.uint16(r)


@njit(nogil=True, cache=True, fastmath=_FAST)
def _decode_rows(codes, norms, center, scale, per, kind, s1, s2, post, cb, bits, out, bf16, heads, t_total, first,
                 lead0):  # pragma: no cover
    """R^T (cb[codes] * norm) * scale + center per row, LANES rows at a time, into ``out``: row i itself
    (heads == 0; out [n, D] float32), or, for rows of leading index lead0 + i // per = (layer, head) and
    token t = i % per, out[layer * t_total + first + t, head * D : (head + 1) * D] of an LMCache chunk part
    [layers * t_total, heads * D] (float32, or with ``bf16`` uint16 holding bfloat16 bits)."""
    n = codes.shape[0]
    d = center.shape[1]
    mask = (1 << bits) - 1
    v = np.empty((d, LANES), np.float32)
    w = np.empty((d, LANES), np.float32)
    row_f = np.empty(d, np.float32)
    row_u = row_f.view(np.uint32)
    for r0 in range(0, n, LANES):
        m = min(LANES, n - r0)
        for r in range(m):
            row = codes[r0 + r]
            nr = norms[r0 + r]
            if bits == 4 and d % 2 == 0:
                for b in range(d // 2):
                    c = row[b]
                    v[2 * b, r] = cb[c & 15] * nr
                    v[2 * b + 1, r] = cb[c >> 4] * nr
            elif bits == 8:
                for j in range(d):
                    v[j, r] = cb[row[j]] * nr
            else:
                pos = 0
                for j in range(d):
                    byte, shift = pos >> 3, pos & 7
                    c = np.int64(row[byte]) >> shift
                    if shift + bits > 8:
                        c |= np.int64(row[byte + 1]) << (8 - shift)
                    v[j, r] = cb[c & mask] * nr
                    pos += bits
        _rotate_back(v, m, kind, s1, s2, post, w)
        for r in range(m):
            i = r0 + r
            lead = i // per
            c, sc = center[lead], scale[lead]
            if heads == 0:
                dst, col = i, 0
            else:
                g = lead0 + lead
                dst, col = (g // heads) * t_total + first + i % per, (g % heads) * d
            o = out[dst]
            for j in range(d):
                row_f[j] = w[j, r] * sc[j] + c[j]
            if bf16:
                for j in range(d):
                    o[col + j] = _bf16_bits(row_f[j], row_u[j])
            else:
                for j in range(d):
                    o[col + j] = row_f[j]


class _Plan:
    """A quantizer's constants as the kernels take them (built once per quantizer)."""

    def __init__(self, q: TurboQuantMSE):
        d = q.dim
        signs = hadamard_signs(d, q.seed, q.rotation_kind)
        self.kind = _HADAMARD2 if q.rotation_kind == "hadamard2" else _HADAMARD
        self.s1 = signs[0].astype(np.float32)
        self.s2 = signs[-1].astype(np.float32)  # unused by "hadamard"
        self.post = np.float32(1.0 / d if self.kind == _HADAMARD2 else 1.0 / math.sqrt(d))
        self.cb = np.ascontiguousarray(q.codebook.numpy(), np.float32)
        self.thr = np.ascontiguousarray(((q.codebook[1:] + q.codebook[:-1]) / 2).numpy(), np.float32)
        self.bits = q.bits
        self.width = packed_width(d, q.bits)

    def args(self):
        return self.kind, self.s1, self.s2, self.post


_PLANS: dict[int, tuple] = {}


def _plan(q: TurboQuantMSE) -> _Plan:
    hit = _PLANS.get(id(q))
    if hit is None or hit[0] is not q:
        hit = _PLANS[id(q)] = (q, _Plan(q))
    return hit[1]


def applies(q, *tensors: torch.Tensor) -> bool:
    """True where this module codes for ``q``: exactly TurboQuantMSE with a Hadamard rotation (power-of-two
    head dims: the default), CPU tensors, compiled paths on (``turboquant_fast.disabled()`` turns it off)."""
    return (type(q) is TurboQuantMSE and q.rotation_kind in ("hadamard", "hadamard2")
            and turboquant_fast.usable(*tensors))


def _side_rows(pre: ChannelPreconditioner, lead: tuple, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """center and scale [prod(lead), D] float32 as the kernels read them (zeros and ones where absent)."""
    n_lead = math.prod(lead)
    out = []
    for t, fill in ((pre.center, 0.0), (pre.scale, 1.0)):
        if t is None:
            out.append(np.full((n_lead, dim), fill, np.float32))
        else:
            out.append(np.ascontiguousarray(t.float().expand(*lead, 1, dim).reshape(n_lead, dim).numpy()))
    return out[0], out[1]


def quantize(q, x: torch.Tensor, precond=None) -> QuantizedTensor:
    """``q.quantize(x, precond)`` in one compiled pass per row where :func:`applies`, else ``q.quantize``."""
    if not applies(q, x) or x.numel() == 0:
        return q.quantize(x, precond)
    base.check_input(x, q.dim, finite=False)
    pre = resolve_precond(q, x, precond)
    plan = _plan(q)
    lead, n_tokens = tuple(x.shape[:-2]), x.shape[-2]
    center, scale = _side_rows(pre, lead, q.dim)
    rows = turboquant_fast._rows(x.float())
    codes = np.empty((rows.shape[0], plan.width), np.uint8)
    scales = np.empty(rows.shape[0], np.float32)

    def run(lo, hi):
        _encode_rows(rows[lo:hi], center[lo // n_tokens:], scale[lo // n_tokens:], n_tokens, *plan.args(), plan.thr,
                     plan.cb, plan.bits, q.norm_correction, codes[lo:hi], scales[lo:hi])

    turboquant_fast.split_ranges(run, rows.shape[0], n_tokens)  # ranges of whole leading indices
    norms = torch.from_numpy(scales).reshape(*lead, n_tokens)
    dt = base.settle_norms(x, norms)
    token = {"codes": torch.from_numpy(codes).reshape(*lead, n_tokens, plan.width), "norms": norms.to(dt)}
    return QuantizedTensor(config=q.config(), lead_shape=lead, num_tokens=n_tokens, dim=q.dim, token=token,
                           side=pre.side_fields())


def _decode_plan(c: QuantizedTensor):
    """(quantizer, plan, codes rows, norms, center, scale) for the kernels, or None where they do not apply."""
    q = c.quantizer
    codes, norms = c.token.get("codes"), c.token.get("norms")
    if (not applies(q, *c.token.values(), *c.side.values()) or codes is None or norms is None
            or c.num_tokens == 0 or set(c.token) != {"codes", "norms"}):
        return None
    q._own(c)
    center, scale = _side_rows(ChannelPreconditioner.from_side(c.side), tuple(c.lead_shape), q.dim)
    nr = turboquant_fast._rows(norms.float().unsqueeze(-1))[:, 0].copy()
    return q, _plan(q), turboquant_fast._rows(codes), nr, center, scale


def dequantize(c: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``c.dequantize(dtype)`` in one compiled pass per row where :func:`applies`, else ``c.dequantize``."""
    found = _decode_plan(c)
    if found is None:
        return c.dequantize(dtype)
    q, plan, rows, nr, center, scale = found
    n_tokens = c.num_tokens
    out = np.empty((rows.shape[0], q.dim), np.float32)

    def run(lo, hi):
        _decode_rows(rows[lo:hi], nr[lo:hi], center[lo // n_tokens:], scale[lo // n_tokens:], n_tokens,
                     *plan.args(), plan.cb, plan.bits, out[lo:hi], False, 0, 0, 0, 0)

    turboquant_fast.split_ranges(run, rows.shape[0], n_tokens)  # ranges of whole leading indices
    return torch.from_numpy(out).reshape(*c.lead_shape, n_tokens, q.dim).to(dtype)


def dequantize_into_chunk(c: QuantizedTensor, out: torch.Tensor, first: int) -> bool:
    """Write ``c`` ([layers, heads, T, D] codes) into tokens [first, first + T) of ``out``, an LMCache chunk
    part [layers, tokens, heads * D] (contiguous CPU bfloat16 or float32; bfloat16 rounded as torch
    rounds), without the float32 [layers, heads, T, D] intermediate. False (nothing written) where the
    kernels do not apply: the caller takes ``dequantize``."""
    found = _decode_plan(c) if out.dtype in (torch.bfloat16, torch.float32) else None
    if found is None or out.device.type != "cpu" or not out.is_contiguous() or out.dim() != 3:
        return False
    q, plan, rows, nr, center, scale = found
    layers, t_total, hidden = out.shape
    if len(c.lead_shape) != 2 or c.lead_shape[0] != layers or c.lead_shape[1] * q.dim != hidden \
            or not 0 <= first <= t_total - c.num_tokens:
        return False
    heads, n_tokens = c.lead_shape[1], c.num_tokens
    flat = out.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else out.numpy()
    flat = flat.reshape(layers * t_total, hidden)

    def run(lo, hi):
        _decode_rows(rows[lo:hi], nr[lo:hi], center[lo // n_tokens:], scale[lo // n_tokens:], n_tokens,
                     *plan.args(), plan.cb, plan.bits, flat, out.dtype == torch.bfloat16, heads, t_total, first,
                     lo // n_tokens)

    turboquant_fast.split_ranges(run, rows.shape[0], n_tokens)  # ranges of whole leading indices
    return True
