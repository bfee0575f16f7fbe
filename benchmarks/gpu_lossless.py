"""Lossless codecs on a GPU, data already on the device: kvcodec planes (GPU encode + decode) and the
kvctx / predictive codecs (CPU encode, GPU decode) against nvCOMP ANS and Bitcomp and a plain device
copy, with CPU rows (kvcodec planes, kvctx, predictive, zstd) for reference.

    PYTHONPATH=. python3 benchmarks/gpu_lossless.py [--mb 256] [--out benchmarks/results]

Tensors: the shipped SmolLM2 KV sample (keys, values and their fp8-predictor twins, bf16) tiled to
``--mb`` MB, the same cast to float8_e4m3fn, and N(0, 0.02) bf16 "weights". GPU rows time the call
end to end (wall clock around the call with ``torch.cuda.synchronize()``, median of 5 after a
warm-up; every GPU row of every tensor runs before the CPU rows): ``compress_device(x)`` / ``decompress(blob_tensor)`` for kvcodec (host work, every kernel
and the final status read included), ``Codec.encode`` / ``decode`` for nvCOMP; every decode is
checked bit-exact; 'first decode' rows forget the plan kept from the previous decode of the blob, and the
'format 2 blob' row decodes the same tensor rewritten in planes format 2 (chunk offsets in the JSON header),
the same-run A/B of format 3. ``kvcodec planes (host blob)`` is ``compress(x)`` -> bytes and
``decompress(bytes, device="cuda")`` (the PCIe copies included). kvctx rows (KV tensors as [heads,
256 tokens, 64], the sample's own blocks; fp8 with ``version=2``, its GPU-decodable format) and the
predictive row (keys and values predicted by their fp8-weight twins, half the size) are encoded on the
CPU (all cores; that time is the row's encode column) and decoded by ``decompress`` of the device
blob / of the host bytes; ``gpu_path`` says the GPU kernel decoded it (not a CPU fallback). CPU
rows: one run on all cores.
Writes gpu_lossless.{json,md}; prints the table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_record, save_with_out  # noqa: E402


KV_SAMPLE_ELEMENTS = 4 * 8 * 3 * 256 * 64  # keys, values and their fp8-predictor twins: the tiling period


def log(*a):
    print(*a, flush=True)


def tensors(mb: int) -> dict:
    import torch

    from kvcodec.data import load_kv_sample

    s = load_kv_sample()
    kv = torch.cat([t.reshape(-1) for t in (s.keys, s.values, s.keys_fp8pred, s.values_fp8pred)]).to(torch.bfloat16)
    n = (mb << 20) // 2
    kv_big = kv.repeat(-(-n // kv.numel()))[:n].reshape(-1, 64).contiguous()
    g = torch.Generator().manual_seed(0)
    return {
        "kv_bf16": kv_big.cuda(),
        "kv_fp8_e4m3": kv_big.to(torch.float8_e4m3fn).cuda(),
        "weights_bf16": (torch.randn(n // 4096, 4096, generator=g) * 0.02).to(torch.bfloat16).cuda(),
    }


def timed(fn, reps: int = 5):
    import torch

    fn()  # warm-up (NVRTC, allocator)
    times, out = [], None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def same_bits(a, b) -> bool:
    import torch

    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


DEVICE_REPS = 21  # device-blob rows: a few ms per call, so more calls for a steady median
CHUNK_SWEEP: list[int] = []  # --chunks: extra device-blob rows at these chunk sizes (KiB)


def kvcodec_rows(name, x):
    import kvcodec
    from kvcodec.lossless import compress_device

    nbytes = x.numel() * x.element_size()
    rows = []
    enc_s, blob = timed(lambda: compress_device(x), reps=DEVICE_REPS)
    dec_s, y = timed(lambda: kvcodec.decompress(blob), reps=DEVICE_REPS)
    rows.append(dict(data=name, codec="kvcodec planes (GPU, device blob)", MB=nbytes / 1e6, ratio=nbytes / blob.numel(),
                     enc_GBps=nbytes / enc_s / 1e9, dec_GBps=nbytes / dec_s / 1e9, exact=same_bits(x, y),
                     **decode_apart(blob)))
    dec_s, y = timed(lambda: first_decode(lambda: kvcodec.decompress(blob)), reps=DEVICE_REPS)
    rows.append(dict(data=name, codec="kvcodec planes (GPU, device blob, first decode: no reused plan)", MB=nbytes / 1e6,
                     ratio=nbytes / blob.numel(), dec_GBps=nbytes / dec_s / 1e9, exact=same_bits(x, y),
                     **decode_apart(blob, first=True)))
    old = format2_device_blob(blob)  # A/B in the same run: offsets in the JSON header, descriptors made on the host
    dec_s, y = timed(lambda: first_decode(lambda: kvcodec.decompress(old)), reps=DEVICE_REPS)
    rows.append(dict(data=name, codec="kvcodec planes (GPU, device blob, first decode, format 2 blob: offsets in the header)",
                     MB=nbytes / 1e6, ratio=nbytes / old.numel(), dec_GBps=nbytes / dec_s / 1e9, exact=same_bits(x, y),
                     **decode_apart(old, first=True)))
    if HOST_PROFILE:
        HOST_PROFILES.append(host_profile(f"{name} first decode", lambda: first_decode(lambda: kvcodec.decompress(blob))))
        HOST_PROFILES.append(host_profile(f"{name} repeat decode", lambda: kvcodec.decompress(blob)))
        HOST_PROFILES.append(host_profile(f"{name} encode", lambda: compress_device(x)))
    rows += rans_kernel_rows(name, blob, nbytes)
    for kib in CHUNK_SWEEP:
        enc_s, b = timed(lambda: compress_device(x, chunk_bytes=kib << 10))
        dec_s, y = timed(lambda: kvcodec.decompress(b))
        rows.append(dict(data=name, codec=f"kvcodec planes (GPU, device blob, {kib} KiB chunks)", MB=nbytes / 1e6,
                         ratio=nbytes / b.numel(), enc_GBps=nbytes / enc_s / 1e9, dec_GBps=nbytes / dec_s / 1e9,
                         exact=same_bits(x, y)))
    enc_s, hblob = timed(lambda: kvcodec.compress(x), reps=3)
    dec_s, y = timed(lambda: kvcodec.decompress(hblob, device="cuda"), reps=3)
    rows.append(dict(data=name, codec="kvcodec planes (GPU, host blob: PCIe incl.)", MB=nbytes / 1e6,
                     ratio=nbytes / len(hblob), enc_GBps=nbytes / enc_s / 1e9, dec_GBps=nbytes / dec_s / 1e9,
                     exact=same_bits(x, y) and hblob == blob.cpu().numpy().tobytes()))
    return rows


def format2_device_blob(blob):
    """The device blob ``blob`` rewritten in planes format 2 (what the GPU encoder wrote before format 3)."""
    import torch

    from kvcodec.lossless.planes import format2_blob

    return torch.frombuffer(bytearray(format2_blob(blob.cpu().numpy())), dtype=torch.uint8).to(blob.device)


def first_decode(fn):
    """``fn()`` as a blob's first decode: the header and plan kept from earlier decodes are forgotten."""
    from kvcodec.lossless import api

    api._blob_plans.clear()
    return fn()


