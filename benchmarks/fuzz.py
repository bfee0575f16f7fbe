"""Mutation fuzzer for kvcodec's decoders: hostile input must raise CorruptStreamError.

Each *target* is one public decode entry point with a few small valid samples. A case takes a
sample, applies one random mutation and runs the entry point; its outcome is one of

- ``corrupt``: CorruptStreamError (the documented refusal);
- ``identical``: decoded to exactly the sample's content (e.g. a mutated JSON spacing);
- ``valid``: decoded, and the result re-encodes to exactly the *mutated* input, i.e. the mutation
  produced another well-formed file (formats with no checksum of their content: quantized codes,
  a cache's saved tensors); the result is also used (dequantized / materialized) without error;
- ``other``: any other exception (a bug: the decoder trusted something it should have checked);
- ``timeout``: the case used more than ``--case-seconds`` of CPU (default 2 s);
- ``memory``: MemoryError / an allocation refused by the worker's RLIMIT_AS, or a hard kill.

Mutations are structural where the format has structure, with every checksum recomputed so the
decoders themselves are reached: JSON header fields of any container (nested ones too) replaced
by huge / negative / wrong-type values or their neighbours, keys dropped or added, section bytes
flipped, entropy-stream header fields rewritten (the symbol count, table, payload length) with
both CRCs fixed, ``.kvc`` records and index entries mutated with record checksums, offsets and
the footer fixed, zstd frames that declare 2^40 bytes; plus plain bit flips and truncations.

Run: ``python benchmarks/fuzz.py --minutes 30`` (workers are subprocesses, one per target, each
under RLIMIT_AS and a per-case CPU limit); writes ``benchmarks/results/fuzz.{json,md}``.
The hypothesis tests in ``tests/test_fuzz.py`` drive the same targets and mutations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import struct
import sys
import tempfile
import time
import warnings
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvcodec import container  # noqa: E402
from kvcodec.errors import CorruptStreamError  # noqa: E402

OUTCOMES = ("corrupt", "identical", "valid", "other", "timeout", "memory")
GOOD = ("corrupt", "identical", "valid")
#: What the fuzzed decoders may produce: small samples, so anything above is an over-allocation.
FUZZ_MAX_OUTPUT = 64 << 20

HOSTILE = [
    -1, -(2**31), -(2**63), 0, 1, 2, 3, 7, 255, 256, 4095, 4096, 65535, 65536, 2**24, 2**31 - 1, 2**31,
    2**32, 2**40, 2**62, 2**63, 2**64, 10**30, 10**400, 0.5, 1.5, -0.0, 1e308, "", "x", "bfloat16",
    "float4_e2m1fn_x2", "int64", "uint8", "bool", "complex32", "float8_e4m3fn", "torch", "numpy", "bytes",
    "tensor", "raw", "rans", "planes", "kvctx", None, True, False, [], [0], [2**40, 2**40], [1] * 17,
    [[[[[]]]]], {}, {"a": 1}, [2**31, 2**31, 2**31],
]


# ----------------------------------------------------------------------------- JSON mutation
def _paths(obj, prefix=()):
    """Every path (tuple of keys / indices) to a value inside a JSON object, the root excluded."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            if len(out) < 4000:
                out.extend(_paths(v, prefix + (i,)))
    return out


def _neighbour(rng: random.Random, v):
    if type(v) is int:
        return rng.choice([v + 1, v - 1, v * 2, v // 2, -v, v + 2**32, v * 2**20, 0, v ^ (1 << rng.randrange(64))])
    if type(v) is float:
        return rng.choice([v * 2, -v, int(v), v + 1])
    if type(v) is str:
        return rng.choice([v[:-1], v + "x", v.upper(), v * 2, ""])
    if type(v) is list:
        return rng.choice([v[:-1], v + v[-1:], v[::-1], [v], v * 2])
    if type(v) is bool:
        return not v
    return rng.choice(HOSTILE)


def mutate_json(rng: random.Random, obj):
    """A deep copy of ``obj`` with one field replaced, dropped, duplicated or added."""
    obj = json.loads(json.dumps(obj))
    paths = _paths(obj)
    if not paths:
        obj["x"] = rng.choice(HOSTILE)
        return obj
    path = rng.choice(paths)
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1]
    op = rng.random()
    if op < 0.45:
        parent[key] = _neighbour(rng, parent[key])
    elif op < 0.8:
        parent[key] = rng.choice(HOSTILE)
    elif op < 0.9:
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif isinstance(parent, dict):
        parent[rng.choice(["x", str(key) + "_", "dtype", "shape"])] = rng.choice(HOSTILE)
    else:
        parent.insert(key, parent[key])
    return obj


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flip, set, insert or delete a few bytes (no checksum fix-up)."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        op = rng.random()
        if not b:
            b.append(rng.randrange(256))
        elif op < 0.5:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op < 0.75:
            b[rng.randrange(len(b))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif op < 0.88:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 4, 8])))
        else:
            i = rng.randrange(len(b))
            del b[i : i + rng.choice([1, 2, 4, 8])]
    return bytes(b)


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))] if data else data


