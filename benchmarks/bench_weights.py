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

- ``format`` with ``--dfloat11`` (CUDA): the same bf16 tensor compressed by DFloat11's own encoder
  (``dfloat11.dfloat11_utils``, PyPI ``dfloat11`` 0.5.0, Huffman-coded exponents) and decoded by its own
  kernel (the wheel's ``decode.ptx``, launched as ``DFloat11Model`` launches it); ratio and decode GB/s
  beside kvcodec's in the same process.
- ``large`` (CUDA, ``--large-layers N``): a random-weight 8B-shaped Llama (hidden 4096, MLP 14336, 32/8
  heads, vocab 128256; N(0, 0.02) init like HF's) dense vs compressed on the GPU: weight bytes held,
  ms per new token at each ``--batches`` size from two generate lengths (prefill cancels), and whether
  the compressed model's logits and greedy tokens equal the dense model's.

Run: ``python benchmarks/bench_weights.py [--device cpu|cuda] [--tokens 8] [--no-smollm2] [--dfloat11]
[--large-layers 32] [--batches 1,8,64]``; results in ``benchmarks/results/bench_weights[_cuda].{json,md}``.
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

import smollm2  # noqa: E402
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


def dfloat11_row(device: torch.device, name: str, t: torch.Tensor) -> dict:
    """DFloat11's encoder and decode kernel on one bf16 tensor (what ``DFloat11Model`` does per block)."""
    import math

    import importlib.util

    import cupy as cp

    # the package's __init__ loads its kernel and Hugging Face hub helpers at import: read only the codec module
    where = Path(importlib.util.find_spec("dfloat11").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("dfloat11_utils", where / "dfloat11_utils.py")
    dfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dfu)

    flat = t.detach().cpu().flatten()
    t0 = time.perf_counter()
    _, counter = dfu.get_codec(flat)
    codec, _, table = dfu.get_32bit_codec(counter)
    luts = dfu.get_luts(table)
    threads, per_thread = 512, 8  # dfloat11 0.5.0's threads_per_block and bytes_per_thread
    encoded, other, positions, gaps, _ = dfu.encode_weights([flat], codec, per_thread, threads)
    encode_s = time.perf_counter() - t0
    pos = positions.view(torch.uint32).numpy()
    shared = threads * 4 + 4 + int((pos[1:] - pos[:-1]).max()) * 2
    ptx = where / "decode.ptx"
    kernel = cp.RawModule(path=str(ptx)).get_function("decode")
    dev = [x.to(device) for x in (luts, encoded, other, positions.view(torch.uint8), gaps)]
    out = torch.full((flat.numel(),), float("nan"), dtype=torch.bfloat16, device=device)
    grid = (math.ceil(encoded.numel() / (threads * per_thread)),)

    def run():
        with cp.cuda.Device(device.index or 0):
            kernel(grid=grid, block=(threads,), shared_mem=shared,
                   args=[dev[0].data_ptr(), dev[1].data_ptr(), dev[2].data_ptr(), dev[3].data_ptr(), dev[4].data_ptr(),
                         out.data_ptr(), luts.shape[0], encoded.numel(), flat.numel()])
        _sync(device)

    gpu_s = best_time(run, repeat=5)
    stored = sum(x.numel() * x.element_size() for x in (luts, encoded, other, positions, gaps))
    dense = flat.numel() * 2
    return {"kind": "format", "data": f"{name} (DFloat11 0.5.0)", "dtype": "bfloat16", "MB": dense / 1e6,
            "ratio": dense / stored, "bits_per_value": 8 * stored / flat.numel(), "encode_s": encode_s,
            "gpu_decode_GBps": dense / gpu_s / 1e9,
            "gpu_exact": bool(torch.equal(out.cpu().view(torch.int16), flat.view(torch.int16)))}


def _llama_8b_shape(layers: int, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         initializer_range=0.02, tie_word_embeddings=False)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _decode_ms(model, ids: torch.Tensor, device, short: int = 4, long: int = 20) -> tuple[float, torch.Tensor]:
    """ms per new token from two greedy generate lengths (the prefill cancels), best of 2 each."""
    times, out = {}, None
    for n in (short, long):
        def run():
            nonlocal out
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            _sync(device)
        times[n] = best_time(run, repeat=2)
    return (times[long] - times[short]) / (long - short) * 1e3, out


@torch.no_grad()
def large_rows(device: torch.device, layers: int, batches: list[int]) -> list[dict]:
    model = _llama_8b_shape(layers, device)
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, model.config.vocab_size, (b, 16), generator=gen).to(device) for b in batches}
    dense_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith(".weight")
                      and p.dim() == 2)
    ref_logits = model(prompts[batches[0]]).logits
    dense = {b: _decode_ms(model, prompts[b], device) for b in batches}
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    report = compress_model(model)
    _sync(device)
    compress_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    logits = model(prompts[batches[0]]).logits
    same_logits = bool(torch.equal(logits, ref_logits))
    rows = []
    for b in batches:
        ms, out = _decode_ms(model, prompts[b], device)
        rows.append({"kind": "large", "data": f"8B-shaped Llama, {layers} layers", "dtype": "bfloat16", "batch": b,
                     "MB": report.original_nbytes / 1e6, "held_MB": report.nbytes / 1e6, "ratio": report.ratio,
                     "dense_2d_weight_MB": dense_bytes / 1e6,
                     "freed_MB": (before - torch.cuda.memory_allocated(device)) / 1e6, "compress_s": compress_s,
                     "dense_ms_per_token": dense[b][0], "compressed_ms_per_token": ms,
                     "slowdown": ms / dense[b][0], "same_tokens": bool(torch.equal(out, dense[b][1])),
                     "same_logits": same_logits})
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--dfloat11", action="store_true", help="add DFloat11's own codec on the same tensor (CUDA)")
    ap.add_argument("--large-layers", type=int, default=0, help="layers of the 8B-shaped model rows (CUDA; 0: none)")
    ap.add_argument("--batches", default="1,8,64")
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
    if args.dfloat11:
        rows.append(dfloat11_row(device, "normal_0.02", tensors["normal_0.02"]))
    rows.append(model_row("tiny llama (4 layers, d 512)", _tiny_llama(), device, args.tokens))
    if use_smollm2:
        rows.append(model_row("SmolLM2-135M-Instruct", copy.deepcopy(real), device, args.tokens))
    if args.large_layers and device.type == "cuda":
        del tensors
        rows += large_rows(device, args.large_layers, [int(b) for b in args.batches.split(",")])
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