def decode_apart(blob, first: bool = False) -> dict:
    """Where a device-blob decode spends its time (median of DEVICE_REPS calls): ``host_ms`` from the
    call to the start of its final checks (header read, parse, plan, every launch but the last
    checks'), ``wait_ms`` from there to the end (the last launches and the one synchronization:
    the GPU work not yet done), and ``rans_ms``, the rANS decode kernel alone (CUDA events)."""
    import torch

    import kvcodec
    from kvcodec.entropy.cuda import rans as gr
    from kvcodec.lossless import device_container

    stamps, events = [], []
    read, launch = device_container.Checks.read, gr.LaunchPlan.launch

    def stamped_read(self, *a, **k):
        stamps.append(time.perf_counter())
        return read(self, *a, **k)

    def timed_launch(self, *a, **k):
        ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev[0].record()
        launch(self, *a, **k)
        ev[1].record()
        events.append(ev)

    device_container.Checks.read, gr.LaunchPlan.launch = stamped_read, timed_launch
    try:
        host, total = [], []
        for _ in range(DEVICE_REPS):
            torch.cuda.synchronize()
            if first:
                first_decode(lambda: None)
            t0 = time.perf_counter()
            kvcodec.decompress(blob)
            torch.cuda.synchronize()
            total.append(time.perf_counter() - t0)
            host.append(stamps[-1] - t0)
    finally:
        device_container.Checks.read, gr.LaunchPlan.launch = read, launch
    med = statistics.median
    return dict(host_ms=round(med(host) * 1e3, 3), wait_ms=round((med(total) - med(host)) * 1e3, 3),
                rans_ms=round(med([a.elapsed_time(b) for a, b in events]), 3) if events else None)


RANS_VARIANTS = [4, 2]  # warps per block of the rANS kernel alone (H200: 2 was slower on every tensor)


