"""kvcodec serdes inside the real LMCache (0.5.6): real SmolLM2 KV chunks go through LMCache's own
StorageManager (L1 on the CPU, an L2 adapter wrapped by LMCache's serde wrapper) to a file-system
directory and to a real redis-server started here, and come back bit-exact (lossless), within a
stated error (TurboQuant), or as a miss when the stored object was damaged."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

try:  # not installed, or installed but built for another torch (lmcache 0.5.6's native part on torch 2.6)
    import lmcache.v1.distributed.serde  # noqa: F401
except ImportError as exc:
    pytest.skip(f"lmcache is not usable here (pip install 'kvcodec[lmcache]'): {exc}", allow_module_level=True)

from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec  # noqa: E402
from lmcache.v1.distributed.config import parse_args  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402

from kvcodec.data import attention_error, load_kv_sample  # noqa: E402
from kvcodec.errors import CorruptStreamError  # noqa: E402
from kvcodec.integrations import lmcache as kvlm  # noqa: E402
from redis_service import redis_server  # noqa: E402,F401  (a fixture)

WAIT_S = 30


@pytest.fixture(scope="module")
def sample():
    return load_kv_sample()


@pytest.fixture(scope="module")
def chunk(sample):
    return kvlm.kv_chunk(sample.keys, sample.values)  # bf16 [2, 8, 256, 192]: 8 real layers, 256 tokens


class Store:
    """One LMCache StorageManager with a single serde-wrapped L2 adapter, built from the CLI flags
    an LMCache server takes."""

    def __init__(self, adapter: dict):
        cfg = parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)])
        self.sm = StorageManager(cfg)

    def put(self, chunk: torch.Tensor, stored) -> ObjectKey:
        """Write a chunk to L1, wait until ``stored()`` says L2 holds it, then drop the L1 copy."""
        key = ObjectKey(chunk_hash=os.urandom(16), model_name="smollm2", kv_rank=0)
        layout = MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])
        objs = self.sm.reserve_write([key], layout)
        objs[key].tensor.copy_(chunk)
        self.sm.finish_write([key])
        deadline = time.monotonic() + WAIT_S
        while not stored() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the store task finishes after the bytes land
        self.sm.delete_l1_keys([key], force=True)
        return key

    def get(self, key: ObjectKey, like: torch.Tensor):
        """Prefetch from L2 through the serde (L1 holds no copy); the chunk, or None for a miss."""
        layout = MemoryLayoutDesc(shapes=[like.shape], dtypes=[like.dtype])
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=[key], object_group_id=0, layout_desc=layout)])
        handle = self.sm.submit_prefetch_task(spec)
        assert self.sm.wait_prefetch_status(handle, WAIT_S)
        result = self.sm.query_prefetch_status(handle)
        if not result.hit_cells[0].popcount():
            return None
        with self.sm.read_prefetched_results([key], result.l1_owners) as objs:
            back = objs[0].tensor.clone()
        self.sm.delete_l1_keys([key], force=True)  # the next get reads L2 again
        return back

    def close(self):
        self.sm.close()


def files_in(path: Path):
    return [p for p in path.rglob("*") if p.is_file()]


def fs_store(tmp_path, serde: dict) -> tuple[Store, Path]:
    base = tmp_path / "l2"
    return Store({"type": "fs", "base_path": str(base), "serde": serde}), base


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_registered_after_one_import():
    assert {"kvcodec_lossless", "kvcodec_turboquant", "kvcodec_transform"} <= set(get_registered_serde_types())
    kvlm.register()  # idempotent


def test_kvcodec_does_not_need_lmcache():
    code = "import sys, kvcodec, kvcodec.integrations; kvcodec.compress; assert 'lmcache' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_fs_lossless_bit_exact_and_slot_sized(tmp_path, chunk):
    store, base = fs_store(tmp_path, {"type": "kvcodec_lossless", "slot_ratio": 1.4})
    try:
        key = store.put(chunk, lambda: files_in(base))
        stored = files_in(base)[0].stat().st_size
        assert stored == kvlm.FRAME.size + math.ceil(chunk.nbytes / 1.4)
        back = store.get(key, chunk)
    finally:
        store.close()
    assert back is not None and bit_equal(back, chunk)


def test_fs_lossless_auto_slot_measures_then_stores(tmp_path, chunk):
    """slot_ratio='auto' inside LMCache: the first chunks are measured and not stored, later ones get
    the chosen slot, are stored at its size and load bit-exact; the slot file holds the choice."""
    slot_file = tmp_path / "slots.json"
    store, base = fs_store(tmp_path, {"type": "kvcodec_lossless", "calibration_chunks": 2, "slot_file": str(slot_file)})
    try:
        for i in range(2):
            store.put(chunk.roll(i + 1, dims=2).contiguous(), lambda: time.sleep(1.0) or True)
        assert files_in(base) == [] and slot_file.exists()
        ratio = json.loads(slot_file.read_text())["planes"]["bfloat16[2, 8, 256, 192]"]["slot_ratio"]
        key = store.put(chunk, lambda: files_in(base))
        assert files_in(base)[0].stat().st_size == kvlm.FRAME.size + math.ceil(chunk.nbytes / ratio)
        back = store.get(key, chunk)
    finally:
        store.close()
    assert back is not None and bit_equal(back, chunk)


def test_fs_lossless_every_bit_pattern(tmp_path):
    """NaN payloads, infinities, -0.0 and subnormals survive LMCache's storage path bit for bit."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**15), 2**15, (2, 2, 64, 128), generator=g, dtype=torch.int16)
    bits[0, 0, 0, :4] = torch.tensor([0x7FC1, -0x0001, 0x7F80, -0x8000], dtype=torch.int16)  # NaN, NaN, +inf, -0.0
    # mostly small values so the chunk compresses into its slot; the special patterns ride along
    chunk = torch.where(torch.rand(bits.shape, generator=g) < 0.9, (torch.randn(bits.shape, generator=g) * 0.1).to(torch.bfloat16).view(torch.int16), bits).view(torch.bfloat16)
    store, base = fs_store(tmp_path, {"type": "kvcodec_lossless", "slot_ratio": 1.0})
    try:
        back = store.get(store.put(chunk, lambda: files_in(base)), chunk)
    finally:
        store.close()
    assert back is not None and bit_equal(back, chunk)


