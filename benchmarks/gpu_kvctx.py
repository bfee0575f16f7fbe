"""The kvctx / predictive GPU decode alone, taken apart (the kvctx rows of gpu_lossless.py, plus
the host plan and the kernel per variant: ``gpu_lossless.kvctx_kernel_rows``), in a short run.

    PYTHONPATH=. python3 benchmarks/gpu_kvctx.py [--mb 256] [--out benchmarks/results]
    ncu --kernel-name regex:kx_decode --launch-skip 1 --launch-count 1 python3 benchmarks/gpu_kvctx.py --once

``--once``: only decode the bf16 kvctx blob twice (a profiler's target; nothing written).

Rows (for the benchmark's [heads, 256 tokens, 64] blocks, and "long rows": the same tiled sample as
[-1, 2048, 64], 8x fewer channels, each with its own stored parameters): for the KV tensors of gpu_lossless (bf16 256 MB, fp8 128 MB) the kvctx blob and, for bf16, the
predictive blob (fp8-weight twin): decode of the device blob and of the host bytes end to end
(``decompress``), the host plan, the kernel alone per variant, a device copy, then the CPU decode of the
same blobs; in the notes, where the host part of one device-blob decode goes (cProfile).
Writes gpu_lossless_kvctx.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu_lossless as gl  # noqa: E402
from benchmarks.common import machine_record, save_with_out  # noqa: E402


# (label suffix, tokens per row): the benchmark's [heads, 256 tokens, 64] blocks, and "long rows": the same
# tiled sample as [-1, 2048, 64] (8 consecutive 256-token blocks concatenated: 8x fewer channels, each
# with its own stored parameters, like a real 2k-token cache per head)
LAYOUTS = (("", 256), (" long rows [-1, 2048, 64]", 2048))


@contextmanager
def kv_rows(tokens: int):
    """gpu_lossless' KV layout as [-1, tokens, 64] while inside (its row helpers call ``kv_shaped``)."""
    real = gl.kv_shaped
    gl.kv_shaped = lambda x: x.reshape(-1, tokens, 64)
    try:
        yield
    finally:
        gl.kv_shaped = real


def profile_call(label: str, what: str, fn, top: int = 12) -> str:
    """cProfile of one call ``fn()`` (after a warm-up call and a sync): the host functions taking the
    most time (own time, ms), where the host part of the call goes."""
    import cProfile
    import pstats

    import torch

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in stats.items()), reverse=True)[:top]
    total = sum(v[2] for v in stats.values())
    return (f"{label}: host time of one {what} (cProfile, own time, incl. the final sync) {total * 1e3:.2f} ms: "
            + ", ".join(f"{fn} {t * 1e3:.2f}" for t, fn in rows))


def device_blob(hblob: bytes):
    """(the blob on the GPU, its codec meta, its device sections)."""
    import torch

    from kvcodec.lossless import device_container

    dblob = torch.frombuffer(bytearray(hblob), dtype=torch.uint8).cuda()
    header, end = device_container.read_header(dblob)
    return dblob, header["meta"]["codec_meta"], device_container.sections(dblob, header, end)[0]