def rans_kernel_rows(name, blob, nbytes, reps: int = 20):
    """The rANS decode kernel of a device-blob decode alone, per block size: the launch descriptors
    of one ``decompress(blob)`` captured, then ``reps`` back-to-back launches between two CUDA events
    (no host gaps); each variant's output and statuses checked against the default's."""
    import torch

    import kvcodec
    from kvcodec.entropy.cuda import rans as gr

    got = {}
    build, launch = gr.LaunchPlan.build.__func__, gr.LaunchPlan.launch

    def grab(self, data, out, status):
        got.setdefault("launch", (data, out, status))
        launch(self, data, out, status)

    def grab_build(cls, *a, **k):
        got.setdefault("build", (a, k))
        return build(cls, *a, **k)

    gr.LaunchPlan.launch, gr.LaunchPlan.build = grab, classmethod(grab_build)
    try:
        first_decode(lambda: kvcodec.decompress(blob))  # a decode again reuses its plan: no build to capture
    finally:
        gr.LaunchPlan.launch, gr.LaunchPlan.build = launch, classmethod(build)
    if "launch" not in got:
        return []
    pdesc, table_of, tables, device = got["build"][0][:4]
    also = got["build"][1].get("also", ())
    data, out, status = got["launch"]
    ref_out, ref_status = None, None
    rows = []
    for warps in RANS_VARIANTS:
        label = f"kvcodec planes: rANS kernel alone ({warps} warps/block)"
        try:
            plan = gr.LaunchPlan.build(pdesc, table_of, tables, device, also=also, warps=warps)
            if any(tb.data is None for tb in tables):  # tables made on the device: write this plan's
                from kvcodec.entropy import rans_lanes
                from kvcodec.lossless.cuda import planes_codec as pc

                pc.stream_desc(data, plan.also[0], len(tables), 0, 0, 0, plan.pdesc, plan.also[1], rans_lanes.M,
                               plan.table_data)
            out.fill_(0xA5)
            plan.launch(data, out, status)
            torch.cuda.synchronize()
            if ref_out is None:
                ref_out, ref_status = out.clone(), status.clone()
            exact = bool(torch.equal(out, ref_out) and torch.equal(status, ref_status) and not status.any())
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
            for _ in range(reps):
                plan.launch(data, out, status)
            ev[1].record()
            torch.cuda.synchronize()
            ms = ev[0].elapsed_time(ev[1]) / reps
            rows.append(dict(data=name, codec=label, MB=nbytes / 1e6, dec_GBps=nbytes / ms / 1e6, rans_ms=round(ms, 4),
                             exact=exact))
        except Exception as e:  # noqa: BLE001  one device call must report every variant
            rows.append(dict(data=name, codec=label, error=f"{type(e).__name__}: {e}"[:200]))
    return rows


HOST_PROFILE = False  # --host-profile: note a cProfile of the device-blob decode of each tensor
HOST_PROFILES: list = []


def host_profile(name, fn, calls: int = 20, top: int = 16) -> str:
    """The host side of ``fn()`` (a planes call on a device tensor) under cProfile (``calls`` calls): the
    functions with the most own time, in us per call (cProfile's overhead included: relative costs,
    not wall time)."""
    import cProfile
    import pstats

    import torch

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, func) -> (calls, ncalls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.values()) / calls
    parts = [f"{Path(f).name}:{ln}({func}) {v[2] / calls * 1e6:.0f}" for (f, ln, func), v in rows]
    return f"{name}: host profile, us per call of own time (total {total * 1e6:.0f}): " + "; ".join(parts)


TRACE_STEPS = [  # (label, owner, attribute): host steps of a device-blob decode, timed inclusive per call
    ("decompress_on_device", "kvcodec.lossless.api", "_decompress_on_device"),
    ("read_front", "kvcodec.lossless.device_container", "read_front"),
    ("header download+sync", "kvcodec.lossless.device_container", "download"),
    ("sections", "kvcodec.lossless.device_container", "sections"),
    ("Checks()", "kvcodec.lossless.device_container:Checks", "__init__"),
    ("planes_device.decode", "kvcodec.lossless.planes_device", "decode"),
    ("_prepare", "kvcodec.lossless.planes:PlaneCodec", "_prepare"),
    ("launch_inputs", "kvcodec.lossless.planes_device", "launch_inputs"),
    ("stream_descriptors", "kvcodec.lossless.planes_device", "stream_descriptors"),
    ("build_table", "kvcodec.entropy.cuda.rans", "build_table"),
    ("LaunchPlan.build", "kvcodec.entropy.cuda.rans:LaunchPlan", "build"),
    ("upload", "kvcodec.device.transfer", "upload"),
    ("stream_desc launch", "kvcodec.lossless.cuda.planes_codec", "stream_desc"),
    ("rANS launch", "kvcodec.entropy.cuda.rans:LaunchPlan", "launch"),
    ("merge launch", "kvcodec.lossless.cuda.planes_codec", "merge"),
    ("Checks.read", "kvcodec.lossless.device_container:Checks", "read"),
    ("crc32 _launch", "kvcodec.device.crc32", "_launch"),
    ("planes_device.encode", "kvcodec.lossless.planes_device", "encode"),
    ("split_hist", "kvcodec.lossless.cuda.planes_codec", "split_hist"),
    ("one_table", "kvcodec.lossless.planes_device", "one_table"),
    ("encode_chunks", "kvcodec.lossless.cuda.planes_codec", "encode_chunks"),
    ("gather", "kvcodec.lossless.cuda.planes_codec", "gather"),
    ("crc32_many", "kvcodec.device.crc32", "crc32_many"),
    ("assemble", "kvcodec.lossless.device_container", "assemble"),
    ("torch.empty", "torch", "empty"),
    ("torch.cat", "torch", "cat"),
]