def test_fs_turboquant_states_its_error(tmp_path, sample, chunk):
    serde = {"type": "kvcodec_turboquant", "head_dim": 64, "key_bits": 4, "value_bits": 4}
    store, base = fs_store(tmp_path, serde)
    try:
        key = store.put(chunk, lambda: files_in(base))
        stored = files_in(base)[0].stat().st_size
        back = store.get(key, chunk)
    finally:
        store.close()
    assert back is not None and back.dtype == chunk.dtype and back.shape == chunk.shape
    assert stored < chunk.nbytes / 3.4  # ~4.4 stored bits per value incl. norms, side data, token 0
    k_hat, v_hat = kvlm.kv_unchunk(back, sample.n_kv_heads)
    err = attention_error(sample, k_hat, v_hat)
    assert err < 0.13, err  # docs/lmcache.md states the measured value
    assert bit_equal(back[:, :, :1], chunk[:, :, :1])  # exact_tokens=1: the attention sink


@pytest.mark.parametrize("serde", [{"type": "kvcodec_lossless", "slot_ratio": 1.4},
                                   {"type": "kvcodec_turboquant", "head_dim": 64}])
def test_fs_corrupted_object_is_a_miss(tmp_path, chunk, serde):
    store, base = fs_store(tmp_path, serde)
    try:
        keys = [store.put(chunk, lambda n=n: len(files_in(base)) > n) for n in range(3)]
        paths = {p.name: p for p in files_in(base)}
        for i, key in enumerate(keys):  # flip one payload byte, one header byte, one padding-adjacent byte
            path = next(p for name, p in paths.items() if key.chunk_hash.hex() in name)
            data = bytearray(path.read_bytes())
            data[(40 + 7919 * i * i) % len(data) if i != 1 else 9] ^= 0x10
            path.write_bytes(bytes(data))
            assert store.get(key, chunk) is None
    finally:
        store.close()


def test_fs_chunk_over_its_slot_is_refused_not_truncated(tmp_path, chunk):
    store, base = fs_store(tmp_path, {"type": "kvcodec_lossless", "slot_ratio": 4.0})
    try:
        key = store.put(chunk, lambda: time.sleep(1.0) or True)
        assert files_in(base) == []
        assert store.get(key, chunk) is None
    finally:
        store.close()


def test_serializer_refuses_a_chunk_over_its_slot(chunk):
    proc = create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs={"slot_ratio": 4.0}))
    try:
        ser = proc._serializer  # the sync serializer LMCache's AsyncSerdeProcessor runs
        dst = torch.zeros(ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])),
                          dtype=torch.uint8)
        with pytest.raises(kvlm.SlotOverflowError, match="slot_ratio=4.0"):
            ser.serialize(kvlm.host_memory_obj(chunk), kvlm.host_memory_obj(dst), None)
    finally:
        proc.close()