def plan_breakdown(name: str, reps: int = 7) -> list[str]:
    """Wall time (median of ``reps`` after a warm-up) and minor page faults per call of each step of the
    host plan of the tensor's kvctx / predictive device blobs: the model section's read-back (pinned, and
    pageable as before), its entropy decode (thread pool), the whole parse with its checks, the plan,
    the upload of the kernel's inputs (with a sync), and decode's host part to the launch (no sync)."""
    import resource
    import statistics
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from kvcodec.lossless import kvctx_device
    from kvcodec.lossless.predictive import codec as pcodec
    from kvcodec.lossless.predictive import format2

    def timed(fn):
        fn()
        ts, faults = [], []
        for _ in range(reps):
            torch.cuda.synchronize()  # the read-back's sync must not wait for an earlier step's kernels
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        return f"{statistics.median(ts) * 1e3:.3f} ms ({statistics.median(faults):.0f} faults)"

    def one_worker(fn):
        real = format2._pool
        format2._pool = lambda: single
        try:
            return fn()
        finally:
            format2._pool = real

    single = ThreadPoolExecutor(1)
    lines = []
    for label, _, hblob, pred, _ in gl.kv_blobs(name):
        dblob, meta, secs = device_blob(hblob)
        stand = kvctx_device._stand_ins(meta, secs)
        model = stand["model"]
        k = int(model[:4].view("<u4")[0])
        body = model[4 + 5 * len(format2.stored_fields(meta["source"])):4 + k].tobytes()
        ps, kp = kvctx_device.plan(meta, secs)
        p2 = ps.v2
        flags = torch.zeros(kvctx_device.flag_count(ps), dtype=torch.int32, device=dblob.device)
        host_fields = (lambda: p2.field_parts.decode(model)) if p2.field_parts is not None else \
            (lambda: format2.decode_model(meta, body, 1 << 40))
        steps = {
            "model read-back (pinned)": lambda: kvctx_device._stand_ins(meta, secs),
            "model read-back (pageable .cpu())": lambda: secs["model"].bytes.cpu(),
            "fields' entropy decode on the host (pool; not done by decode)": host_fields,
            "the same on one worker": lambda: one_worker(host_fields),
            "parse_stream (checks; tables part)": lambda: pcodec.parse_stream(meta, stand),
            "plan": lambda: kvctx_device.plan(meta, secs),
            "device inputs (upload, tables, field parts and checks) + sync":
                lambda: (kvctx_device.device_inputs(ps, kp, secs, dblob.device, flags.data_ptr()),
                         torch.cuda.synchronize()),
            "decode to the launch (no sync)": lambda: kvctx_device.decode(meta, secs, dblob.device, pred),
        }
        lines.append(f"{name}/{label}: host plan steps ({len(body) / 1e6:.2f} MB coded model, "
                     f"{(p2.field_parts.size if p2.field_parts else p2.fields.raw.size) / 1e6:.2f} MB fields, "
                     f"{kp.chunks.shape[0]} chunks): "
                     + "; ".join(f"{k} {timed(fn)}" for k, fn in steps.items()))
        torch.cuda.synchronize()
        gl.log(lines[-1])
    return lines


def host_profile(name: str) -> list[str]:
    """:func:`profile_call` of one device-blob decompress of each of the tensor's kvctx / predictive blobs."""
    import torch

    import kvcodec

    lines = []
    for label, _, hblob, pred, _ in gl.kv_blobs(name):
        dblob = torch.frombuffer(bytearray(hblob), dtype=torch.uint8).cuda()
        lines.append(profile_call(f"{name}/{label}", "decompress",
                                  lambda: kvcodec.decompress(dblob, prediction=pred)))
    return lines


