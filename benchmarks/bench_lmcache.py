"""LMCache L2 serdes on real SmolLM2 KV chunks: kvcodec's beside LMCache's own, in one run.

Data: SmolLM2-135M-Instruct (bf16, CPU) reads ``prefix`` tokens of ``smollm2.real_text``;
its post-RoPE K/V of all 30 layers are cut into LMCache chunks of 256 tokens in LMCache's layout
[2, layers, tokens, kv_heads * head_dim] (5.9 MB each). Every serde is built by LMCache's own
``create_serde_processor`` from the dict an L2 config would carry, and its sync serializer /
deserializer run on real LMCache ``TensorMemoryObj`` buffers. Reported per serde:

* ``bytes_per_token``: bytes LMCache's L2 holds per token (what ``serialize`` returns; for the
  kvcodec serdes that is the fixed slot), ``vs_naive`` = raw bf16 bytes / stored bytes;
  ``payload_vs_naive`` (kvcodec_lossless): what a store that accepted variable sizes would hold,
  ``min_chunk_ratio``: the worst chunk's raw / payload (a ``slot_ratio`` above it refuses chunks);
* ``ser_1c`` / ``deser_1c``: raw KV bytes per second (GB/s) on one CPU core (torch and kvcodec on
  one thread: ``torch.set_num_threads(1)``, serde ``threads=1``), ``ser_all`` / ``deser_all`` on
  every core (chunks on a thread pool of one worker per core, as LMCache's serde processor runs them
  with ``max_workers`` = cores; serde ``threads=0``; torch's own thread pool stays at one thread,
  since its OpenMP workers stall on a shared machine); best of ``repeat``. ``naive`` times a copy of the
  chunk's bytes (what moving them costs; without a serde LMCache's adapters write L1 bytes as they are);
* ``slot_ratio`` / ``refused_share`` (kvcodec_lossless, ``slot_ratio="auto"``): the slot chosen by
  ``calibrate_slots`` from the KV of *another* text (``calib_tokens`` tokens of the same model, from
  position 0: held out), and the share of the benchmark's chunks that did not fit it, ``fits``:
  chunks stored / chunks offered;
* ``attn_err``: relative error of the attention output of the last 64 real queries of the prefix
  over all layers (``kvcodec.data.causal_gqa_attention``, float64), ``ppl`` / ``ppl_delta_pct``: the
  next ``n_eval`` tokens scored with a DynamicCache filled from the round-tripped KV.

LMCache's ``turboquant`` presets run only on CUDA (Triton kernels; ``serialize`` refuses without a
GPU): their stored bytes come from their own ``estimate_serialized_size``. With ``--quick`` and
Triton importable under ``TRITON_INTERPRET=1``, their real kernels also run on the CPU through
Triton's interpreter (LMCache's device pick is pointed at the CPU for the call), which gives their
quality on the same chunk (no speed: it is an emulation). ``naive`` = no serde (raw bf16 bytes).

Run: ``python benchmarks/bench_lmcache.py --out benchmarks/results`` (SmolLM2 model, all layers) and
``TRITON_INTERPRET=1 python benchmarks/bench_lmcache.py --quick`` (the shipped 8-layer sample, no
model; suite ``bench_lmcache_quick``). Triton for the interpreter can live outside the environment:
``pip install --no-deps --target /tmp/tritonenv triton`` and ``PYTHONPATH=/tmp/tritonenv``. ``python benchmarks/bench_lmcache.py --cuda`` (needs a GPU; suite
``bench_lmcache_cuda``): the ``cuda_device`` serdes against the same serdes on every CPU core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402
from kvcodec.cache_argument import cache_kwargs  # noqa: E402

SUITE = "bench_lmcache"
CHUNK_TOKENS = 256
N_Q = 64
COLUMNS = ["serde", "config", "kind", "bytes_per_token", "vs_naive", "payload_vs_naive", "min_chunk_ratio", "slot_ratio",
           "refused_share", "fits", "ser_1c", "deser_1c", "ser_all", "deser_all", "bit_exact", "attn_err", "ppl",
           "ppl_delta_pct", "note"]


# ---------------------------------------------------------------------------------------- data
def model_kv(prefix: int, n_eval: int, calib_tokens: int):
    """(keys, values, queries [layers, heads, T, d] bf16, model, ids, calibration (keys, values)) from
    SmolLM2 on real text; the calibration K/V come from the text after the evaluated tokens."""
    import smollm2
    from kvcodec.recording import record_qkv

    model = smollm2.load_model()
    tok = smollm2.load_tokenizer()
    all_ids = tok(smollm2.real_text("mixed"), return_tensors="pt").input_ids
    ids = all_ids[:, : prefix + n_eval]

    def kv(window):
        rec = record_qkv(model, window)
        stack = lambda part: torch.stack([rec[part][i][0] for i in sorted(rec[part])])  # noqa: E731
        return stack("k"), stack("v"), stack("q")

    k, v, q = kv(ids[:, :prefix])
    start = prefix + n_eval
    ck, cv, _ = kv(all_ids[:, start:start + calib_tokens])
    return k, v, q, model, ids, (ck, cv)


def sample_kv():
    from kvcodec.data import load_kv_sample

    s = load_kv_sample()
    return s.keys, s.values, s.queries, None, None, (s.keys, s.values)


def attention_error(queries, keys, values, keys_hat, values_hat) -> float:
    """||O_hat - O|| / ||O|| over every layer for the last N_Q queries (causal, GQA, float64)."""
    from kvcodec.data import causal_gqa_attention

    num = den = 0.0
    for layer in range(keys.shape[0]):
        q = queries[layer][:, -N_Q:]
        ref = causal_gqa_attention(q, keys[layer], values[layer])
        out = causal_gqa_attention(q, keys_hat[layer], values_hat[layer])
        num += float((out - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / den) ** 0.5


@torch.no_grad()
def perplexity(model, ids, prefix: int, keys, values) -> float:
    """Perplexity of tokens prefix+1.. given a DynamicCache holding ``keys``/``values`` for the prefix."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    logits = model(input_ids=ids[:, prefix:], **cache_kwargs(model, cache), use_cache=True).logits[0, :-1].float()
    return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, prefix + 1:])))


