"""KV quantizers on real SmolLM2 K/V/queries: true bits per value vs attention quality.

For every method and bit width: true bits/value (every tensor held, side data included), key
reconstruction error, attention-score error, attention-output relative error (keys quantized
alone, and keys + values), and top-16 attention recall, with the model's real queries
(GQA: query head h reads KV head h // 3, causal).

Protocol (the same for every row): per-(layer, head) calibration (channel means/scales, outlier
channels) uses the first half of the tokens and the first half of the queries only; every
metric is measured on the second half of the queries (so query-aware calibration is not
evaluated on the queries it saw). "+sink" rows keep token 0 (the attention sink) in bf16,
counted in the bytes; this is cache configuration, like the recent-token window.
Peers in the same run: PyPI ``turboquant`` 0.2.0 (its bytes as it holds them: uint8 indices +
fp32 norms), Hugging Face's QuantizedCache quanto backend (optimum-quanto), if installed.

Run: ``python benchmarks/bench_quant.py [--quick] [--out DIR]`` or
``python benchmarks/run.py --suite quant`` (results go to ``./kvcodec-bench-results`` unless
``--out`` names another folder; the committed results are refreshed with ``--out benchmarks/results``).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import DEFAULT_OUT, save, pyplot  # noqa: E402

from kvcodec.data import load_kv_sample  # noqa: E402
from kvcodec.quant import KIVI, QJL, TurboQuantMSE, TurboQuantOutlier, TurboQuantProd  # noqa: E402

TOPK = 16


# ----------------------------------------------------------------------------- data and metrics
class Problem:
    """Real K/V/Q of some layers, the exact attention of the evaluation queries, calibration split."""

    def __init__(self, quick: bool):
        s = load_kv_sample(prefer_full=not quick)
        if quick:  # a smoke run: the first and the last layer of the shipped sample
            layers = [0, s.n_layers - 1]
        else:
            layers = list(range(s.n_layers)) if s.n_layers <= 8 else list(range(0, s.n_layers, 3))
        self.sample_note = f"{s.meta.get('model')} layers {[s.layer_ids[i] for i in layers]}, {s.n_tokens} tokens, {s.n_q} queries"
        self.K = s.keys[layers]  # bf16 [L, Hkv, T, D]
        self.V = s.values[layers]
        L, H, T, D = self.K.shape
        q = s.queries[layers].float()  # [L, Hq, nq, D], the last nq positions
        g = q.shape[1] // H
        nq = q.shape[2]
        half = nq // 2
        self.L, self.H, self.T, self.D, self.G = L, H, T, D, g
        fold = lambda t: t.reshape(L, H, g * t.shape[2], D)  # noqa: E731  [L, Hkv, G*n, D]
        self.q_calib = fold(q[:, :, :half])
        self.q_eval = fold(q[:, :, half:])
        pos = torch.arange(T - nq + half, T).repeat(g)  # position of each evaluation query
        self.mask = torch.arange(T).unsqueeze(0) > pos.unsqueeze(1)  # [G*n, T] True = masked
        self.calib_tokens = T // 2
        self.Kf, self.Vf = self.K.float(), self.V.float()
        self.ref_scores = self.scores(self.Kf)
        self.ref_p = torch.softmax(self.ref_scores, -1)
        self.ref_out = self.ref_p @ self.Vf
        self.ref_top = self.ref_scores.topk(TOPK, dim=-1).indices

    def scores(self, k: torch.Tensor) -> torch.Tensor:
        s = self.q_eval @ k.transpose(-1, -2) / math.sqrt(self.D)
        return s.masked_fill(self.mask, float("-inf"))

    def evaluate(self, k_hat=None, v_hat=None) -> dict:
        out = {}
        if k_hat is not None:
            k_hat = k_hat.float()
            s = self.scores(k_hat)
            vis = ~self.mask.expand_as(s)
            out["key_rel_mse"] = float((k_hat - self.Kf).pow(2).sum() / self.Kf.pow(2).sum())
            out["score_rel_err"] = float((s - self.ref_scores)[vis].norm() / self.ref_scores[vis].norm())
            top = s.topk(TOPK, dim=-1).indices
            hit = (top.unsqueeze(-1) == self.ref_top.unsqueeze(-2)).any(-1).float()
            out[f"top{TOPK}_recall"] = float(hit.mean())
            o = torch.softmax(s, -1) @ self.Vf
            out["attn_err_K"] = float((o - self.ref_out).norm() / self.ref_out.norm())
        if v_hat is not None:
            kk = self.Kf if k_hat is None else k_hat
            o = torch.softmax(self.scores(kk), -1) @ v_hat.float()
            out["attn_err_KV" if k_hat is not None else "attn_err_V"] = float((o - self.ref_out).norm() / self.ref_out.norm())
        return out


# ----------------------------------------------------------------------------- codecs
def kvcodec_codec(quantizer, sink: bool, calib: str = "plain"):
    """Quantize with a kvcodec quantizer; calibrate on the first half; optionally keep token 0 in bf16."""

    def run(x: torch.Tensor, prob: Problem, is_key: bool):
        head = x[..., :1, :] if sink else x[..., :0, :]
        body = x[..., 1:, :] if sink else x
        cal = body[..., : prob.calib_tokens, :]
        if calib == "query" and is_key:
            pre = quantizer.calibrate(cal, queries=prob.q_calib)
        elif isinstance(quantizer, TurboQuantOutlier):
            pre = quantizer.calibrate(cal)
        elif hasattr(quantizer, "calibrate"):
            pre = quantizer.calibrate(cal)
        else:
            pre = None
        c = quantizer.quantize(body, precond=pre)
        xh = quantizer.dequantize(c)
        return torch.cat([head.float(), xh], dim=-2), c.nbytes + head.numel() * 2

    return run


def pypi_turboquant_codec(bits: int, ip: bool = False):
    """PyPI turboquant 0.2.0 (numpy-2.4 np.trapz crash patched here only); bytes as it holds them."""
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid
    from turboquant.core import TurboQuantIP
    from turboquant.core import TurboQuantMSE as PeerMSE

    def run(x: torch.Tensor, prob: Problem, is_key: bool):
        q = (TurboQuantIP if ip else PeerMSE)(prob.D, bits=bits, device="cpu", seed=0)
        xf = x.float()
        if ip:
            idx, norms, signs, rn = q.quantize(xf)
            xh = q.dequantize(idx, norms, signs, rn)
            nbytes = sum(t.numel() * t.element_size() for t in (idx, norms, signs, rn))
        else:
            idx, norms = q.quantize(xf)
            xh = q.dequantize(idx, norms)
            nbytes = sum(t.numel() * t.element_size() for t in (idx, norms))
        return xh, nbytes

    return run


def quanto_codec(bits: int):
    """transformers' QuantizedCache quanto backend (axis 0, group 64: its defaults), codes+scale+shift bytes."""
    from transformers.cache_utils import QuantoQuantizedLayer

    layer = QuantoQuantizedLayer(nbits=bits, axis_key=0, axis_value=0, q_group_size=64)

    def run(x: torch.Tensor, prob: Problem, is_key: bool):
        xh = torch.empty_like(x, dtype=torch.float32)
        nbytes = 0
        for i in range(x.shape[0]):
            qt = layer._quantize(x[i: i + 1].contiguous(), axis=0)
            xh[i: i + 1] = layer._dequantize(qt).float()
            nbytes += qt._data.numel() * bits // 8 + sum(t.numel() * t.element_size() for t in (qt._scale, qt._shift))
        return xh, nbytes

    return run


