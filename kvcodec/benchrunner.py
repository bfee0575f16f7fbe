"""``kvcodec bench``: find the ``benchmarks/`` folder of a source checkout and run its suites.

A suite is a module ``benchmarks/<name>.py`` with ``run(quick: bool, out_dir: str) -> dict``
(see ``benchmarks/common.py``). GPU suites print a skip message on machines without CUDA.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

SUITES: dict[str, list[str]] = {
    "entropy": ["bench_entropy", "bench_entropy_models"],
    "lossless": ["bench_lossless"],  # includes bench_lossless_kv rows
    "quant": ["bench_quant"],
    "hf": ["bench_hf"],
    "gpu": ["gpu_kernels"],
}


def find_benchmarks_dir() -> Path:
    candidates = [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[1] / "benchmarks"]
    for c in candidates:
        if (c / "common.py").is_file():
            return c
    raise FileNotFoundError(
        "kvcodec bench needs the benchmarks/ folder of a source checkout "
        "(git clone the repository and run it from there)"
    )


def run_bench(suite: str = "all", quick: bool = False, out_dir: str = "benchmarks/results") -> int:
    names = list(SUITES) if suite == "all" else [suite]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)} or all")
    bench_dir = find_benchmarks_dir()
    sys.path.insert(0, str(bench_dir))
    failed = 0
    for name in names:
        for module_name in SUITES[name]:
            t0 = time.perf_counter()
            print(f"== suite {name}: {module_name} ==", flush=True)
            try:
                module = importlib.import_module(module_name)
                module.run(quick=quick, out_dir=out_dir)
            except Exception:  # one broken suite must not hide the others' results
                failed += 1
                traceback.print_exc()
                print(f"   suite {name}: {module_name} FAILED", flush=True)
            print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 1 if failed else 0