# -------------------------------------------------------------------------------------- serdes
def serde_specs(head_dim: int, slot_file: str) -> list[dict]:
    """kvcodec's serdes and LMCache's CPU-capable fp8; TurboQuant bit pairs that match LMCache's
    presets at equal bytes (k8v4, 4bit_nc, k3v4_nc, 3bit_nc) plus 2/2."""
    tq = {"type": "kvcodec_turboquant", "head_dim": head_dim}
    auto = {"slot_ratio": "auto", "slot_file": slot_file}
    return [{"type": "kvcodec_lossless", "codec": "planes", **auto}, {"type": "kvcodec_lossless", "codec": "kvctx", **auto},
            {"type": "fp8"}] + [{**tq, "key_bits": kb, "value_bits": vb} for kb, vb in ((8, 4), (4, 4), (3, 4), (3, 3), (2, 2))] + [
            {**tq, "key_bits": kb, "value_bits": vb, "exact_tokens": 0} for kb, vb in ((4, 4), (3, 3))]


def object_key(i: int):
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=i.to_bytes(16, "little"), model_name="HuggingFaceTB/SmolLM2-135M-Instruct", kv_rank=0)


def run_serde(spec: dict, chunks: list[torch.Tensor], repeat: int, cores: int | None = None) -> dict:
    """Serialize/deserialize every chunk through the serde LMCache builds from ``spec``. ``cores``:
    1 (torch on one thread, kvcodec ``threads=1``) or every core (``threads=0``); None: one core, no timing
    (LMCache's Triton presets in the interpreter)."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    from kvcodec.integrations.lmcache import SlotOverflowError, host_memory_obj as memory_obj

    kwargs = {k: v for k, v in spec.items() if k != "type"}
    if spec["type"].startswith("kvcodec_") and cores is not None:
        kwargs["threads"] = 1 if cores == 1 else 0
    torch.set_num_threads(1)  # torch's OpenMP threads stall on a shared machine: cores work on chunks instead
    proc = create_serde_processor(SerdeConfig(type=spec["type"], kwargs=kwargs))
    ser, de = proc._serializer, proc._deserializer  # the sync pair AsyncSerdeProcessor runs on its worker
    stored, payload, fits, done, t_ser, t_de, outs, ratios, jobs = 0, 0, 0, 0, 0.0, 0.0, [], [], []
    try:
        for i, c in enumerate(chunks):
            key = object_key(i)
            layout = MemoryLayoutDesc(shapes=[c.shape], dtypes=[c.dtype])
            dst = torch.zeros(ser.estimate_serialized_size(layout), dtype=torch.uint8)
            src, dst_obj = memory_obj(c), memory_obj(dst)
            try:
                n = ser.serialize(src, dst_obj, key)
            except SlotOverflowError:  # kvcodec_lossless refuses a chunk that does not fit its slot
                stored += c.nbytes  # not in L2 (a miss later); counted as if stored raw
                outs.append(c.clone())
                continue
            fits += 1
            done += c.nbytes
            stored += n
            payload += _payload_bytes(dst)
            ratios.append(c.nbytes / _payload_bytes(dst))
            out = torch.empty_like(c)
            out_obj = memory_obj(out)
            de.deserialize(memory_obj(dst[:n]), out_obj, key)
            outs.append(out)
            jobs.append((src, dst_obj, key, dst[:n], out_obj))
        if repeat and cores is not None:
            t_ser, t_de = timed_passes(ser, de, jobs, repeat, cores)
        slot = getattr(ser, "stats", None)
        slot = slot() if slot else None
    finally:
        proc.close()
    raw = sum(c.nbytes for c in chunks)
    row = {"stored": stored, "payload": payload, "fits": f"{fits}/{len(chunks)}",
           "ser_GBps": done / t_ser / 1e9 if t_ser else None, "deser_GBps": done / t_de / 1e9 if t_de else None,
           "raw": raw, "min_chunk_ratio": min(ratios) if ratios else None,
           "slot_ratio": next(iter(slot.slot_ratios.values()), None) if slot else None,
           "refused_share": 1 - fits / len(chunks) if slot else None}
    return row, outs


def timed_passes(ser, de, jobs: list, repeat: int, cores: int) -> tuple[float, float]:
    """Seconds to serialize / deserialize every stored chunk once, best of ``repeat``: one chunk after
    another on one core; with more cores, ``cores`` chunks at a time on a thread pool (what LMCache's
    AsyncSerdeProcessor does with max_workers=cores), each chunk also using the serde's own threads."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcodec.integrations.lmcache import host_memory_obj as memory_obj

    def one_ser(job):
        ser.serialize(job[0], job[1], job[2])

    def one_de(job):
        de.deserialize(memory_obj(job[3]), job[4], job[2])

    if cores == 1:
        return (sum(best(lambda j=j: one_ser(j), repeat) for j in jobs),
                sum(best(lambda j=j: one_de(j), repeat) for j in jobs))
    with ThreadPoolExecutor(cores) as pool:
        return (best(lambda: list(pool.map(one_ser, jobs)), repeat), best(lambda: list(pool.map(one_de, jobs)), repeat))


