"""Format 2's parallel chunk kernels: the model (``cdf.location``) + bins (``bins``) feed the 32-lane
rANS (``kvcodec.entropy.rans_lanes``) and a raw bit stream.

A chunk is a block of consecutive leading indices ``g`` x a block of tokens (about 65536 values;
``layout`` lists them). Inside a chunk the values go in order (g, t, d); value ``i`` is coded by
rANS lane ``i % lanes`` with the table of its class, and its raw bits go, in the same order, to
the chunk's bit stream (little-endian uint32 words, least significant bit first). The
previous-token term restarts at every (g, chunk) start. Chunks are independent: coded in parallel
(numba ``prange``) and any one decodes alone.

Encoding is two passes: ``symbolise`` (symbols, classes and raw codes of every value, and the
per-chunk class histograms the tables are fitted on), then ``write_chunks`` (raw bits, and the
rANS of each chunk through ``rans_lanes.encode`` with one context per value).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvcodec.entropy import rans_lanes
from kvcodec.lossless.predictive.bins import (
    CENTRE, DEPTH_MAX, ESC, LOG2_FLOOR, MU_MAX, N_CLASSES, encode_value, locate, value_of,
)
from kvcodec.lossless.predictive.cdf import location, prediction_at

_M = rans_lanes.M
_UNARY = DEPTH_MAX + 1  # bits peeked to read a unary depth


@njit(inline="always", cache=True)
def _mu_v(m, c, a, p, dev, inv_unit):
    """(base, mu in V units) with a non-finite location replaced by 0."""
    base, mu = location(m, c, p, a, dev)
    mv = mu * inv_unit
    if not (abs(mv) < MU_MAX):
        mv = 0.0
    return base, mv


@njit(parallel=True, cache=True)
def symbolise(pats, pred, has_pred, m, c, a, es, level, shared, cg0, cng, ct0, cnt, coff,
              width, sign, mb, maxmag, escape, unit, inv_unit, packed, chunk_bits, hist):
    """Pass 1: every value (flat, chunk after chunk from ``coff``) as one int64 ``code << 24 |
    nbits << 16 | class << 8 | symbol`` (one store per value); per chunk the raw bit total and the
    [class, symbol] histogram."""
    d_n = pats.shape[2]
    for ci in prange(cg0.size):
        dev = np.zeros(d_n, np.float64)
        base = np.empty(d_n, np.float64)
        t_ep = np.empty(d_n, np.int64)
        t_centre = np.empty(d_n, np.int64)
        t_cls = np.empty(d_n, np.int64)
        i = coff[ci]
        total = np.int64(0)
        for g in range(cg0[ci], cg0[ci] + cng[ci]):
            gp = 0 if shared else g
            dev[:] = 0.0
            for t in range(ct0[ci], ct0[ci] + cnt[ci]):  # per token: model, bins, residuals (as the decoder)
                for d in range(d_n):
                    p = prediction_at(pred, has_pred, g, t, d)
                    base[d], mv = _mu_v(m[gp, d], c[gp, d], a[gp, d], p, dev[d], inv_unit)
                    t_ep[d], t_centre[d], t_cls[d] = locate(mv, es[gp, d], level[gp, d], mb)
                for d in range(d_n):
                    s, cd, nb = encode_value(np.int64(pats[g, t, d]), t_ep[d], t_centre[d], width, sign, mb, escape)
                    packed[i + d] = (cd << 24) | (nb << 16) | (t_cls[d] << 8) | s
                    total += nb
                for d in range(d_n):  # an escaped value (NaN, Inf, outlier) leaves no residual
                    v = value_of(np.int64(pats[g, t, d]), sign, mb, maxmag, unit)[1]
                    dev[d] = v - base[d] if (packed[i + d] & 0xFF) != ESC else 0.0
                i += d_n
        chunk_bits[ci] = total
        for i in range(coff[ci], coff[ci + 1]):
            hist[ci, (packed[i] >> 8) & 0xFF, packed[i] & 0xFF] += 1


@njit(parallel=True, cache=True)
def write_chunks(packed, coff, freq, cum, lanes, wcap, words, wstart, bstart, bits):
    """Pass 2: chunk ``ci``'s raw bits to ``bits[bstart[ci]:bstart[ci + 1]]`` and its rANS words to
    ``words[wcap[ci]:wcap[ci + 1]]`` (filled from the end; ``wstart[ci]`` = where they begin)."""
    for ci in prange(coff.size - 1):
        a, b = coff[ci], coff[ci + 1]
        sym = np.empty(b - a, np.uint8)
        cls = np.empty(b - a, np.uint8)
        acc = np.int64(0)
        have = 0
        wp = bstart[ci]
        for i in range(a, b):
            v = packed[i]
            sym[i - a] = v & 0xFF
            cls[i - a] = (v >> 8) & 0xFF
            n = (v >> 16) & 0xFF
            acc |= (v >> 24) << have
            have += n
            if have >= 32:
                bits[wp] = acc & 0xFFFFFFFF
                wp += 1
                acc >>= 32
                have -= 32
        if have > 0:
            bits[wp] = acc & 0xFFFFFFFF
        seg = words[wcap[ci]:wcap[ci + 1]]
        wstart[ci] = wcap[ci] + rans_lanes.encode(sym, 0, 1, cls, freq, cum, lanes, seg)


@njit(inline="always", cache=True)
def _fill(acc, have, bp, bits, bend):
    """Top the bit buffer up to >= 32 bits, branch-free (zeros past the chunk's end, which the
    caller's bit count catches; ``bits`` is never empty)."""
    refill = np.int64(have < 32)
    w = np.int64(bits[min(bp, bits.size - 1)]) & -np.int64(bp < bend)
    acc |= (w << have) & -refill
    return acc, have + (refill << 5), bp + refill


@njit(inline="always", cache=True)
def _decode_mag(sym, ep, centre, mb, maxmag, acc, have):
    """(negative: -1 or 0, magnitude, bits used, ok) of a non-ESC symbol; ``acc`` holds >= 32 bits."""
    j = centre + sym - CENTRE
    neg = j >> 63  # -1 or 0
    u = j ^ neg  # -1 - j or j, branch-free
    if u == 0:
        if ep <= mb + 1:
            return neg, acc & ((np.int64(1) << ep) - 1), ep, True
        last = ep - mb - 1
        d = 0
        while d < _UNARY and ((acc >> d) & 1) == 0:
            d += 1
        if last < DEPTH_MAX and d >= last:
            mag = (acc >> last) & ((np.int64(1) << (mb + 1)) - 1)
            used = last + mb + 1
        elif d >= DEPTH_MAX:
            return neg, np.int64(0), 0, False
        else:
            mag = ((ep - mb - d) << mb) | ((acc >> (d + 1)) & ((np.int64(1) << mb) - 1))
            used = d + 1 + mb
        if mag > maxmag:
            return neg, np.int64(0), 0, False
        return neg, mag, used, True
    if u >= (np.int64(1) << mb):  # one pattern per bin
        mag = u + (np.int64(ep) << mb)
        used = 0
    else:  # 1 <= u < 2**mb: 2**nb patterns in one binade
        big_e = LOG2_FLOOR[u] + ep
        nb = ep - (big_e - mb if big_e > mb else 0)
        first = (u << ep) if big_e < mb else ((big_e - mb + 1) << mb) + (u << nb) - (np.int64(1) << mb)
        mag = first + (acc & ((np.int64(1) << nb) - 1))
        used = nb
    if mag > maxmag:
        return neg, np.int64(0), 0, False
    return neg, mag, used, True


@njit(parallel=True, cache=True)
def decode_chunks(words, wstart, wlen, bits, bstart, blen, cg0, cng, ct0, cnt, pred, has_pred, pred_g0, pred_t0,
                  m, c, a, es, level, shared, tabs, lanes, width, sign, mb, maxmag, escape, unit, inv_unit,
                  out, out_g0, out_t0, err):
    """Decode the listed chunks into ``out`` (bit patterns; its [0, 0] is (out_g0, out_t0)); the
    prediction's [0, 0] is (pred_g0, pred_t0). ``err[i]`` is set non-zero for a malformed chunk.

    The values of one token depend on the previous token only, so each token is three tight loops:
    the model (bins and classes of all channels), the rANS symbols, the raw bits and patterns."""
    d_n = out.shape[2]
    for ci in prange(cg0.size):
        ptr, end = wstart[ci], wstart[ci] + wlen[ci]
        if wlen[ci] < 2 * lanes:
            err[ci] = 1
            continue
        xs = np.empty(lanes, np.int64)
        if not rans_lanes.start_states(words, ptr, lanes, xs):
            err[ci] = 2
            continue
        ptr += 2 * lanes
        bp, bend = bstart[ci], bstart[ci] + blen[ci]
        acc = np.int64(0)
        have = 0
        used = np.int64(0)
        dev = np.zeros(d_n, np.float64)
        base = np.empty(d_n, np.float64)
        t_ep = np.empty(d_n, np.int64)
        t_centre = np.empty(d_n, np.int64)
        t_base = np.empty(d_n, np.int64)
        t_sym = np.empty(d_n, np.int64)
        t_pat = np.empty(d_n, np.int64)
        i = 0
        bad = 0
        for g in range(cg0[ci], cg0[ci] + cng[ci]):
            gp = 0 if shared else g
            dev[:] = 0.0
            for t in range(ct0[ci], ct0[ci] + cnt[ci]):
                for d in range(d_n):
                    p = prediction_at(pred, has_pred, g - pred_g0, t - pred_t0, d)
                    base[d], mv = _mu_v(m[gp, d], c[gp, d], a[gp, d], p, dev[d], inv_unit)
                    t_ep[d], t_centre[d], k = locate(mv, es[gp, d], level[gp, d], mb)
                    t_base[d] = k * _M
                for d in range(d_n):
                    j = (i + d) & (lanes - 1)
                    xs[j], ptr, t_sym[d] = rans_lanes.decode_step(xs[j], tabs, t_base[d], words, ptr, end)
                i += d_n
                for d in range(d_n):
                    acc, have, bp = _fill(acc, have, bp, bits, bend)
                    s = t_sym[d]
                    if s == ESC:
                        pat = acc & ((np.int64(1) << width) - 1)
                        n = width
                    else:
                        neg, mag, n, ok = _decode_mag(s, t_ep[d], t_centre[d], mb, maxmag, acc, have)
                        if not ok:
                            bad = 5
                            break
                        pat = mag | (sign & neg)
                    acc >>= n
                    have -= n
                    used += n
                    t_pat[d] = pat
                if bad:
                    break
                for d in range(d_n):
                    pat = t_pat[d]
                    out[g - out_g0, t - out_t0, d] = pat
                    v = value_of(pat, sign, mb, maxmag, unit)[1]
                    dev[d] = v - base[d] if t_sym[d] != ESC else 0.0
            if bad:
                break
        if bad:
            err[ci] = bad
            continue
        for j in range(lanes):
            if xs[j] != rans_lanes.RANS_L:
                bad = 4
        if bad or ptr != end or (used + 31) // 32 != blen[ci]:
            err[ci] = 4


_ = N_CLASSES  # tables are [N_CLASSES * 4096]: one per class of ``bins.locate``
