"""The kvcodec LMCache serdes on the chunk layouts vLLM hands LMCache (MHA/GQA [2, layers, tokens,
hidden], MLA [1, layers, tokens, latent]; bf16 and fp8 KV; any chunk size), and the lossless slot
chosen from measured chunks (slot_ratio="auto", slot files, refused-share counters)."""

import json
import math
import os
import time

import pytest
import torch

try:
    import lmcache.v1.distributed.serde  # noqa: F401
except ImportError as exc:
    pytest.skip(f"lmcache is not usable here (pip install 'kvcodec[lmcache]'): {exc}", allow_module_level=True)

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402

from kvcodec.data import load_kv_sample  # noqa: E402
from kvcodec.integrations import lmcache as kvlm  # noqa: E402

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def sample():
    return load_kv_sample()


def mha(sample, tokens: int, dtype=torch.bfloat16) -> torch.Tensor:
    """[2, 8, tokens, 192]: the sample's real K/V (GQA, 3 KV heads of 64), repeated past its 256 tokens."""
    c = kvlm.kv_chunk(sample.keys, sample.values)
    reps = math.ceil(tokens / c.shape[2])
    return _cast(torch.cat([c] * reps, dim=2)[:, :, :tokens].contiguous(), dtype)


def mla(sample, tokens: int, dtype=torch.bfloat16) -> torch.Tensor:
    """[1, 8, tokens, 576]: a DeepSeek-shaped latent chunk (512 + 64) built from the sample's real K/V."""
    c = mha(sample, tokens)
    return _cast(torch.cat([c[0], c[1], c[0].roll(1, dims=1)], dim=-1)[None].contiguous(), dtype)


def _cast(x: torch.Tensor, dtype) -> torch.Tensor:
    if dtype.itemsize == 1:
        return (x.float() * 8).clamp(-448, 448).to(FP8)  # fp8 KV with a per-tensor scale, as vLLM stores it
    return x.to(dtype)


class Serde:
    """One serde built by LMCache's create_serde_processor; its sync serializer/deserializer."""

    def __init__(self, type_: str, **kwargs):
        self.proc = create_serde_processor(SerdeConfig(type=type_, kwargs=kwargs))
        self.ser, self.de = self.proc._serializer, self.proc._deserializer

    def size(self, chunk) -> int:
        return self.ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype]))

    def store(self, chunk, key) -> torch.Tensor:
        dst = torch.zeros(self.size(chunk), dtype=torch.uint8)
        n = self.ser.serialize(kvlm.host_memory_obj(chunk), kvlm.host_memory_obj(dst), key)
        assert n == dst.numel()  # fixed slot
        return dst

    def load(self, stored, like, key) -> torch.Tensor:
        out = torch.empty_like(like)
        self.de.deserialize(kvlm.host_memory_obj(stored), kvlm.host_memory_obj(out), key)
        return out

    def close(self):
        self.proc.close()


def key(i: int = 0) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(16, "little"), model_name="m", kv_rank=0)


def bit_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


LAYOUTS = [("mha", torch.bfloat16, 256), ("mha", torch.bfloat16, 16), ("mha", torch.bfloat16, 1),
           ("mha", torch.bfloat16, 1000), ("mha", FP8, 256), ("mha", FP8, 48), ("mla", torch.bfloat16, 256),
           ("mla", torch.bfloat16, 7), ("mla", FP8, 256), ("mha", torch.float16, 64), ("mha", torch.float8_e5m2, 64)]


@pytest.mark.parametrize("kind,dtype,tokens,codec", [(*layout, "planes") for layout in LAYOUTS] + [
    ("mha", torch.bfloat16, 1000, "kvctx"), ("mha", FP8, 48, "kvctx"), ("mla", torch.bfloat16, 7, "kvctx")])
