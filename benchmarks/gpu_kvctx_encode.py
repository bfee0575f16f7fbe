"""GPU encode of the kvctx / predictive format 2 streams (kvcodec/lossless/kvctx_device_encode.py) against
the CPU encoder, on gpu_lossless.py's tensors (the SmolLM2 KV sample tiled to --mb MB, bf16 and fp8 e4m3;
predictive: the fp8-weight twin as the prediction), in one run.

Layouts: the KV tensors as [heads, 256 tokens, 64] blocks, and "long rows" (bf16 kvctx and predictive
only): the same tiled sample as [-1, 2048, 64], 8x fewer channels, each with its own stored parameters.

Rows: GPU encode (``compress_device``: device blob; ``compress``: host bytes incl. the copy), its ratio,
its host time per step (``steps_ms`` in the JSON; the notes: waits for the device at the syncs included),
the same blob decoded on the GPU and on the CPU (bit-exact), the CPU encoder (all cores) on the same
tensor and its ratio; a per-kernel profile of one GPU encode call. Writes gpu_kvctx_encode.{json,md};
``--merge`` appends the rows to gpu_lossless.{json,md} (the suite's table).

    python benchmarks/gpu_kvctx_encode.py --out $OUT --mb 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_record, save_with_out  # noqa: E402
from benchmarks.gpu_kvctx import LAYOUTS, profile_call  # noqa: E402
from benchmarks.gpu_lossless import fp8_twin_pair, same_bits, tensors, timed  # noqa: E402

COLUMNS = ["data", "codec", "MB", "ratio", "enc_GBps", "dec_GBps", "exact", "gpu_path", "error"]


def jobs(data: dict, tokens: int = 256):
    """(data, label, tensor, prediction, options) of each encode, the KV tensors as [-1, tokens, 64]."""

    def kv_shaped(t):
        return t.reshape(-1, tokens, 64)

    x = data["kv_bf16"]
    out = [("kv_bf16", "kvctx", kv_shaped(x), None, {"layout": "kv"})]
    if tokens == 256:
        out.append(("kv_fp8_e4m3", "kvctx (version=2)", kv_shaped(data["kv_fp8_e4m3"]), None,
                    {"layout": "kv", "version": 2}))
    xp, pred = fp8_twin_pair(x.numel() // 2, kv_shaped)
    out.append(("kv_bf16", "predictive (fp8-weight twin)", xp, pred, {}))
    return out


def profile(t, pred, opts) -> list:
    import torch

    import kvcodec
    from kvcodec.lossless import api

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        api.compress_device(t, prediction=pred, **opts)
        torch.cuda.synchronize()
    rows = sorted(((e.key[:60], round(e.device_time_total / 1e3, 4)) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    return rows[:10]


def step_breakdown(label: str, t, pred, opts, reps: int = 7) -> tuple[str, dict]:
    """Host wall time of each step of one GPU encode call (kvctx_device_encode's step clock: launches,
    host work, and the waits for the device at its syncs), median of ``reps`` calls after a warm-up."""
    import statistics

    import torch

    from kvcodec.lossless import api
    from kvcodec.lossless import kvctx_device_encode as kde

    routed = api._gpu_kv_route(t, pred, "auto", opts, None)
    runs = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        steps: dict = {}
        t0 = time.perf_counter()
        kde.compress(t, pred, *routed, steps=steps)
        torch.cuda.synchronize()
        steps["total (synchronized)"] = (time.perf_counter() - t0) * 1e3
        runs.append(steps)
    med = {k: round(statistics.median(r[k] for r in runs[1:]), 3) for k in runs[-1]}
    return f"{label}: host steps of one GPU encode (ms, median of {reps}): " + ", ".join(
        f"{k} {v}" for k, v in med.items()), med


def rows_for(name, label, t, pred, opts, full: bool | None = True) -> tuple[list, list]:
    """The rows and notes of one encode: ``full`` all rows, False the device rows and the host profile,
    None (``--quick``) the device row, its host steps and its kernel profile."""
    import torch

    import kvcodec
    from kvcodec.lossless import api
    from kvcodec.lossless import kvctx_device_encode as kde

    nbytes = t.numel() * t.element_size()
    mb = nbytes / 1e6
    calls = []
    real = kde.encode

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    kde.encode = counting
    try:
        enc_s, dblob = timed(lambda: api.compress_device(t, prediction=pred, **opts), reps=11)
        host_s, hblob = timed(lambda: kvcodec.compress(t, prediction=pred, **opts), reps=3)
    finally:
        kde.encode = real
    on_gpu = bool(calls)
    dec_s, y = timed(lambda: kvcodec.decompress(dblob, prediction=pred))
    pc = pred.cpu() if pred is not None else None
    t0 = time.perf_counter()
    y_cpu = kvcodec.decompress(hblob, prediction=pc, device="cpu")
    cpu_dec = time.perf_counter() - t0
    ratio = nbytes / dblob.numel()
    rows = [dict(data=name, codec=f"kvcodec {label} (GPU encode, device blob)", MB=mb, ratio=ratio,
                 enc_GBps=nbytes / enc_s / 1e9, dec_GBps=nbytes / dec_s / 1e9, exact=same_bits(t, y), gpu_path=on_gpu)]
    note, steps = step_breakdown(f"{name} / {label}", t, pred, opts)
    rows[0]["steps_ms"] = steps
    if full is None:  # --quick: the device row, its steps and its kernels
        return rows, [note, f"{name} / {label}: GPU encode profile (ms by kernel): {profile(t, pred, opts)}"]
    notes = [note, profile_call(f"{name} / {label}", "GPU encode (compress_device)",
                                lambda: api.compress_device(t, prediction=pred, **opts))]
    if not full:  # the long-rows layout: the device rows and the host profile only
        torch.cuda.empty_cache()
        return rows, notes
    rows += [dict(data=name, codec=f"kvcodec {label} (GPU encode, host bytes; CPU decode, all cores)", MB=mb,
                 ratio=nbytes / len(hblob), enc_GBps=nbytes / host_s / 1e9, dec_GBps=nbytes / cpu_dec / 1e9,
                 exact=same_bits(t.cpu(), y_cpu) and bytes(dblob.cpu().numpy()) == hblob, gpu_path=on_gpu)]
    t0 = time.perf_counter()
    cblob = kvcodec.compress(t, prediction=pred, gpu=False, **opts)
    cpu_enc = time.perf_counter() - t0
    yc = kvcodec.decompress(cblob, prediction=pred, device="cuda")
    rows.append(dict(data=name, codec=f"kvcodec {label} (CPU encode, all cores; GPU decode)", MB=mb,
                     ratio=nbytes / len(cblob), enc_GBps=nbytes / cpu_enc / 1e9, exact=same_bits(t, yc)))
    notes.append(f"{name} / {label}: GPU encode profile (ms by kernel): {profile(t, pred, opts)}")
    torch.cuda.empty_cache()
    return rows, notes


VARIANTS = {  # kvctx_encode.cu builds to compare (macros): how far ahead each kernel loads its values, and how
    "ke_symbolise": [(), ("KE_SYM_AHEAD=2",), ("KE_SYM_AHEAD=4",)],
    "ke_encode": [(), ("KE_RANS_AHEAD=4",), ("KE_RANS_AHEAD=16",), ("KE_LOAD=__ldcs",)],
    "ke_bits": [(), ("KE_BITS_AHEAD=8",), ("KE_LOAD=__ldcs",)],
    "ke_fit_residuals": [(), ("KE_RES_AHEAD=2",), ("KE_RES_AHEAD=4",)],
}
PAIR_VARIANTS = [(), ("KE_LOAD=__ldcs",)]  # ke_bits and ke_encode together on two streams (co-running,
# ke_encode went 0.82 -> 1.61 ms: is it its tables evicted from L1 by ke_bits' 8-byte raw codes?)
# H200: the pair 1.513 ms, with __ldcs 1.492 (ke_bits alone 0.985, ke_encode 0.848): no.


def kernel_variants(label: str, t, pred, opts, reps: int = 5) -> list[str]:
    """Device time (CUDA events, mean of ``reps`` launches after a warm-up) of each ``VARIANTS`` build of
    a kernel on one GPU encode's own inputs (symbolise's variants count into a scratch histogram; every
    build writes the same values; the call itself runs the default build after them, so its blob stays
    exact): where the kernels' time goes."""
    import numpy as np
    import torch

    from kvcodec.device import build
    from kvcodec.lossless import api
    from kvcodec.lossless import kvctx_device_encode as kde
    from kvcodec.lossless.cuda import kvctx_encode as ke

    out, seen = [], {}

    def together(device) -> None:
        """ke_bits and ke_encode (their arguments of this call) launched together on two streams, ``reps`` times
        each: the device time of the pair per launch, for each PAIR_VARIANTS build (both kernels built with it)."""
        streams = [torch.cuda.Stream(device) for _ in range(2)]
        for defines in PAIR_VARIANTS:
            fns = [(build.get_function(ke.SOURCE, n, defines), g, b, a) for n, (g, b, a) in seen.items()]
            cur = torch.cuda.current_stream(device)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record(cur)
            for _ in range(reps):
                for s, (fn, g, b, a) in zip(streams, fns):
                    s.wait_stream(cur)
                    with torch.cuda.stream(s), build.cupy_stream(device):
                        fn((g,), (b,), a)
            for s in streams:
                cur.wait_stream(s)
            ev[1].record(cur)
            torch.cuda.synchronize()
            out.append(f"ke_bits + ke_encode together {'+'.join(defines) or 'default'} "
                       f"{ev[0].elapsed_time(ev[1]) / reps:.3f} ms")

    def runner(name, grid, block, args, device, smem=0):
        base = name.partition("<")[0]
        if base in ("ke_bits", "ke_encode"):
            seen[name] = (grid, block, tuple(args))
            if len(seen) == 2:
                together(device)
        if base in VARIANTS:
            probe = list(args)
            n_keys = int(args[-5]) if base == "ke_symbolise" else 0
            if base == "ke_symbolise":
                junk = [torch.zeros(n, dtype=torch.int64, device=device) for n in (256 * n_keys, 1 << 22)]
                probe[-2:] = [np.uint64(j.data_ptr()) for j in junk]
            for defines in VARIANTS[base]:
                fn = build.get_function(ke.SOURCE, name, defines)
                vs = 4 * n_keys if "KE_HIST_IN_GLOBAL" not in defines else 0
                if vs:
                    fn.max_dynamic_shared_size_bytes = vs
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                with build.cupy_stream(device):
                    fn((grid,), (block,), tuple(probe), shared_mem=vs)
                    ev[0].record()
                    for _ in range(reps):
                        fn((grid,), (block,), tuple(probe), shared_mem=vs)
                    ev[1].record()
                torch.cuda.synchronize()
                out.append(f"{name} {'+'.join(defines) or 'default'} {ev[0].elapsed_time(ev[1]) / reps:.3f} ms")
        ke.gpu_runner(name, grid, block, args, device, smem)

    routed = api._gpu_kv_route(t, pred, "auto", opts, None)
    tt = t.detach().contiguous()
    kde.encode(tt, pred, routed[1], runner=runner)
    torch.cuda.synchronize()
    return [f"{label}: kernel variants (ms, mean of {reps}): " + "; ".join(out)]