# ----------------------------------------------------------------------------- containers
def raw_container(header, payloads: list[bytes], fix: bool = True) -> bytes:
    """Lay out a container from a (possibly hostile) header and section payloads.

    ``fix``: recompute each section's offset, nbytes and crc32 where the descriptor is a dict (so
    a mutated dtype or shape reaches the shape checks, not a checksum mismatch). The header crc
    is always recomputed.
    """
    sections = header.get("sections") if isinstance(header, dict) else None
    descs = [d for d in sections if isinstance(d, dict)] if isinstance(sections, list) else []
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    for _ in range(8):
        pos, layout = -(-(container.PREFIX.size + len(body)) // 64) * 64, []
        for i, p in enumerate(payloads):
            layout.append(pos)
            if fix and i < len(descs):
                descs[i]["offset"], descs[i]["nbytes"], descs[i]["crc32"] = pos, len(p), zlib.crc32(p)
                if descs[i].get("type") == "bytes" and isinstance(descs[i].get("shape"), list):
                    descs[i]["shape"] = [len(p)]  # a bytes section resized by a mutation
            pos = -(-(pos + len(p)) // 64) * 64
        new = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
        if new == body:
            break
        body = new
    prefix = struct.pack("<4sHHI", container.MAGIC, container.VERSION, 0, len(body))
    out = bytearray(prefix + struct.pack("<I", zlib.crc32(body, zlib.crc32(prefix))) + body)
    for off, p in zip(layout, payloads):
        out += bytes(max(off - len(out), 0))
        out += p
    return bytes(out)


def split_container(blob: bytes) -> tuple[dict, list[bytes]]:
    header, mv = container.read_header(blob)
    return header, [bytes(mv[d["offset"] : d["offset"] + d["nbytes"]]) for d in header["sections"]]


def mutate_container(rng: random.Random, blob: bytes, depth: int = 0) -> bytes:
    """One structural mutation of a container with every checksum recomputed; recurses into
    sections that are containers themselves (saved cache layers, lossless rows)."""
    header, payloads = split_container(blob)
    op = rng.random()
    nested = [i for i, p in enumerate(payloads) if p[:4] == container.MAGIC]
    if nested and depth < 3 and op < 0.35:
        i = rng.choice(nested)
        payloads[i] = mutate_container(rng, payloads[i], depth + 1)
        return raw_container(header, payloads)
    if payloads and op < 0.55:  # section content: reaches the codecs' own payload parsers
        i = rng.randrange(len(payloads))
        p = payloads[i]
        payloads[i] = mutate_bytes(rng, p) if rng.random() < 0.7 or not p else p[: rng.randrange(len(p))]
        return raw_container(header, payloads)
    if op < 0.62 and "meta" in header:
        sub = header["meta"]
        for key in ("codec_meta",):
            if isinstance(sub, dict) and isinstance(sub.get(key), dict) and rng.random() < 0.7:
                sub[key] = mutate_json(rng, sub[key])
                return raw_container(header, payloads)
    return raw_container(mutate_json(rng, header), payloads, fix=rng.random() < 0.85)


def unstructured(rng: random.Random, blob: bytes, u: float) -> bytes:
    """A truncation (u < 0.4) or raw byte flips, no checksum fixed: the decoder's first checks."""
    return truncate(rng, blob) if u < 0.4 else mutate_bytes(rng, blob)


def mutate_generic(rng: random.Random, blob: bytes) -> bytes:
    """A container mutation (most cases), else raw bit flips or a truncation."""
    r = rng.random()
    return mutate_container(rng, blob) if r < 0.75 else unstructured(rng, blob, (1 - r) / 0.25)


# ----------------------------------------------------------------------------- targets
class Target:
    """A decode entry point: valid samples, a mutator, and a check of what decoding returned."""

    name = ""

    def samples(self) -> list:
        raise NotImplementedError

    def mutate(self, rng: random.Random, sample) -> bytes:
        return mutate_generic(rng, sample[0])

    def run(self, sample, blob: bytes) -> str:
        """'identical' or 'valid'; raises whatever the entry point raises."""
        raise NotImplementedError


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class EntropyDecode(Target):
    name = "entropy.decode"

    @lru_cache(maxsize=1)
    def samples(self):
        from kvcodec import entropy

        rng = np.random.default_rng(0)
        out = []
        for coder in ("rans", "tans", "arith"):
            for dtype, n, alpha in ((np.uint8, 300, 12), (np.uint16, 200, 700), (np.uint8, 40, 2), (np.uint8, 5, 1)):
                x = np.minimum(rng.geometric(0.2, n) - 1, alpha - 1).astype(dtype)
                out.append((entropy.encode(x, coder=coder), x))
        out.append((entropy.encode(np.zeros(0, np.uint8)), np.zeros(0, np.uint8)))
        return out

    @staticmethod
    def _layout(blob: bytes):
        from kvcodec.entropy import stream

        header, payload = stream.parse(blob)
        hcrc = len(blob) - len(payload) - 8
        return hcrc

    def mutate(self, rng, sample):
        from kvcodec.entropy.stream import _put_varint

        blob = sample[0]
        r = rng.random()
        if r < 0.2:
            return unstructured(rng, blob, r / 0.2)
        hcrc = self._layout(blob)
        head, payload = bytearray(blob[:hcrc]), bytearray(blob[hcrc + 8 :])
        if r < 0.45:  # rewrite the symbol count (varint at offset 8) with a hostile one
            _, end = _varint(head, 8)
            v = bytearray()
            _put_varint(v, rng.choice([0, 1, 2, 2**31, 2**31 + 1, 2**32, 2**40, 2**63, 2**70, rng.randrange(2**34)]))
            head[8:end] = v
        elif r < 0.6:  # fixed fields: version, coder, dtype, param, streams
            head[rng.randrange(4, 8)] = rng.choice([0, 1, 2, 3, 4, 5, 12, 16, 17, 31, 32, 33, 255])
        elif r < 0.8:
            head = bytearray(mutate_bytes(rng, bytes(head)))
        else:
            payload = bytearray(mutate_bytes(rng, bytes(payload)) if payload else b"\0")
        # payload_len (the varint right before the crcs) follows the payload, unless that field was hit
        plen = bytearray()
        _put_varint(plen, len(payload))
        old = bytearray()
        _put_varint(old, len(blob) - hcrc - 8)
        if head.endswith(old):
            head[len(head) - len(old) :] = plen
        return bytes(head) + struct.pack("<II", zlib.crc32(head), zlib.crc32(payload)) + bytes(payload)

    def run(self, sample, blob):
        from kvcodec import entropy

        out = entropy.decode(blob, max_output_bytes=FUZZ_MAX_OUTPUT)
        x = sample[1]
        if out.dtype == x.dtype and np.array_equal(out, x):
            return "identical"
        again = _entropy_reencode(out, blob)
        if again == blob or _same_stream(again, blob):
            return "valid"
        return "different"


def _entropy_reencode(out: np.ndarray, blob: bytes) -> bytes:
    """The stream a writer makes for ``out`` with ``blob``'s own table and parameters.

    A mutated stream that decodes (its CRCs were recomputed, its coder ends in the right state)
    is another valid stream when this gives it back: the table need not be the one the encoder
    would have quantized, so re-encoding with ``entropy.encode`` alone would not.
    """
    from kvcodec import entropy
    from kvcodec.entropy import stream

    h = entropy.inspect(blob)
    if h.n == 0:
        return stream.pack(h.coder, h.dtype, 0, 0, 0, None, b"")
    payload = entropy._encode_payload(out, h.coder, "fast", h.freqs, h.param, h.streams)
    return stream.pack(h.coder, h.dtype, h.n, h.param, h.streams, h.freqs, bytes(payload))


def _same_stream(a: bytes, b: bytes) -> bool:
    """Same coder, parameters, frequencies and payload: only the table's byte encoding differs
    (the reader accepts a table mode other than the shortest one the writer picks)."""
    from kvcodec.entropy import stream

    (ha, pa), (hb, pb) = stream.parse(a), stream.parse(b)
    same_table = (ha.freqs is None and hb.freqs is None) or (
        ha.freqs is not None and hb.freqs is not None and np.array_equal(ha.freqs, hb.freqs))
    return (ha.coder, ha.dtype, ha.n, ha.param, ha.streams) == (hb.coder, hb.dtype, hb.n, hb.param, hb.streams) \
        and same_table and bytes(pa) == bytes(pb)


def _varint(buf, pos):
    v, shift = 0, 0
    while pos < len(buf):
        b = buf[pos]
        v |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            break
        shift += 7
    return v, pos


class TensorDecompress(Target):
    name = "kvcodec.decompress"

    @lru_cache(maxsize=1)
    def samples(self):
        from kvcodec.lossless import api

        g = torch.Generator().manual_seed(0)
        kv = (torch.randn(1, 2, 40, 16, generator=g) * 0.5).to(torch.bfloat16)
        tensors = [
            (kv, {}), (kv, {"layout": "kv"}), (torch.randn(300, generator=g).to(torch.float32), {}),
            (torch.randn(8, 33, generator=g).to(torch.float16), {}), (torch.zeros(4096, dtype=torch.bfloat16), {}),
            (torch.randint(-5, 5, (64,), generator=g, dtype=torch.int32), {}), (torch.empty(0, 3), {}),
        ]
        out = []
        for t, opts in tensors:
            try:
                out.append((api.compress(t, **opts), t))
            except (ValueError, KeyError):
                pass
        return out

    def run(self, sample, blob):
        from kvcodec.lossless import api

        out = api.decompress(blob, device="cpu", max_output_bytes=FUZZ_MAX_OUTPUT)
        return "identical" if _equal_bits(out, sample[1]) else "different"


class QuantFromBytes(Target):
    name = "QuantizedTensor.from_bytes"

    @lru_cache(maxsize=1)
    def samples(self):
        from kvcodec.quant import KIVI, QJL, TurboQuantMSE, TurboQuantProd
        from kvcodec.quant.outliers import TurboQuantOutlier

        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 3, 9, 16, generator=g)
        qs = [TurboQuantMSE(16, 3), TurboQuantProd(16, 3), QJL(16, m=32), KIVI(2, group_size=4, axis="channel", dim=16),
              KIVI(3, group_size=8, axis="token", dim=16), TurboQuantOutlier(16, 4, 4, 2), TurboQuantMSE(12, 2)]
        out = []
        for q in qs:
            xi = x if q.dim == 16 else torch.randn(2, 5, 12, generator=g)
            out.append((q.quantize(xi).to_bytes(),))
        return out

    def run(self, sample, blob):
        from kvcodec.quant.compressed import QuantizedTensor

        qt = QuantizedTensor.from_bytes(blob, max_output_bytes=FUZZ_MAX_OUTPUT)
        again = qt.to_bytes()
        if again == sample[0]:
            return "identical"
        qt.dequantize()  # a well-formed tensor must be usable
        return "valid" if again == blob else "different"


class KvcFile(Target):
    name = ".kvc file (decompress_file)"

    @lru_cache(maxsize=1)
    def samples(self):
        from safetensors.torch import save_file

        from kvcodec.lossless.files import compress_file

        g = torch.Generator().manual_seed(2)
        tmp = Path(tempfile.mkdtemp(prefix="kvcfuzz"))
        out = []
        sets = [
            {"w": (torch.randn(64, 40, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(7, generator=g)},
            {"a": torch.randn(1100, generator=g), "i": torch.arange(3000, dtype=torch.int16), "z": torch.zeros(2048, dtype=torch.float16)},
            # small norm-like tensors: coded together in a group (format version 2)
            {f"n{i}": (1 + 0.05 * torch.randn(300, generator=g)).to(torch.bfloat16) for i in range(8)},
        ]
        for i, tensors in enumerate(sets):
            src, dst = tmp / f"s{i}.safetensors", tmp / f"s{i}.kvc"
            save_file(tensors, str(src), metadata={"k": "v"})
            compress_file(src, dst, threads=1, progress=False)
            out.append((dst.read_bytes(), src.read_bytes()))
        return out

    def mutate(self, rng, sample):
        blob = sample[0]
        r = rng.random()
        if r < 0.18:
            return unstructured(rng, blob, r / 0.18)
        ioff, ilen = struct.unpack_from("<QQ", blob, len(blob) - 16)
        index = blob[ioff : ioff + ilen]
        header, payloads = split_container(index)
        entries = header["meta"]["entries"]
        records = [blob[e["offset"] : e["offset"] + e["length"]] for e in entries]
        if r < 0.4:  # a record: a tensor blob container, or raw bytes
            i = rng.randrange(len(records))
            rec = records[i]
            records[i] = mutate_generic(rng, rec) if rec[:4] == container.MAGIC else mutate_bytes(rng, rec)
        elif r < 0.5:  # the zstd'd safetensors header: garbage, or a frame declaring 2^40 bytes
            payloads[0] = _zstd_bomb(rng) if rng.random() < 0.5 else mutate_bytes(rng, payloads[0])
        elif r < 0.9:
            header = mutate_json(rng, header)
        else:  # footer fields
            return blob[:-16] + struct.pack("<QQ", *(rng.choice([ioff, ilen, 0, 2**63, 2**64 - 1, ioff + 1, len(blob)])
                                                     for _ in range(2)))
        return _kvc_layout(blob[:8], records, header, payloads, fix=rng.random() < 0.85)

    def run(self, sample, blob):
        from kvcodec.lossless.files import decompress_file, inspect_file

        d = Path(tempfile.mkdtemp(prefix="kvcf", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        src, dst = d / "in.kvc", d / "out.safetensors"
        try:
            src.write_bytes(blob)
            inspect_file(src)
            decompress_file(src, dst, threads=1, progress=False, max_output_bytes=FUZZ_MAX_OUTPUT)
            return "identical" if dst.read_bytes() == sample[1] else "different"
        finally:
            for p in (src, dst):
                p.unlink(missing_ok=True)
            d.rmdir()


def _zstd_bomb(rng: random.Random) -> bytes:
    """A zstd frame whose header declares a huge content size (2^33..2^56 bytes)."""
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)
    magic, fhd = frame[:4], frame[4]
    # frame header descriptor: content-size flag 3 (8-byte field), single segment off, keep the checksum flag
    fhd = (3 << 6) | (fhd & 0x04)
    size = 1 << rng.randrange(33, 57)
    rest = frame[5:]
    if not frame[4] & 0x20:  # the source frame has a window descriptor byte: keep it
        return magic + bytes([fhd]) + rest[:1] + struct.pack("<Q", size) + rest[1:]
    return magic + bytes([fhd]) + struct.pack("<Q", size) + rest


def _kvc_layout(head: bytes, records: list[bytes], header: dict, payloads: list[bytes], fix: bool) -> bytes:
    """A .kvc file from records and a (mutated) index header; ``fix`` recomputes each entry's
    offset, length and crc32 and the footer, so a mutation reaches the checks behind them."""
    meta = header.get("meta") if isinstance(header, dict) else None
    entries = meta.get("entries") if isinstance(meta, dict) else None
    pos = len(head)
    for i, rec in enumerate(records):
        if fix and isinstance(entries, list) and i < len(entries) and isinstance(entries[i], dict):
            entries[i].update(offset=pos, length=len(rec), crc32=zlib.crc32(rec))
        pos += len(rec)
    index = raw_container(header, payloads)
    return head + b"".join(records) + index + struct.pack("<4sIQQ", b"KVCE", 0, pos, len(index))


class CacheLoad(Target):
    name = "CompressedCache.load"

    @lru_cache(maxsize=1)
    def samples(self):
        from transformers import LlamaConfig

        from kvcodec.hf import CompressedCache
        from kvcodec.hf.persist import cache_to_bytes

        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        out = []
        runs = (("turboquant", 4, 40), ("kivi", 32, 40), ("qjl", 4, 20), ("none", 4, 20), ("lossless", 8, 12))
        for method, block, tokens in runs:
            cache = CompressedCache(cfg, method=method, residual=4, block_size=block, sink=1, key_bits=3)
            g = torch.Generator().manual_seed(3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for step in (tokens, 1):
                    for layer in range(2):
                        k, v = (torch.randn(2, 2, step, 16, generator=g).to(torch.bfloat16) for _ in range(2))
                        cache.update(k, v, layer)
                        cache.layers[layer].finish_step()
            out.append((cache_to_bytes(cache), cfg))
        return out

    def run(self, sample, blob):
        from kvcodec.hf import CompressedCache
        from kvcodec.hf.persist import cache_from_bytes, cache_to_bytes

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = cache_from_bytes(CompressedCache, blob, sample[1], max_output_bytes=FUZZ_MAX_OUTPUT)
            again = cache_to_bytes(cache)
            if again == sample[0]:
                return "identical"
            for layer in cache.layers:  # a well-formed cache must be usable
                if layer.store is not None:
                    layer.store.materialize(layer.dtype)
        return "valid" if again == blob else "different"


TARGETS = {t.name: t for t in (EntropyDecode(), TensorDecompress(), KvcFile(), QuantFromBytes(), CacheLoad())}


# ----------------------------------------------------------------------------- one case
class CaseTimeout(BaseException):
    """Raised by the CPU-time alarm; a BaseException so no decoder's ``except Exception`` swallows it."""


def run_case(target: Target, sample, blob: bytes) -> tuple[str, str]:
    """(outcome, detail) of decoding one mutated input."""
    try:
        result = target.run(sample, blob)
    except CorruptStreamError:
        return "corrupt", ""
    except CaseTimeout:
        return "timeout", ""
    except MemoryError as exc:
        return "memory", f"MemoryError: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - the point is to catch what the decoder let through
        msg = f"{type(exc).__name__}: {str(exc)[:300]}"
        if isinstance(exc, RuntimeError) and "allocate" in str(exc):
            return "memory", msg
        return "other", msg
    if result in ("identical", "valid"):
        return result, ""
    return "other", f"decoded to different content ({result})"


def case(target: Target, seed_or_rng) -> tuple[str, str, bytes]:
    """(outcome, detail, mutated input) of one case; a seed, or a random.Random (hypothesis's)."""
    rng = seed_or_rng if isinstance(seed_or_rng, random.Random) else random.Random(seed_or_rng)
    samples = target.samples()
    sample = samples[rng.randrange(len(samples))]
    blob = target.mutate(rng, sample)
    outcome, detail = run_case(target, sample, blob)
    return outcome, detail, blob


# ----------------------------------------------------------------------------- runner
def _limit_memory(extra_bytes: int) -> None:
    """RLIMIT_AS = what this process maps now + extra_bytes: a bigger allocation fails (MemoryError)."""
    import resource

    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_bytes, vm + extra_bytes))


def worker(name: str, seed0: int, count: int, case_seconds: float, mem_extra: int, out_path: str) -> None:
    """Run cases seed0 .. seed0+count-1 of one target; append one JSON line per case that is not
    'corrupt'/'identical' plus periodic counters to out_path."""
    import signal

    torch.set_num_threads(1)
    target = TARGETS[name]
    target.samples()
    for s in range(3):  # warm-up: numba compilation and lazy imports happen before the limits
        case(target, seed0 - 1 - s)
    _limit_memory(mem_extra)

    def on_alarm(*_):
        raise CaseTimeout()

    signal.signal(signal.SIGVTALRM, on_alarm)  # fires after case_seconds of this process's CPU time
    counts = {o: 0 for o in OUTCOMES}
    slowest, slowest_seed = 0.0, -1
    with open(out_path, "a") as out:
        for seed in range(seed0, seed0 + count):
            out.write(json.dumps({"start": seed}) + "\n")
            out.flush()
            t0 = time.process_time()
            signal.setitimer(signal.ITIMER_VIRTUAL, case_seconds)
            try:
                outcome, detail, blob = case(target, seed)
            except CaseTimeout:
                outcome, detail, blob = "timeout", "", b""
            finally:
                signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            dt = time.process_time() - t0
            if dt > slowest:
                slowest, slowest_seed = dt, seed
            if dt > case_seconds and outcome != "timeout":  # native code the alarm could not interrupt
                outcome, detail = "timeout", f"{outcome} after {dt:.2f} s CPU"
            counts[outcome] += 1
            if outcome not in ("corrupt", "identical"):
                out.write(json.dumps({"seed": seed, "outcome": outcome, "detail": detail, "cpu_s": round(dt, 3),
                                      "blob_len": len(blob)}) + "\n")
            if (seed - seed0) % 200 == 199 or seed == seed0 + count - 1:
                out.write(json.dumps({"counts": counts, "done": seed, "slowest_cpu_s": round(slowest, 3),
                                      "slowest_seed": slowest_seed}) + "\n")
                out.flush()


def _tally(path: Path) -> tuple[dict, tuple[float, int], list, int | None, int]:
    """(counts, (slowest case CPU s, its seed), bad cases, last case started, last case counted)."""
    counts, slowest, bad, last_start, done = {o: 0 for o in OUTCOMES}, (0.0, -1), [], None, -1
    block = {o: 0 for o in OUTCOMES}
    if not path.exists():
        return counts, slowest, bad, last_start, done
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "start" in rec:
            last_start = rec["start"]
        elif "counts" in rec:
            block = rec["counts"]
            slowest = max(slowest, (rec["slowest_cpu_s"], rec.get("slowest_seed", -1)))
            done = rec["done"]
        elif rec.get("outcome") not in (None, "valid"):
            bad.append(rec)
    return block, slowest, bad, last_start, done


def run(minutes: float, targets: list[str], case_seconds: float, mem_extra: int, out_dir: Path, parallel: int,
        hard_seconds: float) -> dict:
    """Run chunks of cases on ``parallel`` worker subprocesses until ``minutes`` pass, always
    starting the target that has had the least worker time so far (cheap decoders get more cases)."""
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="kvcodec-fuzz-"))
    totals = {t: {o: 0 for o in OUTCOMES} for t in targets}
    slowest = {t: (0.0, -1) for t in targets}
    examples = {t: [] for t in targets}
    next_seed = {t: 100_000_000 * (i + 1) for i, t in enumerate(targets)}
    chunk = 10000
    deadline = time.time() + minutes * 60
    running: list = []
    spent = {t: 0.0 for t in targets}  # worker wall seconds per target, finished chunks
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def launch(t, seed0, n):
        log = work / f"{abs(hash((t, seed0)))}.jsonl"
        cmd = [sys.executable, __file__, "--worker", t, "--seed0", str(seed0), "--count", str(n),
               "--case-seconds", str(case_seconds), "--mem-extra", str(mem_extra), "--log", str(log)]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return {"t": t, "p": p, "log": log, "seed0": seed0, "n": n, "last": None, "since": time.time(),
                "born": time.time()}

    def harvest(w, killed: bool, stopped: bool = False):
        """Add a finished (or killed) worker's counts; return the seed ranges still to run.
        ``stopped``: killed at the deadline, so the case in flight is simply not counted."""
        block, slow, bad, last_start, done = _tally(w["log"])
        t = w["t"]
        for o in OUTCOMES:
            totals[t][o] += block[o]
        slowest[t] = max(slowest[t], slow)
        examples[t].extend(bad[: 20 - len(examples[t])])
        resume = None
        if stopped:
            return []
        if killed or w["p"].returncode not in (0, None):
            # the case that was running when the worker died: a hard timeout or an uncatchable failure
            stuck = last_start if last_start is not None else w["seed0"]
            # cases between the last counter line and the stuck one finished: re-run them to count them
            lost_from = done + 1 if done >= w["seed0"] else w["seed0"]
            err = w["p"].stderr.read().decode(errors="replace")[-300:] if w["p"].stderr else ""
            outcome = "timeout" if killed else "memory"
            totals[t][outcome] += 1
            examples[t].append({"seed": stuck, "outcome": outcome, "detail": f"worker {'killed' if killed else 'died'}: {err}"})
            if lost_from < stuck:
                resume = (lost_from, stuck - lost_from)
            end = w["seed0"] + w["n"]
            if stuck + 1 < end:
                resume2 = (stuck + 1, end - stuck - 1)
                return [r for r in (resume, resume2) if r]
            return [resume] if resume else []
        return []

    pending: list = []
    while time.time() < deadline or running:
        while len(running) < parallel and time.time() < deadline:
            if pending:
                t, s0, n = pending.pop()
            else:
                busy = {t: spent[t] + sum(time.time() - w["born"] for w in running if w["t"] == t) for t in targets}
                t = min(targets, key=lambda t: busy[t])
                s0, n = next_seed[t], chunk
                next_seed[t] += chunk
            running.append(launch(t, s0, n))
        time.sleep(1.0)
        for w in list(running):
            rc = w["p"].poll()
            _, _, _, last_start, _ = _tally(w["log"]) if rc is None else (None, None, None, None, None)
            if rc is None and last_start != w["last"]:
                w["last"], w["since"] = last_start, time.time()
            stuck = rc is None and w["last"] is not None and time.time() - w["since"] > hard_seconds
            late = rc is None and time.time() > deadline
            if stuck or late:
                w["p"].kill()
                w["p"].wait()
            if rc is not None or stuck or late:
                running.remove(w)
                spent[w["t"]] += time.time() - w["born"]
                for s0, n in harvest(w, killed=stuck, stopped=late and not stuck):
                    pending.append((w["t"], s0, n))
                if late:
                    pending.clear()
        if time.time() >= deadline:
            pending.clear()
    from benchmarks.common import machine_record

    result = {"suite": "fuzz", "machine": machine_record(), "minutes": minutes, "case_cpu_seconds": case_seconds, "memory_allowance_bytes": mem_extra,
              "max_output_bytes": FUZZ_MAX_OUTPUT, "hard_wall_seconds": hard_seconds, "targets": {}}
    for t in targets:
        n = sum(totals[t].values())
        bad = n - sum(totals[t][o] for o in GOOD)
        result["targets"][t] = {"cases": n, **totals[t], "bad": bad, "slowest_case_cpu_s": slowest[t][0],
                                "slowest_case_seed": slowest[t][1], "examples": examples[t][:20]}
    return result


def markdown(result: dict) -> str:
    lines = [
        "# Fuzzing the decoders (benchmarks/fuzz.py)",
        "",
        f"{result['minutes']:.0f} minutes; per-case CPU limit {result['case_cpu_seconds']} s; each worker under "
        f"RLIMIT_AS = its own size + {result['memory_allowance_bytes'] >> 20} MiB; decoders called with "
        f"max_output_bytes = {result['max_output_bytes'] >> 20} MiB.",
        "",
        "| entry point | cases | CorruptStreamError | identical | valid other input | other exception | timeout | memory | bad | slowest case (CPU s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, r in result["targets"].items():
        lines.append(f"| {t} | {r['cases']} | {r['corrupt']} | {r['identical']} | {r['valid']} | {r['other']} | "
                     f"{r['timeout']} | {r['memory']} | {r['bad']} | {r['slowest_case_cpu_s']:.2f} "
                     f"(seed {r.get('slowest_case_seed', '?')}) |")
    lines.append("")
    lines.append("'valid other input': the mutated bytes were themselves a well-formed file (decoding and "
                 "re-encoding gives them back exactly; an entropy stream counts when only its frequency table's "
                 "byte encoding differs), e.g. a changed quantization code; such formats carry no checksum of "
                 "their content.")
    for t, r in result["targets"].items():
        if r["examples"]:
            lines += ["", f"First bad cases of {t} (seed: outcome, detail):", ""]
            lines += [f"- {e.get('seed')}: {e.get('outcome')} {str(e.get('detail'))[:200]}" for e in r["examples"][:10]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated entry points")
    ap.add_argument("--case-seconds", type=float, default=2.0, help="CPU seconds allowed per case")
    ap.add_argument("--hard-seconds", type=float, default=60.0, help="wall seconds before a stuck worker is killed")
    ap.add_argument("--mem-extra", type=int, default=512 << 20, help="bytes a worker may map beyond its start size")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--seed0", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed0, args.count, args.case_seconds, args.mem_extra, args.log)
        return 0
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}; choose from {list(TARGETS)}")
    result = run(args.minutes, targets, args.case_seconds, args.mem_extra, Path(args.out), args.parallel,
                 args.hard_seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "fuzz.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
