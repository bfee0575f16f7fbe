"""Quality per bit: perplexity change with a confidence interval, greedy agreement and passkey retrieval.

Every cache in the same run, on real SmolLM2-135M (bf16, CPU): DynamicCache (the reference), each
kvcodec preset (``CompressedCache(model, preset=...)``), uniform TurboQuant baselines, the paper's
outlier split, the presets with fitted codebooks (``calibration=``), kvcodec's KIVI and HF
``QuantizedCache`` (quanto). Levers are chosen beforehand on calibration text (bench_quality_levers.py).

Texts: held-out real text shipped with Python itself (no hub, no download), none of which the
project ever tuned on (its calibration and earlier benchmarks use ``smollm2.real_text``,
the language reference prose and a few stdlib modules): Python's LICENSE history, the IDLE manual
(help.html, tags stripped), IDLE's release notes, docstrings of ten stdlib modules, and the source
of five other stdlib modules.

Perplexity protocol: the texts are cut to the same length and batched (one row each, no padding).
The first ``prefix`` tokens are prefilled exactly once (DynamicCache) and their K/V handed to each
cache with ``cache.update`` (what the model's own prefill does: kvcodec then compresses all but
the window, quanto quantizes it whole); then the next ``n_eval`` tokens are fed one decode step at
a time through the cache (teacher forcing), so every scored token attends to the compressed
history. Reported: perplexity change vs DynamicCache over all scored tokens with a 95% interval
from a paired block bootstrap (blocks of 32 consecutive tokens of a text, the same resample for
every cache), the change per text, greedy top-1 agreement, true bits per value and bytes held.

Passkey protocol: a sentence "The pass key is NNNNN. Remember it. NNNNN is the pass key." is put
at one of several depths of a haystack of held-out real text; the haystack (with the fact) is
prefilled once and handed to every cache; the question is then fed through the cache as a second
chunk (so it reads the compressed haystack) and the answer is decoded greedily: exact match of
all digits.

Run: ``nice python benchmarks/bench_quality.py [--quick]``; results in
``benchmarks/results/bench_quality.{json,md}``.
"""

from __future__ import annotations

import argparse
import html.parser
import inspect
import logging
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf import dynamic_bytes, quanto_report  # noqa: E402
from common import save  # noqa: E402
from kvcodec.cache_argument import cache_kwargs  # noqa: E402

SUITE = "bench_quality"
RESIDUAL = 128  # full-precision window of every cache (kvcodec, KIVI, quanto), as in the quality targets' table (docs/quality.md)
DOC_MODULES = ("argparse", "subprocess", "shutil", "pathlib", "logging", "tarfile", "zipfile", "collections",
               "functools", "unittest.case")
CODE_MODULES = ("difflib", "calendar", "dataclasses", "string", "graphlib")


# ------------------------------------------------------------------------------------ texts
class _HTMLText(html.parser.HTMLParser):
    BREAKS = {"p", "li", "h1", "h2", "h3", "dd", "dt", "pre", "div"}

    def __init__(self):
        super().__init__()
        self.out, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self.skip -= tag in ("script", "style")
        if tag in self.BREAKS:
            self.out.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data)


def _stdlib(*parts: str) -> str:
    return Path(sysconfig.get_paths()["stdlib"], *parts).read_text(encoding="utf-8")


def _tidy(text: str) -> str:
    text = re.sub(r"[ \t]+", " ", text)
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


def held_out_texts() -> dict[str, str]:
    """Five real texts shipped with CPython, never used to tune kvcodec."""
    import importlib

    parser = _HTMLText()
    parser.feed(_stdlib("idlelib", "help.html"))
    idle_help = _tidy("".join(parser.out))
    idle_help = idle_help[idle_help.find("IDLE is Python"):] if "IDLE is Python" in idle_help else idle_help
    docs = []
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in sorted(vars(mod)) if not a.startswith("_")]:
            doc = inspect.getdoc(obj) if (obj is mod or getattr(obj, "__module__", None) == mod.__name__) else None
            if doc and len(doc) > 200:
                docs.append(doc)
    code = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES)
    return {
        "license": _stdlib("LICENSE.txt"),
        "idle_help": idle_help,
        "idle_news": _stdlib("idlelib", "NEWS.txt"),
        "docstrings": "\n\n".join(dict.fromkeys(docs)),
        "code": code,
    }


