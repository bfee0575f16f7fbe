"""GPU decode step of a Hugging Face model on every cache, same run: HF baselines vs kvcodec eager and static.

Random-weight 8B-Llama-shaped model (hidden 4096, 32/8 heads, head_dim 128, bf16), 4 layers (and all
32 where memory and time allow). Per (batch, context) each cache is filled with the same random bf16
K/V through its own ``update`` (a prefill forward at 128k x 32 would take minutes and is not what is
measured), then greedy one-token steps ``model(input_ids, position_ids, cache_position,
past_key_values)`` are timed with CUDA events after warm-up steps. Caches:

* ``dynamic``: DynamicCache, eager, SDPA kept on flash / mem-efficient (not cuDNN);
* ``static+graph``: HF StaticCache, the eager step captured in a ``torch.cuda.CUDAGraph`` (what
  ``torch.compile(mode="reduce-overhead")`` does, without inductor's fusion);
* ``static+compile``: HF StaticCache, ``torch.compile(model.forward, mode="reduce-overhead",
  fullgraph=True)`` (``--compile-shapes`` only: each shape recompiles);
* ``quanto``: HF QuantizedCache (optimum-quanto, 4-bit, residual 128), eager, if importable;
* ``kvc eager``: kvcodec CompressedCache turboquant 4/4 (fused kernel, eager host path);
* ``kvc static+graph`` / ``kvc static+compile``: ``CompressedCache(..., max_cache_len=N)`` (static mode)
  captured in a CUDA graph / compiled like HF's StaticCache.

Speed-ups are against the best HF row of the same (model, batch, context). Memory: the cache's bytes,
peak CUDA memory of the decode, and the largest batch x context that fits in 80 GB for the 32-layer
model, from the measured bytes per token. ``--kernels`` adds the attention-kernel table (fused
decode, CUDA-graph timed, vs bf16 flash SDPA and % of copy bandwidth on the compressed bytes).

    PYTHONPATH=. python3 benchmarks/gpu_generate.py --out $OUT         # H200: target shapes + 32 layers (~6 min)
    PYTHONPATH=. python3 benchmarks/gpu_generate.py --out $OUT --no-kernels --full-model-shapes "" \
        --shapes 32:32768,1:131072,8:131072,1:8192,8:8192,32:8192,32:131072 \
        --compile-shapes 32:32768,1:131072,8:131072 --suite gpu_generate_grid   # the rest (~6 min)
    PYTHONPATH=. python3 benchmarks/gpu_generate.py --profile --out $OUT  # launches of one static step, 1x32k, 8x32k
    PYTHONPATH=. python3 benchmarks/gpu_generate.py --out $OUT --no-kernels --full-model-shapes "" \
        --shapes 1:32768,8:32768 --kinds "dynamic,kvc static+graph,kvc static+compile" --suite gpu_generate_static
    PYTHONPATH=. python3 benchmarks/gpu_generate.py --tiny --device cpu # smoke test (tests/)

``--route generate`` measures ``model.generate`` the way users call it instead (32-layer model, fresh
caches, ms per new token from the intervals between generated tokens): DynamicCache, HF StaticCache compiled by
generate (``cache_implementation="static"``), HF QuantizedCache (quanto, if installed), kvcodec eager
and kvcodec's default on CUDA (the static mode growing in pages, compiled by generate) and with a
fixed ``max_cache_len``; the byte floor beside each row:

    PYTHONPATH=. python3 benchmarks/gpu_generate.py --route generate --out $OUT --shapes 1:32768,8:32768
    PYTHONPATH=. python3 benchmarks/gpu_generate.py --route generate --profile --out $OUT  # where a token's time goes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcodec.cache_argument import cache_kwargs, output_cache  # noqa: E402
from benchmarks.common import machine_record, save_with_out  # noqa: E402
from benchmarks.gpu_hf_decode import GiB, MiB, MODELS, TINY_MODELS, build_model  # noqa: E402
from benchmarks.gpu_kernels import log  # noqa: E402

SUITE = "gpu_generate"
HF_ROWS = ("dynamic", "static+graph", "static+compile", "quanto")
ALL_ROWS = HF_ROWS + ("kvc eager", "kvc static+graph", "kvc static+compile")
COLUMNS = ["model", "layers", "batch", "ctx", "cache", "ms_step", "tok_s", "speedup_vs_best_hf", "kv_MiB",
           "peak_GiB", "error"]
BITS = (4, 4)
RESIDUAL = 128
LIMIT_80GB = 80e9
QUANTO_MAX_TOKENS = 8 * 32768
SLOW_STATIC_TOKENS = 32768
KVC_OPTIONS = dict(method="turboquant", key_bits=BITS[0], value_bits=BITS[1], residual=RESIDUAL)


# ------------------------------------------------------------------------------------ caches
def make_cache(kind: str, model, batch: int, max_len: int):
    from transformers import DynamicCache, StaticCache

    import kvcodec.hf as khf

    if kind.startswith("kvc"):
        if kind == "kvc eager":
            return khf.CompressedCache(model, **KVC_OPTIONS, max_cache_len=None)
        return khf.CompressedCache(model, **KVC_OPTIONS, max_cache_len=max_len)
    khf.disable(model)  # back to sdpa
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "quanto":
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=4, residual_length=RESIDUAL)
    return StaticCache(config=model.config, max_cache_len=max_len)


def fill(cache, kind: str, model, batch: int, ctx: int, seed: int) -> None:
    """The same random K/V [B, H_kv, ctx, D] (bf16) into every layer, through the cache's update."""
    cfg = model.config
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    shape = (batch, cfg.num_key_value_heads, ctx, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        k = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
        if kind == "kvc eager":  # the bound eager layer compresses after its attention: finish the step
            cache.layers[i].update(k, v)
            cache.layers[i].finish_step()
        else:
            cache.update(k, v, i, {"cache_position": torch.arange(ctx, device=dev)})
        del k, v


def step_fn(model, cache, batch: int):
    """One greedy decode step on fixed buffers (token, position): the callable that is timed,
    captured or compiled. Returns (step, tok buffer, position buffer)."""
    dev = model.device
    tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)

    def step(forward=model.forward):
        logits = forward(input_ids=tok, position_ids=pos.view(1, 1).expand(batch, 1), cache_position=pos,
                         **cache_kwargs(model, cache), use_cache=True).logits
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)

    return step, tok, pos


