"""Why format 2 coded fp8 KV with a prediction in more bits than format 1, and the model change that
recovers it (built as format 2's "mag" flag, the default there: ``bins.magnitude_symbol``).

For real SmolLM2 KV cast to fp8 e4m3 (``kvcodec.lossless.fp8``) and coded against the fp8-weight
model's KV: bits per value of each format's sections (format 1: model, payload; format 2: model, rANS
payload, raw bits), then format 2's model replayed value by value as its encoder computes it (the
parameters fitted and stored as ``format2.encode`` does, each value's bin, class and symbol) for the
empirical H(symbol | class) of the symbols as coded and of the symbols counted in the direction of
increasing magnitude (``254 - symbol`` when mu's bin is negative; mu's position in its bin measured
the same way), with the same classes. The coded payload is within ~0.01 b/v of H(symbol | class).
``f2_mag_total``: the sections of format 2 as coded with the flag (``encode_tensor(..., mag=True)``).

Run: ``python benchmarks/fp8_symbol_direction.py [--layers N] [--full]`` (``--full``: the 30 x 2048
cache of ``make_kv_sample.py --full``, first N layers; default: the shipped 8 x 256 sample).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from common import save  # noqa: E402

from kvcodec.lossless.fp8 import fp8_prediction, to_fp8_kv  # noqa: E402
from kvcodec.lossless.predictive import codec as pcodec, format2  # noqa: E402
from kvcodec.lossless.predictive.binned import _mu_v  # noqa: E402
from kvcodec.lossless.predictive.bins import ESC, bin_grid, encode_value, float64_bits, locate, value_of  # noqa: E402
from kvcodec.lossless.predictive.grid import grid_for  # noqa: E402
from kvcodec.lossless.predictive.params import fit_params  # noqa: E402

COLUMNS = ["data", "tensor", "values", "f1_model", "f1_payload", "f1_total", "f2_model", "f2_rans", "f2_raw_bits",
           "f2_total", "H_sym_class", "H_sym_class_by_magnitude", "f2_by_magnitude_estimate", "f2_mag_total"]


@njit(cache=True)
def _replay(pats, pred, m, c, a, es, level, shared, tb, width, sign, mb, escape, inv_unit, cls_out, sym_out,
            cls_mag_out, sym_mag_out):
    """Every value's class and symbol as format 2's encoder computes them (``binned.symbolise``'s model),
    and both counted in the direction of increasing magnitude (mu's position and the symbol mirrored
    when mu's bin is negative)."""
    g_n, t_n, d_n = pats.shape
    eoff = 1023 - ((float64_bits(inv_unit) >> 52) & 0x7FF)
    i = 0
    for g in range(g_n):
        gp = 0 if shared else g
        for t0 in range(0, t_n, tb):
            dev = np.zeros(d_n)
            for t in range(t0, min(t_n, t0 + tb)):
                for d in range(d_n):
                    p = np.float64(pred[g, t, d])
                    base, mv = _mu_v(m[gp, d], c[gp, d], a[gp, d], p if np.isfinite(p) else 0.0, dev[d], inv_unit)
                    ep, centre, cls = locate(mv, es[gp, d], level[gp, d], mb, 0)
                    pat = np.int64(pats[g, t, d])
                    s, _, _ = encode_value(pat, ep, centre, width, sign, mb, escape[pat])
                    cls_out[i], sym_out[i] = cls, s
                    neg = centre < 0
                    # the class with mu's position mirrored back (locate measures it towards larger values)
                    _, _, cls_mag = locate(mv, es[gp, d], level[gp, d], mb, 1)
                    cls_mag_out[i] = cls_mag if neg else cls
                    sym_mag_out[i] = 254 - s if neg and s != ESC else s
                    dev[d] = 0.0 if s == ESC else value_of(pat, sign, mb, eoff) - base
                    i += 1


def conditional_entropy_bits(keys: np.ndarray, sym: np.ndarray) -> float:
    """sum over the values of -log2 p(sym | key), the empirical distribution (bits)."""
    _, joint = np.unique(keys.astype(np.int64) * 256 + sym, return_counts=True)
    _, marginal = np.unique(keys, return_counts=True)
    return float((marginal * np.log2(marginal)).sum() - (joint * np.log2(joint)).sum())


def tensor_row(data: str, name: str, x: torch.Tensor, p: torch.Tensor) -> dict:
    q, scale = to_fp8_kv(x)
    p8 = fp8_prediction(p, scale)
    n = q.numel()
    _, s1 = pcodec.encode_tensor(q, p8, "external", 0, version=1)
    _, s2 = pcodec.encode_tensor(q, p8, "external", 0, version=2, mag=False)
    _, s3 = pcodec.encode_tensor(q, p8, "external", 0, version=2, mag=True)
    bpv = {k: 8 * v.nbytes / n for k, v in {**{f"1{k}": v for k, v in s1.items()},
                                             **{f"2{k}": v for k, v in s2.items()}}.items()}
    grid, bg = grid_for(q.dtype), bin_grid(q.dtype)
    g, t, d = pcodec.kv_layout(tuple(q.shape))
    pats = q.reshape(-1).view(torch.uint8).numpy().reshape(g, t, d)
    pred = pcodec._prediction_f32(p8, g, t, d)
    tb = pcodec.token_block(t, d)
    bp = format2.BinParams.from_channel(fit_params(grid.k_of_bits[pats], pred, grid, tb, "one", "fit", t < 64,
                                                   shape=False), bg)
    out = [np.empty(n, np.int64) for _ in range(4)]
    _replay(pats, pred, *bp.kernel_args(bg), bp.shared, tb, bg.width, bg.sign, bg.mb, bg.escape, 2.0 ** -bg.eoff,
            *out)
    h = conditional_entropy_bits(out[0], out[1]) / n
    h_mag = conditional_entropy_bits(out[2], out[3]) / n
    f2 = bpv["2model"] + bpv["2payload"] + bpv["2bits"]
    return {"data": data, "tensor": name, "values": n, "f1_model": bpv["1model"], "f1_payload": bpv["1payload"],
            "f1_total": bpv["1model"] + bpv["1payload"], "f2_model": bpv["2model"], "f2_rans": bpv["2payload"],
            "f2_raw_bits": bpv["2bits"], "f2_total": f2, "H_sym_class": h, "H_sym_class_by_magnitude": h_mag,
            "f2_by_magnitude_estimate": f2 - (h - h_mag), "f2_mag_total": 8 * sum(v.nbytes for v in s3.values()) / n}


def run(full: bool, layers: int | None, out_dir: str) -> dict:
    from kvcodec.data import full_sample_location, load_kv_sample

    sample = load_kv_sample(full_sample_location()) if full else load_kv_sample()
    rows = []
    for name in ("keys", "values"):
        x, p = getattr(sample, name), getattr(sample, name + "_fp8pred")
        if layers:
            x, p = x[:layers].contiguous(), p[:layers].contiguous()
        rows.append(tensor_row(f"{'full' if full else 'sample'} {tuple(x.shape)}", name, x, p))
    notes = ["bits per value of raw fp8 values; sections only (no container); f2_by_magnitude_estimate = f2_total "
             "- (H_sym_class - H_sym_class_by_magnitude): the payload if the symbols were counted by magnitude; "
             "f2_mag_total: format 2 as coded with the flag (meta 'mag': 1)"]
    result = {"suite": "fp8_symbol_direction" + ("_full" if full else ""), "rows": rows, "notes": notes}
    save(result, out_dir, COLUMNS)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the full 30 x 2048 cache (make_kv_sample.py --full)")
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    run(args.full, args.layers, args.out)