def main(out_dir: str, mb: int, quick: bool = False) -> dict:
    import torch

    rec = machine_record()
    data = tensors(mb)
    rows, notes = [], []
    for suffix, tokens in LAYOUTS[:1] if quick else LAYOUTS:
        for name, label, t, pred, opts in jobs(data, tokens):
            name += suffix
            try:
                got, got_notes = rows_for(name, label, t, pred, opts, full=None if quick else tokens == 256)
                notes += got_notes
            except Exception as e:  # noqa: BLE001
                got = [dict(data=name, codec=label, error=f"{type(e).__name__}: {e}"[:300])]
            for r in got:
                print(r, flush=True)
            rows += got
            torch.cuda.empty_cache()
    result = {"suite": "gpu_kvctx_encode", "rows": rows, "machine": rec, "notes": [
        f"GPU {rec.get('gpu')}; tensors of {mb} MB (fp8: half, predictive: half) on the device; wall clock per call "
        "with torch.cuda.synchronize(), median of 11 (host bytes: 3) after a warm-up; CPU encode/decode: one call; "
        "'long rows': the same tiled sample as [-1, 2048, 64] (8 consecutive 256-token rows concatenated: 8x fewer "
        "channels), GPU encode + GPU decode and the host profile only",
        "GPU encode: kvcodec/lossless/cuda/kvctx_encode.cu (fit sums per column, symbolise + histogram, one warp per chunk "
        "for the raw bits on a side stream, one per chunk for rANS); the same format 2 stream the CPU encoder writes",
        *notes]}
    save_with_out(result, out_dir, columns=COLUMNS)
    print("\n".join(result["notes"][2:]), flush=True)
    return result


