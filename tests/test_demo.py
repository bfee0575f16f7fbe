"""``kvcodec demo``: runs end to end on the shipped sample; its attention plumbing is exact."""

import io
import math

import pytest
import torch

from kvcodec import demo
from kvcodec.cli import main
from kvcodec.data import attention_reference, load_kv_sample


@pytest.fixture(scope="module")
def quick_result():
    """One end-to-end run of the real command line, ``kvcodec demo --quick``, keeping its rows."""
    captured = {}
    original = demo.run_demo

    def recording_run_demo(quick=False, file=None):
        buf = io.StringIO()
        captured.update(original(quick=quick, file=buf))
        captured["quick"] = quick
        captured["text"] = buf.getvalue()

    mp = pytest.MonkeyPatch()
    mp.setattr(demo, "run_demo", recording_run_demo)
    try:
        assert main(["demo", "--quick"]) == 0
    finally:
        mp.undo()
    assert captured["quick"] is True
    return captured


def test_demo_quick_table(quick_result):
    rows = {r["method"]: r for r in quick_result["rows"]}
    assert rows["bf16 cache (reference)"]["bits_per_value"] == 16.0
    lossless = [r for r in quick_result["rows"] if r["kind"] == "lossless"]
    assert any(r["method"].startswith("kvcodec") for r in lossless)
    for r in quick_result["rows"]:
        assert set(demo.COLUMNS) <= set(r)
        assert 0 < r["bits_per_value"] <= 17
        assert math.isclose(r["ratio_vs_bf16"], 16 / r["bits_per_value"])
    for r in lossless + [r for r in quick_result["rows"] if r["kind"] == "quantized"]:
        assert r["encode_MBps"] > 0 and r["decode_MBps"] > 0
    for r in lossless:
        assert r["attn_rel_err"] == 0.0  # and run_demo checked every bit
    for r in quick_result["rows"]:
        if r["kind"] == "quantized":
            assert 0 < r["attn_rel_err"] < 1
    text = quick_result["text"]
    assert "kvcodec demo" in text and "bf16 cache (reference)" in text
    assert "bits_per_value" in text and "zstd" in text and "demo total" in text


def test_failed_methods_are_reported_not_hidden(quick_result):
    for note in quick_result["notes"]:
        assert "failed" not in note, note


class _ExactQuantizer:
    """Stores x unchanged: compressed attention must then equal the float64 reference."""

    def quantize(self, x):
        return x.to(torch.float64)

    def scores(self, c, q):
        return q.to(torch.float64) @ c.transpose(-1, -2)

    def weighted_sum(self, c, w):
        return w.to(torch.float64) @ c


def test_compressed_attention_matches_reference():
    sample = load_kv_sample()
    q = _ExactQuantizer()
    out = demo.compressed_attention(sample, q, q.quantize(sample.keys), q, q.quantize(sample.values))
    for i in (0, sample.n_layers - 1):
        torch.testing.assert_close(out[i], attention_reference(sample, i), rtol=2e-5, atol=2e-5)
    assert demo._attention_error(sample, out) < 1e-5


def test_quantized_rows_present_and_consistent_with_dequantize(quick_result):
    """The compressed-domain attention error equals the error of attention over the dequantized
    cache (scores/weighted_sum are exact rewrites of dequantize-then-attend)."""
    quant = pytest.importorskip("kvcodec.quant")
    if not hasattr(quant, "TurboQuantMSE"):
        pytest.skip("kvcodec.quant has no TurboQuantMSE")
    assert any(r["kind"] == "quantized" for r in quick_result["rows"])
    from kvcodec.data import attention_error

    sample = demo._subset(load_kv_sample(), [0, 7])
    kq = quant.TurboQuantMSE(64, 4, seed=0)
    vq = quant.TurboQuantMSE(64, 4, seed=1)
    ck, cv = kq.quantize(sample.keys), vq.quantize(sample.values)
    err_compressed = demo._attention_error(sample, demo.compressed_attention(sample, kq, ck, vq, cv))
    err_dense = attention_error(sample, kq.dequantize(ck), vq.dequantize(cv))
    assert 0 < err_dense < 0.5
    assert abs(err_compressed - err_dense) < 1e-3 * err_dense
