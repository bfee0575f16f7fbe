"""GPU decode throughput of a Hugging Face model on kvcodec's CompressedCache vs DynamicCache at 16k-128k context.

Models are built from a config with random weights (no hub, no internet; bf16, ``torch.manual_seed``):
an 8B-Llama-shaped decoder cut to 4 layers (hidden 4096, 32/8 heads, head_dim 128) and a
SmolLM2-135M-shaped one (30 layers, 9/3 heads, head_dim 64). Per (model, batch, context) the same
random prompt is prefilled (one forward by default) into each cache, then ``n_decode`` greedy
one-token steps ``model(input_ids=tok, past_key_values=cache, use_cache=True)`` are timed with CUDA
events after untimed warm-up steps (no ``generate``, so both caches pay the same per-step overhead).
Caches: ``DynamicCache`` (bf16, sdpa attention) and ``CompressedCache(model, method="turboquant")`` at
4/4 and 3/3 bits (kvcodec attention; the compressed part runs in the fused CUDA kernel, counted in
the ``fused`` column). Reported per row: decode tokens/s, ms per step, KV bytes held, peak CUDA memory
during prefill and during decode, speed-up vs DynamicCache and greedy agreement of the first 16
decoded tokens with DynamicCache (random weights: a sanity number only).

    PYTHONPATH=. python3 benchmarks/gpu_hf_decode.py --out $OUT      # H100/H200, ~3-5 min
    PYTHONPATH=. python3 benchmarks/gpu_hf_decode.py --quick          # contexts 1024, batch 1/2, 8 steps
    PYTHONPATH=. python3 benchmarks/gpu_hf_decode.py --tiny --device cpu   # smoke test (tests/)

Writes ``gpu_hf_decode.json``/``.md`` under ``--out`` (and ``$OUT`` if set); the last thing printed
is the markdown table. One failing row (OOM, error) is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcodec.cache_argument import cache_kwargs  # noqa: E402
from benchmarks.bench_hf import dynamic_bytes  # noqa: E402
from benchmarks.common import machine_record, markdown_table, save_with_out  # noqa: E402
from benchmarks.gpu_kernels import log  # noqa: E402

SUITE = "gpu_hf_decode"
GiB, MiB = 1 << 30, 1 << 20
MAX_POS = 140000
MODELS = {  # LlamaConfig overrides; rope and everything else at transformers' defaults
    "llama8b-like": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=4, vocab_size=32000, tie_word_embeddings=False),
    "smollm2-like": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True),
}
TINY_MODELS = {  # CPU smoke test: head_dim 32 is the smallest the fused kernel takes
    "tiny-llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, num_hidden_layers=2, vocab_size=512, tie_word_embeddings=False),
}
LONG_CONTEXT_MODEL = "llama8b-like"  # the extra batch-1 context (131072) runs for this model only
AGREE_TOKENS = 16
COLUMNS = ["model", "batch", "ctx", "cache", "tok_s", "ms_step", "speedup", "kv_MiB", "kv_vs_dynamic",
           "peak_prefill_GiB", "peak_decode_GiB", "agree16", "fused", "prefill_s", "error"]


# ------------------------------------------------------------------------------------ setup
def build_model(name: str, shape: dict, device: torch.device, seed: int = 0):
    """Random-weight LlamaForCausalLM in bf16 on ``device``, sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16 directly: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.set_attn_implementation("sdpa")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"model {name}: {shape['num_hidden_layers']} layers, {weights / GiB:.2f} GiB of bf16 weights on {device}")
    return model.eval(), weights


def make_cache(model, bits, residual, fused="auto"):
    """DynamicCache (bits None; sdpa attention) or CompressedCache turboquant (kvcodec attention;
    ``fused``: kvcodec.hf.AttentionOptions.fused)."""
    from transformers import DynamicCache

    import kvcodec.hf as khf

    if bits is None or bits == FLASH:
        khf.disable(model)  # hooks off, back to "sdpa"
        return DynamicCache(config=model.config)
    kw = {} if residual is None else {"residual": residual}
    return khf.CompressedCache(model, method="turboquant", key_bits=bits[0], value_bits=bits[1],
                               attention=khf.AttentionOptions(fused=fused), max_cache_len=None, **kw)


