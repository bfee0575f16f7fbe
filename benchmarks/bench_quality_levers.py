"""Quality levers, measured cheaply on the project's calibration text before the full benchmark.

Each lever is applied to a preset (or, for the outlier split, to uniform TurboQuant) and scored
with bench_quality's perplexity protocol (exact prefill handed to the cache, then tokens fed
through it in chunks that never span a compaction point), on four segments of
``smollm2.real_text("mixed")``: the text the presets' allocation was calibrated on, never
the benchmark's held-out texts, and segments other than the ones the allocation
(``calibrate_smollm2.py``) and the fitted statistics (``kvcodec.hf.fitted``) were computed on.

Reported per configuration: true bits per value (codes, norms, side data, sink), bytes held at the
end (window included) vs DynamicCache, the perplexity change with a paired block-bootstrap 95%
interval, the mean KL divergence of the next-token distribution from DynamicCache's (a lower-noise
comparison between configurations than perplexity) and greedy top-1 agreement.

Levers: query-fitted key scales and fitted codebooks (``calibration=``), the paper's outlier split
(16 of 64 channels one bit higher; each part pays its own fp16 norm), sink 0/1/4, window 32-256.

Run: ``nice python benchmarks/bench_quality_levers.py [--only TEXT]``; results in
``benchmarks/results/bench_quality_levers.{json,md}``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import (  # noqa: E402
    _fresh_dynamic,
    _model_copy,
    decode_chunks,
    kvcodec_report,
    ppl_stats,
    prefill_kv,
    teacher_forced,
)
from bench_hf import dynamic_bytes  # noqa: E402
from common import save  # noqa: E402

SUITE = "bench_quality_levers"
SEGMENTS = (10_000, 40_000, 50_000, 80_000)  # token offsets into real_text("mixed")
FIT = "smollm2-135m"  # the shipped fit (kvcodec/data/smollm2_kv_fit.json)


def lever_configs(config) -> list[dict]:
    """(label, CompressedCache options, residual) of every configuration measured."""
    from kvcodec.hf.presets import preset_options

    out = []
    for name in ("3.5bit", "2.5bit"):
        base = {**preset_options(name, config), "calibration": None}
        out += [{"label": f"preset {name}", "options": base},
                {"label": f"preset {name} + query-fitted key scales", "options": {**base, "calibration": FIT + ":qscale"}},
                {"label": f"preset {name} + fitted codebooks", "options": {**base, "calibration": FIT + ":codebooks"}}]
    for bits, paper in ((3, "3.5"), (2, "2.5")):
        out.append({"label": f"outlier split 16ch@{bits + 1}b + 48ch@{bits}b (paper {paper})",
                    "options": {"method": "turboquant", "key_bits": bits, "value_bits": bits, "outliers": 16}})
    base = {**preset_options("3.5bit", config), "calibration": None}
    for sink in (0, 4):
        out.append({"label": f"preset 3.5bit, sink {sink}", "options": {**base, "sink": sink}})
    for window in (32, 64, 256):
        out.append({"label": f"preset 3.5bit, window {window}", "options": base, "residual": window})
    return out


def run(out_dir: str = "benchmarks/results", only: str | None = None) -> dict:
    import smollm2
    from kvcodec.hf import CompressedCache, enable

    logging.getLogger("kvcodec").setLevel(logging.ERROR)
    prefix, n_feed = 512, 513
    model = enable(_model_copy())
    ids = smollm2.load_tokenizer()(smollm2.real_text("mixed"), return_tensors="pt").input_ids[0]
    batch = torch.stack([ids[s:s + prefix + n_feed + 1] for s in SEGMENTS])
    first_logits, kv = prefill_kv(model, batch[:, :prefix])
    ref_chunks = decode_chunks(prefix, n_feed)
    ref_cache = _fresh_dynamic(model)
    ref_nll, ref_arg, ref_logp = teacher_forced(model, batch, prefix, ref_chunks, ref_cache, kv, first_logits, True)
    ref_bytes = dynamic_bytes(ref_cache)
    print(f"DynamicCache ppl {math.exp(ref_nll.mean()):.3f} over {ref_nll.numel()} tokens", flush=True)
    rows = []
    for conf in lever_configs(model.config):
        if only and only not in conf["label"]:
            continue
        t0 = time.perf_counter()
        opts, residual = conf["options"], conf.get("residual", 128)
        cache = CompressedCache(model, residual=residual, **opts)
        chunks = decode_chunks(prefix, n_feed, sink=cache.spec.sink, residual=residual, block=cache.spec.block_size,
                               max_chunk=min(128, residual))
        nll, arg, logp = teacher_forced(model, batch, prefix, chunks, cache, kv, first_logits, True)
        kl = (ref_logp.float().exp() * (ref_logp.float() - logp.float())).sum(-1)  # [B, N]
        held, bits = kvcodec_report(cache)
        row = {"config": conf["label"], "bits_per_value": bits, "window": residual, "sink": cache.spec.sink,
               "kv_bytes": held, "vs_bf16": held / ref_bytes, **ppl_stats(nll, ref_nll),
               "kl_mean": kl.mean().item(), "top1_agree": (arg == ref_arg).float().mean().item(),
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{row['config']:52s} {bits:5.2f} bits  vs_bf16 {row['vs_bf16']:.3f}  ppl {row['ppl_delta_pct']:+.2f}% "
              f"[{row['ci95_lo_pct']:+.2f}, {row['ci95_hi_pct']:+.2f}]  KL {row['kl_mean']:.4f}  "
              f"top1 {row['top1_agree']:.3f}  ({row['seconds']:.0f}s)", flush=True)
        notes = [
            f"SmolLM2-135M-Instruct, bf16, CPU. Calibration text real_text('mixed'), segments at token offsets "
            f"{list(SEGMENTS)} (not the allocation's or the fit's segments); prefix {prefix} exact, then "
            f"{ref_nll.shape[1]} tokens per segment scored ({ref_nll.numel()} in total) through the cache in chunks "
            "that never span a compaction point. DynamicCache ppl "
            f"{math.exp(ref_nll.mean().item()):.3f}.",
            "bits_per_value: (codes + norms + side data + sink) / (sink + compressed K/V scalars), window excluded; "
            "vs_bf16: bytes held at the end (window included) / DynamicCache's. kl_mean: mean per-token "
            "KL(DynamicCache || cache) of the next-token distribution, nats. ci95: paired block bootstrap.",
            f"query-fitted key scales / fitted codebooks: kvcodec.hf.fitted '{FIT}' (python benchmarks/calibrate_smollm2.py "
            "--fit), fitted on other segments of the same text.",
        ]
        save({"suite": SUITE, "rows": rows, "notes": notes}, out_dir, columns=COLUMNS)
    return {"rows": rows}


COLUMNS = ["config", "bits_per_value", "window", "sink", "vs_bf16", "ppl_delta_pct", "ci95_lo_pct", "ci95_hi_pct",
           "kl_mean", "top1_agree"]

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run only the configurations whose label contains this")
    ap.add_argument("--out", default=os.environ.get("KVCODEC_RESULTS", "benchmarks/results"))
    args = ap.parse_args()
    run(out_dir=args.out, only=args.only)
