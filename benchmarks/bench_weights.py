"""Weights held compressed, decoded just in time (``kvcodec.weights``): memory, decode speed, ms per token.

Rows:
- ``format``: one weight tensor (N(0, 0.02) 2048 x 4096 in bf16 / fp16 / fp8 e4m3, and the real
  SmolLM2-135M q_proj stack when the model is installed): blob bytes over dense bytes, decode GB/s
  (dense bytes out per second) of ``HostWeight.decode_into`` (numba, all cores) and, on CUDA,
  ``DeviceWeight.decode`` (GPU planes decoder; timed with a device sync). Best of 5.
- ``model``: a tiny random Llama (bf16) and SmolLM2-135M-Instruct (bf16) dense vs compressed in memory:
  bytes of the Linear / Embedding weights (tied once) dense and held, compress seconds, ms per
  generated token (greedy ``generate`` of ``--tokens`` tokens after a 16-token prompt, prefill included,
  best of 2) and whether the generated tokens and the prompt's logits are identical.

Run: ``python benchmarks/bench_weights.py [--device cpu|cuda] [--tokens 8] [--no-smollm2]``; results in
``benchmarks/results/bench_weights[_cuda].{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # a source checkout without pip install
from common import best_time, save_with_out  # noqa: E402

from kvcodec import smollm2  # noqa: E402
from kvcodec.weights import HostWeight, compress_model, encode  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_rows(device: torch.device, tensors: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for name, t in tensors.items():
        blob = encode(t)
        w = HostWeight(blob)
        out = np.empty(w.nbytes_decoded, np.uint8)
        cpu_s = best_time(lambda: w.decode_into(out), repeat=5)
        row = {"kind": "format", "data": name, "dtype": str(t.dtype).removeprefix("torch."), "MB": t.numel() * t.element_size() / 1e6,
               "ratio": w.nbytes_decoded / w.nbytes, "bits_per_value": 8 * w.nbytes / t.numel(),
               "cpu_decode_GBps": w.nbytes_decoded / cpu_s / 1e9}
        if device.type == "cuda":
            from kvcodec.weights.device import DeviceWeight

            dw = DeviceWeight(encode(t.to(device)))

            def run():
                dw.decode()
                _sync(device)

            gpu_s = best_time(run, repeat=5)
            row["gpu_decode_GBps"] = w.nbytes_decoded / gpu_s / 1e9
            row["gpu_exact"] = bool(torch.equal(dw.decode().cpu().view(torch.uint8), t.view(torch.uint8)))
        rows.append(row)
    return rows


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _per_token_ms(model, ids, tokens: int, device) -> tuple[float, torch.Tensor]:
    out = None

    def run():
        nonlocal out
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        _sync(device)

    return best_time(run, repeat=2) / tokens * 1e3, out


def model_row(name: str, model, device: torch.device, tokens: int) -> dict:
    model = model.to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref_logits = model(ids).logits
    dense_ms, ref = _per_token_ms(model, ids, tokens, device)
    t0 = time.perf_counter()
    report = compress_model(model)
    _sync(device)
    compress_s = time.perf_counter() - t0
    with torch.no_grad():
        logits = model(ids).logits
    comp_ms, out = _per_token_ms(model, ids, tokens, device)
    return {"kind": "model", "data": name, "dtype": "bfloat16", "MB": report.original_nbytes / 1e6,
            "held_MB": report.nbytes / 1e6, "ratio": report.ratio, "weights": len(report.rows),
            "compress_s": compress_s, "dense_ms_per_token": dense_ms, "compressed_ms_per_token": comp_ms,
            "same_tokens": bool(torch.equal(out, ref)), "same_logits": bool(torch.equal(logits, ref_logits))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    load_before = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 4096, generator=gen) * 0.02
    tensors = {"normal_0.02": w.to(torch.bfloat16), "normal_0.02 fp16": w.to(torch.float16),
               "normal_0.02 fp8": (w * 20).to(torch.float8_e4m3fn)}
    use_smollm2 = not args.no_smollm2 and smollm2.is_available()
    if use_smollm2:
        real = smollm2.load_model(torch.bfloat16)
        tensors["smollm2 q_proj x30"] = torch.cat([layer.self_attn.q_proj.weight.detach() for layer in real.model.layers])
    rows = format_rows(device, tensors)
    rows.append(model_row("tiny llama (4 layers, d 512)", _tiny_llama(), device, args.tokens))
    if use_smollm2:
        rows.append(model_row("SmolLM2-135M-Instruct", copy.deepcopy(real), device, args.tokens))
    notes = [f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, 1-minute load average "
             f"{load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (other processes slow "
             f"every speed here when it exceeds the CPU count); device {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
             "format: ratio = dense bytes / blob bytes; decode GB/s = dense bytes out per second, best of 5",
             "model: weights = distinct Linear / Embedding weights (tied once); ms/token = greedy generate of "
             f"{args.tokens} tokens after a 16-token prompt, prefill included, best of 2"]
    suite = "bench_weights" + ("" if device.type == "cpu" else "_" + device.type)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    save_with_out({"suite": suite, "rows": rows, "notes": notes}, args.out, columns=columns)


if __name__ == "__main__":
    main()
