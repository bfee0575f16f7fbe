"""Model-driven range coding: kvcodec's numba range coder vs constriction, one core, same run.

Two cases:
  * per-symbol quantized Gaussians (random means and scales, alphabet [-32768, 32767]):
    encode/decode in M symbols/s and bits/symbol against the ideal -log2 P(x) of the exact
    (float) quantized Gaussian; kvcodec's timings include building the model from the float
    parameters (constriction takes them at coding time);
  * a static categorical model on 8-bit data with entropy ~5 bits: MB/s.

Run: ``python benchmarks/bench_entropy_models.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import best_time, constriction_categorical, save  # noqa: E402

from kvcodec.entropy import models  # noqa: E402
from kvcodec.entropy import range_coder_fast as rc  # noqa: E402

LO, HI = -32768, 32767


def gaussian_case(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mean = rng.normal(0.0, 300.0, n)
    std = np.exp(rng.uniform(np.log(0.5), np.log(2000.0), n))
    x = np.clip(np.rint(rng.normal(mean, std)), LO, HI).astype(np.int32)
    return x, mean, std


def exact_gaussian_bits(x, mean, std) -> float:
    """-log2 of the exact quantized-Gaussian mass of each symbol (float64, via torch's ndtr)."""
    import torch

    xs = torch.from_numpy(x.astype(np.float64))
    mu, sd = torch.from_numpy(mean), torch.from_numpy(std)
    hi = torch.special.log_ndtr((xs + 0.5 - mu) / sd)
    lo = torch.special.log_ndtr((xs - 0.5 - mu) / sd)
    logp = hi + torch.log1p(-torch.exp(lo - hi))
    return float(-(logp.sum() / np.log(2.0)))


def _row(coder, case, n, enc_s, dec_s, nbytes, ideal_bits, unit="Msym/s", scale=1e6):
    return {
        "case": case,
        "coder": coder,
        "n": n,
        f"encode {unit}": n / enc_s / scale,
        f"decode {unit}": n / dec_s / scale,
        "bits/sym": 8.0 * nbytes / n,
        "overhead %": 100.0 * (8.0 * nbytes - ideal_bits) / ideal_bits,
    }


def bench_gaussian(n: int, repeat: int) -> list[dict]:
    x, mean, std = gaussian_case(n)
    ideal = exact_gaussian_bits(x, mean, std)
    rows = []

    def kv_encode():
        return rc.encode(x, models.Gaussian(mean, std, LO, HI))

    payload = kv_encode()

    def kv_decode():
        return rc.decode(payload, models.Gaussian(mean, std, LO, HI), n)

    assert np.array_equal(kv_decode(), x)
    rows.append(_row("kvcodec range (numba)", "gaussian", n, best_time(kv_encode, repeat=repeat), best_time(kv_decode, repeat=repeat), len(payload), ideal))
    own = models.Gaussian(mean, std, LO, HI).ideal_bits(x)
    notes = [f"gaussian: kvcodec's own integer model ideal = {own / n:.4f} bits/sym, exact law = {ideal / n:.4f}"]
    try:
        import constriction
    except ImportError:
        return rows, notes + ["constriction not installed: peer rows skipped"]
    family = constriction.stream.model.QuantizedGaussian(LO, HI)

    def c_range_encode():
        enc = constriction.stream.queue.RangeEncoder()
        enc.encode(x, family, mean, std)
        return enc.get_compressed()

    comp = c_range_encode()

    def c_range_decode():
        return constriction.stream.queue.RangeDecoder(comp).decode(family, mean, std)

    assert np.array_equal(c_range_decode(), x)
    rows.append(_row("constriction range", "gaussian", n, best_time(c_range_encode, repeat=repeat), best_time(c_range_decode, repeat=repeat), comp.nbytes, ideal))

    def c_ans_encode():
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(x, family, mean, std)
        return coder.get_compressed()

    comp_ans = c_ans_encode()

    def c_ans_decode():
        return constriction.stream.stack.AnsCoder(comp_ans).decode(family, mean, std)

    assert np.array_equal(c_ans_decode(), x)
    rows.append(_row("constriction ANS", "gaussian", n, best_time(c_ans_encode, repeat=repeat), best_time(c_ans_decode, repeat=repeat), comp_ans.nbytes, ideal))
    return rows, notes


def static_case(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    p = np.exp(-np.arange(256) / 22.0)  # entropy about 5 bits
    p /= p.sum()
    x = rng.choice(256, n, p=p).astype(np.uint8)
    return x, p


def bench_static(n: int, repeat: int) -> list[dict]:
    x, p = static_case(n)
    freqs = models.quantize_probs(p, 16).astype(np.uint32)
    q = freqs / float(1 << 16)
    ideal = float(-np.log2(q[x]).sum())
    payload = rc.encode_static(x, freqs, 16)
    assert np.array_equal(rc.decode_static(payload, freqs, 16, n), x)
    rows = [
        _row(
            "kvcodec range (numba)",
            "static 8-bit",
            n,
            best_time(lambda: rc.encode_static(x, freqs, 16), repeat=repeat),
            best_time(lambda: rc.decode_static(payload, freqs, 16, n), repeat=repeat),
            len(payload),
            ideal,
            unit="MB/s",
        )
    ]
    for name, nbytes, te, td in constriction_categorical(x.astype(np.int32), p, repeat):
        rows.append(_row(name, "static 8-bit", n, te, td, nbytes, ideal, unit="MB/s"))
    return rows


def run(quick: bool = False, out_dir: str = "benchmarks/results") -> dict:
    n_gauss = 200_000 if quick else 2_000_000
    n_static = 500_000 if quick else 4_000_000
    repeat = 2 if quick else 3
    rows, notes = bench_gaussian(n_gauss, repeat)
    rows += bench_static(n_static, repeat)
    notes += [
        "one thread each; best of %d; timings on a shared machine are provisional" % repeat,
        "overhead %: coded size over the ideal -log2 P(x) (gaussian: exact float law; static: the 16-bit table)",
    ]
    result = {"suite": "bench_entropy_models", "rows": rows, "notes": notes}
    columns = ["case", "coder", "n", "encode Msym/s", "decode Msym/s", "encode MB/s", "decode MB/s", "bits/sym", "overhead %"]
    save(result, out_dir, columns)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    run(quick=args.quick, out_dir=args.out)