def methods(D: int, quick: bool = False) -> list[tuple]:
    """(method, nominal bits, key codec, value codec or None); ``quick``: 4-bit rows (and QJL m=2D) only."""
    rows = []
    for b in (4,) if quick else (2, 3, 4, 5):
        rows.append(("kvcodec TQ-MSE (center+normcorr) +sink", b,
                     kvcodec_codec(TurboQuantMSE(D, b), True), kvcodec_codec(TurboQuantMSE(D, b), True)))
        rows.append(("kvcodec TQ-MSE (query-aware scale) +sink", b,
                     kvcodec_codec(TurboQuantMSE(D, b, precondition="scale"), True, "query"),
                     kvcodec_codec(TurboQuantMSE(D, b), True)))
    for b in (4,) if quick else (2, 3, 4):
        rows.append(("kvcodec TQ-MSE (center+normcorr)", b,
                     kvcodec_codec(TurboQuantMSE(D, b), False), kvcodec_codec(TurboQuantMSE(D, b), False)))
        rows.append(("kvcodec TQ-MSE paper (plain)", b,
                     kvcodec_codec(TurboQuantMSE(D, b, precondition="none", norm_correction=False), False),
                     kvcodec_codec(TurboQuantMSE(D, b, precondition="none", norm_correction=False), False)))
        rows.append(("kvcodec TQ-Prod paper (plain)", b,
                     kvcodec_codec(TurboQuantProd(D, b, precondition="none", norm_correction=False), False),
                     kvcodec_codec(TurboQuantMSE(D, b, precondition="none", norm_correction=False), False)))
        rows.append(("kvcodec TQ-Prod (query-aware scale) +sink", b,
                     kvcodec_codec(TurboQuantProd(D, b, precondition="scale"), True, "query"),
                     kvcodec_codec(TurboQuantMSE(D, b), True)))
    for name in ("3.5",) if quick else ("2.5", "3.5"):
        rows.append(("kvcodec TQ outlier split (paper 2.5 / 3.5)", float(name),
                     kvcodec_codec(TurboQuantOutlier.paper(D, name), False),
                     kvcodec_codec(TurboQuantOutlier.paper(D, name), False)))
    for m in (2,) if quick else (1, 2, 3):
        rows.append(("kvcodec QJL, m = bits*D (keys only)", m, kvcodec_codec(QJL(D, m=m * D), False), None))
    for b in (4,) if quick else (2, 3, 4):
        rows.append(("KIVI g32 (K per-channel, V per-token)", b,
                     kvcodec_codec(KIVI(b, 32, "channel"), False), kvcodec_codec(KIVI(b, 32, "token"), False)))
        rows.append(("KIVI g32 +sink", b,
                     kvcodec_codec(KIVI(b, 32, "channel"), True), kvcodec_codec(KIVI(b, 32, "token"), True)))
    try:
        import scipy  # noqa: F401  (the PyPI peer needs it for its codebook)

        for b in (4,) if quick else (2, 3, 4):
            rows.append(("peer: PyPI turboquant 0.2.0 MSE", b, pypi_turboquant_codec(b), pypi_turboquant_codec(b)))
        for b in (4,) if quick else (3, 4):
            rows.append(("peer: PyPI turboquant 0.2.0 IP", b, pypi_turboquant_codec(b, ip=True), pypi_turboquant_codec(b)))
    except ImportError:
        pass
    try:
        import optimum.quanto  # noqa: F401

        for b in (4,) if quick else (2, 4):
            rows.append(("peer: HF QuantizedCache quanto", b, quanto_codec(b), quanto_codec(b)))
    except ImportError:
        pass
    return rows


