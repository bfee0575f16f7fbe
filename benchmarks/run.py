"""Run benchmark suites of a kvcodec source checkout and say where the results went.

    python benchmarks/run.py --suite quant --quick --out DIR   # entropy | lossless | quant | hf | gpu | all

A suite is one or more scripts ``benchmarks/<name>.py`` with ``run(quick: bool, out_dir: str) -> dict``
that write ``<out_dir>/<name>.json`` and ``.md`` (see ``common.py``). They import their neighbours
(``common``, ``smollm2``) and the checkout's ``kvcodec``, so this folder and the checkout go first
on ``sys.path``: the suites measure the code beside them, not another installed kvcodec.

Results go to the folder ``--out`` names, by default ``./kvcodec-bench-results`` in the current
folder: never over the checkout's committed ``benchmarks/results`` unless it is named. Every JSON
file a run writes is stamped ``"quick": true|false``. GPU suites print a skip message on machines
without CUDA. Exit code 0 when every suite ran, 1 when one failed (the others still run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the checkout's kvcodec before any installed one

from common import DEFAULT_OUT  # noqa: E402
from kvcodec.safe_write import write_bytes  # noqa: E402

SUITES: dict[str, list[str]] = {
    "entropy": ["bench_entropy", "bench_entropy_models"],
    "lossless": ["bench_lossless"],  # includes bench_lossless_kv rows
    "quant": ["bench_quant"],
    "hf": ["bench_hf"],
    "gpu": ["gpu_kernels"],
}


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
        raise SystemExit(f"benchmarks/run.py: unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)} or all")
    out = Path(out_dir).resolve()
    print(f"benchmarks/run.py: {'quick ' if quick else ''}suite {suite} from {HERE}; results go to {out}", flush=True)
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
        print(f"benchmarks/run.py: wrote {', '.join(files)} in {out}", flush=True)
    else:
        print(f"benchmarks/run.py: no result files written in {out}", flush=True)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="all", choices=[*SUITES, "all"], help="which suite (default: all)")
    ap.add_argument("--quick", action="store_true", help="small inputs, for a smoke run (marked in the JSON)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help=f"folder for the JSON, markdown and PNG results (default: ./{DEFAULT_OUT})")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_bench(suite=args.suite, quick=args.quick, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
