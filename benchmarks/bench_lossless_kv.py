"""Lossless KV cache compression on real SmolLM2 KV: kvctx / predictive vs zipnn, zstd 3/19, planes.

Data: the real SmolLM2-135M KV (keys and values, post-RoPE, bf16) and its predictor (the same
tokens through an fp8-weight copy of the model), from ``kvcodec.data.load_kv_sample``: the full
cache (30 layers x 2048 tokens, ``kvcodec.data.full_sample_location()``, made by
``python benchmarks/make_kv_sample.py --full``) when present, else the shipped sample; ``quick``
always uses the shipped sample. Then held-out KV (unless ``--no-heldout`` or the real model is
not installed): the same model over text kvcodec was never tuned on (the IDLE help page shipped
with CPython, ``bench_quality.held_out_texts``), all 30 layers x ``--heldout-tokens`` tokens,
computed once with ``smollm2.py`` and cached under ``benchmarks/results/cache/``. fp8 rows:
keys/values cast to float8_e4m3fn with a per-(layer, head) scale (``kvcodec.lossless.fp8``); the
ratio is over raw fp8 bytes and the predictor is given in the fp8 tensor's units; fp8 kvctx is coded
in format 2 by default and fp8 with the predictor in format 1 (its better ratio); the other format of
each is in the ``format 1`` / ``format 2`` rows.

Every method codes keys and values separately (sizes and times summed) and every result is checked
bit-exact. Ratios are whole blobs (container headers included); speeds are MB/s of raw bytes, best
of a few runs, with 1 thread and all cores: ``*_MBps`` from wall-clock time, ``*_MBps_core`` from
the process's CPU time (all threads summed), i.e. MB/s per busy core. On a shared machine the CPU
time figure is the fair one (the load average at the start and the end is in the notes); peers are
measured the same way in the same run.

Run: ``python benchmarks/bench_lossless_kv.py [--quick] [--no-heldout] [--heldout-tokens N]``
(``python benchmarks/run.py --suite lossless`` also appends these rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # a source checkout without pip install
from common import save  # noqa: E402

from kvcodec.data import full_sample_location  # noqa: E402

COLUMNS = ["source", "method", "threads", "raw_MB", "ratio", "bits_per_value", "compress_MBps",
           "decompress_MBps", "compress_MBps_core", "decompress_MBps_core", "exact"]
FULL_CACHE = full_sample_location()  # where make_kv_sample.py --full writes it
TARGETS = {"bf16 kvctx": 1.58, "bf16 predictive fp8-weight": 2.48, "fp8 predictive fp8-weight": 3.0}
SPEED_TARGET_MBPS_CORE = 300  # target: decode >= 300 MB/s per core for every codec
DECODE_EXTRA_REPEATS = 12  # decoding is cheap: more tries give a steadier best time on a shared machine (3 moved a
# sample row by up to 15% between runs at load 1.3)


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def load(quick: bool):
    from kvcodec.data import load_kv_sample

    if not quick and FULL_CACHE.is_file():
        return load_kv_sample(FULL_CACHE), "SmolLM2 KV full (30 layers x 2048 tokens)"
    s = load_kv_sample()
    return s, f"SmolLM2 KV sample ({s.n_layers} layers x {s.n_tokens} tokens)"


HELDOUT_TEXT = "idle_help"


def heldout_sample(n_tokens: int):
    """Real SmolLM2 KV of held-out text, all layers, with its fp8-weight predictor (cached)."""
    from types import SimpleNamespace

    import smollm2
    from kvcodec.recording import record_qkv

    cache_dir = Path(__file__).resolve().parent / "results" / "cache"
    cache = cache_dir / f"lossless_kv_heldout_{HELDOUT_TEXT}_{n_tokens}.pt"
    if cache.is_file():
        return SimpleNamespace(**torch.load(cache))
    from bench_quality import held_out_texts

    tokenizer = smollm2.load_tokenizer()
    model = smollm2.load_model(torch.bfloat16)
    ids = tokenizer(held_out_texts()[HELDOUT_TEXT], return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the held-out text has only {ids.shape[1]} tokens")
    layers = range(model.config.num_hidden_layers)
    rec = record_qkv(model, ids, layers)
    pred = record_qkv(smollm2.fp8_weight_copy(model), ids, layers)

    def stack(r, kind):
        return torch.cat([r[kind][i] for i in layers]).contiguous()  # [L, heads, T, D]

    out = {"keys": stack(rec, "k"), "values": stack(rec, "v"), "keys_fp8pred": stack(pred, "k"),
           "values_fp8pred": stack(pred, "v")}
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, cache)
    return SimpleNamespace(**out)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _progress(source, method, threads):
    print(f"  lossless_kv: {source.split(',')[0]} / {method} / {threads} thread(s)", file=sys.stderr, flush=True)


def _row(source, method, threads, tensors, sizes, t_enc, t_dec, exact):
    """``t_enc`` / ``t_dec``: (wall seconds, CPU seconds) of coding all ``tensors``."""
    raw = sum(t.numel() * t.element_size() for t in tensors)
    n = sum(t.numel() for t in tensors)
    comp = sum(sizes)
    _progress(source, method, threads)
    return {"source": source, "method": method, "threads": threads, "raw_MB": raw / 1e6,
            "ratio": raw / comp, "bits_per_value": 8 * comp / n,
            "compress_MBps": raw / 1e6 / t_enc[0], "decompress_MBps": raw / 1e6 / t_dec[0],
            "compress_MBps_core": raw / 1e6 / t_enc[1], "decompress_MBps_core": raw / 1e6 / t_dec[1],
            "exact": exact}


def _timed(fn, repeat: int):
    """((best wall s, best CPU s) over ``repeat`` calls, the last result); no warm-up call here."""
    wall = cpu = float("inf")
    out = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return (wall, max(cpu, 1e-9)), out


def kvcodec_rows(source, method, tensors, preds, repeat, codec="auto", **opts):
    """One row per thread count for a kvcodec codec through compress/decompress."""
    from kvcodec.lossless.api import compress, decompress

    def small(t):
        return None if t is None else t[..., :8, :].contiguous()

    # compile the numba kernels on a small slice so the timed calls measure coding only
    for t, p in zip(tensors, preds):
        decompress(compress(small(t), prediction=small(p), codec=codec, **opts), prediction=small(p))
    rows = []
    for threads in sorted({1, _cores()}):
        t_enc, blobs = _timed(lambda: [compress(t, prediction=p, codec=codec, threads=threads, **opts)
                                       for t, p in zip(tensors, preds)], repeat)
        t_dec, outs = _timed(lambda: [decompress(b, prediction=p, threads=threads) for b, p in zip(blobs, preds)],
                             repeat + DECODE_EXTRA_REPEATS)
        exact = all(_bits(a) == _bits(b) for a, b in zip(outs, tensors))
        rows.append(_row(source, method, threads, tensors, [len(b) for b in blobs], t_enc, t_dec, exact))
    return rows


def zstd_rows(source, tensors, repeat, notes):
    try:
        import zstandard
    except ImportError:
        notes.append("zstandard not installed: no zstd rows")
        return []

    rows = []
    raw = [_bits(t) for t in tensors]
    for level in (3, 19):
        for threads in sorted({1, _cores()}):
            cctx = zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0)
            dctx = zstandard.ZstdDecompressor()
            blobs = [cctx.compress(r) for r in raw]
            t_enc, _ = _timed(lambda: [cctx.compress(r) for r in raw], repeat)
            t_dec, _ = _timed(lambda: [dctx.decompress(b) for b in blobs], repeat)
            exact = [dctx.decompress(b) for b in blobs] == raw
            rows.append(_row(source, f"zstd-{level}", threads, tensors, [len(b) for b in blobs], t_enc, t_dec, exact))
    return rows


def zipnn_rows(source, tensors, repeat, notes):
    try:
        import zipnn
    except ImportError:
        notes.append("zipnn not installed: no zipnn rows")
        return []
    rows = []
    raw = [_bits(t) for t in tensors]
    for threads in sorted({1, _cores()}):
        coder = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=threads)
        # zipnn overwrites the buffer it is given: a fresh copy every call.
        blobs = [bytes(coder.compress(bytearray(r))) for r in raw]
        t_enc, _ = _timed(lambda: [coder.compress(bytearray(r)) for r in raw], repeat)
        t_dec, _ = _timed(lambda: [coder.decompress(b) for b in blobs], repeat)
        exact = [bytes(coder.decompress(b)) for b in blobs] == raw
        rows.append(_row(source, "zipnn", threads, tensors, [len(b) for b in blobs], t_enc, t_dec, exact))
    return rows


def _other_codec(fn, notes):
    """Rows of a codec this suite does not own; a failure there becomes a note, not a crash."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the notes
        notes.append(f"planes codec failed: {type(exc).__name__}: {exc}")
        return []


