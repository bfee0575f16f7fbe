"""Where numba's compile time goes on a cold cache: every compile of a kvcodec kernel while pytest runs
the tests given, timed by numba's own compile events, in an empty ``NUMBA_CACHE_DIR`` (what a clean CI
checkout and a user's first-ever call see).

Why: on a cold cache the suite spends minutes compiling (the kernels are cached on disk afterwards),
and which test pays for a kernel depends on the order the tests run in; this names the kernels.

    python benchmarks/numba_compile.py [--out DIR] [pytest arguments, default: tests/]

Writes ``numba_compile.json`` (and prints the table): per kernel (module.qualname), the number of
compiles (one per signature; factories make one kernel per configuration), their seconds and the
argument types of each compile (two compiles of one kernel for arguments that could have been one type
are time a user pays too); only
outermost compiles count (a kernel compiled inside another's compile is part of that one's time).
Also writes ``pytest.log`` (pytest's whole output) and lists failed tests in the JSON and on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT = "KVCODEC_NUMBA_COMPILE_REPORT"  # where the plugin (in the pytest process) writes its counts


# ----------------------------------------------------------------- the pytest plugin (-p numba_compile)
_seconds: Counter = Counter()
_counts: Counter = Counter()
_signatures: dict = {}


def _listener():
    from numba.core import event

    class Timer(event.Listener):
        def __init__(self):
            self.started: list[float] = []

        def on_start(self, ev):
            self.started.append(time.perf_counter())

        def on_end(self, ev):
            t0 = self.started.pop()
            if self.started:  # nested in another compile: counted there
                return
            fn = getattr(ev.data.get("dispatcher"), "py_func", None) if isinstance(ev.data, dict) else None
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
            _seconds[name] += time.perf_counter() - t0
            _counts[name] += 1
            _signatures.setdefault(name, []).append(str(ev.data.get("args", "?")))

    return Timer()


def pytest_configure(config):
    from numba.core import event

    event.register("numba:compile", _listener())


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT)
    if path:
        Path(path).write_text(json.dumps({k: [_counts[k], round(v, 3), _signatures.get(k, [])]
                                          for k, v in _seconds.items()}))


# ------------------------------------------------------------------------------------------ the runner
def run(pytest_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvcodec-numba-cold-") as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(tmp) / "cache"), **{REPORT: str(report)},
                   PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "numba_compile",
                               *pytest_args], cwd=HERE.parent, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        found = json.loads(report.read_text()) if report.is_file() else {}
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    rows = sorted(({"kernel": k, "compiles": n, "seconds": s, "signatures": sig} for k, (n, s, sig) in found.items()),
                  key=lambda r: -r["seconds"])
    return {"suite": "numba_compile", "rows": rows, "pytest": summary, "failed": failed, "output": proc.stdout,
            "wall_s": round(wall, 1),
            "compile_s": round(sum(r["seconds"] for r in rows), 3),
            "command": "python benchmarks/numba_compile.py " + " ".join(pytest_args)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    out = "kvcodec-bench-results"
    if argv[:1] == ["--out"]:
        out, argv = argv[1], argv[2:]
    result = run(argv or ["tests/"])
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "pytest.log").write_text(result.pop("output"))  # the whole pytest output: failures in full
    (Path(out) / "numba_compile.json").write_text(json.dumps(result, indent=1))
    for line in result["failed"]:
        print(line)
    print(f"{result['command']}: {result['compile_s']} s compiling in {result['wall_s']} s ({result['pytest']})")
    print("| seconds | compiles | kernel |\n|---|---|---|")
    for r in result["rows"][:25]:
        print(f"| {r['seconds']:.2f} | {r['compiles']} | {r['kernel']} |")


if __name__ == "__main__":
    main()