def timeline(name: str, reps: int = 9) -> list[str]:
    """Where one device-blob decompress of each of the tensor's kvctx / predictive blobs goes, as a blob's
    first decode and decoded again (plan reused): host stamps and CUDA events on torch's stream at the
    boundaries of its steps (wrapped functions), medians over ``reps`` calls after a warm-up, in ms from
    the call: "step: host at entry / exit, GPU (torch's stream) reached entry / exit". Also the crc32 pass
    over the decoded tensor alone (CUDA events), the tail after the kernel."""
    import statistics
    import time

    import torch

    import kvcodec
    from kvcodec.device import crc32
    from kvcodec.lossless import api, device_container, kvctx_device
    from kvcodec.lossless.cuda import kvctx_decode, kvctx_plan
    from kvcodec.lossless.predictive import codec as pcodec

    marks = []

    def mark(label):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((label, time.perf_counter(), ev))

    def wrapped(real, label):
        def f(*a, **k):
            mark(label + " <")
            try:
                return real(*a, **k)
            finally:
                mark(label + " >")
        return f

    targets = [(device_container, "read_front"), (device_container, "sections"), (kvctx_device, "plan"),
               (pcodec, "parse_stream"), (kvctx_device, "device_inputs"), (kvctx_plan, "decode_field_parts"),
               (kvctx_plan, "plan_kernel"), (kvctx_device, "decode"), (kvctx_decode, "launch"),
               (device_container.Checks, "__init__"), (device_container.Checks, "read")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in targets]
    lines = []
    try:
        for obj, attr, real in saved:
            setattr(obj, attr, wrapped(real, f"{getattr(obj, '__name__', '?').split('.')[-1]}.{attr}"))
        for label, t, hblob, pred, nbytes in gl.kv_blobs(name):
            dblob = torch.frombuffer(bytearray(hblob), dtype=torch.uint8).cuda()
            for first in (True, False):
                rows = {}
                for rep in range(reps + 1):
                    if first:
                        api._blob_plans.clear()
                    torch.cuda.synchronize()
                    marks.clear()
                    mark("call")
                    y = kvcodec.decompress(dblob, prediction=pred)
                    mark("returned")
                    torch.cuda.synchronize()
                    t0, e0 = marks[0][1], marks[0][2]
                    seen: dict = {}
                    for step, tm, ev in marks[1:]:
                        seen[step] = seen.get(step, 0) + 1
                        key = step if seen[step] == 1 else f"{step} #{seen[step]}"
                        rows.setdefault(key, []).append(((tm - t0) * 1e3, e0.elapsed_time(ev)))
                med = statistics.median
                lines.append(f"{name}/{label} timeline, {'first decode' if first else 'decoded again'} "
                             f"(exact {gl.same_bits(t, y)}; ms from the call, host / GPU stream): " + "; ".join(
                                 f"{k} {med(a for a, _ in v[1:]):.3f} / {med(b for _, b in v[1:]):.3f}"
                                 for k, v in rows.items()))
                gl.log(lines[-1])
            if label == "kvctx":  # the host steps' pieces, alone (idle stream, median of 20 after a warm-up)
                lines.append(f"{name}: host step pieces alone (ms): " + "; ".join(
                    f"{k} {host_ms(fn):.3f}" for k, fn in host_pieces(dblob).items()))
                gl.log(lines[-1])
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            flat = y.reshape(-1).view(torch.uint8)
            times = []
            for _ in range(6):
                torch.cuda._sleep(2_000_000)  # the GPU busy while the host launches: the events time the kernels
                ev[0].record()
                crc32.check_many([flat], [0], [0], 1)
                ev[1].record()
                torch.cuda.synchronize()
                times.append(ev[0].elapsed_time(ev[1]))
            lines.append(f"{name}/{label}: crc32 check of the decoded tensor alone ({nbytes / 1e6:.0f} MB, CUDA events, "
                         "queued behind a busy GPU so the host's launch work is not timed, "
                         f"median of 5): {statistics.median(times[1:]):.3f} ms")
            gl.log(lines[-1])
    finally:
        for obj, attr, real in saved:
            setattr(obj, attr, real)
    return lines