def run_rows(quick: bool = False) -> tuple[list[dict], list[str]]:
    """(rows, notes): every method on real bf16 KV and on its fp8 cast, side by side, and the load
    averages and targets (``notes_for``)."""
    return _rows_and_notes(quick)


def _rows_and_notes(quick: bool, heldout_tokens: int = 0):
    sample, name = load(quick)
    repeat = 3 if quick else 2
    notes = [f"load average at start: {os.getloadavg()[0]:.1f} on {_cores()} cores"]
    rows = _dataset_rows(sample, name, repeat, notes, every_predictor=True)
    if heldout_tokens:
        try:
            held = heldout_sample(heldout_tokens)
        except Exception as exc:  # noqa: BLE001 - no model installed: say so
            notes.append(f"no held-out rows: {type(exc).__name__}: {exc}")
        else:
            hname = f"held-out SmolLM2 KV ({HELDOUT_TEXT}, {held.keys.shape[0]} layers x {heldout_tokens} tokens)"
            rows += _dataset_rows(held, hname, 2, notes, every_predictor=False)
    notes.append(f"load average at end: {os.getloadavg()[0]:.1f} on {_cores()} cores")
    return rows, notes + notes_for(rows)


def _dataset_rows(sample, name: str, repeat: int, notes: list, every_predictor: bool) -> list[dict]:
    from kvcodec.lossless.fp8 import fp8_prediction, to_fp8_kv

    notes.append(f"data: {name}; keys and values coded separately, sizes and times summed")
    kv = [sample.keys, sample.values]
    pred = [sample.keys_fp8pred, sample.values_fp8pred]
    none = [None, None]
    src = f"bf16 KV, {name}"
    rows = zipnn_rows(src, kv, repeat, notes) + zstd_rows(src, kv, repeat, notes)
    rows += _other_codec(lambda: kvcodec_rows(src, "planes", kv, none, repeat, codec="planes"), notes)
    rows += kvcodec_rows(src, "kvctx", kv, none, repeat, codec="kvctx")
    rows += kvcodec_rows(src, "predictive fp8-weight", kv, pred, repeat, codec="predictive")
    if every_predictor:
        rows += kvcodec_rows(src, "predictive previous_token", kv, none, repeat, codec="predictive",
                             predictor="previous_token")
        rows += kvcodec_rows(src, "predictive neighbour_layer", kv, none, repeat, codec="predictive",
                             predictor="neighbour_layer")

    q, p8 = [], []
    for t, p in zip(kv, pred):
        qt, scale = to_fp8_kv(t)
        q.append(qt)
        p8.append(fp8_prediction(p, scale))
    src8 = f"fp8 e4m3 KV (per-head scale), {name}"
    rows += zstd_rows(src8, q, repeat, notes)
    rows += _other_codec(lambda: kvcodec_rows(src8, "planes", q, none, repeat, codec="planes"), notes)
    # fp8 defaults to format 2 without a prediction tensor and to format 1 (its ratio) with one: the
    # other format of each beside it
    rows += kvcodec_rows(src8, "kvctx", q, none, repeat, codec="kvctx")
    rows += kvcodec_rows(src8, "kvctx format 1", q, none, repeat, codec="kvctx", version=1)
    rows += kvcodec_rows(src8, "predictive fp8-weight", q, p8, repeat, codec="predictive")
    rows += kvcodec_rows(src8, "predictive fp8-weight format 2", q, p8, repeat, codec="predictive", version=2)
    return rows