def naive_speed(chunks: list[torch.Tensor], repeat: int, cores: int) -> float:
    """GB/s of copying every chunk's bytes into a byte buffer (LMCache without a serde moves them as they are)."""
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)
    dsts = [torch.empty(c.nbytes, dtype=torch.uint8) for c in chunks]
    copy = lambda i: dsts[i].copy_(chunks[i].reshape(-1).view(torch.uint8))  # noqa: E731
    with ThreadPoolExecutor(cores) as pool:
        t = best(lambda: list(pool.map(copy, range(len(chunks)))), max(repeat, 3))
    return sum(c.nbytes for c in chunks) / t / 1e9


def _payload_bytes(dst: torch.Tensor) -> int:
    """Frame + payload of a kvcodec frame (the slot's used part); the whole buffer for other serdes."""
    from kvcodec.integrations.lmcache import FRAME, MAGIC

    head = dst[:FRAME.size].numpy().tobytes()
    if head[:4] != MAGIC:
        return dst.numel()
    return FRAME.size + FRAME.unpack(head)[4]


def best(fn, repeat: int) -> float:
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def lmcache_turboquant_specs(head_dim: int) -> list[dict]:
    from lmcache.v1.distributed.serde.turboquant.turboquant import TQ_PRESETS

    return [{"type": "turboquant", "preset": p, "head_dim": head_dim, "skip_first_layers": skip, "skip_last_layers": skip}
            for p in TQ_PRESETS for skip in (0, 2)]