def test_frame_rejects_every_damage():
    payload = np.arange(1000, dtype=np.uint32).tobytes()
    buf = torch.zeros(kvlm.FRAME.size + len(payload) + 100, dtype=torch.uint8)
    assert kvlm.write_frame(buf, kvlm.LOSSLESS, payload) == buf.numel()
    assert kvlm.read_frame(buf, kvlm.LOSSLESS).tobytes() == payload
    with pytest.raises(CorruptStreamError):
        kvlm.read_frame(buf, kvlm.TURBOQUANT)
    for pos in list(range(kvlm.FRAME.size)) + [kvlm.FRAME.size, kvlm.FRAME.size + len(payload) - 1]:
        bad = buf.clone()
        bad[pos] ^= 0x01
        if 16 <= pos < 20:  # the reserved u16 is covered by the crc32 (bytes 0-15): check 16-19 too
            pass
        with pytest.raises(CorruptStreamError):
            kvlm.read_frame(bad, kvlm.LOSSLESS)
    with pytest.raises(CorruptStreamError):
        kvlm.read_frame(buf[:10], kvlm.LOSSLESS)
    with pytest.raises(kvlm.SlotOverflowError):
        kvlm.write_frame(torch.zeros(100, dtype=torch.uint8), kvlm.LOSSLESS, payload)


@pytest.fixture(scope="module")
def transform_calibration(sample, tmp_path_factory):
    """A chunk-relative calibration of the sample's 8 layers (fitted on the sample itself: a
    functional test of the serde, not a held-out quality figure; bench_transform has those)."""
    from kvcodec import transform

    path = tmp_path_factory.mktemp("calib") / "smollm2-8layers.kvtc"
    kvlm.fit_chunk_calibration(sample.keys, sample.values, transform.RoPE.default(64, sample.meta["rope_theta"]),
                               chunk_tokens=128).save(path)
    return str(path)


def test_fs_transform_round_trip_slot_and_corruption(tmp_path, sample, chunk, transform_calibration):
    serde = {"type": "kvcodec_transform", "calibration": transform_calibration, "bits": 3.0}
    store, base = fs_store(tmp_path, serde)
    try:
        key = store.put(chunk, lambda: files_in(base))
        (path,) = files_in(base)
        stored = path.stat().st_size
        back = store.get(key, chunk)
        data = bytearray(path.read_bytes())
        data[len(data) // 4] ^= 0x08
        path.write_bytes(bytes(data))
        damaged = store.get(key, chunk)
    finally:
        store.close()
    assert stored == kvlm.FRAME.size + math.ceil(3.0 * chunk.numel() / 8 * 1.02)  # fixed slot: ~5.2x vs bf16
    assert back is not None and back.dtype == chunk.dtype and back.shape == chunk.shape
    assert bit_equal(back[:, :, :1], chunk[:, :, :1])  # exact_tokens=1: the attention sink
    k_hat, v_hat = kvlm.kv_unchunk(back, sample.n_kv_heads)
    assert attention_error(sample, k_hat, v_hat) < 0.12  # measured 0.061 (calibration on the same text)
    assert damaged is None


def test_transform_serde_refuses_another_models_chunk(chunk, transform_calibration):
    proc = create_serde_processor(SerdeConfig(type="kvcodec_transform", kwargs={"calibration": transform_calibration}))
    try:
        ser = proc._serializer
        small = chunk[:, :4].contiguous()
        dst = torch.zeros(ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[small.shape], dtypes=[small.dtype])),
                          dtype=torch.uint8)
        with pytest.raises(ValueError, match="does not match the calibration"):
            ser.serialize(kvlm.host_memory_obj(small), kvlm.host_memory_obj(dst), None)
    finally:
        proc.close()


@pytest.mark.parametrize("kwargs", [
    {"type": "kvcodec_lossless", "slot_ratio": 0.5},
    {"type": "kvcodec_lossless", "codec": "zstd"},
    {"type": "kvcodec_lossless", "level": 3},
    {"type": "kvcodec_turboquant", "key_bits": 0},
    {"type": "kvcodec_turboquant", "head_dim": 2},
    {"type": "kvcodec_turboquant", "bits": 4},
    {"type": "kvcodec_turboquant", "max_workers": 0},
    {"type": "kvcodec_transform"},
    {"type": "kvcodec_transform", "calibration": "/nonexistent/model.kvtc"},
    {"type": "kvcodec_transform", "calibration": "/nonexistent/model.kvtc", "rate": 2},
])
def test_bad_config_raises_value_error(kwargs):
    kwargs = dict(kwargs)
    with pytest.raises(ValueError):
        create_serde_processor(SerdeConfig(type=kwargs.pop("type"), kwargs=kwargs))


