"""Lossless codecs on a GPU, data already on the device: kvcodec planes (GPU encode + decode) against
nvCOMP ANS and Bitcomp and a plain device copy, with CPU rows (kvcodec planes, zstd) for reference.

    PYTHONPATH=. python3 benchmarks/gpu_lossless.py [--mb 256] [--out benchmarks/results]

Tensors: the shipped SmolLM2 KV sample (keys, values and their fp8-predictor twins, bf16) tiled to
``--mb`` MB, the same cast to float8_e4m3fn, and N(0, 0.02) bf16 "weights". GPU rows time the call
end to end (wall clock around the call with ``torch.cuda.synchronize()``, median of 5 after a
warm-up; every GPU row of every tensor runs before the CPU rows): ``compress_device(x)`` / ``decompress(blob_tensor)`` for kvcodec (host work, every kernel
and the final status read included), ``Codec.encode`` / ``decode`` for nvCOMP; every decode is
checked bit-exact. ``kvcodec planes (host blob)`` is ``compress(x)`` -> bytes and
``decompress(bytes, device="cuda")`` (the PCIe copies included). CPU rows: one run on all cores.
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


def kvcodec_rows(name, x):
    import kvcodec
    from kvcodec.lossless import compress_device

    nbytes = x.numel() * x.element_size()
    rows = []
    enc_s, blob = timed(lambda: compress_device(x))
    dec_s, y = timed(lambda: kvcodec.decompress(blob))
    rows.append(dict(data=name, codec="kvcodec planes (GPU, device blob)", MB=nbytes / 1e6, ratio=nbytes / blob.numel(),
                     enc_GBps=nbytes / enc_s / 1e9, dec_GBps=nbytes / dec_s / 1e9, exact=same_bits(x, y)))
    enc_s, hblob = timed(lambda: kvcodec.compress(x), reps=3)
    dec_s, y = timed(lambda: kvcodec.decompress(hblob, device="cuda"), reps=3)
    rows.append(dict(data=name, codec="kvcodec planes (GPU, host blob: PCIe incl.)", MB=nbytes / 1e6,
                     ratio=nbytes / len(hblob), enc_GBps=nbytes / enc_s / 1e9, dec_GBps=nbytes / dec_s / 1e9,
                     exact=same_bits(x, y) and hblob == blob.cpu().numpy().tobytes()))
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


def copy_row(name, x):
    nbytes = x.numel() * x.element_size()
    s, y = timed(lambda: x.clone(), reps=10)
    return dict(data=name, codec="device copy (clone)", MB=nbytes / 1e6, ratio=1.0, enc_GBps=nbytes / s / 1e9,
                dec_GBps=nbytes / s / 1e9, exact=same_bits(x, y))


def cpu_rows(name, x):
    import kvcodec

    xc = x.cpu()
    nbytes = xc.numel() * xc.element_size()
    rows = []
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


def breakdown(x) -> dict:
    """Where one encode and one decode spend their time: GPU kernel time per kernel (torch.profiler,
    CUPTI sees the CuPy launches too) against the call's wall clock."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kvcodec
    from kvcodec.lossless import compress_device

    blob = compress_device(x)
    kvcodec.decompress(blob)
    res = {}
    for label, fn in (("encode", lambda: compress_device(x)), ("decode", lambda: kvcodec.decompress(blob))):
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


def main(out_dir: str, mb: int) -> dict:
    import torch

    import kvcodec.cuda

    rec = machine_record()
    if not kvcodec.cuda.is_available():
        log("gpu_lossless: no CUDA GPU + CuPy; skipped")
        return {}
    data = tensors(mb)
    rows, notes = [], []
    # every GPU row first, the CPU rows last: CPU work (16 numba / zstd threads) must not share the
    # host with a GPU row's host-side work
    phases = [(kvcodec_rows, nvcomp_rows, lambda n, t: [copy_row(n, t)]), (cpu_rows,)]
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
            if phase is phases[0]:
                try:
                    notes.append(f"{name}: profile of one call: {breakdown(x)}")
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{name}: breakdown failed: {type(e).__name__}: {e}"[:300])
                torch.cuda.empty_cache()
    order = list(data)
    rows.sort(key=lambda r: order.index(r["data"]))  # stable: per tensor, GPU rows then CPU rows
    result = {"suite": "gpu_lossless", "rows": rows, "machine": rec, "notes": [
        f"GPU {rec.get('gpu')}; tensors of {mb} MB (fp8: half) on the device; wall clock per call with "
        "torch.cuda.synchronize(), median of 5 (host-blob rows: 3) after a warm-up; every decode checked bit-exact",
        "kvcodec GPU rows: planes codec, GPU defaults (64 KiB chunks, one table per plane); device blob = "
        "compress_device / decompress(tensor); host blob = compress(x) -> bytes, decompress(bytes, device='cuda')",
        "nvCOMP: nvidia-nvcomp-cu13 6.0.0.12 Python API, Codec(algorithm, data_type), default chunk size (64 KiB), "
        "NVCOMP_NATIVE bitstream",
        *notes]}
    save_with_out(result, out_dir, columns=["data", "codec", "MB", "ratio", "enc_GBps", "dec_GBps", "exact", "error"])
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args()
    main(args.out, args.mb)