def capture(step):
    """``step`` as a CUDA graph replay (two warm-up steps on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(kind: str, model, batch: int, ctx: int, n_steps: int, seed: int) -> dict:
    dev = model.device
    cuda = dev.type == "cuda"
    max_len = ctx + n_steps + 16
    row = {}
    with torch.no_grad(), _sdpa_flash(cuda), contextlib.ExitStack() as bound:
        cache = make_cache(kind, model, batch, max_len)
        if kind.startswith("kvc"):  # model.forward is called directly (and compiled, captured): bind by hand
            import kvcodec.hf as khf

            bound.enter_context(khf.use(model, cache))
        fill(cache, kind, model, batch, ctx, seed)
        step, tok, pos = step_fn(model, cache, batch)
        pos.fill_(ctx)
        tok.fill_(7)
        if kind.endswith("+compile"):
            forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            run = lambda: step(forward)  # noqa: E731
        elif kind.endswith("+graph"):
            run = capture(step) if cuda else step
        else:
            run = step
        for _ in range(3):  # warm-up (compile, capture, first launches)
            run()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        for _ in range(n_steps):
            run()
        if cuda:
            b.record()
            b.synchronize()
            secs = a.elapsed_time(b) / 1e3
        else:
            secs = time.perf_counter() - t0
    held = _cache_bytes(cache)
    row.update(ms_step=1e3 * secs / n_steps, tok_s=batch * n_steps / secs, kv_bytes=held, kv_MiB=held / MiB,
               peak_GiB=torch.cuda.max_memory_allocated() / GiB if cuda else None)
    del cache, run, step
    return row


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
            elif t is not None and hasattr(t, "_data"):  # quanto QTensor: data + scale + shift
                total += sum(x.numel() * x.element_size() for x in (t._data, getattr(t, "_scale", None),
                                                                    getattr(t, "_shift", None)) if x is not None)
    return total


class _sdpa_flash:
    """SDPA without cuDNN (its per-call host cost dominates a decode step on torch 2.11)."""

    def __init__(self, cuda: bool):
        self.ctx = None
        if cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *a):
        return self.ctx.__exit__(*a) if self.ctx else None


# ------------------------------------------------------------------------------------ sweep
def run_shape(model, name, layers, batch, ctx, kinds, n_steps, deadline) -> list[dict]:
    rows = []
    for kind in kinds:
        row = {"model": name, "layers": layers, "batch": batch, "ctx": ctx, "cache": kind}
        if time.time() > deadline:
            row["error"] = "skipped: time budget"
        else:
            try:
                row.update(measure(kind, model, batch, ctx, n_steps, seed=batch * 131 + ctx))
            except Exception as e:  # OOM, missing package, a bug: record it, go on
                row["error"] = f"{type(e).__name__}: {e}"[:240]
                traceback.print_exc()
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
            torch._dynamo.reset()
        log("row", {k: v for k, v in row.items() if k != "tokens"})
        rows.append(row)
    hf = [r for r in rows if r["cache"] in HF_ROWS and "ms_step" in r]
    best = min(hf, key=lambda r: r["ms_step"]) if hf else None
    for r in rows:
        if best and "ms_step" in r:
            r["speedup_vs_best_hf"] = best["ms_step"] / r["ms_step"]
    return rows


def fits_80gb(rows: list[dict], weights_32: float) -> list[str]:
    """Largest batch x context per cache for the 32-layer model in 80 GB, from bytes per token."""
    notes = []
    for kind in ALL_ROWS:
        per_tok = [r["kv_bytes"] / (r["batch"] * r["ctx"] * r["layers"]) for r in rows
                   if r["cache"] == kind and r.get("kv_bytes")]
        if per_tok:
            tokens = (LIMIT_80GB - weights_32) / (min(per_tok) * 32)
            notes.append(f"{kind}: {min(per_tok):.0f} B per token per layer -> about {tokens / 1e6:.2f}M tokens "
                         f"(batch x context) fit in 80 GB beside the 32-layer model's {weights_32 / 1e9:.1f} GB of weights")
    return notes


def run(out_dir="benchmarks/results", *, device=None, tiny=False, shapes=None, kinds=ALL_ROWS, n_steps=None,
        compile_shapes=((1, 32768), (8, 32768)), full_model_shapes=((1, 32768), (8, 32768)), kernels=True,
        budget_s=420.0, suite=SUITE) -> dict:
    t0 = time.time()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    name = "tiny-llama" if tiny else "llama8b-like"
    shape = dict((TINY_MODELS if tiny else MODELS)[name])
    shapes = shapes or ([(1, 40)] if tiny else
                        [(1, 32768), (8, 32768), (32, 32768), (1, 131072), (8, 131072), (1, 8192), (8, 8192),
                         (32, 8192), (32, 131072)])
    n_steps = n_steps or (2 if tiny else 20)
    compile_shapes = set(map(tuple, compile_shapes)) if not tiny else set()  # CPU smoke test: no inductor
    rec = machine_record()
    if cuda:
        rec["gpu"] = torch.cuda.get_device_name(dev)
    model, weights = build_model(name, shape, dev)
    rows = []
    deadline = t0 + budget_s
    first, rest = shapes[:2], shapes[2:]  # the target shapes first, then the 32-layer model, then the rest

    def sweep(m, layers, grid, kinds_here):
        out = []
        for batch, ctx in grid:
            ks = [k for k in kinds_here if not k.endswith("+compile") or (batch, ctx) in compile_shapes]
            if not cuda or batch * ctx > QUANTO_MAX_TOKENS:  # quanto dequantizes the whole cache every step
                ks = [k for k in ks if k != "quanto"]
            if batch * ctx > SLOW_STATIC_TOKENS:  # HF StaticCache's masked SDPA (no flash): 26-456 ms, run 16
                ks = [k for k in ks if k != "static+graph"]
            out += run_shape(m, name, layers, batch, ctx, ks, n_steps, deadline)
        return out

    rows += sweep(model, shape["num_hidden_layers"], first, kinds)
    weights_32 = weights / shape["num_hidden_layers"] * 32
    if not tiny and cuda and full_model_shapes and time.time() < deadline:
        try:
            big, weights_32 = build_model(name + "-32L", dict(shape, num_hidden_layers=32), dev)
            rows += sweep(big, 32, full_model_shapes, ("dynamic", "kvc eager", "kvc static+graph"))
            del big
        except Exception as e:
            log(f"32-layer model: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()
    rows += sweep(model, shape["num_hidden_layers"], rest, kinds)
    del model
    gc.collect()
    notes = fits_80gb(rows, weights_32)
    kernel_rows = kernel_table(dev) if kernels and cuda and time.time() < deadline + 60 else []
    result = {"suite": suite, "machine": rec, "rows": rows, "kernel_rows": kernel_rows,
              "notes": notes + [f"{n_steps} timed decode steps per row after 3 warm-up steps; bits {BITS}, residual {RESIDUAL}",
                                f"elapsed {time.time() - t0:.0f} s"]}
    save_with_out(result, out_dir, COLUMNS)
    if kernel_rows:
        from benchmarks.common import markdown_table

        print(markdown_table(kernel_rows))
    return result


def profile_static_step(shapes=((1, 32768), (8, 32768)), out_dir=None) -> dict:
    """Kernels of one static-cache decode step per (batch, ctx) (4-layer model, eager launches: what a
    CUDA graph of the step replays): launch count, device time and the top kernels; JSON under out_dir."""
    from torch.profiler import ProfilerActivity, profile

    name = "llama8b-like"
    model, _ = build_model(name, MODELS[name], torch.device("cuda"))
    result = {"suite": SUITE + "_profile", "machine": machine_record(), "rows": []}
    result["machine"]["gpu"] = torch.cuda.get_device_name()
    for batch, ctx in shapes:
        with torch.no_grad():
            cache = make_cache("kvc static+graph", model, batch, ctx + 64)
            fill(cache, "kvc static+graph", model, batch, ctx, seed=1)
            step, tok, pos = step_fn(model, cache, batch)
            pos.fill_(ctx)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        row = {"batch": batch, "ctx": ctx, "layers": MODELS[name]["num_hidden_layers"],
               "launches": sum(e.count for e in events),
               "device_ms": sum(e.self_device_time_total for e in events) / 1e3,
               "top": [(e.count, round(e.self_device_time_total / max(e.count, 1), 1), e.key[:110])
                       for e in sorted(events, key=lambda e: -e.count)[:30]]}
        log(f"static step b{batch} x {ctx}: {row['launches']} kernel launches, {row['device_ms']:.3f} ms device time")
        for count, us, key in row["top"]:
            log(f"  {count:4d} x {us:8.1f} us  {key}")
        result["rows"].append(row)
        del cache
        gc.collect()
        torch.cuda.empty_cache()
    _write_json(result, out_dir)
    del model
    return result


def _write_json(result: dict, out_dir) -> None:
    """A profile's result as out_dir/<suite>.json (no table: its rows are lists of kernels)."""
    if out_dir:
        import json

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{result['suite']}.json").write_text(json.dumps(result, indent=1))


