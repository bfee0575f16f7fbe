"""CompressedCache on SmolLM2-135M: quality vs bytes held vs speed, beside HF QuantizedCache and PyPI turboquant.

Protocol (same for every cache): prefill a fixed prefix of real text (``smollm2.real_text``)
into the cache, then score the next ``n_eval`` tokens *one step at a time through the cache*
(teacher forcing), so every scored token attends to compressed history. Reported per cache:

* ``ppl`` and ``ppl_delta_pct`` against DynamicCache (bf16, exact);
* ``top1_agree``: fraction of steps whose argmax equals DynamicCache's argmax (greedy agreement);
* ``kv_bytes``: bytes the cache actually holds at the end (compressed blocks, full-precision window,
  side data, and any dequantized copy a peer keeps), ``vs_bf16`` = kv_bytes / DynamicCache bytes;
* ``bits_per_value``: compressed bytes * 8 / compressed K+V scalars (the "true bits", side data included);
* ``tok_per_s``: decode steps per second of the teacher-forced loop (batch 1, CPU, provisional on a
  shared machine).

Run: ``python benchmarks/bench_hf.py [--quick] [--out DIR]`` or ``python benchmarks/run.py --suite hf``
(results go to ``./kvcodec-bench-results`` unless ``--out`` names another folder).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, save, pyplot  # noqa: E402
from kvcodec.cache_argument import cache_kwargs  # noqa: E402

SUITE = "bench_hf"


# ------------------------------------------------------------------------------------ caches
def _dense_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def dynamic_bytes(cache) -> int:
    return sum(_dense_bytes(layer.keys, layer.values) for layer in cache.layers)


def quanto_report(cache) -> tuple[int, float]:
    """HF QuantizedCache (quanto): (bytes held, true bits per quantized value). Bytes: packed data +
    scales + shifts + the full-precision residual; a quanto PackedTensor reports its *unpacked* size
    (one byte per 2- or 4-bit code), so its packed ``_data`` is what is counted."""
    total, qbytes, qvalues = 0, 0, 0
    for layer in cache.layers:
        total += _dense_bytes(layer.keys, layer.values)
        for q in (layer._quantized_keys, layer._quantized_values):
            if q is not None:
                data = q._data
                data = getattr(data, "_data", data)
                b = _dense_bytes(data, q._scale, q._shift)
                total += b
                qbytes += b
                qvalues += math.prod(q.shape)
    return total, (qbytes * 8 / qvalues if qvalues else float("nan"))


def quanto_bytes(cache) -> int:
    return quanto_report(cache)[0]


def pypi_turboquant_bytes(cache) -> int:
    """PyPI turboquant 0.2.0: uint8 indices + fp32 norms + residual, *plus* the dequantized copy it keeps."""
    total = 0
    for layer in cache.layers:
        total += _dense_bytes(
            layer._key_indices, layer._key_norms, layer._value_indices, layer._value_norms,
            layer._residual_keys, layer._residual_values, layer.keys, layer.values,
        )
    return total


def kvcodec_true_bits(cache, head_dim: int) -> float:
    rep = cache.memory_report()
    comp = sum(r["compressed_keys"] + r["compressed_values"] + r["side"] for r in rep)
    scalars = 0
    for layer in cache.layers:
        st = layer.store
        if st is not None and st.blocks:
            b = st.batch_size or 1
            scalars += 2 * b * layer.spec.num_kv_heads * head_dim * st.compressed_len
    return comp * 8 / scalars if scalars else float("nan")


def cache_configs(model, residual: int, quick: bool) -> list[dict]:
    """Every cache under test: name, factory, byte counter, bits label."""
    from kvcodec.hf import CompressedCache

    cfg = model.config
    out = []

    def kv(method, kb, vb, **kw):
        bits = {} if method == "lossless" else {"key_bits": kb, "value_bits": vb}
        return {
            "cache": f"kvcodec/{method}" + (f"-{kw['key_mode']}" if "key_mode" in kw else ""),
            "key_bits": kb, "value_bits": vb,
            "make": lambda: CompressedCache(model, method=method, residual=residual, **bits, **kw),
            "bytes": lambda c: c.nbytes(),
            "true_bits": lambda c: kvcodec_true_bits(c, cfg.head_dim),
        }

    lossless = kv("lossless", 16, 16)
    # bit-exact (ppl equal by construction); its decode is slow. quick feeds 8 tokens per forward: 8 steps are one
    # forward of the reference's shape (a forward of another length rounds its bf16 logits differently)
    lossless["max_steps"] = 8 if quick else 16
    out.append(lossless)
    for method, settings in _quant_settings(quick).items():
        for kb, vb, kw in settings:
            out.append(kv(method, kb, vb, **kw))
    out.extend(_peer_configs(cfg, residual, quick))
    return out


def _quant_settings(quick: bool) -> dict:
    """(key_bits, value_bits, extra kwargs) per kvcodec quantized method."""
    from kvcodec.hf.methods import QUANT_METHODS

    have = list(QUANT_METHODS)
    grid = {
        "turboquant": [(4, 4, {})] if quick else [
            (4, 4, {}), (4, 3, {}), (3, 3, {}), (3, 2, {}), (2, 2, {}), (4, 4, {"key_mode": "prod"}),
            (3, 3, {"key_mode": "prod"})],
        "kivi": [(4, 4, {})] if quick else [(4, 4, {}), (3, 3, {}), (2, 2, {})],
        "qjl": [(4, 4, {})] if quick else [(4, 4, {}), (3, 3, {})],
    }
    return {m: grid[m] for m in have}


def _peer_configs(cfg, residual: int, quick: bool) -> list[dict]:
    out = []
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache

        for nbits in ([4] if quick else [4, 2]):
            out.append({
                "cache": "hf-QuantizedCache/quanto", "key_bits": nbits, "value_bits": nbits,
                "make": lambda nbits=nbits: QuantizedCache(backend="quanto", config=cfg, nbits=nbits,
                                                          residual_length=residual, q_group_size=64),
                "bytes": quanto_bytes, "true_bits": lambda c: quanto_report(c)[1],
            })
    except ImportError:
        pass
    try:
        import numpy as np

        if not hasattr(np, "trapz"):
            np.trapz = np.trapezoid  # turboquant 0.2.0 calls the removed np.trapz (benchmark-only patch)
        from turboquant.cache import TurboQuantCache, TurboQuantLayer

        def make_tq(bits):
            c = TurboQuantCache(bits=bits)
            c.layers = [TurboQuantLayer(bits=bits, residual_len=residual) for _ in range(cfg.num_hidden_layers)]
            return c

        for bits in ([4] if quick else [4, 3, 2]):
            out.append({
                "cache": "pypi-turboquant-0.2.0", "key_bits": bits, "value_bits": bits,
                "make": lambda bits=bits: make_tq(bits), "bytes": pypi_turboquant_bytes,
                "true_bits": lambda c, bits=bits: float("nan"),
            })
    except ImportError:
        pass
    return out


# ------------------------------------------------------------------------------------ protocol
@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, prefix: int, cache, bytes_fn, steps: int | None = None,
                   chunk: int = 1, speed_steps: int = 4) -> dict:
    """Prefill ids[:, :prefix], then feed the next ``steps`` tokens through the cache ``chunk`` tokens per
    forward (1 = true decode steps) and collect the log-prob of each next token; any remaining tokens
    are fed in one chunk so the cache ends at full length. Then ``speed_steps`` single-token decode
    steps are timed (tokens/s)."""
    total = ids.shape[1] - 1
    steps = total - prefix if steps is None else min(steps, total - prefix)
    out = model(ids[:, :prefix], **cache_kwargs(model, cache), use_cache=True)
    logits = [out.logits[:, -1]]
    for t in range(prefix, prefix + steps, chunk):
        n = min(chunk, prefix + steps - t)
        out = model(ids[:, t : t + n], **cache_kwargs(model, cache), use_cache=True)
        logits.extend(out.logits[:, i] for i in range(n))
    if prefix + steps < total:
        model(ids[:, prefix + steps : total], **cache_kwargs(model, cache), use_cache=True)
    logits = torch.cat(logits).float()  # [steps + 1, vocab]
    targets = ids[0, prefix : prefix + steps + 1]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
    held = bytes_fn(cache)  # at exactly prefix + n_eval tokens, before the timing steps grow the cache
    tok_per_s = float("nan")
    if speed_steps:
        t0 = time.perf_counter()
        for t in range(speed_steps):
            model(ids[:, total : total + 1], **cache_kwargs(model, cache), use_cache=True)
        tok_per_s = speed_steps / (time.perf_counter() - t0)
    return {"nll": nll, "argmax": logits.argmax(-1), "tok_per_s": tok_per_s, "bytes": held}


def run(quick: bool = False, out_dir: str = DEFAULT_OUT) -> dict:
    from transformers import DynamicCache

    import smollm2
    from kvcodec.hf import enable

    torch.manual_seed(0)
    # quick (a smoke run of the protocol): continuation fed 8 tokens per forward (each still attends to
    # the compressed history; the window of 16 exact tokens covers the chunk), one timed decode step (the
    # lossless cache's decode steps cost seconds each); full: true one-token decode steps, 4 timed
    prefix, n_eval, residual, chunk = (64, 16, 16, 8) if quick else (1024, 128, 32, 1)
    speed_steps = 1 if quick else 4
    base = smollm2.load_model(torch.bfloat16)
    model = enable(copy.deepcopy(base))
    tok = smollm2.load_tokenizer()
    ids = tok(smollm2.real_text("mixed"), return_tensors="pt").input_ids[:, : prefix + n_eval + 1]

    ref_cache = DynamicCache(config=model.config)
    ref = teacher_forced(model, ids, prefix, ref_cache, dynamic_bytes, chunk=chunk, speed_steps=speed_steps)
    ref_bytes = ref["bytes"]
    ref_ppl = math.exp(ref["nll"].mean().item())
    print(f"  DynamicCache bf16: ppl {ref_ppl:.3f}, {ref_bytes} bytes, {ref['tok_per_s']:.1f} tok/s", flush=True)
    rows = [{
        "cache": "DynamicCache (bf16)", "key_bits": 16, "value_bits": 16, "bits_per_value": 16.0,
        "kv_bytes": ref_bytes, "vs_bf16": 1.0, "ppl": ref_ppl, "ppl_delta_pct": 0.0, "top1_agree": 1.0,
        "tok_per_s": ref["tok_per_s"], "eval_tokens": n_eval + 1,
    }]
    notes = [
        f"SmolLM2-135M-Instruct bf16 on CPU; prefix {prefix} tokens of real_text('mixed'), {n_eval} teacher-forced "
        f"decode through the cache, {chunk} token(s) per forward; residual (full-precision window) {residual} "
        f"tokens for every cache; tok_per_s from {speed_steps} single-token decode step{'s' * (speed_steps > 1)} after "
        "that (batch 1).",
        "kv_bytes: everything the cache holds at the end, including full-precision windows and any dequantized copy.",
        "lossless: bit-exact, so its perplexity equals DynamicCache's by construction; it is scored on fewer steps "
        "(eval_tokens) because its decode is slow; the rest of the text is then fed in one chunk, so its bytes are "
        "measured at the same length as every other cache.",
    ]
    for conf in cache_configs(model, residual, quick):
        cache = conf["make"]()
        steps = min(conf.get("max_steps", n_eval), n_eval)
        try:
            res = teacher_forced(model, ids, prefix, cache, conf["bytes"], steps, chunk=chunk, speed_steps=speed_steps)
        except Exception as exc:  # a peer that crashes is reported, not hidden
            notes.append(f"{conf['cache']} {conf['key_bits']}/{conf['value_bits']} bits failed: {type(exc).__name__}: {exc}")
            continue
        nbytes = res["bytes"]
        ppl = math.exp(res["nll"].mean().item())
        ref_ppl_n = math.exp(ref["nll"][: steps + 1].mean().item())
        rows.append({
            "cache": conf["cache"], "key_bits": conf["key_bits"], "value_bits": conf["value_bits"],
            "bits_per_value": conf["true_bits"](cache), "kv_bytes": nbytes, "vs_bf16": nbytes / ref_bytes,
            "ppl": ppl, "ppl_delta_pct": 100 * (ppl / ref_ppl_n - 1),
            "top1_agree": (res["argmax"] == ref["argmax"][: steps + 1]).float().mean().item(),
            "tok_per_s": res["tok_per_s"], "eval_tokens": steps + 1,
        })
        print(f"  {rows[-1]['cache']:28s} {conf['key_bits']}/{conf['value_bits']}  ppl {ppl:.3f}  "
              f"bytes x{nbytes / ref_bytes:.3f}  {res['tok_per_s']:.1f} tok/s", flush=True)
    if "optimum.quanto" not in sys.modules:
        notes.append("HF QuantizedCache(quanto) not measured: optimum-quanto is not installed.")
    notes.append("HF QuantizedCache(hqq) not measured: installing hqq makes transformers import it at start-up.")
    result = {"suite": SUITE, "quick": quick, "rows": rows, "notes": notes,
              "config": {"prefix": prefix, "n_eval": n_eval, "residual": residual, "chunk": chunk}}
    path = save(result, out_dir)
    _plot(rows, Path(out_dir) / f"{SUITE}.png")
    return {**result, "json": str(path)}


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[str, list] = {}
    for r in rows[1:]:
        groups.setdefault(r["cache"], []).append(r)
    for name, rs in groups.items():
        x = [r["vs_bf16"] for r in rs]
        ax[0].plot(x, [r["ppl_delta_pct"] for r in rs], "o-", label=name)
        ax[1].plot(x, [r["top1_agree"] for r in rs], "o-", label=name)
    ax[0].set_xlabel("KV bytes held / bf16 DynamicCache")
    ax[0].set_ylabel("perplexity change (%)")
    ax[0].set_yscale("symlog", linthresh=1.0)
    ax[1].set_xlabel("KV bytes held / bf16 DynamicCache")
    ax[1].set_ylabel("top-1 agreement with DynamicCache")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short prefix, fewer caches: a smoke run")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default ./{DEFAULT_OUT})")
    args = ap.parse_args()
    run(quick=args.quick, out_dir=args.out)
