"""GPU benchmark of the batched 32-state rANS decoder (kvcodec/entropy/cuda/rans_decode.cu) vs the numba CPU
decoder, on the byte planes of real bf16 KV values.

    PYTHONPATH=. python3 benchmarks/gpu_rans.py [--out DIR] [--quick] [--mb 128]

Data: the shipped SmolLM2 KV sample (keys + values + their fp8-predictor twins, bf16), tiled to ``--mb``
MB per plane: the high byte (sign + 7 exponent bits: few symbols, precision 12, shared-memory table
mode 0), the low byte (exponent bit + mantissa: near-uniform, precision 14, mode 1), and the bf16
values as uint16 symbols (precision 16, global-memory table mode 2). Each is split into chunks of 64 KiB
and 256 KiB of symbols (bytes), encoded on the host (numba, all cores) as independent 32-state streams. GPU time is
one kernel launch for all chunks (CUDA events, warm-up, median of rounds); the check compares every
decoded byte with the input. CPU: the numba decoder on the same payloads (headers pre-parsed), one
thread and all cores. Writes gpu_rans.json/.md under --out and $OUT; prints a table last.

Whole ``planes`` blobs encoded and decoded on the GPU (``kvcodec.compress`` / ``decompress`` of CUDA
tensors) against nvCOMP: ``benchmarks/gpu_lossless.py`` (``gpu_planes.json`` is an older run of a
since-replaced host-side path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_record, save_with_out  # noqa: E402


def log(*a):
    print(*a, flush=True)


def planes(mb: int) -> dict[str, np.ndarray]:
    import torch

    from kvcodec.data import load_kv_sample

    s = load_kv_sample()
    v = np.concatenate([t.contiguous().view(torch.int16).numpy().ravel().view(np.uint16)
                        for t in (s.keys, s.values, s.keys_fp8pred, s.values_fp8pred)])
    n8 = (mb << 20)
    reps8 = -(-n8 // v.size)
    big = np.tile(v, reps8)
    hi = (big >> 8).astype(np.uint8)[:n8]
    lo = (big & 0xFF).astype(np.uint8)[:n8]
    u16 = big[: n8 // 4]  # a quarter as many uint16 symbols (the global-table path is slower)
    return {"kv_bf16_hi_byte": hi, "kv_bf16_lo_byte": lo, "kv_bf16_u16": u16}


def cpu_decode_fn(blobs):
    from kvcodec.entropy import rans_fast, stream

    parsed = []
    for b in blobs:
        h, p = stream.parse(b)
        parsed.append((np.frombuffer(p, dtype=np.uint8), h))

    def one(item):
        p, h = item
        return rans_fast.decode_table(p, h.freqs, h.param, h.n, h.streams, h.dtype)

    return parsed, one


def time_cpu(blobs, x, workers: int, budget_s: float = 4.0) -> float:
    """Decoded MB/s of the numba decoder (headers pre-parsed); a prefix of the chunks for 1 thread."""
    parsed, one = cpu_decode_fn(blobs)
    one(parsed[0])  # JIT
    if workers == 1:
        n_sym, t0 = 0, time.perf_counter()
        for it in parsed:
            one(it)
            n_sym += it[1].n
            if time.perf_counter() - t0 > budget_s:
                break
        return n_sym * x.itemsize / (time.perf_counter() - t0) / 1e6
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, parsed[: workers]))  # warm the threads
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            ys = list(ex.map(one, parsed))
            best = min(best, time.perf_counter() - t0)
    if not np.array_equal(np.concatenate(ys), x):
        raise AssertionError("CPU decoder mismatch")
    return x.nbytes / best / 1e6


def time_gpu(batch, reps: int, rounds: int) -> float:
    import torch

    out, status = batch.launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            batch.launch(out, status)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def run(out_dir: str, mb: int, quick: bool) -> dict:
    t_start = time.time()
    rec = machine_record()
    import torch

    import kvcodec.device as kc
    from kvcodec.entropy.cuda import rans as gr

    if not kc.is_available():
        log("gpu_rans: no CUDA GPU + CuPy here; skipped")
        return {"suite": "gpu_rans", "rows": [], "notes": ["skipped: no CUDA GPU and CuPy"], "machine": rec}
    cores = os.cpu_count() or 1
    from kvcodec import entropy

    warm = np.arange(1000, dtype=np.uint8) % 5  # compile the kernel (NVRTC) before any timing
    gr.decode_batch([entropy.encode(warm, coder="rans", streams=32)])
    data = planes(mb)
    chunk_bytes = (64 << 10, 256 << 10)  # chunk sizes in bytes of decoded symbols
    rows = []
    for name, x in data.items():
        for cb in chunk_bytes:
            chunk = cb // x.itemsize
            t0 = time.perf_counter()
            blobs = gr.encode_chunks(x, chunk, workers=cores)
            enc_s = time.perf_counter() - t0
            comp = sum(len(b) for b in blobs)
            t0 = time.perf_counter()
            try:
                ys = gr.decode_batch(blobs)  # end to end: parse + CRC + tables + upload + kernel + status
                torch.cuda.synchronize()
                e2e_s = time.perf_counter() - t0
                exact = bool(torch.equal(torch.cat([y.view(torch.uint8) for y in ys]).cpu(),
                                         torch.from_numpy(x.view(np.uint8))))
                del ys
            except Exception as e:  # record and go on: one run on the GPU must report everything
                log("decode_batch failed:", type(e).__name__, e)
                e2e_s, exact = float("nan"), False
            batch = gr.RansBatch(blobs, "cuda")
            modes = sorted({t.mode for t in batch.tables})
            payload = batch.compressed_bytes
            variants = [(None, batch)]
            if not quick:
                for m in (1, 2):
                    if m > max(modes):
                        try:
                            variants.append((m, gr.RansBatch(blobs, "cuda", table_mode=m)))
                        except ValueError:
                            pass
            cpu1 = time_cpu(blobs, x, 1, 1.0 if quick else 3.0)
            cpun = time_cpu(blobs, x, cores)
            for forced, b in variants:
                try:
                    out, status = b.launch()
                    b.check(status)
                    ok = bool(torch.equal(out[: b.out_bytes].cpu(), torch.from_numpy(x.view(np.uint8))))
                    ms = time_gpu(b, 3 if quick else 10, 3 if quick else 7)
                except Exception as e:
                    log("GPU decode failed:", name, cb, forced, type(e).__name__, e)
                    rows.append(dict(data=name, chunk_KiB=cb >> 10, forced=forced is not None, exact=False,
                                     error=f"{type(e).__name__}: {e}"[:200]))
                    continue
                row = dict(data=name, chunk_KiB=chunk * x.itemsize >> 10, payloads=b.n_payloads,
                           table_mode=",".join(map(str, sorted({t.mode for t in b.tables}))),
                           forced=forced is not None, ratio=x.nbytes / comp, gpu_ms=ms,
                           gpu_GBps=x.nbytes / ms / 1e6, gpu_comp_GBps=payload / ms / 1e6,
                           cpu1_GBps=cpu1 / 1e3, cpuN_GBps=cpun / 1e3, speedup_vs_cpuN=x.nbytes / ms / 1e3 / cpun,
                           e2e_s=e2e_s, encode_s=enc_s, exact=exact and ok)
                rows.append(row)
                log(row)
                if not row["exact"]:
                    log("MISMATCH", name, chunk, forced)
            del batch, variants
            torch.cuda.empty_cache()
    copy = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(copy)
    dst.copy_(copy)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(copy)
    b.record()
    torch.cuda.synchronize()
    copy_GBps = 2 * copy.numel() * 10 / (a.elapsed_time(b) / 1e3) / 1e9
    result = {
        "suite": "gpu_rans",
        "rows": rows,
        "copy_GBps": copy_GBps,
        "machine": rec,
        "notes": [
            f"GPU {rec.get('gpu')}; {cores} CPU cores; {mb} MB per byte plane ({mb // 4} MB of uint16 symbols), "
            "SmolLM2 KV sample bf16 (keys, values, fp8-predictor twins) tiled",
            "gpu_GBps: decoded bytes / kernel time (one launch for all chunks; CUDA events, median); gpu_comp_GBps: "
            "payload bytes read / kernel time; cpu1/cpuN: numba decoder, headers pre-parsed, 1 thread / all cores",
            "table_mode: 0 = shared-memory packed u32 per slot, 1 = shared-memory slot->symbol + per-symbol table, "
            "2 = global-memory tables; forced = a slower layout forced for comparison",
            "e2e_s: decode_batch wall time incl. host parse + CRC, table build, upload, kernel, status check",
            f"device copy bandwidth (read+write): {copy_GBps:.0f} GB/s",
            f"all exact: {all(r['exact'] for r in rows)}; total {time.time() - t_start:.0f}s",
        ],
    }
    cols = ["data", "chunk_KiB", "payloads", "table_mode", "forced", "ratio", "gpu_ms", "gpu_GBps", "gpu_comp_GBps",
            "cpu1_GBps", "cpuN_GBps", "speedup_vs_cpuN", "exact"]
    save_with_out(result, out_dir, columns=cols)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--mb", type=int, default=128, help="MB of symbols per byte plane")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    run(args.out, args.mb, args.quick)