def notes_for(rows: list[dict]) -> list[str]:
    """What each target asked for and what the rows reach."""
    notes = []
    best = {}
    for r in rows:
        data = r["source"].split(", ", 1)[-1].split(" (")[0]
        key = ("fp8 " if r["source"].startswith("fp8") else "bf16 ") + r["method"]
        best[key, data] = max(best.get((key, data), 0.0), r["ratio"])
    for (key, data), got in best.items():
        if key in TARGETS:
            target = TARGETS[key]
            notes.append(f"target {key} >= {target}x on {data}: measured {got:.3f}x "
                         f"({'met' if got >= target else 'NOT met'})")
    for r in rows:
        if r["threads"] == 1 and r["method"] in ("planes", "kvctx", "predictive fp8-weight", "kvctx format 1",
                                                 "predictive fp8-weight format 2", "predictive previous_token",
                                                 "predictive neighbour_layer"):
            got = r["decompress_MBps_core"]
            data = r["source"].split(", ", 1)[-1].split(" (")[0]
            notes.append(f"target decode >= {SPEED_TARGET_MBPS_CORE} MB/s per core, {r['source'].split(',')[0]} "
                         f"{r['method']} on {data}: measured {got:.0f} "
                         f"({'met' if got >= SPEED_TARGET_MBPS_CORE else 'NOT met'})")
    notes.append("fp8 ratios are over raw fp8 bytes; the fp8 predictor is the fp8-weight model's KV / the "
                 "target's per-head scale, in float32")
    return notes


def run(quick: bool = False, out_dir: str = "benchmarks/results", heldout_tokens: int = 512) -> dict:
    rows, notes = _rows_and_notes(quick, heldout_tokens)
    result = {"suite": "lossless_kv", "rows": rows, "notes": notes}
    save(result, out_dir, COLUMNS)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shipped sample only, fewer repeats")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-heldout", action="store_true", help="skip the held-out KV rows (needs the real model)")
    ap.add_argument("--heldout-tokens", type=int, default=512)
    args = ap.parse_args()
    run(args.quick, args.out, 0 if args.no_heldout else args.heldout_tokens)
