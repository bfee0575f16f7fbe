"""One merge of compressed and exact tokens (``quant.cuda.attention.join_exact``), used by the eager
cache, the static cache and ``merge_window``: equal to one softmax over every token, sinks included."""

import math

import torch
from hypothesis import given, settings, strategies as st

from kvcodec.quant.cuda.attention import join_exact, merge_window


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), n_comp=st.integers(1, 9), n_exact=st.integers(1, 9), dv=st.integers(1, 8),
       masked=st.integers(0, 8), with_sink=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_join_equals_one_softmax_over_every_token(rows, n_comp, n_exact, dv, masked, with_sink, seed):
    g = torch.Generator().manual_seed(seed)
    sc = torch.randn(rows, n_comp, generator=g, dtype=torch.float64) * 3  # compressed tokens' scores
    vc = torch.randn(n_comp, dv, generator=g, dtype=torch.float64)  # values are shared by the query rows
    se = torch.randn(rows, n_exact, generator=g, dtype=torch.float64) * 3
    se[:, : min(masked, n_exact - 1)] = -math.inf  # masked exact tokens (one stays)
    ve = torch.randn(n_exact, dv, generator=g, dtype=torch.float64)
    sink = torch.randn(rows, 1, generator=g, dtype=torch.float64) if with_sink else None
    lse = torch.logsumexp(sc, -1, keepdim=True)
    out_c = torch.softmax(sc, -1) @ vc  # what the kernel returns
    joined, logits = join_exact(lse, out_c, se, ve, sink)
    every = torch.cat([sc, se] + ([sink] if with_sink else []), -1)
    p = torch.softmax(every, -1)
    want = p[:, :n_comp] @ vc + p[:, n_comp:n_comp + n_exact] @ ve  # a sink has no value
    assert torch.allclose(joined, want, atol=1e-12, rtol=1e-10)
    assert torch.allclose(torch.logsumexp(logits, -1), torch.logsumexp(every, -1), atol=1e-12)


def test_merge_window_rows_with_nothing_to_attend_give_zeros():
    """No compressed token (lse -inf) and no window token: zeros and lse -inf, not NaN; with window
    tokens only, the window's own attention."""
    b, h, d, w = 2, 2, 4, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=g)
    wk, wv = torch.randn(b, h, w, d, generator=g), torch.randn(b, h, w, d, generator=g)
    out = torch.zeros(b, h, 1, d)
    lse = torch.full((b, h, 1), -math.inf)
    res, total = merge_window(q, out, lse, wk, wv, torch.tensor([0, w]), 0.5, causal=False)
    assert torch.equal(res[0], torch.zeros(h, 1, d)) and bool(torch.isneginf(total[0]).all())
    s = (q[1] @ wk[1].transpose(-1, -2)) * 0.5
    assert torch.allclose(res[1], torch.softmax(s, -1) @ wv[1], atol=1e-6)
    assert torch.allclose(total[1], torch.logsumexp(s, -1), atol=1e-6)