def kernel_table(dev) -> list[dict]:
    """Fused decode attention (default launcher) vs bf16 flash SDPA, CUDA-graph timed, batch 1-32."""
    import torch.nn.functional as F

    from benchmarks.gpu_kernels import copy_bandwidth, cuda_time_ms
    from benchmarks import cuda_cases
    from kvcodec.quant.cuda import decode_attention

    bw = copy_bandwidth()
    rows = []
    for b, t in ((1, 32768), (8, 32768), (32, 32768), (1, 131072), (8, 131072)):
        case, kw = cuda_cases.random_decode_case(b, 32, 8, 1, t, 128, 4, 4, [t] * b, device="cuda")
        nbytes = sum(case[k].numel() * case[k].element_size() for k in ("k_codes", "v_codes", "k_norms", "v_norms"))
        fused = lambda: decode_attention(**case, **kw)  # noqa: E731
        ms, mode = cuda_time_ms(fused)
        q = case["query"]
        kk = torch.randn(b, 8, t, 128, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

        sdpa_ms, _ = cuda_time_ms(sdpa)
        rows.append({"batch": b, "ctx": t, "fused_ms": ms, "sdpa_bf16_ms": sdpa_ms, "speedup": sdpa_ms / ms,
                     "TB_s": nbytes / ms / 1e9, "pct_copy_bw": 100 * nbytes / ms / 1e9 / bw, "timing": mode})
        log("kernel", rows[-1])
        del case, kk, vv
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny model, small contexts (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only list the kernels of one static-cache step")
    ap.add_argument("--route", choices=("step", "generate"), default="step",
                    help="step: the decode step called by hand (default); generate: model.generate as users call it")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model on the generate route")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one generate-route row (a subprocess)
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="generate route: each row in a process of its own (default on CUDA)")
    ap.add_argument("--shapes", type=_shapes, default=None, help="batch:ctx,... (default: the full grid)")
    ap.add_argument("--compile-shapes", type=_shapes, default=((1, 32768), (8, 32768)))
    ap.add_argument("--full-model-shapes", type=_shapes, default=((1, 32768), (8, 32768)),
                    help="shapes for the 32-layer model ('' for none)")
    ap.add_argument("--suite", default=SUITE, help="result file name (several runs of one grid)")
    ap.add_argument("--kinds", type=lambda t: tuple(k.strip() for k in t.split(",") if k.strip()), default=ALL_ROWS,
                    help=f"caches to measure, comma-separated among: {', '.join(ALL_ROWS)}")
    a = ap.parse_args(argv)
    if a.profile and a.route == "generate":
        kinds = ("kvc fast", "dynamic") if a.kinds == ALL_ROWS else a.kinds
        return profile_generate(kinds, a.shapes or ((1, 32768),), a.layers, a.out)
    if a.profile:
        return profile_static_step(a.shapes or ((1, 32768), (8, 32768)), a.out)
    if a.route == "generate" and a.row:
        return _one_row(a.out, a.row, a.device, a.tiny, a.shapes, a.layers)
    if a.route == "generate":
        kinds = GENERATE_ROWS if a.kinds == ALL_ROWS else a.kinds
        return run_generate(a.out, device=a.device, tiny=a.tiny, shapes=a.shapes, kinds=kinds, layers=a.layers,
                            budget_s=a.budget_s, suite=a.suite if a.suite != SUITE else SUITE + "_route",
                            isolate=a.isolate)
    unknown = set(a.kinds) - set(ALL_ROWS)
    if unknown:
        ap.error(f"unknown caches {sorted(unknown)}")
    return run(a.out, device=a.device, tiny=a.tiny, shapes=a.shapes, kinds=a.kinds, n_steps=a.steps,
               kernels=not a.no_kernels,
               budget_s=a.budget_s, compile_shapes=a.compile_shapes, full_model_shapes=a.full_model_shapes,
               suite=a.suite)


# ------------------------------------------------------------------------------------ the generate route
GENERATE_ROWS = ("dynamic", "static", "quanto", "kvc eager", "kvc fast", "kvc fixed")
GENERATE_COLUMNS = ["model", "layers", "batch", "ctx", "cache", "ms_token", "speedup_vs_best_hf", "floor_ms",
                    "x_floor", "kv_MiB", "peak_GiB", "prefill_s", "error"]


def generate_call(kind: str, model, ids, new: int, max_len: int, **extra):
    """One ``model.generate`` as a user writes it, with a fresh cache of ``kind``: ``dynamic`` (the
    default DynamicCache), ``static`` (``cache_implementation="static"``: HF's StaticCache, which
    generate compiles), ``quanto`` (HF QuantizedCache, 4 bits), ``kvc eager`` (``CompressedCache(...,
    max_cache_len=None)``), ``kvc fast`` (``CompressedCache(...)``: on CUDA the static mode, growing in
    pages, which generate compiles), ``kvc fixed`` (``CompressedCache(..., max_cache_len=N)``).
    Returns the output and the cache (for its bytes)."""
    import kvcodec.hf as khf

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra)
    if kind.startswith("kvc"):
        size = {"kvc eager": {"max_cache_len": None}, "kvc fixed": {"max_cache_len": max_len}}.get(kind, {})
        cache = khf.CompressedCache(model, **KVC_OPTIONS, **size)
        return model.generate(ids, **cache_kwargs(model, cache), **kw), cache
    if kind == "static":
        kw.update(cache_implementation="static", max_cache_len=max_len)
    elif kind == "quanto":
        kw.update(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4,
                                                                  "residual_length": RESIDUAL})
    out = model.generate(ids, return_dict_in_generate=True, **kw)
    return out.sequences, output_cache(out)


