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
tensors; anything else goes to the quantizer's own methods. :func:`quantize_chunk` reads an LMCache chunk
part (bfloat16 or float32) in place, its preconditioner statistics included, so the stored-chunk serde makes
no transposed float32 copy of the chunk.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from kvcodec.quant import base, turboquant_fast
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.packing import packed_width
from kvcodec.quant.precondition import ChannelPreconditioner, scaled
from kvcodec.quant.rotations import hadamard_signs
from kvcodec.quant.turboquant import TurboQuantMSE, resolve_precond

# rotation kinds as the kernels see them
_HADAMARD, _HADAMARD2 = 1, 2


# sums may be reassociated (vector lanes) and multiply-adds fused; NaN and Inf keep their meaning
_FAST = {"reassoc", "contract"}
LANES = 16  # rows rotated together: a butterfly is one vector operation over these rows


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _fwht(y):  # pragma: no cover - compiled
    """In place, unnormalised, on y [D, LANES]: y <- H y (Sylvester order). Two butterfly rounds (h, 2h) a
    pass over the block: the same sums in the same order as one round a pass, with half the loads and
    stores (the rounds are bound by them, not by the adds)."""
    d = y.shape[0]
    h = 1
    while 2 * h < d:
        for i in range(0, d, 4 * h):
            for j in range(i, i + h):
                for r in range(LANES):
                    a, b, c, e = y[j, r], y[j + h, r], y[j + 2 * h, r], y[j + 3 * h, r]
                    s0, s1, t0, t1 = a + b, a - b, c + e, c - e
                    y[j, r] = s0 + t0
                    y[j + h, r] = s1 + t1
                    y[j + 2 * h, r] = s0 - t0
                    y[j + 3 * h, r] = s1 - t1
        h *= 4
    if h < d:  # an odd number of rounds: the last one alone
        for j in range(h):
            for r in range(LANES):
                a, b = y[j, r], y[j + h, r]
                y[j, r] = a + b
                y[j + h, r] = a - b


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _hadamard_rounds(y, kind, s2):  # pragma: no cover - compiled
    """y <- H y, or H diag(s2) H y ("hadamard2"): the part R and R^T share."""
    _fwht(y)
    if kind == _HADAMARD2:
        for j in range(y.shape[0]):
            f = s2[j]
            for r in range(LANES):
                y[j, r] *= f
        _fwht(y)


@njit(nogil=True, cache=True, fastmath=_FAST, inline="always")
def _unit_row(row, center, inv_scale, u):  # pragma: no cover - compiled
    """u <- x' / ||x'|| with x' = (row - center) * inv_scale; returns ||x'|| (NaN for a NaN or Inf in the
    row). The plain sum of squares where it neither overflows nor underflows; else that of x' / max|x'|,
    scaled back."""
    d = row.shape[0]
    ss = np.float32(0.0)
    for j in range(d):
        v = (row[j] - center[j]) * inv_scale[j]
        u[j] = v
        ss += v * v
    if ss >= np.float32(1e-30) and ss <= np.float32(1e38):
        nr = np.float32(math.sqrt(ss))
    else:
        amax = np.float32(0.0)
        for j in range(d):
            a = abs(u[j])
            amax = a if a > amax else amax  # a NaN is skipped here and caught by the sum below
        safe = amax if amax > 0 else np.float32(1.0)
        ss = np.float32(0.0)
        for j in range(d):
            t = u[j] / safe
            ss += t * t
        nr = np.float32(math.sqrt(ss)) * amax
    inv = np.float32(1.0) / nr if nr > 0 else np.float32(1.0)
    for j in range(d):
        u[j] *= inv
    return nr