#: presets run through Triton's interpreter in --quick (about 20 min each for one 8-layer chunk on a
#: loaded 2-core machine): the two that kvcodec's 4/4 and 3/3 meet at equal bytes
INTERPRETED = ("turboquant_4bit_nc", "turboquant_3bit_nc")


def lmcache_turboquant_sizes(spec: dict, chunks: list[torch.Tensor]) -> dict:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde.turboquant.turboquant import TurboQuantSerdeConfig, TurboQuantSerializer

    cfg = TurboQuantSerdeConfig(**{k: v for k, v in spec.items() if k != "type"})
    stored = sum(TurboQuantSerializer(cfg).estimate_serialized_size(MemoryLayoutDesc(shapes=[c.shape], dtypes=[c.dtype]))
                 for c in chunks)
    return {"stored": stored, "payload": 0, "fits": None, "ser_GBps": None, "deser_GBps": None,
            "raw": sum(c.nbytes for c in chunks), "min_chunk_ratio": None}


def triton_interpreter_ready() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def lmcache_turboquant_on_cpu():
    """Point LMCache's TurboQuant serde at the CPU (its Triton kernels then run in Triton's
    interpreter): the device pick returns the CPU and the fp8 flavour is the sm_89+ one (H100)."""
    import lmcache.v1.distributed.serde.turboquant.decode_kernel as dk
    import lmcache.v1.distributed.serde.turboquant.store_kernel as sk
    import lmcache.v1.distributed.serde.turboquant.turboquant as tq

    saved = tq._select_cuda_device, dk._use_fp8_e4b15, sk._use_fp8_e4b15
    tq._select_cuda_device = lambda *a, **k: torch.device("cpu")
    dk._use_fp8_e4b15 = sk._use_fp8_e4b15 = lambda device=0: 0
    try:
        yield
    finally:
        tq._select_cuda_device, dk._use_fp8_e4b15, sk._use_fp8_e4b15 = saved