def merge(results_dir: str) -> None:
    """Append this suite's rows and notes to gpu_lossless.{json,md} (replacing earlier GPU-encode rows)."""
    from benchmarks.common import save

    d = Path(results_dir)
    mine = json.loads((d / "gpu_kvctx_encode.json").read_text())
    suite = json.loads((d / "gpu_lossless.json").read_text())
    suite["rows"] = [r for r in suite["rows"] if "GPU encode" not in r.get("codec", "")] + mine["rows"]
    suite["notes"] = [n for n in suite["notes"] if not n.startswith("gpu_kvctx_encode:")] + [
        f"gpu_kvctx_encode: {n}" for n in mine["notes"]]
    save(suite, str(d), columns=COLUMNS)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--merge", action="store_true", help="append results/gpu_kvctx_encode.json to gpu_lossless")
    ap.add_argument("--variants", action="store_true", help="only time the kernel variants (VARIANTS), print them")
    ap.add_argument("--quick", action="store_true", help="the [-1, 256, 64] layout's device rows, steps and kernels only")
    args = ap.parse_args()
    if args.merge:
        merge(args.out)
    elif args.variants:
        from benchmarks.gpu_lossless import tensors as _tensors

        for name, label, t, pred, opts in jobs(_tensors(args.mb)):
            print("\n".join(kernel_variants(f"{name} / {label}", t, pred, opts)), flush=True)
    else:
        main(args.out, args.mb, args.quick)
