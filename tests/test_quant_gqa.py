"""GQA in the quantizer API: queries/weights with Hq heads against K/V compressed with Hkv heads."""

import pytest
import torch

from kvcodec.quant import TurboQuantMSE, TurboQuantProd


@pytest.mark.parametrize("cls", [TurboQuantMSE, TurboQuantProd])
def test_gqa_equals_repeating_the_kv_heads(cls):
    """Hq = 3 * Hkv: the result is what repeating each KV head for its query heads gives
    (query head h reads KV head h // 3, as Hugging Face's repeat_kv does)."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, T, Q, D = 2, 2, 3, 40, 5, 32
    keys = torch.randn(B, Hkv, T, D, generator=g)
    queries = torch.randn(B, Hkv * G, Q, D, generator=g)
    weights = torch.softmax(torch.randn(B, Hkv * G, Q, T, generator=g), -1)
    q = cls(D, 4, seed=0)
    c = q.quantize(keys)
    repeated = q.quantize(keys.repeat_interleave(G, dim=1), precond=None)
    torch.testing.assert_close(q.scores(c, queries), q.scores(repeated, queries), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.weighted_sum(c, weights), q.weighted_sum(repeated, weights), rtol=1e-5, atol=1e-5)
    assert q.scores(c, queries).shape == (B, Hkv * G, Q, T)
    assert q.weighted_sum(c, weights).shape == (B, Hkv * G, Q, D)


def test_gqa_matches_dense_attention_math():
    """Against the dequantized keys, repeated per group: exact up to float rounding."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 3, 24, 64, generator=g)
    queries = torch.randn(1, 9, 4, 64, generator=g)
    q = TurboQuantMSE(64, 4, seed=0)
    c = q.quantize(keys)
    dense = queries @ q.dequantize(c).repeat_interleave(3, dim=1).transpose(-1, -2)
    torch.testing.assert_close(q.scores(c, queries), dense, rtol=1e-4, atol=1e-4)


def test_heads_that_do_not_fit_are_a_clear_value_error():
    q = TurboQuantMSE(32, 4, seed=0)
    c = q.quantize(torch.randn(1, 3, 10, 32))
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        q.scores(c, torch.randn(1, 5, 2, 32))
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        q.weighted_sum(c, torch.softmax(torch.randn(1, 4, 2, 10), -1))
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        q.scores(c, torch.randn(6, 2, 2, 32))  # batch 6 broadcasts against 1; 2 heads do not fit 3