class StepTrace:
    """Wraps TRACE_STEPS while active: per call of the traced function, each step's count, inclusive host
    time and the offset of its first entry and last exit from the call's start (perf_counter); with
    ``annotate`` each step is also a torch.profiler range (to line host steps up with the GPU timeline)."""

    def __init__(self, annotate: bool = False):
        self.annotate, self.calls, self._saved, self.t0 = annotate, [], [], None

    def __enter__(self):
        import importlib

        import torch

        for label, owner, attr in TRACE_STEPS:
            mod, _, cls = owner.partition(":")
            obj = importlib.import_module(mod)
            obj = getattr(obj, cls) if cls else obj
            raw = obj.__dict__[attr] if cls else getattr(obj, attr)
            is_cm = isinstance(raw, classmethod)
            fn = raw.__func__ if is_cm else raw

            def wrapped(*a, _fn=fn, _label=label, **k):
                rec = self.calls[-1] if self.calls else None
                if rec is None:
                    return _fn(*a, **k)
                t = time.perf_counter()
                if self.annotate:
                    with torch.profiler.record_function(_label):
                        res = _fn(*a, **k)
                else:
                    res = _fn(*a, **k)
                e = time.perf_counter()
                c, tot, first, last = rec.get(_label, (0, 0.0, None, 0.0))
                rec[_label] = (c + 1, tot + e - t, t - self.t0 if first is None else first, e - self.t0)
                return res

            self._saved.append((obj, attr, raw))
            setattr(obj, attr, classmethod(wrapped) if is_cm else wrapped)
        return self

    def __exit__(self, *exc):
        for obj, attr, raw in reversed(self._saved):
            setattr(obj, attr, raw)

    def call(self, fn):
        """``fn()`` as one traced call; its record also holds 'total' (the call, its final sync included)."""
        import torch

        torch.cuda.synchronize()
        self.calls.append({})
        self.t0 = time.perf_counter()
        out = fn()
        total = time.perf_counter() - self.t0
        self.calls[-1]["total"] = (1, total, 0.0, total)
        torch.cuda.synchronize()
        return out


def step_table(calls) -> list[str]:
    """Median over calls of each step: count, inclusive us, first entry / last exit (us from the start)."""
    med = statistics.median
    labels = [lab for lab, *_ in TRACE_STEPS if any(lab in c for c in calls)] + ["total"]
    lines = [f"{'step':24s} {'n':>3s} {'incl us':>8s} {'from us':>8s} {'to us':>8s}"]
    for lab in labels:
        got = [c[lab] for c in calls if lab in c]
        lines.append(f"{lab:24s} {got[0][0]:3d} {med(g[1] for g in got) * 1e6:8.1f} {med(g[2] for g in got) * 1e6:8.1f} "
                     f"{med(g[3] for g in got) * 1e6:8.1f}")
    return lines


def gpu_timeline(fn, path: str | None = None, limit: int = 120) -> list[str]:
    """One call of ``fn`` under torch.profiler with host steps annotated: every GPU kernel / copy and
    every CUDA runtime or driver call of >= 3 us, in start order, as us from the call's start
    (the chrome trace goes to ``path`` when given)."""
    import json
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with StepTrace(annotate=True) as tr, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("traced call"):
            tr.call(fn)
    path = path or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    start = min(e["ts"] for e in ev if e.get("name") == "traced call")
    keep = []
    for e in ev:
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") or (cat in ("cuda_runtime", "cuda_driver") and e["dur"] >= 3) \
                or (cat == "user_annotation" and e["name"] != "traced call"):
            keep.append((e["ts"] - start, e["dur"], cat, e["name"][:70], e.get("args", {}).get("stream", "")))
    keep.sort()
    lines = [f"{'start us':>9s} {'dur us':>8s} {'what':16s} name (stream)"]
    lines += [f"{t:9.1f} {d:8.1f} {c[:16]:16s} {n} {f'(stream {s})' if s != '' else ''}" for t, d, c, n, s in keep[:limit]]
    return lines


def trace_first_decodes(name, x, calls: int = 25) -> list[str]:
    """First decodes of ``x``'s device blob, format 3 and the same tensor as a format-2 blob, interleaved
    call by call (each after torch.cuda.synchronize and with the plan cache cleared): per-step host
    medians per format, then one call of each under torch.profiler (GPU timeline)."""
    import kvcodec
    from kvcodec.lossless import compress_device

    blob = compress_device(x)
    blobs = {"format 3": blob, "format 2": format2_device_blob(blob)}
    for b in blobs.values():
        assert same_bits(x, kvcodec.decompress(b))
    recs = {k: [] for k in blobs}
    with StepTrace() as tr:
        for _ in range(calls):
            for k, b in blobs.items():
                tr.calls.clear()
                first_decode(lambda: tr.call(lambda: kvcodec.decompress(b)))
                recs[k].append(tr.calls[-1])
    nbytes = x.numel() * x.element_size()
    lines = []
    for k, rs in recs.items():
        tot = statistics.median(r["total"][1] for r in rs)
        lines += [f"== {name} ({nbytes / 1e6:.0f} MB) first decode, {k} blob: median {tot * 1e3:.3f} ms = "
                  f"{nbytes / tot / 1e9:.1f} GB/s (min {min(r['total'][1] for r in rs) * 1e3:.3f} ms), {calls} calls"]
        lines += step_table(rs)
    if x.element_size() == 1:  # the encode of fp8 too: its steps and GPU timeline
        with StepTrace() as tr:
            for _ in range(calls):
                tr.call(lambda: compress_device(x))
        tot = statistics.median(r["total"][1] for r in tr.calls)
        lines += [f"== {name} encode (compress_device): median {tot * 1e3:.3f} ms = {nbytes / tot / 1e9:.1f} GB/s"]
        lines += step_table(tr.calls)
        lines.append(f"== {name} encode: GPU timeline (torch.profiler, one call; host steps annotated)")
        lines += gpu_timeline(lambda: compress_device(x))
    for k, b in blobs.items():
        lines.append(f"== {name} first decode, {k} blob: GPU timeline (torch.profiler, one call; host steps annotated)")
        lines += gpu_timeline(lambda: first_decode(lambda: kvcodec.decompress(b)))
    return lines