class _StepClock:
    """A stopping criterion that only notes when each generated token is ready (generate reads its
    result on the host every step, so the step has finished on the device by then)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def measure_generate(kind: str, model, batch: int, ctx: int, new: int = 40, seed: int = 0) -> dict:
    """ms per new token inside ``model.generate`` on a fresh cache (one warm-up call first: compile,
    capture, first launches): the median interval between consecutive tokens from the third on (the
    step a graph is captured in and the prefill excluded), the prefill time and the peak memory."""
    from transformers import StoppingCriteriaList

    dev = model.device
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(2, model.config.vocab_size, (batch, ctx), device=dev, generator=g)
    max_len = ctx + new
    with _sdpa_flash(cuda):
        generate_call(kind, model, ids, min(8, new), max_len)  # warm-up
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock = _StepClock()
        t0 = time.perf_counter()
        out, cache = generate_call(kind, model, ids, new, max_len, stopping_criteria=StoppingCriteriaList([clock]))
        if cuda:
            torch.cuda.synchronize()
        assert out.shape[-1] == ctx + new, out.shape
        held = _cache_bytes(cache)
        del out, cache
    steps = sorted(b - a for a, b in zip(clock.times[2:], clock.times[3:]))
    return {"ms_token": 1e3 * steps[len(steps) // 2], "ms_token_mean": 1e3 * sum(steps) / len(steps),
            "prefill_s": clock.times[0] - t0, "kv_bytes": held, "kv_MiB": held / MiB,
            "peak_GiB": torch.cuda.max_memory_allocated() / GiB if cuda else None}


def run_generate(out_dir="benchmarks/results", *, device=None, tiny=False, shapes=None, kinds=GENERATE_ROWS,
                 layers=32, budget_s=540.0, suite=SUITE + "_route", isolate=None) -> dict:
    """Every cache of GENERATE_ROWS through ``model.generate`` per (batch, context), same run; the
    byte floor is the weights plus the KV held read once at the device's copy bandwidth.
    ``isolate`` (default: on CUDA): each row in a process of its own, so an out-of-memory row or a
    compiled graph it left behind cannot break the next one."""
    t0 = time.time()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    name, shape = _route_model(tiny, layers)
    shapes = shapes or ([(1, 40), (2, 24)] if tiny else [(1, 32768), (8, 32768), (1, 131072)])
    rec = machine_record()
    bw = None
    if cuda:
        from benchmarks.gpu_kernels import copy_bandwidth

        rec["gpu"] = torch.cuda.get_device_name(dev)
        bw = copy_bandwidth() * 1e12  # bytes moved per second by a device copy (read + write): the floor's rate
    isolate = cuda if isolate is None else isolate
    model, weights = build_model(name, shape, dev)
    model.generation_config.pad_token_id = 0
    if isolate:  # the rows build their own (the weights' size is kept for the floor)
        del model
        gc.collect()
        model = None
        if cuda:
            torch.cuda.empty_cache()
    rows = []
    for batch, ctx in shapes:
        shape_rows = []
        for kind in kinds:
            row = {"model": name, "layers": shape["num_hidden_layers"], "batch": batch, "ctx": ctx, "cache": kind}
            if kind == "quanto" and not _quanto_available():
                row["error"] = "skipped: optimum-quanto is not installed"
            elif time.time() > t0 + budget_s:
                row["error"] = "skipped: time budget"
            elif isolate:
                row.update(_row_in_subprocess(kind, batch, ctx, shape["num_hidden_layers"], dev, tiny))
            else:
                try:
                    row.update(measure_generate(kind, model, batch, ctx, new=8 if tiny else 40,
                                                seed=batch * 131 + ctx))
                except Exception as e:  # OOM, a bug: recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
            if bw and "kv_bytes" in row:
                row["floor_ms"] = 1e3 * (weights + row["kv_bytes"]) / bw
                row["x_floor"] = row["ms_token"] / row["floor_ms"]
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            log("row", {k: v for k, v in row.items() if k != "s_per_call"})
            shape_rows.append(row)
        hf = [r for r in shape_rows if r["cache"] in ("dynamic", "static", "quanto") and "ms_token" in r]
        best = min(hf, key=lambda r: r["ms_token"]) if hf else None
        for r in shape_rows:
            if best and "ms_token" in r:
                r["speedup_vs_best_hf"] = best["ms_token"] / r["ms_token"]
        rows += shape_rows
    result = {"suite": suite, "machine": rec, "rows": rows,
              "notes": [f"ms per new token: median interval between consecutive tokens (from the third) of one "
                        f"generate(max_new_tokens={8 if tiny else 40}) on a fresh cache after one warm-up call; "
                        f"bits {BITS}, residual {RESIDUAL}; weights {weights / GiB:.2f} GiB",
                        f"byte floor: (weights + KV held) read once at the device's copy bandwidth "
                        f"({bw / 1e12:.2f} TB/s, bytes read + written per second)" if bw else "byte floor: CUDA only",
                        f"elapsed {time.time() - t0:.0f} s"]}
    save_with_out(result, out_dir, GENERATE_COLUMNS)
    return result


def _route_model(tiny: bool, layers: int) -> tuple[str, dict]:
    """(name, LlamaConfig overrides) of the generate route's model: 8B-shaped with ``layers`` layers,
    or the tiny CPU one with 2."""
    name = "tiny-llama" if tiny else "llama8b-like"
    return name, dict((TINY_MODELS if tiny else MODELS)[name], num_hidden_layers=2 if tiny else layers)


def _row_in_subprocess(kind: str, batch: int, ctx: int, layers: int, dev, tiny: bool) -> dict:
    """One generate-route row measured by a fresh interpreter running this script with ``--row``."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--route", "generate", "--row", kind,
               "--shapes", f"{batch}:{ctx}", "--layers", str(layers), "--device", str(dev), "--out", tmp]
        proc = subprocess.run(cmd + (["--tiny"] if tiny else []), capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:])
        try:
            return json.loads((Path(tmp) / "row.json").read_text())
        except OSError:
            return {"error": f"process exited {proc.returncode}: {proc.stderr.strip()[-280:]}"}