def test_resp_lossless_round_trip_and_corruption_miss(redis_server, chunk):
    port, client = redis_server
    store = Store({"type": "resp", "host": "127.0.0.1", "port": port,
                   "serde": {"type": "kvcodec_lossless", "slot_ratio": 1.4}})
    try:
        key = store.put(chunk, lambda: client.dbsize() > 0)
        (name,) = client.keys("*")
        assert client.strlen(name) < chunk.nbytes / 1.39
        back = store.get(key, chunk)
        assert back is not None and bit_equal(back, chunk)
        value = bytearray(client.get(name))
        value[len(value) // 3] ^= 0x04
        client.set(name, bytes(value))
        assert store.get(key, chunk) is None
    finally:
        store.close()


# ------------------------------------------------------------------ key binding: a mix-up is a miss
def mixup_serdes(calibration: str) -> list[dict]:
    return [{"type": "kvcodec_lossless", "slot_ratio": 1.4},
            {"type": "kvcodec_lossless", "codec": "kvctx", "slot_ratio": 1.4},
            {"type": "kvcodec_turboquant", "head_dim": 64},
            {"type": "kvcodec_transform", "calibration": calibration, "bits": 3.0}]


def another_key(key: ObjectKey) -> ObjectKey:
    return ObjectKey(chunk_hash=os.urandom(16), model_name=key.model_name, kv_rank=key.kv_rank)


@pytest.mark.parametrize("which", range(4))
def test_fs_object_copied_under_another_key_is_a_miss(tmp_path, chunk, transform_calibration, which):
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename

    store, base = fs_store(tmp_path, mixup_serdes(transform_calibration)[which])
    try:
        key_a = store.put(chunk, lambda: files_in(base))
        (path_a,) = files_in(base)
        key_b = another_key(key_a)
        shutil.copyfile(path_a, path_a.parent / _object_key_to_filename(key_b))
        assert store.get(key_a, chunk) is not None  # the original still loads
        assert store.get(key_b, chunk) is None  # a valid object under the wrong name: a miss
        other = ObjectKey(chunk_hash=key_a.chunk_hash, model_name="another-model", kv_rank=key_a.kv_rank)
        shutil.copyfile(path_a, path_a.parent / _object_key_to_filename(other))
        assert store.get(other, chunk) is None  # same chunk hash, another model
    finally:
        store.close()


@pytest.mark.parametrize("which", range(4))
def test_resp_object_copied_under_another_key_is_a_miss(redis_server, chunk, transform_calibration, which):
    port, client = redis_server
    store = Store({"type": "resp", "host": "127.0.0.1", "port": port, "serde": mixup_serdes(transform_calibration)[which]})
    try:
        key_a = store.put(chunk, lambda: client.dbsize() > 0)
        (name_a,) = client.keys("*")
        key_b = another_key(key_a)
        a_hex, b_hex = key_a.chunk_hash.hex().encode(), key_b.chunk_hash.hex().encode()
        assert a_hex in name_a, name_a  # the RESP adapter names objects by the chunk hash in hex
        client.set(name_a.replace(a_hex, b_hex), client.get(name_a))
        assert store.get(key_a, chunk) is not None
        assert store.get(key_b, chunk) is None
    finally:
        store.close()


def test_key_digest_covers_every_field_and_the_config():
    key = ObjectKey(chunk_hash=b"\x01" * 16, model_name="m", kv_rank=3, object_group_id=1, cache_salt="s")
    base = kvlm.key_digest(key, "c")
    assert len(base) == kvlm.DIGEST_BYTES and base == kvlm.key_digest(key, "c")
    for change in ({"chunk_hash": b"\x02" * 16}, {"model_name": "n"}, {"kv_rank": 4}, {"object_group_id": 2},
                   {"cache_salt": "t"}):
        assert kvlm.key_digest(ObjectKey(**{**key.__dict__, **change}), "c") != base, change
    assert kvlm.key_digest(key, "d") != base
    with pytest.raises(ValueError):
        kvlm.key_digest("not a key", "c")
