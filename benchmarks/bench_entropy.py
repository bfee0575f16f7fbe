"""Static entropy coders vs peers: size over the Shannon entropy, encode/decode speed, one core.

Data: (1) bytes from a rounded Laplace source (entropy ~5.1 bits), (2) the real SmolLM2 KV
sample's bf16 bit patterns as uint16 symbols (when ``kvcodec.data`` has it), (3) bf16 N(0, 1)
bit patterns as uint16 symbols.
Rows: kvcodec rans (1, 8 and 32 states; 8 is the default), tans, arith (range coder), constriction's stack ANS and
range coder (categorical model over the used symbols), zstd -3 and -19. Speeds are MB/s of
symbol data (1 byte per uint8 symbol, 2 per uint16), best of several runs, numba and torch on
one thread. Sizes include each coder's header/model (kvcodec: the full self-describing stream).

Run: ``python benchmarks/bench_entropy.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # a source checkout without pip install
from common import best_time, constriction_categorical, save  # noqa: E402

from kvcodec import entropy  # noqa: E402

SUITE = "bench_entropy"


def laplace_bytes(n: int, scale: float = 5.9, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).laplace(0.0, scale, n)
    return np.clip(np.round(v), -128, 127).astype(np.int8).view(np.uint8)


def kv_symbols() -> np.ndarray | None:
    """The real SmolLM2 KV sample's bf16 bit patterns (keys then values), or None without it.

    Used as is (about 0.8 M symbols), never tiled: repeats would flatter dictionary coders."""
    try:
        import torch

        from kvcodec.data import load_kv_sample

        s = load_kv_sample()
    except Exception:
        return None
    parts = [t.contiguous().view(torch.int16).numpy().view(np.uint16).ravel() for t in (s.keys, s.values)]
    return np.concatenate(parts)


def bf16_normal(n: int) -> np.ndarray:
    """bf16 N(0, 1) bit patterns (round to nearest even), as uint16 symbols."""
    bits = np.random.default_rng(0).standard_normal(n).astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _kvcodec_rows(x, repeat):
    configs = [
        ("kvcodec rans x1", dict(coder="rans", streams=1)),
        ("kvcodec rans x8", dict(coder="rans", streams=8)),
        ("kvcodec rans x32", dict(coder="rans", streams=32)),
        ("kvcodec tans", dict(coder="tans")),
        ("kvcodec arith", dict(coder="arith")),
    ]
    for name, kw in configs:
        try:
            blob = entropy.encode(x, **kw)
            assert np.array_equal(entropy.decode(blob), x)
        except Exception as exc:  # e.g. the range coder missing: report, do not fake
            yield name, None, None, None, f"failed: {exc!r}"[:120]
            continue
        te = best_time(lambda: entropy.encode(x, **kw), repeat=repeat)
        td = best_time(lambda: entropy.decode(blob), repeat=repeat)
        yield name, len(blob), te, td, f"header {entropy.inspect(blob).header_len} B"


def _constriction_rows(x, repeat):
    # The rank mapping (np.unique) is done once and not timed; the model is not counted.
    used, ranks = np.unique(x, return_inverse=True)
    ranks = ranks.astype(np.int32)
    probs = np.bincount(ranks, minlength=used.size).astype(np.float64) / x.size
    for name, nbytes, te, td in constriction_categorical(ranks, probs, repeat):
        yield name, nbytes, te, td, "model not counted"


def _zstd_rows(x, repeat):
    try:
        import zstandard
    except ImportError:
        return
    raw = x.tobytes()
    for level in (3, 19):
        cctx = zstandard.ZstdCompressor(level=level, threads=0)
        comp = cctx.compress(raw)
        dctx = zstandard.ZstdDecompressor()
        assert dctx.decompress(comp) == raw
        te = best_time(lambda: cctx.compress(raw), repeat=1 if level == 19 else repeat)
        td = best_time(lambda: dctx.decompress(comp), repeat=repeat)
        yield f"zstd -{level}", len(comp), te, td, ""


def run(quick: bool = False, out_dir: str = "benchmarks/results") -> dict:
    """Run the suite (``quick``: 1 MiB / 0.5 M-symbol inputs, 2 repeats) and save JSON + table."""
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    n8 = (1 << 20) if quick else (8 << 20)
    n16 = (1 << 19) if quick else (4 << 20)
    repeat = 2 if quick else 5
    datasets = [("Laplace bytes (uint8)", laplace_bytes(n8))]
    kv = kv_symbols()
    if kv is not None:
        datasets.append(("SmolLM2 KV bf16 (uint16)", kv))
    datasets.append(("bf16 N(0,1) (uint16)", bf16_normal(n16)))
    rows = []
    for dname, x in datasets:
        a = 256 if x.dtype == np.uint8 else 65536
        h = entropy.entropy_bits(np.bincount(x, minlength=a))
        mb = x.nbytes / 1e6
        for gen in (_kvcodec_rows, _constriction_rows, _zstd_rows):
            for coder, size, te, td, note in gen(x, repeat):
                row = {"data": dname, "coder": coder, "entropy_bits": h, "symbols": x.size}
                if size is None:
                    row.update(bits_per_symbol=float("nan"), over_entropy_pct=float("nan"), payload_over_entropy_pct=float("nan"),
                               encode_MBps=float("nan"), decode_MBps=float("nan"))
                else:
                    bps = 8.0 * size / x.size
                    header = int(note.split()[1]) if note.startswith("header ") else 0
                    row["payload_over_entropy_pct"] = 100.0 * (8.0 * (size - header) / x.size / h - 1.0)
                    row.update(
                        bits_per_symbol=bps,
                        over_entropy_pct=100.0 * (bps / h - 1.0),
                        encode_MBps=mb / te,
                        decode_MBps=mb / td,
                    )
                row["note"] = note
                rows.append(row)
                print(f"{dname[:24]:24s} {coder:20s} {row['bits_per_symbol']:7.4f} b/s "
                      f"{row['over_entropy_pct']:+7.3f}%  enc {row['encode_MBps']:8.1f}  dec {row['decode_MBps']:8.1f} MB/s",
                      flush=True)
    result = {
        "suite": SUITE,
        "rows": rows,
        "notes": [
            "one core: numba kernels are single-threaded, torch.set_num_threads(1), zstd threads=0",
            "MB/s = megabytes of symbols (uint8: 1 B, uint16: 2 B) per second, best of runs",
            "kvcodec sizes are whole self-describing streams (header + frequency table + checksums); "
            "payload_over_entropy_pct leaves the header out (constriction's model is never counted)",
            "targets: rans within 0.5% of entropy, tans within 1.5%; fast decode >= 300 MB/s, encode >= 200 MB/s",
        ],
    }
    save(result, out_dir, columns=["data", "coder", "bits_per_symbol", "over_entropy_pct", "payload_over_entropy_pct", "encode_MBps", "decode_MBps", "note"])
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    run(quick=args.quick, out_dir=args.out)