def test_lossless_bit_exact_every_layout(sample, kind, dtype, tokens, codec):
    chunk = (mha if kind == "mha" else mla)(sample, tokens, dtype)
    s = Serde("kvcodec_lossless", codec=codec, slot_ratio=1.0)
    try:
        back = s.load(s.store(chunk, key()), chunk, key())
        with pytest.raises(kvlm.KeyMismatchError):
            s.load(s.store(chunk, key()), chunk, key(1))
    finally:
        s.close()
    assert bit_equal(back, chunk)


@pytest.mark.parametrize("kind,dtype,tokens", LAYOUTS)
def test_turboquant_every_layout(sample, kind, dtype, tokens):
    chunk = (mha if kind == "mha" else mla)(sample, tokens, dtype)
    s = Serde("kvcodec_turboquant", head_dim=64, key_bits=4, value_bits=4)
    try:
        stored = s.store(chunk, key())
        back = s.load(stored, chunk, key())
    finally:
        s.close()
    assert back.dtype == chunk.dtype and back.shape == chunk.shape
    assert bool(torch.isfinite(back.float()).all())
    assert bit_equal(back[:, :, :1], chunk[:, :, :1])  # exact_tokens=1
    if tokens > 1:
        # 4-bit TurboQuant (~0.09 on bf16 KV); fp8 adds its own rounding of the reconstruction
        assert rel_err(back[:, :, 1:], chunk[:, :, 1:]) < (0.16 if dtype == FP8 else 0.12)
    if tokens >= 256:  # ~4.4 bits per value incl. norms, side data and the exact token
        assert stored.numel() < chunk.nbytes * 4.6 / (16 if dtype != FP8 else 8)


def test_turboquant_mla_one_head_of_the_whole_latent(sample):
    chunk = mla(sample, 64)
    s = Serde("kvcodec_turboquant", head_dim=576, key_bits=4, value_bits=4)
    try:
        back = s.load(s.store(chunk, key()), chunk, key())
    finally:
        s.close()
    assert rel_err(back[:, :, 1:], chunk[:, :, 1:]) < 0.12


def test_turboquant_refuses_other_layouts():
    s = Serde("kvcodec_turboquant", head_dim=64)
    try:
        for bad in (torch.zeros(3, 2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 4, 100, dtype=torch.bfloat16),
                    torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 4, 64, dtype=torch.int16)):
            with pytest.raises(ValueError):
                s.store(bad, key())
    finally:
        s.close()


def test_stored_shape_or_dtype_other_than_asked_is_corrupt(sample):
    chunk = mha(sample, 32)
    for type_, kw in (("kvcodec_lossless", {"slot_ratio": 1.0}), ("kvcodec_turboquant", {"head_dim": 64})):
        s = Serde(type_, **kw)
        try:
            stored = s.store(chunk, key())
            with pytest.raises(kvlm.CorruptStreamError):
                s.load(stored, chunk.to(torch.float16), key())
            with pytest.raises(kvlm.CorruptStreamError):
                s.load(stored, mha(sample, 16), key())
        finally:
            s.close()


# -------------------------------------------------------------------------------- slot choice
def test_choose_slot_ratio():
    assert kvlm.choose_slot_ratio([1.5] * 10) == 1.5
    r = [1.50, 1.52, 1.55, 1.49, 1.53, 1.51, 1.56, 1.50]
    got = kvlm.choose_slot_ratio(r)
    assert got < min(r) and got == round(got, 2) and got >= 1.0  # a few chunks: below the minimum
    assert kvlm.choose_slot_ratio(r, fit=0.9) >= got
    assert kvlm.choose_slot_ratio([0.9, 0.95]) == 1.0  # never below raw
    import numpy as np

    big = np.random.default_rng(0).lognormal(np.log(1.5), 0.02, 100_000)
    chosen = kvlm.choose_slot_ratio(big)
    assert (big >= chosen).mean() >= 0.999
    for bad in ([], [1.0, float("nan")], [0.0]):
        with pytest.raises(ValueError):
            kvlm.choose_slot_ratio(bad)
    with pytest.raises(ValueError):
        kvlm.choose_slot_ratio([1.5], fit=1.0)


