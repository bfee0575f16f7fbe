"""CPU smoke test of benchmarks/gpu_hf_decode.py (the GPU decode-throughput benchmark of CompressedCache).

Runs the script's ``main`` with ``--tiny --device cpu`` (2-layer model, context 64, 2 timed steps) with
kvcodec's fused-kernel wiring routed through its CPU reference, so the path the GPU run takes is exercised.
"""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")

from benchmarks import gpu_hf_decode, report  # noqa: E402

NUMBERS = ("tok_s", "ms_step", "kv_MiB", "kv_bytes", "speedup", "kv_vs_dynamic", "agree16", "prefill_s")


def test_tiny_cpu_run_writes_finite_rows(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    result = gpu_hf_decode.main(["--tiny", "--device", "cpu", "--fused", "cpu-reference", "--out", str(tmp_path)])

    rows = result["rows"]
    assert [(r["batch"], r["cache"]) for r in rows] == [
        (b, c) for b in (1, 2) for c in ("DynamicCache bf16", "turboquant 4/4", "turboquant 3/3")]
    for r in rows:
        assert "error" not in r, r
        assert set(gpu_hf_decode.COLUMNS) - {"error"} <= set(r), r
        assert r["model"] == "tiny-llama" and r["ctx"] == 64
        for key in NUMBERS:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["peak_prefill_GiB"] is None and r["peak_decode_GiB"] is None  # CPU: no CUDA allocator
        assert 0.0 <= r["agree16"] <= 1.0
        if r["cache"].startswith("DynamicCache"):
            assert r["speedup"] == 1.0 and r["kv_vs_dynamic"] == 1.0 and r["fused"] == "-"
            assert r["kv_bytes"] == 2 * 2 * r["batch"] * 2 * (64 + 3) * 32 * 2  # layers, K+V, B, Hkv, T, D, bf16
        else:
            assert 0.0 < r["kv_vs_dynamic"] < 1.0  # residual 16: most of the 67 tokens are compressed
            taken, calls = map(int, r["fused"].split("/"))
            assert calls == 2 * 2 and taken == calls  # 2 layers x 2 timed steps, all through the fused wiring

    data = report.validate(json.loads((tmp_path / "gpu_hf_decode.json").read_text()))
    assert data["columns"] == gpu_hf_decode.COLUMNS and len(data["rows"]) == 6
    assert "| tiny-llama | 1 | 64 | turboquant 4/4 |" in (tmp_path / "gpu_hf_decode.md").read_text()
