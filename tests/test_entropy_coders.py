"""The named coders of kvcodec.entropy against their pure-Python references, byte for byte."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvcodec.entropy import rans, rans_lanes
from kvcodec.entropy.freq import quantize_frequencies


def _tables(rng, k):
    out = []
    for _ in range(k):
        counts = rng.integers(0, 50, 256) * (rng.random(256) < rng.uniform(0.05, 1.0))
        counts[rng.integers(0, 256)] += 1
        out.append(quantize_frequencies(counts, rans_lanes.PRECISION).astype(np.int64))
    return np.stack(out)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 700), D=st.integers(1, 90), a=st.integers(0, 200), k=st.integers(1, 4),
       lanes=st.sampled_from(rans_lanes.LANES), seed=st.integers(0, 2**32 - 1))
def test_rans_lanes_matches_the_reference(n, D, a, k, lanes, seed):
    rng = np.random.default_rng(seed)
    freqs = _tables(rng, k)
    rows = (a + n) // D + 1
    rowctx = rng.integers(0, k, rows).astype(np.uint8)
    ctx = rans_lanes.row_contexts(a, n, D, rowctx)
    sym = np.empty(n, np.uint8)
    for i in range(n):  # draw each symbol from its context's table support
        sup = np.flatnonzero(freqs[ctx[i]])
        sym[i] = sup[rng.integers(0, sup.size)]
    words = np.empty(n + 2 * lanes, np.uint16)
    start = rans_lanes.encode(sym, a, D, rowctx, freqs, rans_lanes.cumulative(freqs), lanes, words)
    stream = words[start:]
    assert stream.tobytes() == rans.encode_ctx(sym, ctx, list(freqs), rans_lanes.PRECISION, lanes)
    tabs = rans_lanes.decode_tables(freqs)
    out = np.empty(n, np.uint8)
    assert rans_lanes.decode(stream, a, D, rowctx, tabs, lanes, out) == 0
    assert np.array_equal(out, sym)
    side = rng.integers(0, 256, n).astype(np.uint8)
    hi = (np.arange(256, dtype=np.uint16) << 8).astype(np.uint16)
    lo = np.arange(256, dtype=np.uint16)
    out16 = np.empty(n, np.uint16)
    assert rans_lanes.decode_merged(stream, a, D, rowctx, tabs, lanes, side, hi, lo, out16) == 0
    assert np.array_equal(out16, (sym.astype(np.uint16) << 8) | side)
    if stream.size > 2 * lanes:  # any damage is reported, never a crash or a hang
        for bad in (stream[:-1], np.concatenate([stream, stream[-1:]])):
            assert rans_lanes.decode(bad, a, D, rowctx, tabs, lanes, out) == 1
