"""``kvcodec bench``: run the benchmark suites that ship with kvcodec and say where the results went.

A suite is a script ``benchmarks/<name>.py`` with ``run(quick: bool, out_dir: str) -> dict`` that
writes ``<out_dir>/<name>.json`` and ``.md`` (see ``benchmarks/common.py``). The scripts live in
the checkout's ``benchmarks/`` folder; a wheel ships the same files as ``kvcodec/_bench/benchmarks/``
(``setup.py`` maps them there), so ``kvcodec bench`` works from a pip install too. The suites
are scripts that import their neighbour ``common``, so the folder holding them goes on
``sys.path`` while they run.

Results go to the folder the user names (``--out``), by default ``./kvcodec-bench-results``: never
inside the package, never over the checkout's committed ``benchmarks/results`` unless asked. Every
JSON file a run writes is stamped ``"quick": true|false``. GPU suites print a skip message on
machines without CUDA.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from kvcodec.safe_write import write_bytes

SUITES: dict[str, list[str]] = {
    "entropy": ["bench_entropy", "bench_entropy_models"],
    "lossless": ["bench_lossless"],  # includes bench_lossless_kv rows
    "quant": ["bench_quant"],
    "hf": ["bench_hf"],
    "gpu": ["gpu_kernels"],
}
DEFAULT_OUT = "kvcodec-bench-results"
_SHIPPED = Path(__file__).resolve().parent / "_bench" / "benchmarks"  # where a wheel puts the suites
_SOURCE_TREE = Path(__file__).resolve().parents[1] / "benchmarks"  # a checkout / editable install


def suites_dir() -> Path:
    """The folder holding the suite scripts: the copy inside an installed wheel, else the
    ``benchmarks/`` folder of the source tree this kvcodec was imported from."""
    for candidate in (_SHIPPED, _SOURCE_TREE):
        if (candidate / "common.py").is_file():
            return candidate
    raise FileNotFoundError(
        f"kvcodec bench: the benchmark suites are missing (looked in {_SHIPPED} and {_SOURCE_TREE}); "
        "reinstall kvcodec from a wheel or a source checkout"
    )


def _json_files(out: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in out.glob("*.json")} if out.is_dir() else {}


def _stamp_quick(path: Path, quick: bool) -> None:
    """Record in a result file whether it came from a ``--quick`` run (small inputs)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # not ours to repair; report.py lists unreadable files
    if isinstance(data, dict) and data.get("quick") != quick:
        data["quick"] = quick
        write_bytes(path, json.dumps(data, indent=2, default=float).encode(), overwrite=True)  # the run's own file


def run_bench(suite: str = "all", quick: bool = False, out_dir: str | Path = DEFAULT_OUT) -> int:
    """Run one suite (or ``"all"``) into ``out_dir``; print each file written. Returns the exit
    code: 0 when every suite ran, 1 when one failed (the others still run)."""
    names = list(SUITES) if suite == "all" else [suite]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"kvcodec bench: unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)} or all")
    out = Path(out_dir).resolve()
    folder = str(suites_dir())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    print(f"kvcodec bench: {'quick ' if quick else ''}suite {suite} from {folder}; results go to {out}", flush=True)
    failed = 0
    written: list[Path] = []
    for name in names:
        for module_name in SUITES[name]:
            t0 = time.perf_counter()
            before = _json_files(out)
            print(f"== suite {name}: {module_name} ==", flush=True)
            try:
                module = importlib.import_module(module_name)
                module.run(quick=quick, out_dir=str(out))
            except Exception:  # one broken suite must not hide the others' results
                failed += 1
                traceback.print_exc()
                print(f"   suite {name}: {module_name} FAILED", flush=True)
            for path, mtime in _json_files(out).items():
                if before.get(path) != mtime:
                    _stamp_quick(path, quick)
                    written.append(path)
            print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    if written:
        files = [q.name for p in written for q in (p, p.with_suffix(".md"), p.with_suffix(".png")) if q.is_file()]
        print(f"kvcodec bench: wrote {', '.join(files)} in {out}", flush=True)
    else:
        print(f"kvcodec bench: no result files written in {out}", flush=True)
    return 1 if failed else 0
