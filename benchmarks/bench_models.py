"""CompressedCache across every decoder architecture of the installed transformers (CPU).

For each architecture of ``tests/model_zoo.py`` (tiny random models that keep each architecture's
attention features: sliding windows, sinks, soft-capping, MLA head dims, hybrid stacks, fused QKV) and
each method, in one run:

* ``supported``: the cache is built and ``model.generate`` runs;
* ``identical`` (lossless only): the same greedy tokens as DynamicCache;
* ``vs_dynamic``: bytes the cache holds after a ``--context``-token prompt / DynamicCache's bytes for the
  same prompt (sliding layers of both keep about one window);
* ``ms_step`` and ``ms_step_dynamic``: CPU milliseconds per one-token decode step after that prompt, the
  cache's and DynamicCache's, timed alternately in the same run.

Run: ``python benchmarks/bench_models.py [--quick] [--context N] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from common import save_with_out  # noqa: E402
from kvcodec.cache_argument import cache_kwargs  # noqa: E402

METHODS = {
    "lossless": dict(method="lossless"),
    "turboquant 4/4": dict(method="turboquant", key_bits=4, value_bits=4),
    "preset 3.5bit": dict(preset="3.5bit"),
}


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor))


def decode_ms(model, cache, ids, steps: int) -> float:
    """Prefill ``ids`` into ``cache``, then the median ms of ``steps`` one-token forwards."""
    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(tok, **cache_kwargs(model, cache), use_cache=True)
            times.append(time.perf_counter() - t0)
            tok = out.logits[:, -1:].argmax(-1)
    return 1e3 * sorted(times)[len(times) // 2]


def bench_entry(name: str, entry, context: int, steps: int) -> list[dict]:
    from model_zoo import VOCAB, build, supports_dynamic_cache
    from transformers import DynamicCache

    from kvcodec.hf import CompressedCache

    overrides = {"max_position_embeddings": context + 64} if entry.llama_like else {}
    try:
        model, config = build(name, **overrides)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return [{"architecture": name, "method": "-", "supported": False, "error": f"build: {exc}"[:100]}]
    if not supports_dynamic_cache(model):  # kvcodec refuses these when the cache is built
        return [{"architecture": name, "method": "-", "supported": False,
                 "error": "runs only on a cache class of its own"}]
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or context
    n = min(context, int(limit) - steps - 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (1, n), generator=g)
    short = ids[:, :48]
    ref_tokens = model.generate(short, **cache_kwargs(model, DynamicCache(config=config)), max_new_tokens=8, do_sample=False)
    dyn = DynamicCache(config=config)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, dyn), use_cache=True)
    dyn_bytes = cache_bytes(dyn)
    rows = []
    for label, kw in METHODS.items():
        row = {"architecture": name, "method": label, "features": " ".join(sorted(entry.features)), "tokens": n}
        try:
            tokens = model.generate(short, **cache_kwargs(model, CompressedCache(model, **kw)), max_new_tokens=8,
                                    do_sample=False)
            row["supported"] = True
            if label == "lossless":
                row["identical"] = bool(torch.equal(tokens, ref_tokens))
            cache = CompressedCache(model, **kw)
            ms = decode_ms(model, cache, ids, steps)
            row["vs_dynamic"] = cache_bytes(cache) / dyn_bytes
            row["ms_step"] = ms
            row["ms_step_dynamic"] = decode_ms(model, DynamicCache(config=config), ids, steps)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row["supported"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"[:100]
        rows.append(row)
    return rows


def main(argv=None) -> None:
    from model_zoo import zoo

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1k-token prompts, 3 steps")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", nargs="*", help="architecture names")
    p.add_argument("--out", default=str(ROOT / "results"))
    args = p.parse_args(argv)
    context, steps = (1024, 3) if args.quick else (args.context, args.steps)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name, entry in zoo():
        if not entry.available() or not entry.attention_kv or entry.skip or (args.only and name not in args.only):
            continue
        t0 = time.perf_counter()
        rows += bench_entry(name, entry, context, steps)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    supported = sum(r.get("supported", False) for r in rows)
    identical = [r for r in rows if r["method"] == "lossless"]
    notes = [f"{len({r['architecture'] for r in rows})} architectures, transformers {transformers.__version__}; "
             f"{supported}/{len(rows)} (architecture, method) pairs run; lossless identical to DynamicCache in "
             f"{sum(bool(r.get('identical')) for r in identical)}/{len(identical)}",
             f"prompt {context} tokens (fewer where the model's positions end), {steps} timed decode steps, batch 1",
             "tiny random models (hidden 64, 2-4 layers): bytes ratios carry over to real shapes only where "
             "the window and head dims match; ms are host-bound at this size"]
    save_with_out({"suite": "models", "rows": rows, "notes": notes}, args.out,
                  columns=["architecture", "method", "supported", "identical", "tokens", "vs_dynamic", "ms_step",
                           "ms_step_dynamic", "features", "error"])


if __name__ == "__main__":
    main()
