"""The compressed-cache attention path against dense SDPA on the same (decoded) K/V."""

import pytest
import torch

from kvcodec.hf.attention import attend_store
from kvcodec.hf.encodings import ExactEncoding
from kvcodec.hf.storage import LayerStore


def _dense_reference(q, k, v, mask, scaling):
    """Plain softmax attention in float64: q [B,H,Tq,D], k/v [B,Hkv,T,D], mask bool [B,1,Tq,T] or None."""
    B, H, Tq, D = q.shape
    G = H // k.shape[1]
    k = k.double().repeat_interleave(G, dim=1)
    v = v.double().repeat_interleave(G, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scaling
    T = k.shape[-2]
    if mask is None:
        past = T - Tq
        mask = torch.arange(T)[None, :] <= (past + torch.arange(Tq))[:, None]
        mask = mask[None, None]
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def _store(k, v, *, residual, block, sink):
    st = LayerStore(ExactEncoding(), ExactEncoding(), residual=residual, block_size=block, sink=sink)
    st.append(k, v)
    st.compact()
    return st


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 64)])
@pytest.mark.parametrize("tq", [1, 5])
def test_matches_dense_attention_causal(hq, hkv, d, tq):
    torch.manual_seed(hq * 100 + tq)
    B, T = 2, 70
    k = torch.randn(B, hkv, T, d)
    v = torch.randn(B, hkv, T, d)
    q = torch.randn(B, hq, tq, d)
    st = _store(k, v, residual=8, block=16, sink=3)
    assert st.blocks and st.sink_len == 3  # every kind of part is exercised
    out = attend_store(st, q, None, d**-0.5, hkv)
    ref = _dense_reference(q, k, v, None, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_matches_dense_attention_with_padding_mask_and_chunks():
    from kvcodec.hf.attention import AttentionOptions

    chunks = AttentionOptions(q_chunk=3, kv_chunk=7, compressed_chunk=6)
    torch.manual_seed(1)
    B, hq, hkv, d, T, tq = 3, 6, 2, 64, 50, 9
    k, v = torch.randn(B, hkv, T, d), torch.randn(B, hkv, T, d)
    q = torch.randn(B, hq, tq, d)
    pad = torch.tensor([0, 4, 11])  # left padding per row
    causal = torch.arange(T)[None, :] <= (T - tq + torch.arange(tq))[:, None]
    mask = causal[None, None] & (torch.arange(T)[None, :] >= pad[:, None])[:, None, None, :]
    st = _store(k, v, residual=5, block=10, sink=0)
    out = attend_store(st, q, mask, 0.125, hkv, options=chunks)
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, mask, 0.125), atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_stay_finite():
    torch.manual_seed(2)
    k, v = torch.randn(1, 1, 20, 64), torch.randn(1, 1, 20, 64)
    q = torch.randn(1, 2, 1, 64)
    st = _store(k, v, residual=4, block=8, sink=0)
    mask = torch.zeros(1, 1, 1, 20, dtype=torch.bool)
    out = attend_store(st, q, mask, 0.125, 1)
    assert torch.isfinite(out).all()


def test_output_dtype_and_shape_follow_query():
    k, v = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16), torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16)
    st = _store(k, v, residual=8, block=8, sink=0)
    out = attend_store(st, q, None, 0.125, 2)
    assert out.shape == (1, 1, 4, 64) and out.dtype == torch.bfloat16