def _one_row(out_dir: str, kind: str, device, tiny: bool, shapes, layers: int) -> dict:
    """``--row``: measure one (kind, batch, context) row and write it to out_dir/row.json."""
    import json

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name, shape = _route_model(tiny, layers)
    (batch, ctx), = shapes
    model, _ = build_model(name, shape, dev)
    model.generation_config.pad_token_id = 0
    try:
        row = measure_generate(kind, model, batch, ctx, new=8 if tiny else 40, seed=batch * 131 + ctx)
    except Exception as e:  # OOM, a bug: recorded
        row = {"error": f"{type(e).__name__}: {e}"[:300]}
        traceback.print_exc()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "row.json").write_text(json.dumps(row))
    return row


def profile_generate(kinds, shapes, layers: int = 32, out_dir=None, new: int = 24) -> dict:
    """Where a token's time goes inside ``model.generate`` per (cache, batch, ctx): the wall time per
    token beside the device's busy time (the union of its kernels' intervals) and kernel count per
    token, the top kernels by device time and the top host operations by self time; after one
    warm-up call, over the steps from the third on. JSON under out_dir."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import StoppingCriteriaList

    dev = torch.device("cuda")
    name, shape = _route_model(False, layers)
    model, _ = build_model(name, shape, dev)
    model.generation_config.pad_token_id = 0
    result = {"suite": SUITE + "_route_profile", "machine": machine_record(), "rows": []}
    result["machine"]["gpu"] = torch.cuda.get_device_name()
    for batch, ctx in shapes:
        ids = torch.randint(2, model.config.vocab_size, (batch, ctx), device=dev)
        for kind in kinds:
            row = {"cache": kind, "batch": batch, "ctx": ctx, "layers": layers}
            try:
                with _sdpa_flash(True):
                    generate_call(kind, model, ids, 8, ctx + new)  # warm-up: compile, capture
                    torch.cuda.synchronize()
                    clock = _StepClock()
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        generate_call(kind, model, ids, new, ctx + new,
                                      stopping_criteria=StoppingCriteriaList([clock]))
                        torch.cuda.synchronize()
                row.update(_profile_window(prof, clock.times[2], clock.times[-1], len(clock.times) - 3))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
            log("profile", {k: v for k, v in row.items() if k not in ("top_kernels", "top_host")})
            for item in row.get("top_kernels", []) + row.get("top_host", []):
                log("   ", item)
            result["rows"].append(row)
            gc.collect()
            torch.cuda.empty_cache()
    _write_json(result, out_dir)
    return result


def _profile_window(prof, t_start: float, t_end: float, steps: int) -> dict:
    """Busy device time, kernels and host operations of a profile between two perf_counter stamps
    (mapped onto the profiler's clock through the span of its events, which starts at the first)."""
    events = list(prof.events())
    gpu = [e for e in events if e.device_type.name == "CUDA"]
    cpu = [e for e in events if e.device_type.name == "CPU"]
    if not gpu or steps <= 0:
        return {"error": "no device events"}
    # the profiler's microseconds start near the profile's start; the stamps are perf_counter seconds:
    # take the steady window as the last `steps` tokens' share of the span of device events
    t0 = min(e.time_range.start for e in gpu)
    t1 = max(e.time_range.end for e in gpu)
    span_wall = (t_end - t_start) * 1e6
    lo = max(t0, t1 - span_wall)
    window = sorted((max(e.time_range.start, lo), e.time_range.end) for e in gpu if e.time_range.end > lo)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in window:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += (cur_e - cur_s) if cur_e is not None else 0.0
    per_kernel: dict[str, list] = {}
    for e in gpu:
        if e.time_range.end > lo:
            rec = per_kernel.setdefault(e.name[:100], [0, 0.0])
            rec[0] += 1
            rec[1] += e.time_range.end - max(e.time_range.start, lo)
    host: dict[str, list] = {}
    for e in cpu:
        if e.time_range.end > lo:
            rec = host.setdefault(e.name[:80], [0, 0.0])
            rec[0] += 1
            rec[1] += e.self_cpu_time_total
    top_k = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:25]
    top_h = sorted(host.items(), key=lambda kv: -kv[1][1])[:25]
    return {"ms_token_wall": span_wall / 1e3 / steps, "ms_token_device_busy": busy / 1e3 / steps,
            "kernels_per_token": sum(c for c, _ in per_kernel.values()) / steps,
            "top_kernels": [(k, round(c / steps, 2), round(t / 1e3 / steps, 4)) for k, (c, t) in top_k],
            "top_host": [(k, round(c / steps, 2), round(t / 1e3 / steps, 4)) for k, (c, t) in top_h]}


def _quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except Exception:
        return False
    return True


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]


if __name__ == "__main__":
    main()
