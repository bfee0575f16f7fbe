"""The predictive codec's parallel chunk kernels: the model (``cdf``) feeds the coder (``rans64_fast``).

A chunk is one leading index ``g`` x a block of ``tb`` tokens; chunks are independent, so they run
in parallel (numba ``prange``) and any one decodes alone. Inside a chunk, each scalar's location
uses the previous token's residual of the same channel (reset at the chunk start).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvcodec.entropy import rans64_fast
from kvcodec.kernel_inputs import readonly
from kvcodec.entropy.rans64 import M, PRECISION, RANS_L
from kvcodec.lossless.predictive.cdf import cum, find_symbol, location, prediction_at


@njit(parallel=True, cache=True)
def encode_chunks(kx, pred, has_pred, m, c, a, rs, shared, cdf, edges, valf, finite,
                  tb, caps, out, out_start):
    """Code every chunk of ranks ``kx`` [G, T, D]; chunk ``ci``'s words end at ``caps[ci + 1]`` of
    ``out`` and start at ``out_start[ci]`` (written here)."""
    g_n, t_n, d_n = kx.shape
    n_tb = (t_n + tb - 1) // tb
    a_mass = np.int64(M - edges.size + 1)
    for ci in prange(g_n * n_tb):
        g = ci // n_tb
        t0 = (ci % n_tb) * tb
        t1 = min(t_n, t0 + tb)
        gp = 0 if shared else g
        n = (t1 - t0) * d_n
        starts = np.empty(n, np.int64)
        freqs = np.empty(n, np.int64)
        dev = np.zeros(d_n, np.float64)
        i = 0
        for t in range(t0, t1):
            for d in range(d_n):
                p = prediction_at(pred, has_pred, g, t, d)
                base, mu = location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
                k = kx[g, t, d]
                lo = cum(k, mu, rs[gp, d], edges, cdf, a_mass)
                hi = cum(k + 1, mu, rs[gp, d], edges, cdf, a_mass)
                starts[i] = lo
                freqs[i] = hi - lo
                i += 1
                dev[d] = valf[k] - base if finite[k] else 0.0
        x = np.int64(RANS_L)
        pos = caps[ci + 1]
        for j in range(n - 1, -1, -1):
            x, pos = rans64_fast.put(x, starts[j], freqs[j], out, pos)
        out_start[ci] = rans64_fast.flush(x, out, pos)


def decode_chunks(words, *args) -> None:
    """:func:`_decode_chunks` of a read-only view of ``words`` (one compile for any buffer)."""
    _decode_chunks(readonly(words), *args)


@njit(parallel=True, cache=True)
def _decode_chunks(words, wstart, wlen, chunk_g, chunk_b, pred, has_pred, pred_t0, m, c, a, rs, shared,
                  cdf, edges, valf, finite, rank_of, scale, inv_cdf, inv_w, tb, t_total, g0, out_t0, out_k, err):
    """Decode the listed chunks (local group chunk_g[i], token block chunk_b[i]) into out_k, whose
    token 0 is token out_t0; pred's token 0 is token pred_t0; params of group g0 + chunk_g[i].
    err[i] is set non-zero for a malformed chunk."""
    d_n = out_k.shape[2]
    n_sym = edges.size - 1
    a_mass = np.int64(M - n_sym)
    mask = np.int64(M - 1)
    inv_a = 4294967296.0 / a_mass
    for ci in prange(wstart.size):
        gl = chunk_g[ci]
        gp = 0 if shared else g0 + gl
        t0 = chunk_b[ci] * tb
        t1 = min(t_total, t0 + tb)
        ptr = wstart[ci]
        end = ptr + wlen[ci]
        if wlen[ci] < 2:
            err[ci] = 1
            continue
        x = rans64_fast.start(words, ptr)
        ptr += 2
        if x < RANS_L:
            err[ci] = 2
            continue
        dev = np.zeros(d_n, np.float64)
        fbuf = np.zeros(1, np.float64)
        ibuf = fbuf.view(np.int64)
        ok = True
        for t in range(t0, t1):
            for d in range(d_n):
                p = prediction_at(pred, has_pred, gl, t - pred_t0, d)
                base, mu = location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
                slot = x & mask
                lo, c_lo, c_hi = find_symbol(slot, mu, rs[gp, d], scale[gp, d], edges, cdf, a_mass, inv_cdf,
                                             inv_w, inv_a, rank_of, fbuf, ibuf)
                x = rans64_fast.advance(x, slot, c_lo, c_hi - c_lo)
                x, ptr, ok = rans64_fast.refill(x, words, ptr, end)
                if not ok:
                    break
                out_k[gl, t - out_t0, d] = lo
                dev[d] = valf[lo] - base if finite[lo] else 0.0
            if not ok:
                break
        if not ok:
            err[ci] = 3
        elif x != RANS_L or ptr != end:
            err[ci] = 4


_ = PRECISION  # the stream's probability precision is rans64's (28 bits)