def run(quick: bool = False, out_dir: str = "benchmarks/results", prefix: int = 1024, n_eval: int = 128,
        repeat: int = 3, calib_tokens: int = 2048) -> dict:
    import tempfile

    import kvcodec.integrations.lmcache as kvlm

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    keys, values, queries, model, ids, (ck, cv) = sample_kv() if quick else model_kv(prefix, n_eval, calib_tokens)
    n_layers, n_heads, n_tokens, d = keys.shape
    cut = lambda k, v: [kvlm.kv_chunk(k[:, :, s:s + CHUNK_TOKENS], v[:, :, s:s + CHUNK_TOKENS])  # noqa: E731
                        for s in range(0, k.shape[2] - CHUNK_TOKENS + 1, CHUNK_TOKENS)]
    chunks = cut(keys, values)
    calib_chunks = cut(ck, cv)
    raw_per_token = chunks[0].nbytes / chunks[0].shape[2]
    slot_file = os.path.join(tempfile.mkdtemp(prefix="kvcodec-slots-"), "slots.json")
    for codec in ("planes", "kvctx"):
        kvlm.calibrate_slots(calib_chunks, codec=codec, path=slot_file, threads=0)

    def row(spec: dict, r: dict, fast: dict | None = None, **extra) -> dict:
        lossless = "lossless" in spec["type"]
        config = {k: v for k, v in spec.items() if k not in ("type", "slot_file")}
        return {"serde": spec["type"], "config": json.dumps(config), "kind": "lossless" if lossless else "lossy",
                "bytes_per_token": r["stored"] / n_tokens, "vs_naive": r["raw"] / r["stored"],
                "payload_vs_naive": r["raw"] / r["payload"] if lossless and r["payload"] else None,
                "min_chunk_ratio": r["min_chunk_ratio"] if lossless else None,
                "slot_ratio": r.get("slot_ratio"), "refused_share": r.get("refused_share"),
                "fits": r["fits"], "ser_1c": r["ser_GBps"], "deser_1c": r["deser_GBps"],
                "ser_all": (fast or {}).get("ser_GBps"), "deser_all": (fast or {}).get("deser_GBps"), **extra}

    ppl0 = perplexity(model, ids, n_tokens, keys, values) if model is not None else None
    copy1, copy_all = naive_speed(chunks, repeat, 1), naive_speed(chunks, repeat, cores)
    rows = [{"serde": "naive", "config": "no serde (raw bf16)", "kind": "exact", "bytes_per_token": raw_per_token,
             "vs_naive": 1.0, "ser_1c": copy1, "deser_1c": copy1, "ser_all": copy_all, "deser_all": copy_all,
             "bit_exact": True, "attn_err": 0.0, "ppl": ppl0, "ppl_delta_pct": 0.0,
             "note": "GB/s: a copy of the chunk's bytes"}]
    interpret = quick and triton_interpreter_ready()
    for spec in serde_specs(d, slot_file) + lmcache_turboquant_specs(d):
        note, fast = "", None
        if spec["type"] == "turboquant" and not (interpret and spec["skip_first_layers"] == 0
                                                 and spec["preset"] in INTERPRETED):
            r = lmcache_turboquant_sizes(spec, chunks)
            rows.append(row(spec, r, note="LMCache preset: Triton/CUDA only, quality not measured on CPU"))
            continue
        if spec["type"] == "turboquant":
            with lmcache_turboquant_on_cpu():
                r, outs = run_serde(spec, chunks, repeat=0)
            note = "LMCache's Triton kernels in Triton's CPU interpreter (quality only)"
        else:
            r, outs = run_serde(spec, chunks, repeat, cores=1)
            fast, _ = run_serde(spec, chunks, repeat, cores=cores)
        torch.set_num_threads(1)
        k_hat = torch.cat([kvlm.kv_unchunk(o, n_heads)[0] for o in outs], dim=2)
        v_hat = torch.cat([kvlm.kv_unchunk(o, n_heads)[1] for o in outs], dim=2)
        exact = torch.equal(k_hat.view(torch.int16), keys[:, :, :k_hat.shape[2]].view(torch.int16)) and torch.equal(
            v_hat.view(torch.int16), values[:, :, :v_hat.shape[2]].view(torch.int16))
        ppl = perplexity(model, ids, n_tokens, k_hat, v_hat) if model is not None else None
        rows.append(row(spec, r, fast, note=note, bit_exact=exact,
                        attn_err=attention_error(queries, keys, values, k_hat, v_hat),
                        ppl=ppl, ppl_delta_pct=100 * (ppl / ppl0 - 1) if ppl is not None else None))
    commit = os.environ.get("KVCODEC_COMMIT") or subprocess.run(  # set it when running from an exported tree
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    from common import machine_record

    machine = machine_record()
    result = {"suite": SUITE + ("_quick" if quick else ""), "rows": rows, "machine": machine, "notes": [
        f"{'shipped 8-layer sample' if quick else f'SmolLM2-135M-Instruct, all {n_layers} layers'}: {n_tokens} tokens "
        f"in {len(chunks)} LMCache chunks of {CHUNK_TOKENS} tokens [2, {n_layers}, {CHUNK_TOKENS}, {n_heads * d}] bf16; "
        f"{N_Q} real queries per layer for attn_err" + ("" if quick else f"; ppl over the next {n_eval} tokens"),
        f"GB/s: raw KV bytes per second, best of {repeat}: _1c on one core (torch.set_num_threads(1), kvcodec "
        f"threads=1), _all on all {cores} cores ({cores} chunks at a time, kvcodec threads=0, torch on one thread per "
        f"chunk); {machine['processor']}, shared with other jobs "
        f"(load average at the end {os.getloadavg()[0]:.1f})",
        "kvcodec serdes store fixed slots (LMCache 0.5.6's fs/resp loads need objects of exactly the estimated size); "
        "kvcodec_lossless slot_ratio='auto' with the slot chosen by calibrate_slots (>= 99.9% of chunks meant to fit) "
        + ("on the same chunks (quick: no held-out text)" if quick else
           f"on {len(calib_chunks)} chunks of other text ({calib_tokens} tokens after the evaluated ones, from position 0)"),
        f"lmcache {_version('lmcache')}, kvcodec commit {commit}",
    ]}
    save(result, out_dir, columns=COLUMNS)
    return result


def run_cuda(out_dir: str, repeat: int = 5, layers_x: int = 4) -> dict:
    """``--cuda``: the kvcodec serdes with ``cuda_device="auto"`` against the same serdes on every CPU
    core, on the shipped sample chunk with its 8 layers repeated ``layers_x`` times. Each path
    serializes and deserializes the chunk (best of ``repeat``; the GPU path includes the copies
    through pinned memory), and each path's object is also read back by the other path."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    import kvcodec.integrations.lmcache as kvlm
    from kvcodec.data import load_kv_sample

    s = load_kv_sample()
    c = torch.cat([kvlm.kv_chunk(s.keys, s.values)] * layers_x, 1).contiguous()
    key = object_key(0)
    specs = [{"type": "kvcodec_lossless", "codec": "planes", "slot_ratio": 1.3},
             {"type": "kvcodec_lossless", "codec": "kvctx", "slot_ratio": 1.3},
             {"type": "kvcodec_turboquant", "head_dim": 64, "key_bits": 4, "value_bits": 4}]

    def timed(fn) -> float:
        fn()
        t = float("inf")
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            t = min(t, time.perf_counter() - t0)
        return t

    rows = []
    for spec in specs:
        kwargs = {k: v for k, v in spec.items() if k != "type"}
        procs = {"gpu": create_serde_processor(SerdeConfig(type=spec["type"], kwargs={**kwargs, "cuda_device": "auto"})),
                 "cpu": create_serde_processor(SerdeConfig(type=spec["type"], kwargs={**kwargs, "threads": 0}))}
        try:
            for path, proc in procs.items():
                ser, de = proc._serializer, proc._deserializer
                dst = torch.zeros(ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[c.shape], dtypes=[c.dtype])),
                                  dtype=torch.uint8)
                src, dst_obj, out = kvlm.host_memory_obj(c), kvlm.host_memory_obj(dst), torch.empty_like(c)
                t_ser = timed(lambda: ser.serialize(src, dst_obj, key))
                t_de = timed(lambda: de.deserialize(kvlm.host_memory_obj(dst), kvlm.host_memory_obj(out), key))
                other = procs["cpu" if path == "gpu" else "gpu"]._deserializer
                out2 = torch.empty_like(c)
                other.deserialize(kvlm.host_memory_obj(dst), kvlm.host_memory_obj(out2), key)
                rel = lambda o: float((o.float() - c.float()).norm() / c.float().norm())  # noqa: E731
                rows.append({"serde": spec["type"], "config": json.dumps(kwargs), "path": path,
                             "ser_GBps": c.nbytes / t_ser / 1e9, "deser_GBps": c.nbytes / t_de / 1e9,
                             "rel_err": rel(out), "read_by_other_path_rel_err": rel(out2),
                             "bit_exact": torch.equal(out.view(torch.uint8), c.view(torch.uint8))})
        finally:
            for proc in procs.values():
                proc.close()
    from common import machine_record

    machine = machine_record()
    result = {"suite": SUITE + "_cuda", "rows": rows, "machine": machine, "notes": [
        f"one chunk {list(c.shape)} bf16 ({c.nbytes / 1e6:.1f} MB): the shipped 8-layer SmolLM2 sample chunk, layers "
        f"repeated {layers_x}x; GB/s = raw KV bytes per second, best of {repeat}",
        f"gpu: cuda_device='auto' on {machine.get('gpu', 'no GPU')} (host -> pinned -> GPU -> host copies included); "
        f"cpu: threads=0 on {machine['cores']} cores of {machine['processor']}",
        "read_by_other_path_rel_err: the object one path wrote, loaded by the other (CPU <-> GPU compatibility)",
    ]}
    save(result, out_dir, columns=["serde", "config", "path", "ser_GBps", "deser_GBps", "rel_err",
                                   "read_by_other_path_rel_err", "bit_exact"])
    return result


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shipped 8-layer sample, no model, fewer serdes")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--calib-tokens", type=int, default=2048, help="tokens of other text the lossless slot is chosen on")
    p.add_argument("--cuda", action="store_true", help="cuda_device serdes against the CPU path (needs a GPU)")
    a = p.parse_args(argv)
    if a.cuda:
        run_cuda(a.out)
        return 0
    run(quick=a.quick, out_dir=a.out, prefix=a.prefix, repeat=a.repeat, calib_tokens=a.calib_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
