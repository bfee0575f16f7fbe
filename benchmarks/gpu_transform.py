"""GPU decode of kvcodec.transform blobs: the same blob on CPU and GPU, and GPU decode GB/s.

    python benchmarks/bench_transform.py --export-gpu benchmarks/results/cache/gpu     # here (CPU)
    PYTHONPATH=. python3 benchmarks/gpu_transform.py --calib benchmarks/results/cache/gpu/smollm2.kvtc \
        --kv benchmarks/results/cache/gpu/kv.pt [--tokens 32768] --out $OUT          # there (carry that folder)

Data: real SmolLM2-135M prefix KV (``--kv``: a torch file with bf16 ``keys``/``values`` [30, 3, T0, 64]
from bench_transform's first evaluation window) tiled along the tokens to ``--tokens`` tokens: keys
are taken back to pre-RoPE form, tiled, and rotated again at their new positions, so every token
has real statistics and a consistent position. Calibration: ``--calib`` (bench_transform's fit on
text disjoint from the KV). Encode: transform on the GPU, rANS on the host (all cores). Reported per
rate: true bits/value; CPU decode (numba, all cores) and GPU decode end to end (parse, upload,
kernel, inverse transform) in seconds; GPU device time of ``Decoder.run()`` (streams already
uploaded; CUDA events, median of 5); GB/s = decoded bf16 K+V bytes / time; CPU vs GPU agreement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_with_out  # noqa: E402


def log(*a):
    print(*a, flush=True)


def tiled_kv(calib, kv_path: str, tokens: int, device):
    kv = torch.load(kv_path, weights_only=True)
    k, v = kv["keys"].to(device), kv["values"].to(device)
    T0 = k.shape[2]
    reps = -(-tokens // T0)
    pre = calib.rope.undo(k.float(), torch.arange(T0)) if calib.rope is not None else k.float()
    k_all = pre.repeat(1, 1, reps, 1)[:, :, :tokens]
    if calib.rope is not None:
        k_all = calib.rope.apply(k_all, torch.arange(tokens))
    return k_all.to(torch.bfloat16).contiguous(), v.repeat(1, 1, reps, 1)[:, :, :tokens].contiguous()


def cuda_time(fn, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def run(calib_path: str, kv_path: str, tokens: int, out_dir: str, bits_list=(1.6, 1.0)) -> dict:
    from kvcodec import transform
    from kvcodec.transform.codec import Decoder

    dev = torch.device("cuda")
    calib = transform.Calibration.load(calib_path)
    K, V = tiled_kv(calib, kv_path, tokens, dev)
    out_bytes = 2 * K.numel() * 2
    threads = os.cpu_count() or 1
    rows = []
    for bits in bits_list:
        t0 = time.perf_counter()
        blob = transform.encode(K, V, calib, bits=bits)
        t_enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        kc, vc = transform.decode(blob, calib, threads=threads)
        t_cpu = time.perf_counter() - t0
        transform.decode(blob, calib, device=dev)  # warm-up (kernel build, caches)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kg, vg = transform.decode(blob, calib, device=dev)
        torch.cuda.synchronize()
        t_gpu = time.perf_counter() - t0
        dec = Decoder(blob, calib, device=dev)
        t_dev = cuda_time(dec.run)
        same = sum(int((a.view(torch.int16) == b.cpu().view(torch.int16)).sum()) for a, b in ((kc, kg), (vc, vg)))
        maxdiff = max(float((a.float() - b.cpu().float()).abs().max()) for a, b in ((kc, kg), (vc, vg)))
        err = float(((kg.float() - K.float()).pow(2).sum() + (vg.float() - V.float()).pow(2).sum())
                    / (K.float().pow(2).sum() + V.float().pow(2).sum()))
        info = transform.inspect(blob)
        rows.append({
            "tokens": tokens, "bits_target": bits, "bits_per_value": info["bits_per_value"],
            "x_vs_bf16": info["ratio_vs_bf16"], "streams": info["n_streams"], "rel_sq_err": err,
            "encode_s": t_enc, "cpu_decode_s": t_cpu, "gpu_decode_s": t_gpu, "gpu_device_s": t_dev,
            "cpu_decode_GBps": out_bytes / t_cpu / 1e9, "gpu_decode_GBps": out_bytes / t_gpu / 1e9,
            "gpu_device_GBps": out_bytes / t_dev / 1e9,
            "cpu_gpu_bitequal_frac": same / (2 * K.numel()), "cpu_gpu_max_abs_diff": maxdiff,
        })
        log(rows[-1])
    result = {"suite": "gpu_transform", "rows": rows, "notes": [
        f"{torch.cuda.get_device_name(0)}; SmolLM2-135M KV tiled to {tokens} tokens ({out_bytes / 1e9:.2f} GB bf16 K+V); "
        f"CPU decode with {threads} threads (numba rANS + torch)."]}
    save_with_out(result, out_dir)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", required=True)
    ap.add_argument("--kv", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    run(a.calib, a.kv, a.tokens, a.out)


if __name__ == "__main__":
    main()