@njit(nogil=True, cache=True, inline="always")
def _chunk_row(i, per, heads, t_total, first, lead0, d):  # pragma: no cover - compiled
    """Where row i lives: (row, column) of x [n, D] itself (heads == 0), or, for rows of leading index
    g = lead0 + i // per = (layer, head) and token t = i % per, of an LMCache chunk part flattened to
    [layers * t_total, heads * D]: (layer * t_total + first + t, head * D)."""
    if heads == 0:
        return i, 0
    g = lead0 + i // per
    return (g // heads) * t_total + first + i % per, (g % heads) * d


@njit(nogil=True, cache=True, inline="always")
def _load_row(src, bf16, dst, col, row_u, row_f):  # pragma: no cover - compiled
    """row_f <- src[dst, col : col + D] as float32 (``bf16``: src holds bfloat16 bits; row_u views row_f)."""
    d = row_f.shape[0]
    if bf16:
        for j in range(d):
            row_u[j] = np.uint32(src[dst, col + j]) << np.uint32(16)
    else:
        for j in range(d):
            row_f[j] = src[dst, col + j]


@njit(nogil=True, cache=True)
def _channel_moments(src, bf16, heads, t_total, first, lead0, per, n, sums, squares):  # pragma: no cover
    """Per leading index of rows [0, n) (``per`` rows each, addressed as :func:`_chunk_row`): sums[lead] and
    squares[lead], each channel's sum of x and of x^2 over its rows, in float64 (one pass)."""
    d = sums.shape[1]
    row_f = np.empty(d, np.float32)
    row_u = row_f.view(np.uint32)
    s1 = np.empty(d, np.float64)
    s2 = np.empty(d, np.float64)
    for lead in range(n // per):
        for j in range(d):
            s1[j] = 0.0
            s2[j] = 0.0
        for t in range(per):
            dst, col = _chunk_row(lead * per + t, per, heads, t_total, first, lead0, d)
            _load_row(src, bf16, dst, col, row_u, row_f)
            for j in range(d):
                v = np.float64(row_f[j])
                s1[j] += v
                s2[j] += v * v
        for j in range(d):
            sums[lead, j] = s1[j]
            squares[lead, j] = s2[j]


@njit(nogil=True, cache=True, fastmath=_FAST)
def _encode_rows(src, bf16, heads, t_total, first, lead0, n, center, inv_scale, per, kind, s1, s2, post, thr, cb,
                 bits, correct, codes, scales):  # pragma: no cover - compiled
    """Per row i < n of the source (addressed as :func:`_chunk_row`; float32, or ``bf16`` bits): codes [n,
    width] (tq layout v1) and the stored scale (||x'|| / <y, c> with the norm correction, else ||x'||; NaN
    when the row holds NaN or Inf), x' = (x - center) * inv_scale with the preconditioner row of the row's
    leading index (``per`` rows each; zeros and ones without one: an exact no-op). Rows go LANES at a time:
    the rotation runs across the block's rows (transposed, so every butterfly is a vector operation),
    everything else along each row."""
    d = center.shape[1]
    n_thr = thr.shape[0]
    block = np.zeros((LANES, d), np.float32)  # the block's rows: unit rows in, rotated rows out
    y = np.empty((d, LANES), np.float32)
    count = np.empty(d, np.int32)
    norm = np.empty(LANES, np.float32)
    row_f = np.empty(d, np.float32)
    row_u = row_f.view(np.uint32)
    for r0 in range(0, n, LANES):
        m = min(LANES, n - r0)
        for r in range(m):
            i = r0 + r
            lead = i // per
            dst, col = _chunk_row(i, per, heads, t_total, first, lead0, d)
            _load_row(src, bf16, dst, col, row_u, row_f)
            norm[r] = _unit_row(row_f, center[lead], inv_scale[lead], block[r])
        for r in range(m, LANES):  # a last, short block: zeros in the unused lanes
            for j in range(d):
                block[r, j] = 0
        for j in range(d):
            f = s1[j]
            for r in range(LANES):
                y[j, r] = block[r, j] * f
        _hadamard_rounds(y, kind, s2)
        for j in range(d):
            for r in range(LANES):
                block[r, j] = y[j, r] * post
        for r in range(m):  # centroid search (the count of thresholds below), norm correction, packing
            row = block[r]
            turboquant_fast.count_below(row, thr, count)
            nr = norm[r]
            if not abs(nr) < np.inf:  # NaN coordinates sort after every threshold, as in torch.bucketize
                for j in range(d):
                    if row[j] != row[j]:
                        count[j] = n_thr
            dot = np.float32(0.0)
            for j in range(d):
                dot += row[j] * cb[count[j]]
            turboquant_fast.pack_row(count, bits, codes[r0 + r])
            scales[r0 + r] = nr / dot if correct and dot > 0 else nr


@njit(nogil=True, cache=True, inline="always")
def _bf16_bits(u):  # pragma: no cover - compiled
    """The bfloat16 bits of the float32 whose bits are ``u``, rounded as torch rounds, to nearest even (a NaN
    gives 0x7FC0). Integer operations only, so a loop of them vectorises."""
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(0x7FC0) if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else np.uint16(r)


@njit(nogil=True, cache=True, fastmath=_FAST)
def _decode_rows(codes, norms, center, scale, per, kind, s1, s2, post, cb, bits, out, bf16, heads, t_total, first,
                 lead0):  # pragma: no cover
    """R^T (cb[codes] * norm) * scale + center per row, LANES rows at a time, into ``out``: row i itself
    (heads == 0; out [n, D] float32), or, for rows of leading index lead0 + i // per = (layer, head) and
    token t = i % per, out[layer * t_total + first + t, head * D : (head + 1) * D] of an LMCache chunk part
    [layers * t_total, heads * D] (float32, or with ``bf16`` uint16 holding bfloat16 bits). The scaled
    centroids go straight into the transposed block the rotation works on, and the rows come straight out
    of it (no row-major copy of the block either way)."""
    n = codes.shape[0]
    d = center.shape[1]
    mask = (1 << bits) - 1
    y = np.empty((d, LANES), np.float32)  # the block, transposed: scaled centroids in, rotated rows out
    f = np.empty(d, np.float32)
    for j in range(d):
        f[j] = s1[j] * post
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
                    y[2 * b, r] = cb[c & 15] * nr
                    y[2 * b + 1, r] = cb[c >> 4] * nr
            elif bits == 8:
                for j in range(d):
                    y[j, r] = cb[row[j]] * nr
            else:
                pos = 0
                for j in range(d):
                    byte, shift = pos >> 3, pos & 7
                    c = np.int64(row[byte]) >> shift
                    if shift + bits > 8:
                        c |= np.int64(row[byte + 1]) << (8 - shift)
                    y[j, r] = cb[c & mask] * nr
                    pos += bits
        for r in range(m, LANES):  # a last, short block: zeros in the unused lanes
            for j in range(d):
                y[j, r] = 0
        _hadamard_rounds(y, kind, s2)  # R^T = diag(s1) (H diag(s2)) H * post
        for r in range(m):
            i = r0 + r
            lead = i // per
            c, sc = center[lead], scale[lead]
            dst, col = _chunk_row(i, per, heads, t_total, first, lead0, d)
            o = out[dst]
            for j in range(d):
                row_f[j] = (y[j, r] * f[j]) * sc[j] + c[j]
            if bf16:
                for j in range(d):
                    o[col + j] = _bf16_bits(row_u[j])
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


def _encode(q, plan: _Plan, pre: ChannelPreconditioner, x: torch.Tensor, src: np.ndarray, bf16: bool, heads: int,
            first: int, lead: tuple, n_tokens: int) -> QuantizedTensor:
    """The codes and norms of every row of the source (see :func:`_encode_rows`) as ``q.quantize`` stores them;
    ``x``: the tensor the rows are, for the error a NaN or Inf in it raises."""
    center, scale = _side_rows(pre, lead, q.dim)
    inv_scale = np.float32(1.0) / scale
    n = math.prod(lead) * n_tokens
    t_total = src.shape[0] // lead[0] if heads else 0
    codes = np.empty((n, plan.width), np.uint8)
    scales = np.empty(n, np.float32)

    def run(lo, hi):
        _encode_rows(src[lo:hi] if not heads else src, bf16, heads, t_total, first, lo // n_tokens, hi - lo,
                     center[lo // n_tokens:], inv_scale[lo // n_tokens:], n_tokens, *plan.args(), plan.thr, plan.cb,
                     plan.bits, q.norm_correction, codes[lo:hi], scales[lo:hi])

    turboquant_fast.split_ranges(run, n, n_tokens)  # ranges of whole leading indices
    norms = torch.from_numpy(scales).reshape(*lead, n_tokens)
    dt = base.settle_norms(x, norms)
    token = {"codes": torch.from_numpy(codes).reshape(*lead, n_tokens, plan.width), "norms": norms.to(dt)}
    return QuantizedTensor(config=q.config(), lead_shape=lead, num_tokens=n_tokens, dim=q.dim, token=token,
                           side=pre.side_fields())


def quantize(q, x: torch.Tensor, precond=None) -> QuantizedTensor:
    """``q.quantize(x, precond)`` in one compiled pass per row where :func:`applies`, else ``q.quantize``."""
    if not applies(q, x) or x.numel() == 0:
        return q.quantize(x, precond)
    base.check_input(x, q.dim, finite=False)
    pre = resolve_precond(q, x, precond)
    rows = turboquant_fast._rows(x.float())
    return _encode(q, _plan(q), pre, x, rows, False, 0, 0, tuple(x.shape[:-2]), x.shape[-2])


def _chunk_source(part: torch.Tensor) -> tuple[np.ndarray, bool]:
    """An LMCache chunk part [layers, tokens, hidden] as the kernels read it: [layers * tokens, hidden] float32
    or bfloat16 bits (uint16), no copy."""
    layers, tokens, hidden = part.shape
    if part.dtype == torch.bfloat16:
        return part.view(torch.int16).numpy().view(np.uint16).reshape(layers * tokens, hidden), True
    return part.numpy().reshape(layers * tokens, hidden), False


def _chunk_precond(q, src: np.ndarray, bf16: bool, heads: int, first: int, lead: tuple,
                   n_tokens: int) -> ChannelPreconditioner:
    """``calibrate(x, q.precondition)`` of the chunk's rows: the means (and the RMS about the float16 center)
    from :func:`_channel_moments`' float64 sums, the recipe of ``precondition.scaled``."""
    if q.precondition == "none":
        return ChannelPreconditioner()
    n_lead, d = math.prod(lead), q.dim
    t_total = src.shape[0] // lead[0]
    sums, squares = np.empty((n_lead, d), np.float64), np.empty((n_lead, d), np.float64)

    def run(lo, hi):
        _channel_moments(src, bf16, heads, t_total, first, lo // n_tokens, n_tokens, hi - lo, sums[lo // n_tokens:],
                         squares[lo // n_tokens:])

    turboquant_fast.split_ranges(run, n_lead * n_tokens, n_tokens)
    mean = torch.from_numpy(sums / n_tokens).reshape(*lead, 1, d)
    center = mean.to(torch.float16)
    if q.precondition == "center":
        return ChannelPreconditioner(center=center)
    # the mean square about the float16 center: E[x^2] - 2 c E[x] + c^2, exact enough in float64 (its
    # cancellation costs ~1e-16 of E[x^2], far below float16's rounding of the scale)
    c = center.double()
    msd = (torch.from_numpy(squares / n_tokens).reshape(*lead, 1, d) - 2 * c * mean + c * c).clamp_min(0)
    return scaled(center, msd.sqrt().float())


def quantize_chunk(q, part: torch.Tensor, first: int, heads: int) -> QuantizedTensor | None:
    """``q.quantize(x)`` of x = tokens [first, T) of ``part``, an LMCache chunk part [layers, T, heads * D]
    seen as [layers, heads, T - first, D], read in place (bfloat16 or float32, contiguous, CPU): no
    transposed float32 copy, and the preconditioner's statistics measured in the same compiled code. The
    means are summed in float64 (torch sums float32), so a stored float16 center or scale can be the
    neighbouring value where the exact statistic lies on a rounding boundary. None (nothing done) where
    this does not apply: the caller quantizes the tensor itself."""
    if (part.dtype not in (torch.bfloat16, torch.float32) or part.dim() != 3 or not part.is_contiguous()
            or not applies(q, part) or type(heads) is not int or heads < 1 or part.shape[2] != heads * q.dim
            or not 0 <= first < part.shape[1] or part.shape[0] == 0):
        return None
    src, bf16 = _chunk_source(part)
    lead, n_tokens = (part.shape[0], heads), part.shape[1] - first
    pre = _chunk_precond(q, src, bf16, heads, first, lead, n_tokens)
    x = part[:, first:]  # what a NaN or Inf is looked for in
    return _encode(q, _plan(q), pre, x, src, bf16, heads, first, lead, n_tokens)


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
