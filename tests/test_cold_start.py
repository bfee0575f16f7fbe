"""A fresh process finds every kernel of a ``layout="kv"`` decode in numba's disk cache.

Three processes in sequence share one empty ``NUMBA_CACHE_DIR`` (benchmarks/bench_cold_start.py's
children): the first compiles and writes the cache; the second and third add no cache file (a
factory-built kernel keyed on a per-process id used to add one a run) and their first decompress
takes a fraction of the first one's. ``python benchmarks/bench_cold_start.py`` measures the same.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_cold_start  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("case", ["kv_bf16", "predictive_external"])
def test_a_second_process_hits_the_numba_cache(case, tmp_path):
    first, second, third = bench_cold_start.run_case(case, tmp_path, processes=3, shape=(2, 2, 64, 64))
    assert first["new_cache_files"] > 0
    assert second["new_cache_files"] == 0, second
    assert third["new_cache_files"] == 0, third
    assert second["first_decompress_s"] < 0.5 * first["first_decompress_s"], (first, second)
