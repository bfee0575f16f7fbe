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


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 400), n_sym=st.integers(2, 3000), skew=st.floats(0.0, 30.0), seed=st.integers(0, 2**32 - 1))
def test_rans64_fast_matches_the_reference(n, n_sym, skew, seed):
    from kvcodec.entropy import rans64, rans64_fast

    rng = np.random.default_rng(seed)
    w = np.exp(-skew * rng.random(n_sym))  # from flat to one symbol holding almost all the mass
    f = 1 + np.floor(w / w.sum() * (rans64.M - n_sym)).astype(np.int64)
    f[np.argmax(f)] += rans64.M - int(f.sum())
    cum = np.concatenate([[0], np.cumsum(f)]).astype(np.int64)
    sym = rng.choice(n_sym, n, p=f / f.sum())
    model = rans64.CdfModel(lambda i, k: int(cum[k]), n_sym)
    ref = rans64.encode(sym, model)
    out = np.empty(n + 2, np.uint32)
    s0 = rans64_fast.encode_intervals(cum[sym], f[sym], out)
    assert np.array_equal(out[s0:], ref)
    assert rans64.decode(ref, n, model) == sym.tolist()
    dec = np.empty(n, np.int64)
    assert rans64_fast.decode_table(ref, cum, dec) == 0 and np.array_equal(dec, sym)
    with pytest.raises(rans64.CorruptStreamError):
        rans64.decode(ref[:-1] if ref.size > 2 else ref[:1], n, model)
    assert rans64_fast.decode_table(np.concatenate([ref, ref[-1:]]), cum, dec) == 1