# ----------------------------------------------------------------------------- run
def run(quick: bool = False, out_dir: str = DEFAULT_OUT) -> dict:
    torch.manual_seed(0)
    prob = Problem(quick)
    n_values = prob.K.numel()
    rows, notes = [], [
        f"data: {prob.sample_note}; calibration on the first {prob.calib_tokens} tokens and first half of the "
        f"queries, metrics on the other {prob.q_eval.shape[2] // prob.G} queries per head",
        "bits/value = every byte held * 8 / values (codes, norms, scales, side data, bf16 sink token)",
        "attn_err_K: keys quantized, values exact; attn_err_KV: both quantized (same family and bits)",
    ]
    for name, bits, kc, vc in methods(prob.D, quick):
        t0 = time.perf_counter()
        try:
            k_hat, kbytes = kc(prob.K, prob, True)
            row = {"method": name, "bits": bits, "K_bits_per_value": kbytes * 8 / n_values}
            v_hat = None
            if vc is not None:
                v_hat, vbytes = vc(prob.V, prob, False)
                row["V_bits_per_value"] = vbytes * 8 / n_values
            row.update(prob.evaluate(k_hat, v_hat))
        except Exception as e:  # a peer that fails is reported, not hidden
            row = {"method": name, "bits": bits, "error": f"{type(e).__name__}: {e}"[:200]}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{name:45s} b={bits}: " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)), flush=True)
    result = {"suite": "bench_quant", "quick": quick, "rows": rows, "notes": notes}
    cols = ["method", "bits", "K_bits_per_value", "V_bits_per_value", "key_rel_mse", "score_rel_err",
            f"top{TOPK}_recall", "attn_err_K", "attn_err_KV"]
    save(result, out_dir, columns=cols)
    plot(rows, Path(out_dir) / "bench_quant.png")
    return result


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    import matplotlib

    fig, axes = plt.subplots(1, 2, figsize=(13, 6.5))
    fams = list(dict.fromkeys(r["method"] for r in rows if "attn_err_K" in r))
    cmap = plt.get_cmap("tab20")
    color = {fam: cmap(i % 20) for i, fam in enumerate(fams)}  # one colour per method in both panels
    for fam in fams:
        rs = sorted((r for r in rows if r["method"] == fam and "attn_err_K" in r), key=lambda r: r["K_bits_per_value"])
        style = "--" if fam.startswith("peer") else ("-." if "KIVI" in fam else "-")
        axes[0].plot([r["K_bits_per_value"] for r in rs], [r["attn_err_K"] for r in rs], style, marker="o",
                     color=color[fam], label=fam)
        kv = [r for r in rs if "attn_err_KV" in r]
        if kv:
            axes[1].plot([(r["K_bits_per_value"] + r["V_bits_per_value"]) / 2 for r in kv],
                         [r["attn_err_KV"] for r in kv], style, marker="o", color=color[fam])
    for ax, title, xl in ((axes[0], "keys quantized (values exact)", "key bits/value (true, log scale)"),
                          (axes[1], "keys and values quantized", "mean K/V bits/value (true, log scale)")):
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 1.5, 2, 3, 4, 6, 8, 12, 16])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel(xl)
        ax.set_ylabel("attention output relative error")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="lower center", ncol=3, fontsize=7.5, frameon=False)
    fig.suptitle("SmolLM2-135M real KV: true bits vs attention-output error (lower-left is better)")
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4-bit rows on two layers: a smoke run")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default ./{DEFAULT_OUT})")
    args = ap.parse_args()
    run(quick=args.quick, out_dir=args.out)
