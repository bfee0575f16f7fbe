"""Cold start of ``kvcodec.decompress``: the first call in a fresh process, numba's disk cache shared.

For each case a blob is written once; then three fresh Python processes, one after the other, share
one empty ``NUMBA_CACHE_DIR`` (a temporary folder) and each times ``import kvcodec`` and its first
and second ``kvcodec.decompress`` of the blob. Process 1 is the first-ever run (it compiles and fills
the cache), processes 2 and 3 should load everything from the cache. ``new_cache_files`` counts the
files a process added to the cache folder (0 when every kernel was found there).

    python benchmarks/bench_cold_start.py [--out benchmarks/results] [--cases kv_bf16,predictive_external]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEFAULT_OUT, save_with_out  # noqa: E402

SHAPE = (4, 8, 256, 128)  # [layers, heads, tokens, channels]: 1M values
CASES = {
    # name: (dtype, compress keyword options, uses the prediction)
    "kv_bf16": ("bfloat16", {"layout": "kv"}, False),
    "kv_fp8": ("float8_e4m3fn", {"layout": "kv"}, False),
    "predictive_external": ("bfloat16", {}, True),
    "predictive_neighbour_layer": ("bfloat16", {"codec": "predictive", "predictor": "neighbour_layer"}, False),
}


def _sample(dtype_name: str, with_prediction: bool, shape: tuple):
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g).cumsum(0) * 0.5
    t = (base + 0.1 * torch.randn(shape, generator=g)).to(getattr(torch, dtype_name))
    pred = (base + 0.1 * torch.randn(shape, generator=g)).to(getattr(torch, dtype_name)) if with_prediction else None
    return t, pred


def _write_blob(case: str, folder: Path, shape: tuple) -> None:
    """Compress the case's tensor into ``folder``, in this process (its numba cache, not the measured one)."""
    import torch

    import kvcodec

    dtype_name, opts, with_pred = CASES[case]
    t, pred = _sample(dtype_name, with_pred, shape)
    blob = kvcodec.compress(t, prediction=pred, **opts)
    (folder / f"{case}.blob").write_bytes(blob)
    if pred is not None:
        torch.save(pred, folder / f"{case}.pred")


def _time_decode(case: str, folder: Path, preload: bool = False) -> None:
    """Child: time import and the first two decompress calls; print one JSON line. ``preload``: first
    import the decoder's modules and run numba's own per-process setup (``setup_s``), outside the
    timed call: what is left is kvcodec's part (cache loads, decoding)."""
    t0 = time.perf_counter()
    import torch

    import kvcodec

    t_import = time.perf_counter() - t0
    t_setup = 0.0
    if preload:
        t1 = time.perf_counter()
        import kvcodec.lossless.api  # noqa: F401
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()  # numba's first-use setup (its typing and lowering registries)
        t_setup = time.perf_counter() - t1
    blob = (folder / f"{case}.blob").read_bytes()
    pred_path = folder / f"{case}.pred"
    pred = torch.load(pred_path) if pred_path.exists() else None
    times = []
    for _ in range(2):
        t1 = time.perf_counter()
        kvcodec.decompress(blob, prediction=pred)
        times.append(time.perf_counter() - t1)
    print(json.dumps({"import_s": t_import, "setup_s": t_setup, "first_s": times[0], "second_s": times[1]}))


def _child(args: list[str], cache_dir: Path | None, without_scipy: bool = False) -> dict:
    env = dict(os.environ) if cache_dir is None else dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    cmd = [sys.executable, __file__, *args]
    if without_scipy:  # an interpreter where scipy cannot be imported, as if it were not installed
        cmd = [sys.executable, "-c", "import runpy, sys; sys.modules['scipy'] = None; "
               f"sys.argv = {cmd[1:]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _cache_files(cache_dir: Path) -> int:
    return sum(1 for p in cache_dir.rglob("*") if p.is_file())


def run_case(case: str, work: Path, processes: int = 3, shape: tuple = SHAPE, preloaded: bool = False,
             cache: Path | None = None) -> list[dict]:
    """``processes`` fresh processes on one cache folder (``cache``, default an empty one of the case's
    own), then (``preloaded``) one more that runs the setup before its timed call and one without scipy."""
    cache = work / f"cache-{case}" if cache is None else cache
    cache.mkdir(exist_ok=True)
    _write_blob(case, work, shape)
    rows = []
    for k in range(1, processes + 1 + 2 * preloaded):
        before = _cache_files(cache)
        t0 = time.perf_counter()
        pre, bare = k == processes + 1, k == processes + 2
        r = _child(["--decode", case, str(work)] + ["--preload"] * pre, cache, without_scipy=bare)
        wall = time.perf_counter() - t0
        run = ("first-ever" if k == 1 else "cached, setup before the timer" if pre else
               "cached, without scipy" if bare else "cached")
        rows.append({"case": case, "process": k, "run": run,
                     "import_s": r["import_s"], "setup_s": r["setup_s"], "first_decompress_s": r["first_s"],
                     "second_decompress_s": r["second_s"], "process_wall_s": wall,
                     "new_cache_files": _cache_files(cache) - before})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(cases: list[str], processes: int = 3) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvcodec-cold-") as tmp:
        work = Path(tmp)
        rows = [row for case in cases for row in run_case(case, work, processes, preloaded=True)]
    return {
        "suite": "bench_cold_start",
        "rows": rows,
        "notes": [
            f"tensor {list(SHAPE)}; each case: {processes} fresh processes in sequence sharing one empty "
            "NUMBA_CACHE_DIR; times are wall seconds inside the process; a last process per case imports "
            "kvcodec.lossless.api and runs numba's per-process setup (setup_s) before its timed first decompress; "
            "the very last one runs where scipy cannot be imported (a plain `pip install kvcodec`: numba's setup "
            "imports scipy.linalg only where scipy is installed)",
            "python benchmarks/bench_cold_start.py --out benchmarks/results",
        ],
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--decode":
        _time_decode(argv[1], Path(argv[2]), preload="--preload" in argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--processes", type=int, default=3)
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))}; known: {', '.join(CASES)}")
    save_with_out(run(cases, args.processes), args.out)


if __name__ == "__main__":
    main()
