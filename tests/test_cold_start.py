"""A fresh process finds every kernel of a ``layout="kv"`` decode in numba's disk cache.

Processes in sequence share one empty ``NUMBA_CACHE_DIR`` (benchmarks/bench_cold_start.py's
children): the first compiles and writes the cache; a later one adds no cache file (a factory-built
kernel keyed on a per-process id used to add one a run) and its first decompress takes a fraction of
the first one's. ``python benchmarks/bench_cold_start.py`` measures the same.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_cold_start  # noqa: E402


@pytest.mark.slow
def test_a_second_process_hits_the_numba_cache(tmp_path):
    """A kvctx blob's decode, then a predictive one (external prediction) on the same cache folder: the
    first process of each compiles what the folder lacks (the second case shares most kernels); every
    later process adds no file and decodes in a fraction of the first-ever decode's time."""
    cache = tmp_path / "cache"
    kv = bench_cold_start.run_case("kv_bf16", tmp_path, processes=2, shape=(2, 2, 64, 64), cache=cache)
    pred = bench_cold_start.run_case("predictive_external", tmp_path, processes=2, shape=(2, 2, 64, 64), cache=cache)
    assert kv[0]["new_cache_files"] > 0
    for later in (kv[1], pred[1]):
        assert later["new_cache_files"] == 0, later
        assert later["first_decompress_s"] < 0.5 * kv[0]["first_decompress_s"], (kv[0], later)
