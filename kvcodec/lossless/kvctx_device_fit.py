"""The predictive model's per-channel parameters fitted on a CUDA device (step 1 of the GPU encoder,
``kvcodec.lossless.kvctx_device_encode``).

Why: a KV cache of ~0.5 M (leading index, channel) pairs costs ~50 ms of numpy on one host core for the
fit formulas and the bin parameters, ten times the GPU encode of the whole tensor; here they are one
launch per formula step for all channels of both candidates (shared and per-(g, d), stacked), on the sums
of the per-column kernels (``kvcodec.lossless.cuda.kvctx_encode``: ``ke_fit_location`` / ``_coefficient`` /
``_scale``, ``ke_bin_params``), and only the stored fields' byte planes come to the host.

Device forms of ``params.fit_params`` (format 2: no shape table), ``params.estimated_bits`` and
``format2.BinParams.from_channel`` / ``kernel_args``: the same formulas and quantisation (bf16 rounding,
int8 / 64, quarter-octave levels from frexp and exact thresholds, exact powers of two), so the stored
fields mean what the decoders read; the sums come in another order, so a parameter may differ from the
CPU encoder's in a last bit (it is stored: the stream stays exact). The tests check these against the
host functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvcodec.lossless.predictive.bins import EP_MAX, BinGrid
from kvcodec.lossless.predictive.format2 import _FIELD_OF, _LEVEL_HI, _LEVEL_LO, _MQ_MAX, FIELD_ORDER
from kvcodec.lossless.predictive.params import Q, S_MAX, S_MIN, stored_fields


@dataclass
class Candidates:
    """The fitted candidate models stacked into [R, D] rows, flat (channel r * D + d): per ``choices``
    entry its rows (``bounds``): G rows per-(g, d), or one shared row. Stored as params.ChannelParams
    does: m, s float64 (bf16 values), c, a int8 (value * Q); ``bits``: each channel's term of
    params.estimated_bits."""

    m: torch.Tensor
    s: torch.Tensor
    c: torch.Tensor
    a: torch.Tensor
    bits: torch.Tensor
    bounds: list
    choices: tuple
    d: int


@lru_cache(maxsize=8)
def fit_constants(device: torch.device) -> torch.Tensor:
    """float64 [7] on ``device``: the constants of the fit kernels (``KeFitConsts``)."""
    return torch.tensor([S_MIN, S_MAX, Q, _LEVEL_LO, _LEVEL_HI, EP_MAX, _MQ_MAX], dtype=torch.float64).to(device)


def fit(mom: torch.Tensor, residuals, gain: str, prev_coef: str, choices: tuple[bool, ...], runner) -> Candidates:
    """params.fit_params' formulas on ``mom`` [G, D, 7] (params._fit_moments' fields), one model per
    ``choices`` entry (shared parameters or not), fitted together (one launch per formula step,
    ``kvctx_encode.fit_*``; ``residuals([(m, c, a, shared), ...])`` returns each location's [Gp, D, 3]
    residual sums from one pass over the tensor). ``gain``: "zero", "one" or "fit" (c)."""
    from kvcodec.lossless.cuda import kvctx_encode as ke

    d = mom.shape[1]
    parts = [mom.sum(dim=0, keepdim=True) if sh else mom for sh in choices]
    bounds = np.cumsum([0, *(p.shape[0] for p in parts)]).tolist()
    mom = (torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(-1, 7).contiguous()
    consts = fit_constants(mom.device)
    prev_one = prev_coef == "one"
    m, c, c_q, a, a_q = ke.fit_location(mom, {"zero": 0, "one": 1, "fit": 2}[gain], prev_one, consts, runner)

    def residual_sums(a: torch.Tensor) -> torch.Tensor:
        locs = [tuple(x[b0 * d:b1 * d].view(b1 - b0, d) for x in (m, c, a)) + (sh,)
                for b0, b1, sh in zip(bounds[:-1], bounds[1:], choices)]
        res = residuals(locs)
        return (torch.cat(res) if len(res) > 1 else res[0]).reshape(-1, 3).contiguous()

    if not prev_one:
        a, a_q = ke.fit_coefficient(residual_sums(a), consts, runner)
    s, bits = ke.fit_scale(mom, residual_sums(a), consts, runner)
    return Candidates(m=m, s=s, c=c_q, a=a_q, bits=bits, bounds=bounds, choices=tuple(choices), d=d)


def choose(cands: Candidates) -> torch.Tensor | None:
    """Whether the shared candidate costs less than the per-(g, d) one (params.estimated_bits with
    format 2's 16 bits a channel; a tie keeps per-(g, d), as ``min`` does): a 0-d int64 device tensor,
    no sync; None when only one was fitted."""
    if len(cands.choices) == 1:
        return None
    assert cands.choices == (False, True)
    cost = [torch.nan_to_num(cands.bits[b0 * cands.d:b1 * cands.d].sum(), nan=math.inf) + 16.0 * (b1 - b0) * cands.d
            for b0, b1 in zip(cands.bounds[:-1], cands.bounds[1:])]
    return (cost[1] < cost[0]).to(torch.int64)


def bin_params(cands: Candidates, won: torch.Tensor | None, grid: BinGrid, runner) -> tuple[torch.Tensor, list]:
    """(the stored fields' values int32 [4, n] in format2.FIELD_ORDER, the decode kernel's per-channel
    arguments [m, c, a float64 [n], (es, level) int32 [n, 2]]: format2.BinParams.from_channel +
    kernel_args exactly) of the chosen candidate: the first one's n channels, with the shared row
    broadcast over g where ``won`` (:func:`choose`) is set."""
    from kvcodec.lossless.cuda import kvctx_encode as ke

    n = cands.bounds[1] * cands.d
    shared_row = cands.bounds[1] if won is not None else 0
    margs, values = ke.bin_params(cands.s, cands.m, cands.c, cands.a, won, shared_row, n, cands.d, grid.eoff,
                                  fit_constants(cands.s.device), runner)
    return values, margs


def field_planes(values: torch.Tensor, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Device half of ``format2.BinParams.field_bytes``: per stored field (``params.stored_fields``) its
    values as non-negative integers (level - its minimum, zigzag mq, int8 bytes) as a low and a high byte
    plane, uint8 [fields, 2, n], and (minimum, maximum) int64 [fields, 2]; :func:`field_bytes` keeps a
    high plane only where the maximum needs it."""
    stored = stored_fields(source)
    v = torch.stack([values[FIELD_ORDER.index(_FIELD_OF[f])] for f in stored]).to(torch.int64)
    lo = v.amin(dim=1) * _one_hot(len(stored), stored.index("s"), v.device)
    arr = v - lo[:, None]
    planes = arr.view(torch.uint8).view(*arr.shape, 8)[..., :2].transpose(1, 2).contiguous()  # low, high byte
    return planes, torch.stack([lo, arr.amax(dim=1)], 1)


@lru_cache(maxsize=8)
def _one_hot(n: int, k: int, device: torch.device) -> torch.Tensor:
    """int64 [n] on ``device``: 1 at k, else 0 (the field whose minimum is subtracted)."""
    return torch.nn.functional.one_hot(torch.tensor(k), n).to(device)


def plane_histograms(planes: torch.Tensor, d: int, runner) -> torch.Tensor:
    """int64 [2, fields, 2, 256]: the byte histogram of each of :func:`field_planes`' planes over its
    first ``d`` channels (the shared row) and over all of them, on the device (``ke_plane_hist``): the
    model's field bytes are counted for their rANS table before the host knows which of the two it stores."""
    from kvcodec.lossless.cuda import kvctx_encode as ke

    f, _, n = planes.shape
    return ke.plane_histograms(planes.reshape(2 * f, n), d, runner).reshape(2, f, 2, 256)


def field_bytes(planes: torch.Tensor, stats: np.ndarray, n: int) -> tuple[bytes, torch.Tensor, list[int]]:
    """``format2.BinParams.field_bytes``' header (host, from the read-back ``stats``) and bytes (uint8 on
    the planes' device) of the first ``n`` channels of :func:`field_planes`' planes, and each field's
    width (1 or 2 byte planes)."""
    head, body, widths = b"", [], []
    for plane, (lo, top) in zip(planes, stats):
        width = 1 if int(top) < 256 else 2
        head += int(lo).to_bytes(4, "little", signed=True) + bytes([width])
        body += [plane[0, :n], plane[1, :n]][:width]
        widths.append(width)
    return head, torch.cat(body), widths


def field_counts(hist: np.ndarray, widths: list[int]) -> np.ndarray:
    """int64 [256]: the symbol counts of :func:`field_bytes`' bytes from one row of
    :func:`plane_histograms` (read back) and the fields' widths."""
    return sum(hist[f, p] for f, w in enumerate(widths) for p in range(w))
