"""benchmarks/numba_compile.py times numba's compiles on a cold cache, per kernel, while pytest runs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import numba_compile  # noqa: E402


def test_it_names_each_kernel_and_counts_a_compile_per_signature(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from numba import njit\n\n"
        "@njit(cache=True)\n"
        "def twice(x):\n    return 2 * x\n\n"
        "def test_probe():\n    assert twice(2) == 4 and twice(2.5) == 5.0\n")
    result = numba_compile.run([str(probe)])
    assert "1 passed" in result["pytest"], result
    (row,) = [r for r in result["rows"] if r["kernel"].endswith("twice")]
    assert row["compiles"] == 2 and row["seconds"] > 0  # int and float signatures
    assert result["compile_s"] >= row["seconds"]