# ------------------------------------------------------------------------------------ caches
def kvcodec_report(cache) -> tuple[int, float]:
    """(bytes held, true bits per value): codes, norms, side data and the exact sink over the
    sink + compressed K/V scalars (the recent full-precision window is excluded from the bits)."""
    rep = cache.memory_report()
    held = sum(r["total"] for r in rep)
    comp = sum(r["compressed_keys"] + r["compressed_values"] + r["side"] + r["sink"] for r in rep)
    scalars = 0
    for layer in cache.layers:
        st = layer.store
        if st is not None and st.blocks:
            scalars += 2 * (st.batch_size or 1) * layer.spec.num_kv_heads * layer.spec.head_dim * (st.compressed_len + st.sink_len)
    return held, (comp * 8 / scalars if scalars else float("nan"))


def cache_configs(model, quick: bool) -> list[dict]:
    from transformers import QuantizedCache

    from kvcodec.hf import CompressedCache
    from kvcodec.hf.presets import PRESETS

    cfg = model.config
    out = []
    for name in (["2.5bit"] if quick else ["3.5bit", "2.5bit"]):
        out.append(_preset(model, name))
    for bits in ([2] if quick else [3, 2]):
        out.append({"cache": f"kvcodec KIVI {bits}/{bits}", "make": lambda bits=bits: CompressedCache(
            model, method="kivi", key_bits=bits, value_bits=bits, residual=RESIDUAL), "report": kvcodec_report})
    try:
        import optimum.quanto  # noqa: F401

        for bits in ([2] if quick else [4, 2]):
            out.append({"cache": f"HF QuantizedCache quanto {bits}/{bits}", "make": lambda bits=bits: QuantizedCache(
                backend="quanto", config=cfg, nbits=bits, residual_length=RESIDUAL, q_group_size=64),
                "report": quanto_report})
    except ImportError:
        pass
    out += [_preset(model, name) for name in PRESETS if name not in ("3.5bit", "2.5bit") and not quick]
    for bits, paper in ([] if quick else [(3, "3.5"), (2, "2.5")]):  # the paper's split; head_dim 64 pays two norms
        out.append({"cache": f"kvcodec outlier split paper {paper} (16ch@{bits + 1}b+48ch@{bits}b)",
                    "make": lambda bits=bits: CompressedCache(model, key_bits=bits, value_bits=bits, outliers=16,
                                                              residual=RESIDUAL), "report": kvcodec_report})
    for kb, vb in ([] if quick else [(3, 3), (3, 2)]):
        out.append({"cache": f"kvcodec turboquant {kb}/{vb} uniform", "make": lambda kb=kb, vb=vb: CompressedCache(
            model, key_bits=kb, value_bits=vb, residual=RESIDUAL), "report": kvcodec_report})
    for name in ([] if quick else ["3.5bit", "2.5bit"]):  # lever: codebooks fitted to SmolLM2's K/V (kvcodec.hf.fitted)
        out.append({"cache": f"kvcodec preset {name} + fitted codebooks", "make": lambda name=name: CompressedCache(
            model, preset=name, residual=RESIDUAL, calibration="smollm2-135m:codebooks"), "report": kvcodec_report})
    return out


def _preset(model, name: str) -> dict:
    from kvcodec.hf import CompressedCache

    return {"cache": f"kvcodec preset {name}", "make": lambda: CompressedCache(model, preset=name, residual=RESIDUAL),
            "report": kvcodec_report}


