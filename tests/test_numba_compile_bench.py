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


def test_a_failing_test_is_named_and_its_output_kept(tmp_path):
    probe = tmp_path / "test_fails.py"
    probe.write_text("def test_fails():\n    assert 1 == 2, 'the probe fails'\n")
    result = numba_compile.run([str(probe)])
    assert "1 failed" in result["pytest"]
    (line,) = result["failed"]
    assert line.startswith("FAILED ") and "test_fails.py::test_fails" in line
    assert "the probe fails" in result["output"]