def test_auto_slot_measures_then_stores_and_counts(sample, tmp_path):
    slot_file = str(tmp_path / "slots.json")
    chunks = [mha(sample, 256).roll(i, dims=2).contiguous() for i in range(6)]
    s = Serde("kvcodec_lossless", slot_ratio="auto", calibration_chunks=4, slot_file=slot_file)
    try:
        raw_slot = s.size(chunks[0])
        assert raw_slot == kvlm.FRAME.size + chunks[0].nbytes  # while measuring: the raw size
        for c in chunks[:4]:
            with pytest.raises(kvlm.SlotOverflowError, match="measuring"):
                s.store(c, key())
        slot = s.size(chunks[0])
        assert slot < raw_slot / 1.3
        back = s.load(s.store(chunks[4], key(4)), chunks[4], key(4))
        assert bit_equal(back, chunks[4])
        # a buffer sized by an estimate made while measuring: the object is the slot's size all the same
        early = torch.zeros(raw_slot, dtype=torch.uint8)
        n = s.ser.serialize(kvlm.host_memory_obj(chunks[4]), kvlm.host_memory_obj(early), key(4))
        assert n == slot and bit_equal(s.load(early[:n], chunks[4], key(4)), chunks[4])
        noise = torch.randint(-2**15, 2**15, chunks[0].shape, dtype=torch.int16).view(torch.bfloat16)
        with pytest.raises(kvlm.SlotOverflowError, match="slot_ratio"):
            s.store(noise, key(5))
        stats = s.ser.stats()
        assert (s.ser.config, stats) in kvlm.lossless_slot_stats()  # how a deployment finds it
        assert (stats.stored, stats.refused, stats.calibrating) == (2, 1, 4) and stats.refused_share == 1 / 3
        layout = "bfloat16[2, 8, 256, 192]"
        assert stats.slot_ratios == {layout: pytest.approx(chunks[0].nbytes / (slot - kvlm.FRAME.size), abs=1e-3)}
        doc = json.load(open(slot_file))
        assert doc["planes"][layout]["chunks"] == 4 and doc["planes"][layout]["slot_ratio"] == stats.slot_ratios[layout]
    finally:
        s.close()
    again = Serde("kvcodec_lossless", slot_ratio="auto", calibration_chunks=4, slot_file=slot_file)
    try:  # a restart (or another server) reads the slot: same size, stores at once, loads the old object
        assert again.size(chunks[0]) == slot
        assert bit_equal(again.load(again.store(chunks[5], key(6)), chunks[5], key(6)), chunks[5])
    finally:
        again.close()


def test_calibrate_slots_offline(sample, tmp_path):
    path = str(tmp_path / "s.json")
    slots = kvlm.calibrate_slots([mha(sample, 64).roll(i, dims=2) for i in range(5)], path=path, threads=1)
    assert list(slots) == ["bfloat16[2, 8, 64, 192]"] and 1.0 <= slots["bfloat16[2, 8, 64, 192]"] < 2
    s = Serde("kvcodec_lossless", slot_file=path)
    try:
        assert s.size(mha(sample, 64)) == kvlm.FRAME.size + math.ceil(mha(sample, 64).nbytes / slots["bfloat16[2, 8, 64, 192]"])
    finally:
        s.close()


@pytest.mark.parametrize("kwargs", [{"slot_ratio": "fast"}, {"slot_ratio": float("inf")}, {"calibration_chunks": 1},
                                    {"slot_file": ""}, {"fit": 1.0}, {"threads": -1}])
def test_bad_slot_options(kwargs):
    with pytest.raises(ValueError):
        create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs=kwargs))


def test_unreadable_slot_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="slot file"):
        create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs={"slot_file": str(bad)}))
    bad.write_text(json.dumps({"planes": {"bfloat16[1]": {"slot_ratio": 0.5}}}))
    with pytest.raises(ValueError, match="slot"):
        create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs={"slot_file": str(bad)}))
