"""``kvcodec demo``: every codec on the real SmolLM2-135M KV sample that ships with kvcodec.

One table, no network, under a minute of CPU time on a 2-core machine (the note under the table
prints the measured wall and CPU time): for each method, the TRUE bits per
value (every byte the compressed form holds), the ratio against the bf16 cache, the relative error
of the attention output computed with the model's real queries (lossless rows: 0, and the demo
checks every bit), and encode/decode throughput in MB/s of bf16 input, steady state: each is the
best of timed calls after one untimed warm-up call, which pays numba's compilation (or its disk
cache load) once per process; the notes give those first calls' total time and the machine. A
progress bar on stderr names the method being run.

Quantized rows run attention the way a kernel would: scores from the compressed keys
(``q.scores``) and the output from the compressed values (``q.weighted_sum``), never a bf16 copy.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from kvcodec.data import KVSample, attention_reference, load_kv_sample

COLUMNS = ["method", "kind", "bits_per_value", "ratio_vs_bf16", "attn_rel_err", "encode_MBps", "decode_MBps"]

_first_calls: list[float] = []  # wall seconds of every warm-up call of the current run_demo


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s "model name", else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def _timed(fn: Callable, repeat: int, budget_s: float = 0.5):
    """(result of the first call, best wall time of up to ``repeat`` further calls, stopping
    early once ``budget_s`` is spent). The first call is the warm-up that pays numba JIT
    compilation, which a user pays once per process (its time goes to ``_first_calls``)."""
    t_first = time.perf_counter()
    result = fn()
    _first_calls.append(time.perf_counter() - t_first)
    best = math.inf
    spent = 0.0
    for _ in range(max(repeat, 1)):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
        if spent > budget_s:
            break
    return result, best


def _subset(sample: KVSample, layers: list[int]) -> KVSample:
    """The sample restricted to some entries of axis 0 (for --quick)."""
    idx = torch.tensor(layers)
    return KVSample(
        keys=sample.keys[idx], values=sample.values[idx], queries=sample.queries[idx],
        keys_fp8pred=sample.keys_fp8pred[idx], values_fp8pred=sample.values_fp8pred[idx],
        layer_ids=[sample.layer_ids[i] for i in layers], token_ids=sample.token_ids, meta=dict(sample.meta),
    )


def _raw_mb(sample: KVSample) -> float:
    return 2 * sample.keys.numel() * 2 / 1e6  # keys + values, 2 bytes per bf16


def _bits(nbytes: int, sample: KVSample) -> float:
    return 8.0 * nbytes / (2 * sample.keys.numel())


def _row(method, kind, nbytes, sample, err, t_enc, t_dec) -> dict:
    bits = _bits(nbytes, sample)
    mb = _raw_mb(sample)
    return {
        "method": method,
        "kind": kind,
        "bits_per_value": bits,
        "ratio_vs_bf16": 16.0 / bits,
        "attn_rel_err": err,
        "encode_MBps": mb / t_enc if t_enc > 0 else None,  # None: not timed (the reference row)
        "decode_MBps": mb / t_dec if t_dec > 0 else None,
    }


# ------------------------------------------------------------------------------------------------
# Lossless rows


def _bit_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _zipnn_rows(sample: KVSample, repeat: int) -> list[dict]:
    """The published bf16 lossless peer, when installed (``pip install zipnn``; the bench extra)."""
    try:
        import zipnn
    except ImportError:
        return []
    raw = [t.contiguous().view(torch.int16).numpy().tobytes() for t in (sample.keys, sample.values)]
    coder = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    # zipnn overwrites the buffer it is given: hand it a fresh copy every call.
    blobs, t_enc = _timed(lambda: [bytes(coder.compress(bytearray(r))) for r in raw], repeat)
    back, t_dec = _timed(lambda: [bytes(coder.decompress(b)) for b in blobs], repeat)
    if back != raw:
        raise AssertionError("zipnn round trip differs")
    return [_row("zipnn (peer)", "lossless", sum(map(len, blobs)), sample, 0.0, t_enc, t_dec)]


def _lossless_rows(sample: KVSample, repeat: int, notes: list[str], progress=None) -> list[dict]:
    progress = progress or _NoProgress()
    rows = []
    progress.set_description("zstd")
    try:
        import zstandard
    except ImportError:  # a core dependency, but the demo must not die for a baseline
        zstandard = None
    if zstandard is not None:
        cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
        raw = [t.contiguous().view(torch.int16).numpy().tobytes() for t in (sample.keys, sample.values)]
        blobs, t_enc = _timed(lambda: [cctx.compress(r) for r in raw], repeat)
        back, t_dec = _timed(lambda: [dctx.decompress(b) for b in blobs], repeat)
        if back != raw:
            raise AssertionError("zstd round trip differs")
        rows.append(_row("zstd -3 (baseline)", "lossless", sum(map(len, blobs)), sample, 0.0, t_enc, t_dec))
    progress.update()

    progress.set_description("zipnn")
    rows += _zipnn_rows(sample, repeat)
    progress.update()

    import kvcodec
    from kvcodec.lossless import registry

    configs = [
        ("kvcodec planes", "planes", {}, None),
        ("kvcodec kvctx", "kvctx", {}, None),
        ("kvcodec predictive (FP8-weight model)", "predictive", {}, "fp8"),
    ]
    for label, codec, opts, pred in configs:
        progress.set_description(label)
        progress.update()
        if not registry.has(codec):
            notes.append(f"{label}: codec {codec!r} is not available in this install")
            continue
        preds = (sample.keys_fp8pred, sample.values_fp8pred) if pred == "fp8" else (None, None)
        pairs = list(zip((sample.keys, sample.values), preds))
        try:
            blobs, t_enc = _timed(
                lambda: [kvcodec.compress(t, prediction=p, codec=codec, **opts) for t, p in pairs], repeat
            )
            outs, t_dec = _timed(lambda: [kvcodec.decompress(b, prediction=p) for b, (_, p) in zip(blobs, pairs)], repeat)
        except Exception as exc:  # a broken optional codec must not hide the others; say so
            notes.append(f"{label}: failed ({type(exc).__name__}: {exc})")
            continue
        if not all(_bit_exact(o, t) for o, (t, _) in zip(outs, pairs)):
            raise AssertionError(f"{label}: decompressed cache is not bit-exact")
        rows.append(_row(label, "lossless", sum(map(len, blobs)), sample, 0.0, t_enc, t_dec))
    return rows


# ------------------------------------------------------------------------------------------------
# Quantized rows (kvcodec.quant API: quantize / scores / weighted_sum / nbytes)


def _grouped_queries(sample: KVSample) -> torch.Tensor:
    """Queries [L, 9, n_q, D] -> [L, 3, 3 * n_q, D]: the GQA group of KV head h is query heads
    3h, 3h+1, 3h+2 (query head h uses KV head h // 3), stacked along the query axis."""
    L, hq, n_q, d = sample.queries.shape
    g = hq // sample.n_kv_heads
    return sample.queries.float().reshape(L, sample.n_kv_heads, g * n_q, d)


def _causal_mask(sample: KVSample) -> torch.Tensor:
    """[3 * n_q, T] True where the query may attend (query j sits at position T - n_q + j)."""
    t, n_q = sample.n_tokens, sample.n_q
    g = sample.n_q_heads // sample.n_kv_heads
    pos_q = torch.arange(t - n_q, t).repeat(g)
    return torch.arange(t)[None, :] <= pos_q[:, None]


def compressed_attention(sample: KVSample, kq, ck, vq, cv) -> torch.Tensor:
    """Attention output [L, 9, n_q, D] computed from compressed keys and values only."""
    qg = _grouped_queries(sample)
    scores = kq.scores(ck, qg).to(torch.float64) / math.sqrt(sample.head_dim)
    scores = scores.masked_fill(~_causal_mask(sample), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(torch.float32)
    out = vq.weighted_sum(cv, weights).to(torch.float64)
    return out.reshape(sample.queries.shape)


def _attention_error(sample: KVSample, out: torch.Tensor) -> float:
    num = den = 0.0
    for i in range(sample.n_layers):
        ref = attention_reference(sample, i)
        num += float((out[i] - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return math.sqrt(num / den)


def _paper_options(Q) -> dict:
    """Constructor options that make TurboQuantMSE the published algorithm exactly."""
    import inspect

    params = inspect.signature(Q.TurboQuantMSE.__init__).parameters
    opts = {}
    if "precondition" in params:
        opts["precondition"] = "none"
    if "norm_correction" in params:
        opts["norm_correction"] = False
    return opts


def quant_configs(quick: bool) -> list[tuple[str, Callable, Callable]]:
    """(label, key quantizer factory, value quantizer factory) for the quantizers installed.

    A factory takes the head dimension. Rows for a class that is not in ``kvcodec.quant`` are left
    out (never a made-up number). "kvcodec defaults" rows use the quantizers' defaults (per-channel
    centering and norm correction, see docs/quant.md); "paper" rows are TurboQuant as published."""
    try:
        import kvcodec.quant as Q
    except ImportError:
        return []
    has = lambda *names: all(hasattr(Q, n) for n in names)  # noqa: E731
    configs = []
    for b in (4,) if quick else (2, 3, 4):
        if has("TurboQuantMSE"):
            configs.append((
                f"TurboQuant-MSE {b}b (kvcodec defaults)",
                lambda d, b=b: Q.TurboQuantMSE(d, b, seed=0),
                lambda d, b=b: Q.TurboQuantMSE(d, b, seed=1),
            ))
        if has("KIVI"):
            configs.append((
                f"KIVI {b}b (K per-channel, V per-token, group 32)",
                lambda d, b=b: Q.KIVI(b, 32, axis="channel"),
                lambda d, b=b: Q.KIVI(b, 32, axis="token"),
            ))
    if quick:
        return configs
    paper = _paper_options(Q)
    if has("TurboQuantMSE"):
        configs.append(("TurboQuant-MSE 4b (paper)", lambda d: Q.TurboQuantMSE(d, 4, seed=0, **paper),
                        lambda d: Q.TurboQuantMSE(d, 4, seed=1, **paper)))
    if has("TurboQuantProd", "TurboQuantMSE"):
        configs.append(("TurboQuant-Prod 4b K, MSE 4b V (kvcodec defaults)", lambda d: Q.TurboQuantProd(d, 4, seed=0),
                        lambda d: Q.TurboQuantMSE(d, 4, seed=1)))
    if has("QJL", "TurboQuantMSE"):
        configs.append(("QJL m=4d K, TurboQuant-MSE 4b V", lambda d: Q.QJL(d, m=4 * d, seed=0),
                        lambda d: Q.TurboQuantMSE(d, 4, seed=1)))
    if has("TurboQuantOutlier"):
        for name in ("2.5", "3.5"):
            configs.append((f"TurboQuant outlier split '{name}-bit' (paper)",
                            lambda d, n=name: Q.TurboQuantOutlier.paper(d, n, seed=0),
                            lambda d, n=name: Q.TurboQuantOutlier.paper(d, n, seed=1)))
    return configs


def _quant_rows(sample: KVSample, quick: bool, repeat: int, notes: list[str], progress=None) -> list[dict]:
    """One row per quantizer config: true bytes of both compressed tensors, attention error from
    the compressed form, quantize (encode) and dequantize (decode) throughput."""
    progress = progress or _NoProgress()
    rows = []
    d = sample.head_dim
    keys, values = sample.keys, sample.values
    for label, make_k, make_v in quant_configs(quick):
        progress.set_description(label)
        progress.update()
        try:
            kq, vq = make_k(d), make_v(d)
            (ck, cv), t_enc = _timed(lambda: (kq.quantize(keys), vq.quantize(values)), repeat)
            _, t_dec = _timed(lambda: (kq.dequantize(ck), vq.dequantize(cv)), repeat)
            err = _attention_error(sample, compressed_attention(sample, kq, ck, vq, cv))
            nbytes = int(ck.nbytes) + int(cv.nbytes)
        except Exception as exc:  # report it instead of hiding the rest of the table
            notes.append(f"{label}: failed ({type(exc).__name__}: {exc})")
            continue
        rows.append(_row(label, "quantized", nbytes, sample, err, t_enc, t_dec))
    return rows


# ------------------------------------------------------------------------------------------------


class _NoProgress:
    def set_description(self, desc: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


def _progress(total: int):
    """A tqdm bar on stderr (one step per method; it starts with the warm-up of the first)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _NoProgress()
    return tqdm(total=total, desc="kvcodec demo", unit="method", file=sys.stderr, leave=False,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]")


def format_table(rows: list[dict], columns: list[str] = COLUMNS) -> str:
    def fmt(v):
        if v is None:
            return "n/a"
        if isinstance(v, float):
            if not math.isfinite(v):
                return "n/a"
            if v == 0:
                return "0"
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def run_demo(quick: bool = False, file=None) -> dict:
    """Run every available codec on the shipped sample, print the table; return
    ``{"rows", "columns", "notes"}`` (the rows are what ``benchmarks/report.py --demo`` stores)."""
    out = file or sys.stdout
    t0, c0 = time.perf_counter(), time.process_time()
    _first_calls.clear()
    sample = load_kv_sample()
    if quick:
        sample = _subset(sample, [0, sample.n_layers - 1])
    repeat = 1 if quick else 3
    notes: list[str] = []
    print(
        f"kvcodec demo: real {sample.meta.get('model', 'SmolLM2')} KV cache, layers {sample.layer_ids}, "
        f"{sample.n_kv_heads} KV heads x {sample.n_tokens} tokens x {sample.head_dim} dims (bf16), "
        f"attention error over {sample.n_q_heads} real query heads x last {sample.n_q} positions; "
        f"machine: {machine_line()}",
        file=out, flush=True,
    )
    rows = [_row("bf16 cache (reference)", "raw", 2 * sample.keys.numel() * 2, sample, 0.0, 0.0, 0.0)]
    progress = _progress(2 + 3 + len(quant_configs(quick)))  # zstd, zipnn, 3 kvcodec codecs, quantizers
    try:
        rows += _lossless_rows(sample, repeat, notes, progress)
        rows += _quant_rows(sample, quick, repeat, notes, progress)
    finally:
        if hasattr(progress, "close"):
            progress.close()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    notes.append(
        "bits_per_value counts every stored byte (codes, norms, scales, headers) over keys+values; "
        "attn_rel_err = ||O - O_ref|| / ||O_ref|| of causal GQA attention with the real queries "
        "(lossless rows are verified bit-exact); MB/s of bf16 input, best of up to "
        f"{repeat} timed calls after a warm-up call, one process; machine: {machine_line()}"
    )
    notes.append(f"demo total {elapsed:.1f} s wall, {cpu:.1f} s CPU; of it the warm-up calls (numba compilation on "
                 f"a first run, its disk cache after) {sum(_first_calls):.1f} s wall")
    print(format_table(rows), file=out)
    for n in notes:
        print(f"- {n}", file=out)
    return {"rows": rows, "columns": COLUMNS, "notes": notes}


if __name__ == "__main__":
    run_demo(quick="--quick" in sys.argv)