FLASH = "flash"  # DynamicCache with SDPA kept off cuDNN (flash / mem-efficient kernels)


def cache_label(bits) -> str:
    if bits is None:
        return "DynamicCache bf16"
    return "DynamicCache bf16, flash sdpa" if bits == FLASH else f"turboquant {bits[0]}/{bits[1]}"


def sdpa_backends(bits):
    """The FLASH row: torch's SDPA without cuDNN. torch 2.11 picks cuDNN for these decode shapes,
    whose per-call host cost (~1.3 ms measured on an H200) dominates a step; flash is the stronger
    baseline."""
    if bits != FLASH:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def kv_bytes(cache) -> int:
    return cache.nbytes() if hasattr(cache, "nbytes") else dynamic_bytes(cache)


# ------------------------------------------------------------------------------------ timing
class Clock:
    """Seconds of the work between ``start`` and ``stop``: CUDA events on a GPU, wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        return time.perf_counter() - self.t0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device):
    return torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else None


@contextlib.contextmanager
def count_fused():
    """Count the compressed-attention calls and how many the fused kernel took (``[taken, calls]``)."""
    import kvcodec.hf.attention as attn

    seen = [0, 0]
    inner = attn.fused_compressed

    def counted(*a, **kw):
        out = inner(*a, **kw)
        seen[0] += out is not None
        seen[1] += 1
        return out

    attn.fused_compressed = counted
    try:
        yield seen
    finally:
        attn.fused_compressed = inner


def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids`` into ``cache`` (one forward, or chunks of ``chunk`` tokens); returns the greedy next token."""
    step = chunk if chunk > 0 else ids.shape[1]
    for a in range(0, ids.shape[1], step):
        logits = model(input_ids=ids[:, a:a + step], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits
    return logits[:, -1].argmax(-1, keepdim=True)


def decode(model, cache, tok: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``steps`` greedy one-token decode steps; returns (last token, tokens produced)."""
    out = []
    for _ in range(steps):
        logits = model(input_ids=tok, **cache_kwargs(model, cache), use_cache=True).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    return tok, out


def measure(model, bits, ids, *, n_decode, warmup, residual, prefill_chunk, fused, device) -> dict:
    """One row: prefill ``ids`` into a fresh cache, warm up, time ``n_decode`` steps."""
    clock = Clock(device)
    row = {}
    reset_peak(device)
    with torch.no_grad(), sdpa_backends(bits):
        cache = make_cache(model, bits, residual, fused)
        clock.start()
        tok = prefill(model, cache, ids, prefill_chunk)
        row["prefill_s"] = clock.stop()
        row["peak_prefill_GiB"] = peak_gib(device)
        reset_peak(device)
        tok, toks = decode(model, cache, tok, warmup)  # compiles kernels; the first compaction lands here
        with count_fused() as fused:
            clock.start()
            _, timed = decode(model, cache, tok, n_decode)
            secs = clock.stop()
        toks = torch.cat(toks + timed, dim=1).cpu()
    batch = ids.shape[0]
    held = kv_bytes(cache)
    row.update(tok_s=batch * n_decode / secs, ms_step=1e3 * secs / n_decode, kv_bytes=held, kv_MiB=held / MiB,
               peak_decode_GiB=peak_gib(device), fused="-" if bits in (None, FLASH) else f"{fused[0]}/{fused[1]}",
               tokens=toks[:, :AGREE_TOKENS])
    return row


# ------------------------------------------------------------------------------------ sweep
def plan(models, batches, contexts, long_context) -> list[tuple[str, int, int]]:
    """(model, batch, ctx) in run order, grouped by model; LONG_CONTEXT_MODEL adds batch 1 at ``long_context``."""
    out = []
    for m in models:
        out += [(m, b, t) for b in batches for t in contexts]
        if long_context and m == LONG_CONTEXT_MODEL and 1 in batches:
            out.append((m, 1, long_context))
    return out


def run_group(model, name, batch, ctx, bit_list, vocab, device, opts) -> list[dict]:
    """DynamicCache first, then each CompressedCache setting, on the same random prompt."""
    gen = torch.Generator().manual_seed(1000 * batch + ctx)
    ids = torch.randint(2, vocab, (batch, ctx), generator=gen).to(device)
    rows, dynamic = [], []
    caches = [None] + ([FLASH] if device.type == "cuda" else []) + list(bit_list)
    for bits in caches:
        row = {"model": name, "batch": batch, "ctx": ctx, "cache": cache_label(bits)}
        try:
            row.update(measure(model, bits, ids, device=device, **opts))
        except Exception as e:  # OOM or a bug: record it, keep going
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tokens = row.pop("tokens", None)
        if bits in (None, FLASH) and tokens is not None:
            dynamic.append((row, tokens))
        if dynamic and tokens is not None:  # against the faster DynamicCache row; tokens vs the first
            fastest = max(dynamic, key=lambda rt: rt[0]["tok_s"])[0]
            compare(row, tokens, fastest, dynamic[0][1])
        log("row", row)
        rows.append(row)
    if len(dynamic) > 1:  # the first DynamicCache row was compared before the faster one existed
        fastest = max(dynamic, key=lambda rt: rt[0]["tok_s"])[0]
        for row, _ in dynamic:
            row["speedup"] = row["tok_s"] / fastest["tok_s"]
    return rows


def compare(row: dict, tokens: torch.Tensor, ref: dict, ref_tokens: torch.Tensor) -> None:
    """Speed-up, bytes ratio and greedy agreement against the DynamicCache row of the same group."""
    row["speedup"] = row["tok_s"] / ref["tok_s"]
    row["kv_vs_dynamic"] = row["kv_MiB"] / ref["kv_MiB"]
    n = min(tokens.shape[1], ref_tokens.shape[1])
    row["agree16"] = (tokens[:, :n] == ref_tokens[:, :n]).float().mean().item()


def run(quick: bool = False, out_dir: str = "benchmarks/results", *, device: str | None = None, tiny: bool = False,
        models: list[str] | None = None, batches=None, contexts=None, long_context: int | None = None,
        bits=((4, 4), (3, 3)), n_decode: int | None = None, warmup: int | None = None, residual: int | None = None,
        prefill_chunk: int = 0, budget_s: float = 270.0, fused: str = "auto") -> dict:
    t_start = time.time()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = TINY_MODELS if tiny else MODELS
    names = models or list(shapes)
    small = quick or tiny
    batches = batches or ([1, 2] if small else [1, 8])
    contexts = contexts or ([64] if tiny else [1024] if quick else [16384, 32768])
    long_context = (0 if small else 131072) if long_context is None else long_context
    n_decode = n_decode or (2 if tiny else 8 if quick else 64)
    warmup = warmup if warmup is not None else (1 if tiny else 2 if quick else 4)
    residual = residual if residual is not None else (16 if tiny else None)
    opts = dict(n_decode=n_decode, warmup=warmup, residual=residual, prefill_chunk=prefill_chunk, fused=fused)
    bit_list = [tuple(b) for b in bits]
    rec = machine_record()
    if dev.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(dev)
    log(f"{SUITE}: device {dev} ({rec.get('gpu', rec['processor'])}), torch {torch.__version__}")

    rows, weights, todo = [], {}, plan(names, batches, contexts, long_context)
    model, loaded = None, None
    for name, batch, ctx in todo:
        if time.time() - t_start > budget_s:
            rows.append({"model": name, "batch": batch, "ctx": ctx, "cache": "-",
                         "error": f"skipped: over the {budget_s:.0f}s budget"})
            continue
        if loaded != name:
            model = loaded = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            model, weights[name] = build_model(name, shapes[name], dev)
            loaded = name
        rows += run_group(model, name, batch, ctx, bit_list, shapes[name]["vocab_size"], dev, opts)

    res_note = "128 (default)" if residual is None else str(residual)
    notes = [
        "random-weight Llama decoders in bf16 (no hub): " + "; ".join(
            f"{n}: {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, heads {s['num_attention_heads']}/"
            f"{s['num_key_value_heads']}, head_dim {s['head_dim']}, vocab {s['vocab_size']}, "
            f"weights {weights.get(n, 0) / GiB:.2f} GiB" for n, s in shapes.items() if n in names),
        "llama8b-like has 4 of the real model's 32 layers (time and memory); ms/step and KV bytes cover those 4 only",
        f"device {dev}; prefill: {'one forward' if prefill_chunk <= 0 else f'chunks of {prefill_chunk} tokens'} "
        f"of random token ids (logits of the last position only), then {warmup} untimed warm-up and {n_decode} timed "
        "greedy decode steps model(input_ids=tok, past_key_values=cache, use_cache=True), eager (no CUDA graphs)",
        "tok_s = batch * steps / s (CUDA events around the timed steps); speedup = tok_s / tok_s of the faster "
        "DynamicCache row (on CUDA it also runs with SDPA kept off cuDNN, whose per-call host cost dominates "
        "these steps in torch 2.11)",
        f"CompressedCache(model, method='turboquant', key_bits, value_bits), residual {res_note}, sink 1, "
        "block_size = residual, key_precondition 'scale'; the prompt is attended exactly (sdpa) and then compressed; "
        "a compaction (one block_size run quantized and appended) happens every block_size steps",
        "DynamicCache as shipped: each step torch.cat's the new token onto every layer's K/V (a copy of the cache)",
        "kv_MiB: DynamicCache key+value tensors; CompressedCache.nbytes() (codes, norms, side data, sink, window)",
        "peak_*_GiB: torch.cuda.max_memory_allocated, reset before prefill and before decode (weights included)",
        f"agree16: fraction of the first {AGREE_TOKENS} greedy tokens of the decode steps (warm-up included, prefill "
        "token excluded) equal to DynamicCache's (free-running: one divergence changes later inputs; random weights)",
        "fused: compressed-attention calls taken by kvcodec.quant.cuda's fused kernel / all such calls in the timed steps",
        f"total {time.time() - t_start:.0f}s",
    ]
    result = {"suite": SUITE, "rows": rows, "machine": rec, "notes": notes, "columns": COLUMNS}
    with contextlib.redirect_stdout(io.StringIO()):  # printed once, below
        save_with_out(result, out_dir, columns=COLUMNS)
    print("".join(f"- {n}\n" for n in notes))
    print(markdown_table(rows, COLUMNS), flush=True)
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _bits(text: str) -> list[tuple[int, int]]:
    return [tuple(int(b) for b in pair.split("/")) for pair in text.split(",") if pair]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="contexts 1024, batch 1/2, 8 steps")
    ap.add_argument("--tiny", action="store_true", help="tiny model, context 64, 2 steps (CPU smoke test)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--models", type=lambda s: s.split(","), default=None, help="comma list of model names")
    ap.add_argument("--batches", type=_ints, default=None)
    ap.add_argument("--contexts", type=_ints, default=None)
    ap.add_argument("--long-context", type=int, default=None, help="extra batch-1 context (0: none; default 131072)")
    ap.add_argument("--bits", type=_bits, default=[(4, 4), (3, 3)], help="K/V bit pairs, e.g. 4/4,3/3")
    ap.add_argument("--n-decode", type=int, default=None, help="timed decode steps (default 64)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed decode steps first (default 4)")
    ap.add_argument("--residual", type=int, default=None, help="CompressedCache residual (default: kvcodec's)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill tokens per forward (0: all at once)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip the remaining groups after this many s")
    ap.add_argument("--fused", choices=("auto", "off", "cpu-reference"), default="auto",
                    help="kvcodec.hf.AttentionOptions.fused (cpu-reference: the fused wiring on CPU, for smoke tests)")
    a = ap.parse_args(argv)
    return run(a.quick, a.out, device=a.device, tiny=a.tiny, models=a.models, batches=a.batches, contexts=a.contexts,
               long_context=a.long_context, bits=a.bits, n_decode=a.n_decode, warmup=a.warmup, residual=a.residual,
               prefill_chunk=a.prefill_chunk, budget_s=a.budget_s, fused=a.fused)


if __name__ == "__main__":
    main()