# ------------------------------------------------------------------------------------ protocol
@torch.no_grad()
def prefill_kv(model, ids: torch.Tensor):
    """Exact prefill: (logits of the last position, per-layer (keys, values))."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(ids, **cache_kwargs(model, cache), use_cache=True)
    return out.logits[:, -1].float(), [(layer.keys, layer.values) for layer in cache.layers]


def transplant(cache, kv, repeat: int = 1) -> None:
    """Hand exact prefill K/V to a fresh cache, layer by layer, as the model's own prefill does
    (``repeat``: each batch row repeated that many times, consecutively)."""
    for i, (k, v) in enumerate(kv):
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
        cache.update(k, v, i)


def decode_chunks(prefix: int, n_feed: int, *, sink: int = 1, residual: int = RESIDUAL, block: int = RESIDUAL,
                  max_chunk: int = RESIDUAL) -> list[int]:
    """Chunk lengths for feeding ``n_feed`` tokens after a ``prefix``-token prefill so that a kvcodec cache
    sees exactly what one-token decode steps would show it: a chunk never spans a point where the cache
    compacts (moves a block out of its exact window), so every token attends to the same compressed and
    exact tokens as in step-by-step decoding (tests/test_quality.py checks the logits agree)."""
    def compact(w):
        n = (w - residual) // block
        return w - n * block if n > 0 else w

    w = compact(max(prefix - sink, 0))
    chunks, cur = [], 0
    for _ in range(n_feed):
        w += 1
        cur += 1
        after = compact(w)
        if after != w or cur == max_chunk:
            chunks.append(cur)
            cur, w = 0, after
    if cur:
        chunks.append(cur)
    return chunks


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, prefix: int, chunks: list[int], cache, kv, first_logits,
                   with_logp: bool = False):
    """nll and argmax [B, 1 + sum(chunks)] of the tokens after the prefix, fed through the cache in ``chunks``
    (``with_logp``: also the log-probabilities [B, 1 + sum(chunks), vocab] in bf16, for KL divergences)."""
    transplant(cache, kv)
    logits, t = [first_logits[:, None]], prefix
    for n in chunks:
        logits.append(model(ids[:, t:t + n], **cache_kwargs(model, cache), use_cache=True).logits.float())
        t += n
    logp = torch.log_softmax(torch.cat(logits, dim=1), -1)  # [B, 1 + sum(chunks), vocab]
    targets = ids[:, prefix:t + 1]
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    out = (nll, logp.argmax(-1))
    return (*out, logp.to(torch.bfloat16)) if with_logp else out


def block_bootstrap(diff: torch.Tensor, block: int = 32, n: int = 2000, seed: int = 0) -> torch.Tensor:
    """Resampled means of diff [B, T] (blocks of ``block`` tokens of each row, drawn with replacement);
    the same generator seed for every cache, so the intervals are paired."""
    B, T = diff.shape
    block = min(block, T)
    nb = T // block
    blocks = diff[:, : nb * block].reshape(B * nb, block).mean(-1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, B * nb, (n, B * nb), generator=g)
    return blocks[idx].mean(-1)


def ppl_stats(nll: torch.Tensor, ref_nll: torch.Tensor) -> dict:
    diff = (nll - ref_nll).double()
    boot = block_bootstrap(diff)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=boot.dtype)).tolist()
    return {
        "ppl_delta_pct": 100 * math.expm1(diff.mean().item()),
        "ci95_lo_pct": 100 * math.expm1(lo),
        "ci95_hi_pct": 100 * math.expm1(hi),
        "per_text_pct": " / ".join(f"{100 * math.expm1(d):+.2f}" for d in diff.mean(-1).tolist()),
    }


# ------------------------------------------------------------------------------------ passkey
NAMES = (" Anna", " Peter", " Maria", " John", " Lucy")  # one token each: questions have equal lengths
NEEDLE = " The pass key of{name} is {key}. Remember it."
QUESTION = "\n\nWhat is the pass key of{name}? The pass key of{name} is"


def passkey_haystacks(tok, text_ids: torch.Tensor, length: int, n_haystacks: int, depths, seed: int = 0):
    """n_haystacks rows [n, length] of real text, each holding one needle per name at the given depths
    (names rotate over depths from row to row), and the keys [n][name index]."""
    g = torch.Generator().manual_seed(seed)
    rows, keys = [], []
    for h in range(n_haystacks):
        names = [NAMES[(i + h) % len(NAMES)] for i in range(len(depths))]
        row_keys = [str(int(torch.randint(10_000, 100_000, (1,), generator=g))) for _ in depths]
        needles = [tok(NEEDLE.format(name=n, key=k), add_special_tokens=False).input_ids for n, k in zip(names, row_keys)]
        hay_len = length - sum(len(x) for x in needles)
        start = int(torch.randint(0, text_ids.numel() - hay_len, (1,), generator=g))
        hay = text_ids[start:start + hay_len].tolist()
        out, prev = [], 0
        for depth, needle in zip(depths, needles):
            at = int(depth * hay_len)
            out += hay[prev:at] + needle
            prev = at
        out += hay[prev:]
        rows.append(torch.tensor(out))
        keys.append({n: k for n, k in zip(names, row_keys)})
    return torch.stack(rows), keys


def passkey_queries(tok, keys: list[dict]):
    """Question + answer token ids for every (haystack, name): [n * len(NAMES), Q + A], the answer
    length A, and the name of each row."""
    rows, names = [], []
    for row_keys in keys:
        for name in NAMES:
            q = tok(QUESTION.format(name=name), add_special_tokens=False).input_ids
            a = tok(" " + row_keys[name], add_special_tokens=False).input_ids
            rows.append(q + a)
            names.append(name)
    a_len = len(tok(" " + keys[0][NAMES[0]], add_special_tokens=False).input_ids)
    return torch.tensor(rows), a_len


@torch.no_grad()
def passkey_hits(model, cache, kv, queries: torch.Tensor, a_len: int) -> torch.Tensor:
    """Exact match per query row: greedy decoding would produce every answer token (teacher-forced check:
    greedy output equals the answer iff each answer token is the argmax given the answer so far)."""
    from transformers import QuantizedCache

    if isinstance(cache, QuantizedCache):  # its layers repeat only their exact window: hand it repeated K/V
        transplant(cache, kv, repeat=len(NAMES))
    else:  # quantize each haystack once, then repeat the rows (packed form) for the questions
        transplant(cache, kv)
        cache.batch_repeat_interleave(len(NAMES))
    logits = model(queries[:, :-1], **cache_kwargs(model, cache), use_cache=True).logits
    pred = logits[:, -a_len:].argmax(-1)
    return (pred == queries[:, -a_len:]).all(-1)


# ------------------------------------------------------------------------------------ run
def run(quick: bool = False, out_dir: str = "benchmarks/results", only: str | None = None) -> dict:
    import smollm2
    from kvcodec.hf import enable

    logging.getLogger("kvcodec").setLevel(logging.ERROR)  # the cache.update hand-off warns about fallback once
    torch.manual_seed(0)
    prefix, n_feed = (300, 32) if quick else (512, 4 * RESIDUAL + 1)
    hay_len, n_hay, hay_batch = (512, 2, 2) if quick else (2048, 10, 5)
    depths = (0.1, 0.3, 0.5, 0.7, 0.9)
    model = enable(_model_copy())
    tok = smollm2.load_tokenizer()
    texts = held_out_texts()
    names = list(texts)
    ids = [tok(texts[n], return_tensors="pt").input_ids[0] for n in names]
    need = prefix + n_feed + 1
    short = [n for n, t in zip(names, ids) if t.numel() < need]
    if short:
        raise RuntimeError(f"texts shorter than {need} tokens: {short}")
    batch = torch.stack([t[:need] for t in ids])
    chunks = decode_chunks(prefix, n_feed)
    t0 = time.perf_counter()
    first_logits, kv = prefill_kv(model, batch[:, :prefix])
    ref_cache = _fresh_dynamic(model)
    ref_nll, ref_arg = teacher_forced(model, batch, prefix, chunks, ref_cache, kv, first_logits)
    ref_bytes = dynamic_bytes(ref_cache)
    print(f"DynamicCache: ppl {math.exp(ref_nll.mean()):.3f} over {ref_nll.numel()} tokens "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    hay_text = torch.cat([ids[names.index("idle_help")], ids[names.index("license")], ids[names.index("docstrings")]])
    hay_rows, hay_keys = passkey_haystacks(tok, hay_text, hay_len, n_hay, depths)
    pk_sets = []
    for h0 in range(0, n_hay, hay_batch):
        _, pkv = prefill_kv(model, hay_rows[h0:h0 + hay_batch])
        queries, a_len = passkey_queries(tok, hay_keys[h0:h0 + hay_batch])
        pk_sets.append((pkv, queries, a_len))
    # depth of each query row: the name's position in its haystack
    row_depth = [depths[(NAMES.index(n) - h) % len(NAMES)] for h in range(n_hay) for n in NAMES]

    def passkey_eval(make):
        hits = torch.cat([passkey_hits(model, make(), pkv, q, a) for pkv, q, a in pk_sets])
        by_depth = {str(d): int(sum(bool(x) for x, rd in zip(hits, row_depth) if rd == d)) for d in depths}
        return hits, by_depth

    ref_hits, ref_depth = passkey_eval(lambda: _fresh_dynamic(model))
    n_trials = ref_hits.numel()
    print(f"DynamicCache passkey {100 * ref_hits.float().mean():.0f}% of {n_trials}", flush=True)
    rows = [{"cache": "DynamicCache (bf16)", "bits_per_value": 16.0, "kv_bytes": ref_bytes, "vs_bf16": 1.0,
             "ppl": math.exp(ref_nll.mean().item()), "ppl_delta_pct": 0.0, "ci95_lo_pct": 0.0, "ci95_hi_pct": 0.0,
             "per_text_pct": "", "top1_agree": 1.0,
             "passkey_pct": 100 * ref_hits.float().mean().item(), "passkey_vs_ref": "0/0",
             "passkey_by_depth": ref_depth, "seconds": time.perf_counter() - t0}]
    def write(complete: bool = False):
        notes = [
            f"SmolLM2-135M-Instruct, bf16, CPU. Texts (held out, shipped with CPython {sys.version.split()[0]}): "
            f"{', '.join(names)}; one batch row per text; prefix {prefix} tokens prefilled exactly, then "
            f"{ref_nll.shape[1]} tokens per text scored ({ref_nll.numel()} in total): the first from the exact prefill, "
            f"the rest fed through the cache in chunks {sorted(set(chunks))} that never span a compaction point, i.e. "
            "every token attends to the same compressed and exact tokens as in one-token decode steps (kvcodec caches; "
            "quanto re-quantizes when its window is full, at shifted but equally spaced points).",
            f"Full-precision window (residual) {RESIDUAL} tokens for every cache; kvcodec sink 1 token.",
            "ppl_delta_pct: exp(mean per-token nll difference) - 1 vs DynamicCache; ci95: paired block bootstrap "
            f"(blocks of 32 tokens, 2000 resamples); per_text_pct: the change per text ({', '.join(names)}).",
            "bits_per_value: kvcodec: (codes + norms + side data + sink) bits / (sink + compressed K/V scalars), the "
            "window excluded; quanto: packed data + scales + shifts over its quantized scalars. kv_bytes: everything "
            "held at the end of the perplexity run (window included), vs_bf16 = kv_bytes / DynamicCache's.",
            f"passkey: {n_trials} trials: {n_hay} haystacks of {hay_len} tokens of held-out text (IDLE manual, LICENSE, "
            f"docstrings), each holding {len(depths)} facts 'The pass key of <name> is <5 digits>' at depths "
            f"{list(depths)}; each fact is asked for at the end (question fed through the cache after the haystack); "
            "hit = greedy decoding gives every answer token (checked teacher-forced). passkey_vs_ref: trials lost / won "
            "against DynamicCache.",
        ]
        result = {"suite": SUITE, "rows": rows, "notes": notes, "texts": names,
                  "config": {"prefix": prefix, "chunks": chunks, "residual": RESIDUAL, "haystack": hay_len,
                             "depths": list(depths), "trials": n_trials, "quick": quick, "complete": complete}}
        write.result = result
        return save(result, out_dir, columns=COLUMNS)

    for conf in cache_configs(model, quick):
        if only and only not in conf["cache"]:
            continue
        t1 = time.perf_counter()
        cache = conf["make"]()
        try:
            nll, arg = teacher_forced(model, batch, prefix, chunks, cache, kv, first_logits)
            held, bits = conf["report"](cache)
            hits, pk_depth = passkey_eval(conf["make"])
        except Exception as exc:  # a peer that crashes is reported, not hidden
            rows.append({"cache": conf["cache"], "error": f"{type(exc).__name__}: {exc}"})
            print(f"{conf['cache']}: failed {exc}", flush=True)
            continue
        lost, won = int((ref_hits & ~hits).sum()), int((hits & ~ref_hits).sum())
        row = {"cache": conf["cache"], "bits_per_value": bits, "kv_bytes": held, "vs_bf16": held / ref_bytes,
               "ppl": math.exp(nll.mean().item()), **ppl_stats(nll, ref_nll),
               "top1_agree": (arg == ref_arg).float().mean().item(), "passkey_pct": 100 * hits.float().mean().item(),
               "passkey_vs_ref": f"-{lost}/+{won}", "passkey_by_depth": pk_depth,
               "seconds": time.perf_counter() - t1}
        rows.append(row)
        print(f"{row['cache']:40s} {bits:5.2f} bits  ppl {row['ppl_delta_pct']:+.2f}% "
              f"[{row['ci95_lo_pct']:+.2f}, {row['ci95_hi_pct']:+.2f}]  top1 {row['top1_agree']:.3f}  "
              f"passkey {row['passkey_pct']:.0f}% ({row['passkey_vs_ref']})  ({row['seconds']:.0f}s)", flush=True)
        write()  # partial results survive an interrupted run
    path = write(complete=True)
    return {**write.result, "json": str(path)}


COLUMNS = ["cache", "bits_per_value", "vs_bf16", "ppl_delta_pct", "ci95_lo_pct", "ci95_hi_pct", "top1_agree",
           "passkey_pct", "passkey_vs_ref", "per_text_pct"]


def _model_copy():
    import copy

    import smollm2

    return copy.deepcopy(smollm2.load_model(torch.bfloat16))


def _fresh_dynamic(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="run only the caches whose name contains this")
    ap.add_argument("--out", default=os.environ.get("KVCODEC_RESULTS", "benchmarks/results"))
    args = ap.parse_args()
    run(quick=args.quick, out_dir=args.out, only=args.only)