def host_ms(fn, reps: int = 20) -> float:
    """Median wall time (ms) of ``fn()`` on an idle stream, after a warm-up call."""
    import statistics
    import time

    import torch

    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def host_pieces(dblob) -> dict:
    """The small CUDA operations a first decode's host steps are made of, each alone: read-backs, an
    upload, a pinned allocation, a launch, the header's parse."""
    import numpy as np
    import torch

    from kvcodec import container
    from kvcodec.device.transfer import download, upload
    from kvcodec.lossless.cuda import kvctx_plan

    head = download(dblob[:1 << 16])
    freq = torch.zeros(256, dtype=torch.int16, device=dblob.device)
    return {
        "64 KB read-back (pinned)": lambda: download(dblob[:1 << 16]),
        "64 KB read-back (.cpu())": lambda: dblob[:1 << 16].cpu(),
        "4 KB read-back (pinned)": lambda: download(dblob[:4096]),
        "header parse (container.read_header, host)": lambda: container.read_header(head),
        "upload of 170 KB (transfer.upload)": lambda: upload([np.zeros(170_000 // 8, np.int64)], dblob.device),
        "pinned 170 KB torch.empty": lambda: torch.empty(170_000, dtype=torch.uint8, pin_memory=True),
        "one small launch (kp_plan, 1 table)": lambda: kvctx_plan.build_tables(freq),
        "torch.zeros(2100, int32) on the device": lambda: torch.zeros(2100, dtype=torch.int32, device=dblob.device),
    }


def once(mb: int) -> None:
    """Encode the bf16 KV tensor's kvctx blob and decode it twice on the GPU (a profiler's target)."""
    import torch

    import kvcodec

    x = gl.kv_shaped(gl.tensors(mb)["kv_bf16"])
    dblob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8).cuda()
    for _ in range(2):
        y = kvcodec.decompress(dblob)
    torch.cuda.synchronize()
    gl.log(f"gpu_kvctx --once: decoded {x.numel() * 2 / 1e6:.0f} MB twice, exact: {gl.same_bits(x, y)}")


def quick(out_dir: str, mb: int) -> dict:
    """The bf16 KV tensor's kvctx and predictive rows only (end to end, the default kernel alone and the
    timeline): a short device call. Writes gpu_lossless_kvctx_quick.{json,md}."""
    rec = machine_record()
    name, x = "kv_bf16", gl.tensors(mb)["kv_bf16"]
    rows = gl.kvctx_gpu_rows(name, x) + gl.kvctx_kernel_rows(name, x, variants=gl.KERNEL_VARIANTS[:1])
    notes = timeline(name) + plan_breakdown(name)
    result = {"suite": "gpu_lossless_kvctx_quick", "rows": rows, "machine": rec,
              "notes": [f"GPU {rec.get('gpu')}; {name} {mb} MB as [heads, 256 tokens, 64] only (gpu_kvctx.py --quick)", *notes]}
    save_with_out(result, out_dir, columns=["data", "codec", "MB", "ratio", "dec_GBps", "kernel_ms", "plan_ms", "exact",
                                            "gpu_path", "error"])
    return result


def main(out_dir: str, mb: int) -> dict:
    import torch

    import kvcodec.device

    if not kvcodec.device.is_available():
        gl.log("gpu_kvctx: no CUDA GPU + CuPy; skipped")
        return {}
    rec = machine_record()
    data = {k: v for k, v in gl.tensors(mb).items() if k.startswith("kv")}
    rows, notes, order = [], [], []
    for suffix, tokens in LAYOUTS:
        with kv_rows(tokens):
            rows_l = []
            long = tokens != 256  # the long-rows layout: end to end, the default kernel, the CPU decode
            steps = (gl.kvctx_gpu_rows, lambda n, t: gl.kvctx_kernel_rows(n, t, variants=gl.KERNEL_VARIANTS[:1])) \
                if long else (gl.kvctx_gpu_rows, gl.kvctx_kernel_rows, lambda n, t: [gl.copy_row(n, t)])
            for name, x in data.items():  # every GPU row first: the CPU rows' threads must not share the host
                for fn in steps:
                    try:
                        got = fn(name, x)
                    except Exception as e:  # noqa: BLE001  one device call must report every row
                        got = [dict(data=name, codec=getattr(fn, "__name__", "?"), error=f"{type(e).__name__}: {e}"[:300])]
                    rows_l += got
                try:
                    notes += [suffix.strip() + " " + n if suffix else n
                              for n in (host_profile(name) + ([] if long else plan_breakdown(name) + timeline(name)))]
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{name}{suffix}: host profile failed: {type(e).__name__}: {e}"[:300])
                torch.cuda.empty_cache()
            for name, x in data.items():
                rows_l += gl.kvctx_cpu_rows(name, x)
        for r in rows_l:
            r["data"] = r["data"] + suffix
        rows += rows_l
        order += [name + suffix for name in data]
    rows.sort(key=lambda r: order.index(r["data"]))
    result = {"suite": "gpu_lossless_kvctx", "rows": rows, "machine": rec, "notes": [
        f"GPU {rec.get('gpu')}; KV tensors of {mb} MB (fp8: half) as [heads, 256 tokens, 64], and as 'long rows' "
        "[-1, 2048, 64] (the same tiled sample, 8 consecutive 256-token rows concatenated: 8x fewer channels); "
        "long rows: end to end, host plan, default kernel and CPU decode only; end-to-end rows: wall "
        "clock per decompress call with torch.cuda.synchronize(), median of 5 (host bytes: 3) after a warm-up",
        "host plan: kvctx_device.plan (the model section's entropy decode and checks, decode tables, chunk "
        "descriptors), median of 5; kernel alone: CUDA events around the launch, median of 5 after a warm-up, "
        "per variant (NR rounds of 32 values decoded together, warps = chunks per block); every output checked",
        "device-blob rows decode one blob tensor again and again: from the second call on, the header and plan of "
        "the first decode are reused (api._blob_plans; the checks run every call); 'first decode' rows forget them "
        "before each call (what a blob decoded once costs)",
        *notes]}
    save_with_out(result, out_dir, columns=["data", "codec", "MB", "ratio", "enc_GBps", "dec_GBps", "kernel_ms",
                                            "plan_ms", "exact", "gpu_path", "error"])
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--once", action="store_true", help="decode one bf16 kvctx blob twice, write nothing")
    ap.add_argument("--quick", action="store_true", help="the bf16 KV rows only (a short device call)")
    args = ap.parse_args()
    once(args.mb) if args.once else quick(args.out, args.mb) if args.quick else main(args.out, args.mb)
