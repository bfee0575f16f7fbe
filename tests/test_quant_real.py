"""The documented defaults beat the paper's plain TurboQuant on real SmolLM2 keys (attention output)."""

import pytest
import torch

from kvcodec.data import attention_error, load_kv_sample
from kvcodec.quant import KIVI, TurboQuantMSE


@pytest.fixture(scope="module")
def sample():
    return load_kv_sample()


def _keys_err(sample, q):
    c = q.quantize(sample.keys)  # calibrates per (layer, head) on the keys themselves
    return attention_error(sample, keys_hat=q.dequantize(c)), c.bits_per_value()


def test_default_beats_paper_plain_on_real_keys(sample):
    for bits in (3, 4):
        err_default, _ = _keys_err(sample, TurboQuantMSE(64, bits))
        err_plain, _ = _keys_err(sample, TurboQuantMSE(64, bits, precondition="none", norm_correction=False))
        assert err_default < 0.95 * err_plain, (bits, err_default, err_plain)


def _with_sink(sample, q, precond=None):
    """Token 0 (the attention sink) kept exact, as the cache keeps it; the rest quantized."""
    body = sample.keys[..., 1:, :]
    c = q.quantize(body, precond=precond(body) if precond else None)
    k_hat = torch.cat([sample.keys[..., :1, :].float(), q.dequantize(c)], dim=-2)
    return attention_error(sample, keys_hat=k_hat), c.bits_per_value()


def test_query_aware_scale_beats_kivi_with_fewer_bytes(sample):
    qfold = sample.queries.float().reshape(sample.n_layers, 3, 3 * sample.n_q, 64)
    q = TurboQuantMSE(64, 3, precondition="scale")
    err, bits = _with_sink(sample, q, lambda body: q.calibrate(body, queries=qfold))
    err_kivi, bits_kivi = _with_sink(sample, KIVI(3, 32, "channel"))
    assert bits < bits_kivi and err < err_kivi, (err, err_kivi)


def test_packed_attention_equals_dense_on_real_data(sample):
    q = TurboQuantMSE(64, 4)
    k, v = sample.keys[:2], sample.values[:2]
    ck, cv = q.quantize(k), q.quantize(v)
    queries = sample.queries[:2].float().reshape(2, 3, -1, 64)
    s = q.scores(ck, queries) / 8
    dense = queries @ q.dequantize(ck).transpose(-1, -2) / 8
    assert torch.allclose(s, dense, atol=1e-3)
    p = torch.softmax(s, -1)
    assert torch.allclose(q.weighted_sum(cv, p), p @ q.dequantize(cv), atol=1e-4)