_KV_BLOBS: dict = {}  # name -> (tensor, host blob, prediction): the CPU rows decode the same blobs


def kv_blobs(name):
    """(label, tensor, host blob, prediction, bytes) of each kvctx / predictive blob of tensor ``name``."""
    for key, (t, hblob, pred) in _KV_BLOBS.items():
        if key.startswith(name + "/"):
            yield key.split("/", 1)[1], t, hblob, pred, t.numel() * t.element_size()


def kv_shaped(x):
    return x.reshape(-1, 256, 64)  # [heads, tokens, head_dim] blocks of the tiled sample


def fp8_twin_pair(n: int, shaped=kv_shaped):
    """The SmolLM2 sample's K+V and, as its prediction, the fp8-weight twin model's K+V (bf16), each tiled
    to ``n`` values, laid out by ``shaped``, on the GPU: the predictive codec's rows."""
    import torch

    from kvcodec.data import load_kv_sample

    s = load_kv_sample()
    truth = torch.cat([s.keys.reshape(-1), s.values.reshape(-1)])
    twin = torch.cat([s.keys_fp8pred.reshape(-1), s.values_fp8pred.reshape(-1)])
    reps = -(-n // truth.numel())
    return shaped(truth.repeat(reps)[:n].cuda()), shaped(twin.repeat(reps)[:n].to(torch.bfloat16).cuda())


class GpuPathCount:
    """Counts decodes that went through the GPU kernel (kvctx_device.decode returned a result)."""

    def __enter__(self):
        from kvcodec.lossless import kvctx_device

        self.mod, self.real, self.hits = kvctx_device, kvctx_device.decode, []

        def counting(*a, **k):
            res = self.real(*a, **k)
            self.hits.append(res is not None)
            return res

        kvctx_device.decode = counting
        return self

    def __exit__(self, *exc):
        self.mod.decode = self.real


def kvctx_gpu_rows(name, x):
    """kvctx (and, for bf16 KV, predictive) blobs encoded on the CPU, decoded on the GPU."""
    import torch

    import kvcodec

    if not name.startswith("kv"):
        return []
    jobs = [("kvctx", kv_shaped(x), None, {"layout": "kv", **({"version": 2} if x.element_size() == 1 else {})})]
    if name == "kv_bf16":
        xp, pred = fp8_twin_pair(x.numel() // 2)
        jobs.append(("predictive (fp8-weight twin)", xp, pred, {}))
    rows = []
    for label, t, pred, opts in jobs:
        nbytes = t.numel() * t.element_size()
        t0 = time.perf_counter()
        hblob = kvcodec.compress(t, prediction=pred, **opts)
        enc = time.perf_counter() - t0
        _KV_BLOBS[f"{name}/{label}"] = (t, hblob, pred)
        dblob = torch.frombuffer(bytearray(hblob), dtype=torch.uint8).cuda()
        with GpuPathCount() as dev_count:
            dec_s, y = timed(lambda: kvcodec.decompress(dblob, prediction=pred))
        rows.append(dict(data=name, codec=f"kvcodec {label} (GPU decode, device blob; CPU encode)", MB=nbytes / 1e6,
                         ratio=nbytes / len(hblob), enc_GBps=nbytes / enc / 1e9, dec_GBps=nbytes / dec_s / 1e9,
                         exact=same_bits(t, y) and y.is_cuda, gpu_path=all(dev_count.hits) and bool(dev_count.hits)))
        dec_s, y = timed(lambda: first_decode(lambda: kvcodec.decompress(dblob, prediction=pred)))
        rows.append(dict(data=name, codec=f"kvcodec {label} (GPU decode, device blob, first decode: no reused plan)",
                         MB=nbytes / 1e6, ratio=nbytes / len(hblob), dec_GBps=nbytes / dec_s / 1e9,
                         exact=same_bits(t, y) and y.is_cuda))
        with GpuPathCount() as host_count:
            dec_s, y = timed(lambda: kvcodec.decompress(hblob, prediction=pred, device="cuda"), reps=3)
        rows.append(dict(data=name, codec=f"kvcodec {label} (GPU decode, host blob: PCIe incl.)", MB=nbytes / 1e6,
                         ratio=nbytes / len(hblob), dec_GBps=nbytes / dec_s / 1e9, exact=same_bits(t, y) and y.is_cuda,
                         gpu_path=all(host_count.hits) and bool(host_count.hits)))
    return rows


def kvctx_cpu_rows(name, x):
    """The same kvctx / predictive blobs decoded on the CPU (all cores; timed after one warm-up decode)."""
    import kvcodec

    rows = []
    for label, t, hblob, pred, nbytes in kv_blobs(name):
        tc, pc = t.cpu(), (pred.cpu() if pred is not None else None)
        kvcodec.decompress(hblob, prediction=pc, device="cpu")  # warm-up: numba compiles the decoder's kernels
        t0 = time.perf_counter()
        y = kvcodec.decompress(hblob, prediction=pc, device="cpu")
        dec = time.perf_counter() - t0
        rows.append(dict(data=name, codec=f"kvcodec {label} (CPU, {os.cpu_count()} cores)", MB=nbytes / 1e6,
                         ratio=nbytes / len(hblob), dec_GBps=nbytes / dec / 1e9, exact=same_bits(tc, y)))
    return rows


KERNEL_VARIANTS = [(None, 4), (1, 4), (2, 4), (4, 4), (2, 2), (2, 1), (4, 2)]  # (rounds per batch, warps per block)


def kvctx_kernel_rows(name, x, variants=KERNEL_VARIANTS):
    """The kvctx / predictive GPU decode taken apart on the blobs of kvctx_gpu_rows: the host plan
    (``kvctx_device.plan``: stream parse, tables, chunk descriptors; median of 5) and the kernel alone
    (CUDA events around each launch, median of 5 after a warm-up) per kernel variant (rounds per batch
    NR, warps per block; None = the default for D), each output checked bit-exact."""
    import torch

    from kvcodec.lossless import device_container, kvctx_device
    from kvcodec.lossless.cuda import kvctx_decode as kd

    rows = []
    for label, t, hblob, pred, nbytes in kv_blobs(name):
        dblob = torch.frombuffer(bytearray(hblob), dtype=torch.uint8).cuda()
        header, end = device_container.read_header(dblob)
        secs, _ = device_container.sections(dblob, header, end)
        meta = header["meta"]["codec_meta"]
        plan_s = []
        for _ in range(6):
            t0 = time.perf_counter()
            kvctx_device.plan(meta, secs)
            plan_s.append(time.perf_counter() - t0)
        rows.append(dict(data=name, codec=f"kvcodec {label}: host plan (parse, tables, descriptors)", MB=nbytes / 1e6,
                         plan_ms=statistics.median(plan_s[1:]) * 1e3))
        log(rows[-1])
        for nr, warps in variants:
            events = []

            def timed_launch(*a, nr=nr, warps=warps, events=events, **k):
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                kd.launch(*a, **k, nr=nr, warps=warps)
                ev1.record()
                events.append((ev0, ev1))

            label_v = f"kvcodec {label}: kernel alone, NR={nr or 'default'}, {warps} warps/block"
            try:
                for _ in range(6):
                    out, status, _ = kvctx_device.decode(meta, secs, dblob.device, pred, launch=timed_launch)
                torch.cuda.synchronize()
                ms = statistics.median([a.elapsed_time(b) for a, b in events[-5:]])
                rows.append(dict(data=name, codec=label_v, MB=nbytes / 1e6, kernel_ms=ms, dec_GBps=nbytes / ms / 1e6,
                                 exact=not bool(status.any()) and same_bits(t, out)))
            except Exception as e:  # noqa: BLE001  one device call must report every variant
                rows.append(dict(data=name, codec=label_v, error=f"{type(e).__name__}: {e}"[:200]))
            log(rows[-1])
    return rows


def nvcomp_rows(name, x):
    import torch

    try:
        from nvidia import nvcomp
    except Exception as e:  # noqa: BLE001
        return [dict(data=name, codec="nvCOMP", error=f"not importable: {e}"[:200])]
    nbytes = x.numel() * x.element_size()
    raw = x.reshape(-1).view(torch.uint8)
    configs = [("ANS", {"data_type": "|u1"}), ("Bitcomp", {"data_type": "|u1"})]
    if x.element_size() == 2:
        configs = [("ANS", {"data_type": "<f2"})] + configs + [("Bitcomp", {"data_type": "<u2"})]
    rows = []
    stream = torch.cuda.current_stream().cuda_stream
    for algo, opts in configs:
        label = f"nvCOMP {algo} {opts['data_type']}"
        try:
            codec = nvcomp.Codec(algorithm=algo, cuda_stream=stream, **opts)
            src = {"<f2": raw.view(torch.float16), "<u2": raw.view(torch.int16)}.get(opts["data_type"], raw)
            arr = nvcomp.as_array(src)
            enc_s, enc = timed(lambda: codec.encode(arr))
            comp = enc.buffer_size
            dec_s, dec = timed(lambda: codec.decode(enc))
            back = torch.as_tensor(dec, device="cuda").reshape(-1).view(torch.uint8)
            rows.append(dict(data=name, codec=label, MB=nbytes / 1e6, ratio=nbytes / comp, enc_GBps=nbytes / enc_s / 1e9,
                             dec_GBps=nbytes / dec_s / 1e9, exact=bool(torch.equal(back, raw))))
        except Exception as e:  # noqa: BLE001  one device call must report every row
            rows.append(dict(data=name, codec=label, error=f"{type(e).__name__}: {e}"[:200]))
        log(rows[-1])
    return rows


def pcie_rows(name, x):
    """The PCIe ceiling for the host-blob rows: one copy of the tensor's bytes between the device and
    a preallocated pinned buffer, each way (no bytes object made)."""
    import torch

    raw = x.reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h, _ = timed(lambda: host.copy_(raw, non_blocking=True), reps=5)
    dst = torch.empty_like(raw)
    h2d, _ = timed(lambda: dst.copy_(host, non_blocking=True), reps=5)
    return [dict(data=name, codec="pinned copy (PCIe ceiling: enc = D2H, dec = H2D)", MB=nbytes / 1e6, ratio=1.0,
                 enc_GBps=nbytes / d2h / 1e9, dec_GBps=nbytes / h2d / 1e9, exact=True)]


def transfer_rows(name, x):
    """The host-blob path's copies alone, on the compressed blob's bytes: ``transfer.device_to_bytes``
    (enc column) and ``bytes_to_device`` (dec column) with 16 workers and huge pages, without the
    huge-page advice, and with 8 workers."""
    from kvcodec.device import transfer
    from kvcodec.lossless import compress_device

    blob = compress_device(x)
    host = transfer.device_to_bytes(blob)
    nbytes = blob.numel()
    rows = []
    for huge, workers in ((True, 16), (False, 16), (True, 8)):
        d2h, back = timed(lambda: transfer.device_to_bytes(blob, threads=workers, huge_pages=huge), reps=5)
        h2d, dev = timed(lambda: transfer.bytes_to_device(host, blob.device, threads=workers), reps=5)
        label = f"{workers} workers, {'MADV_HUGEPAGE' if huge else 'no huge-page advice'}"
        rows.append(dict(data=name, codec=f"blob bytes <-> device only ({label}; MB = blob)", MB=nbytes / 1e6,
                         ratio=1.0, enc_GBps=nbytes / d2h / 1e9, dec_GBps=nbytes / h2d / 1e9,
                         exact=back == host and same_bits(dev, blob)))
    return rows


def copy_row(name, x):
    nbytes = x.numel() * x.element_size()
    s, y = timed(lambda: x.clone(), reps=10)
    return dict(data=name, codec="device copy (clone)", MB=nbytes / 1e6, ratio=1.0, enc_GBps=nbytes / s / 1e9,
                dec_GBps=nbytes / s / 1e9, exact=same_bits(x, y))


def cpu_rows(name, x):
    import kvcodec

    rows = kvctx_cpu_rows(name, x)
    xc = x.cpu()
    nbytes = xc.numel() * xc.element_size()
    t0 = time.perf_counter()
    blob = kvcodec.compress(xc)
    enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    y = kvcodec.decompress(blob, device="cpu")
    dec = time.perf_counter() - t0
    rows.append(dict(data=name, codec=f"kvcodec planes (CPU, {os.cpu_count()} cores, default options)", MB=nbytes / 1e6,
                     ratio=nbytes / len(blob), enc_GBps=nbytes / enc / 1e9, dec_GBps=nbytes / dec / 1e9,
                     exact=same_bits(xc, y)))
    try:
        import zstandard
    except ImportError:
        return rows
    raw = xc.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
    if name.startswith("kv"):  # one period of the tiled sample: an LZ coder would find the tiling
        raw = raw[: KV_SAMPLE_ELEMENTS * xc.element_size()]
        nbytes = len(raw)
    for level in (3,):
        c = zstandard.ZstdCompressor(level=level, threads=-1)
        t0 = time.perf_counter()
        z = c.compress(raw)
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = zstandard.ZstdDecompressor().decompress(z)
        dec = time.perf_counter() - t0
        rows.append(dict(data=name, codec=f"zstd -{level} (CPU, all cores encode; KV: one untiled period)", MB=nbytes / 1e6, ratio=nbytes / len(z),
                         enc_GBps=nbytes / enc / 1e9, dec_GBps=nbytes / dec / 1e9, exact=back == raw))
    return rows


def breakdown(name, x) -> dict:
    """Where one encode and one decode spend their time: GPU kernel time per kernel (torch.profiler,
    CUPTI sees the CuPy launches too) against the call's wall clock; also the GPU decode of the
    tensor's kvctx / predictive blobs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kvcodec
    from kvcodec.lossless import compress_device

    blob = compress_device(x)
    kvcodec.decompress(blob)
    hblob = kvcodec.compress(x)
    calls = [("encode", lambda: compress_device(x)), ("decode", lambda: kvcodec.decompress(blob)),
             ("host-blob encode", lambda: kvcodec.compress(x)),
             ("host-blob decode", lambda: kvcodec.decompress(hblob, device="cuda"))]
    for key, (_, hblob, pred) in _KV_BLOBS.items():
        if key.startswith(name + "/"):
            dblob = torch.frombuffer(bytearray(hblob), dtype=torch.uint8).cuda()
            label = f"{key.split('/', 1)[1]} decode"
            calls.append((label, lambda d=dblob, p=pred: kvcodec.decompress(d, prediction=p)))
    res = {}
    for label, fn in calls:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        kern = {}
        for e in prof.key_averages():
            dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if dt and e.key.split("(")[0].split("<")[0] not in ("cudaDeviceSynchronize",):
                kern[e.key[:60]] = round(dt / 1e3, 4)
        top = sorted(kern.items(), key=lambda kv: -kv[1])[:10]
        res[label] = {"wall_ms_profiled": round(wall * 1e3, 3), "gpu_ms_by_kernel": top}
    return res


def main(out_dir: str, mb: int, only: set | None = None) -> dict:
    import torch

    import kvcodec.device

    rec = machine_record()
    if not kvcodec.device.is_available():
        log("gpu_lossless: no CUDA GPU + CuPy; skipped")
        return {}
    data = tensors(mb)
    rows, notes = [], []
    # every GPU row first, the CPU rows last: CPU work (16 numba / zstd threads) must not share the
    # host with a GPU row's host-side work
    groups = {"planes": kvcodec_rows, "kvctx": kvctx_gpu_rows, "nvcomp": nvcomp_rows, "pcie": pcie_rows, "transfer": transfer_rows,
              "copy": lambda n, t: [copy_row(n, t)], "cpu": cpu_rows}
    pick = [g for g in groups if only is None or g in only]
    phases = [tuple(groups[g] for g in pick if g != "cpu"), tuple(groups[g] for g in pick if g == "cpu")]
    for phase in phases:
        for name, x in data.items():
            for fn in phase:
                try:
                    got = fn(name, x)
                except Exception as e:  # noqa: BLE001
                    got = [dict(data=name, codec=getattr(fn, "__name__", "?"), error=f"{type(e).__name__}: {e}"[:300])]
                for r in got:
                    log(r)
                rows += got
            if phase is phases[0] and (only is None or "profile" in only):
                try:
                    notes.append(f"{name}: profile of one call: {breakdown(name, x)}")
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{name}: breakdown failed: {type(e).__name__}: {e}"[:300])
                torch.cuda.empty_cache()
    order = list(data)
    rows.sort(key=lambda r: order.index(r["data"]))  # stable: per tensor, GPU rows then CPU rows
    result = {"suite": "gpu_lossless", "rows": rows, "machine": rec, "notes": [
        f"GPU {rec.get('gpu')}; tensors of {mb} MB (fp8: half) on the device; wall clock per call with "
        f"torch.cuda.synchronize(), median of {DEVICE_REPS} (planes device-blob rows), 5 (nvCOMP, copies) or 3 "
        "(host-blob rows) after a warm-up; every decode checked bit-exact",
        "kvcodec GPU rows: planes codec, GPU defaults (64 KiB chunks, one table per plane); device blob = "
        "compress_device / decompress(tensor); host blob = compress(x) -> bytes, decompress(bytes, device='cuda')",
        "device-blob rows decode one blob tensor again and again: from the second call on, the header and plan "
        "of the first decode are reused (api._blob_plans; every check still runs); 'first decode' rows forget "
        "them before each call",
        "kvctx / predictive rows: format 2 encoded on the CPU (all cores: the encode column), decoded on the GPU "
        "(kvcodec/lossless/cuda/kvctx_decode.cu, one warp per ~65536-value chunk); CPU rows decode the same blobs",
        "nvCOMP: nvidia-nvcomp-cu13 6.0.0.12 Python API, Codec(algorithm, data_type), default chunk size (64 KiB), "
        "NVCOMP_NATIVE bitstream",
        "planes device-blob decode taken apart (median of the same number of calls): host_ms = from the call to the "
        "start of its final checks (header read, parse, plan, every launch but the last checks'), wait_ms = the rest "
        "(the GPU work still queued and the one synchronization), rans_ms = the rANS kernel between CUDA events around "
        "its launch; 'rANS kernel alone' rows: the same launch repeated 20 times back to back between two events, per "
        "block size (dec_GBps = tensor bytes / kernel time; bf16: the exponent plane only)",
        *notes, *HOST_PROFILES]}
    save_with_out(result, out_dir, columns=["data", "codec", "MB", "ratio", "enc_GBps", "dec_GBps", "exact", "host_ms",
                                            "wait_ms", "rans_ms", "gpu_path", "error"])
    return result


def trace_main(out_dir: str, mb: int, names: list[str]) -> None:
    """--trace: per-step traces of first decodes; ``kv_fp8_e4m3_full`` is the KV sample cast to fp8 at the full
    ``mb`` MB (the fp8 row of the main table is the bf16 tensor cast: half its bytes)."""
    import torch

    data = tensors(mb)
    if "kv_fp8_e4m3_full" in names:
        half = data["kv_fp8_e4m3"].view(torch.uint8)
        data["kv_fp8_e4m3_full"] = torch.cat([half, half]).view(torch.float8_e4m3fn)
    lines = []
    for name in names:
        lines += trace_first_decodes(name, data[name])
    text = "\n".join(lines)
    log(text)
    for d in dict.fromkeys(filter(None, (out_dir, os.environ.get("OUT")))):
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "planes_trace.txt").write_text(text + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--only", default=None,
                    help="comma-separated row groups: planes, kvctx, nvcomp, pcie, transfer, copy, cpu, profile (default: all)")
    ap.add_argument("--chunks", default="", help="comma-separated chunk sizes in KiB: extra planes device-blob rows")
    ap.add_argument("--trace", default="",
                    help="comma-separated tensor names (kv_fp8_e4m3, kv_bf16, kv_fp8_e4m3_full): per-step trace of first "
                         "decodes (format 3 vs 2), printed and saved as planes_trace.txt; no other rows")
    ap.add_argument("--host-profile", action="store_true",
                    help="note a cProfile of the planes device-blob first / repeat decode and encode")
    args = ap.parse_args()
    CHUNK_SWEEP[:] = [int(c) for c in args.chunks.split(",") if c]
    HOST_PROFILE = args.host_profile
    if args.trace:
        trace_main(args.out, args.mb, args.trace.split(","))
    else:
        main(args.out, args.mb, set(args.only.split(",")) if args.only else None)
