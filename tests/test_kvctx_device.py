"""The kvctx / predictive format 2 GPU decoder (kvcodec.lossless.kvctx_device, kvcodec/lossless/cuda/kvctx_decode.cu).

CPU checks (always): the kernel source itself runs on the CPU (``tests/cuda_emulation``: g++ with the
CUDA names defined there, 32 threads per warp meeting at every warp collective) through the real host
code (stream parsing, chunk descriptors, tables, launches, the API's device checks), against the CPU
decoder on every dtype, special values, every prediction source and damaged streams; the kernel
compiles for sm_90 and sm_100. GPU checks (marked gpu, run on the device): ``decompress(blob,
device="cuda")`` of kvctx / predictive blobs decodes on the GPU bit-exactly, blobs it cannot take fall
back to the CPU, damaged blobs raise CorruptStreamError without a crash.
"""

from __future__ import annotations

import ctypes
import gc
import shutil
import zlib

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import container
from kvcodec.device import build
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import api, device_container, kvctx_device
from kvcodec.lossless.cuda import kvctx_decode as kd
from kvcodec.lossless.predictive import format2
from kvcodec.lossless.predictive.codec import encode_tensor

GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401
except Exception:
    GPU = False

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def kv_like(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Channels of different scales and offsets, some drifting over tokens (as keys do)."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    scale = torch.logspace(-2, 1, d)[torch.randperm(d, generator=g)]
    x = torch.randn(shape, generator=g) * scale + torch.randn(d, generator=g) * scale
    drift = torch.randn(shape, generator=g).cumsum(-2) * 0.1 * scale
    return (x + drift * (torch.arange(d) % 3 == 0)).to(dtype)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """NaN payloads, +-Inf, -0.0, subnormals and the largest values, spread over the tensor."""
    x = x.clone()
    flat = x.view(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])
    n = flat.numel()
    idx = torch.arange(0, n, max(1, n // 97))
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]
    for k, i in enumerate(idx.tolist()):
        flat[i] = specials[k % len(specials)] if k % 7 else flat[i]
    if x.element_size() > 1:
        bits[1] = 1  # smallest subnormal
        bits[2] = -1  # a NaN with every payload bit set
        bits[3] = bits[3] | 0x7F  # a NaN/Inf-range pattern or a large value
    else:
        bits[1] = 1
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


# ------------------------------------------------------------------------------------ CPU emulation
@pytest.fixture(scope="module")
def emulator(cpu_emulator):
    """The kernel compiled for the CPU (skipped without g++)."""
    lib = cpu_emulator("kvctx_decode_emulator")
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.kx_emulate.argtypes = [i, i, i, p, p, p, i, p, ll, ll, p, p, i, p, i, i, i, i, i, i, ll, p, p, p, p]
    lib.kx_emulate.restype = i
    return lib


def emulated_launch(lib, nr=kd.ROUNDS):
    """A stand-in for ``kvctx_decode.launch`` (same signature) running the kernel on CPU tensors (``nr``:
    its rounds per batch, 2 or 4)."""

    def launch(dp, words, bits, out, status, first=0, count=None, pred=None, pred_g0=0, lo16=0):
        plan = dp.plan
        count = plan.chunks.shape[0] - first if count is None else count
        if count <= 0:
            return
        _, tt, d = plan.shape
        scratch = plan.scratch(count, "cpu")
        rc = lib.kx_emulate(plan.out_kind, nr, plan.mag, words, bits,
                            dp.chunks + 8 * kd.CHUNK_FIELDS * first, count,
                            pred.data_ptr() if pred is not None else None, pred_g0, tt, dp.raw,
                            dp.layout, int(plan.shared), dp.tabs, *plan.grid, d, tt,
                            out.data_ptr(), lo16 or None, scratch.data_ptr() if scratch is not None else None,
                            status.data_ptr() + 4 * first)
        assert rc == 0

    return launch


def blob_of(meta, sections, t: torch.Tensor, codec: str, pred: bool) -> bytes:
    """A tensor blob around a codec stream (what ``compress`` writes)."""
    outer = {"codec": codec, "dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape), "device": "cpu",
             "crc32": zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()), "uses_prediction": pred,
             "codec_meta": meta}
    return container.dumps(api.KIND, outer, sections)


def emulated_decode(lib, blob: bytes, prediction=None, nr=kd.ROUNDS):
    """kvctx_device.decode on the CPU with the emulated kernel: (tensor, status, checks) or None."""
    b = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    header, end = device_container.read_header(b)
    secs, _ = device_container.sections(b, header, end)
    return kvctx_device.decode(header["meta"]["codec_meta"], secs, torch.device("cpu"), prediction,
                               launch=emulated_launch(lib, nr))


@pytest.fixture
def emulated_api(emulator, monkeypatch):
    """The API's device decode path on CPU tensors: kernel emulated, crc32 by zlib, CuPy assumed."""
    import kvcodec.device
    from kvcodec.device import crc32 as gcrc

    def crc32_many(bufs):
        return torch.tensor([zlib.crc32(b.contiguous().view(torch.uint8).numpy().tobytes()) for b in bufs])

    monkeypatch.setattr(kd, "launch", emulated_launch(emulator))
    monkeypatch.setattr(gcrc, "crc32_many", crc32_many)
    monkeypatch.setattr(kvcodec.device, "is_available", lambda: True)


CASES = [  # (shape, dtype, source): every chunk >= 16384 values (32 lanes)
    ((2, 128, 64), torch.bfloat16, "none"),  # D a multiple of 32: one lane per channel
    ((2, 1024, 8), torch.bfloat16, "none"),  # per-(g, d) parameters; D < 32: rounds start at lanes 0/8/16/24
    ((1, 12, 2050), torch.bfloat16, "none"),  # D too big for shared memory: deviations in a global scratch
    ((2, 128, 64), torch.float16, "none"),
    ((4, 64, 64), torch.float32, "none"),  # f32split: the lo16 section
    ((2, 128, 64), torch.float8_e5m2, "previous_token"),
    ((2, 128, 64), torch.bfloat16, "external"),
    ((2, 2, 64, 128), torch.bfloat16, "neighbour_layer"),
    ((2, 128, 64), torch.float8_e4m3fn, "external"),  # symbols counted by magnitude (meta "mag": 1, the default)
    ((1, 130, 130), torch.float8_e5m2, "external"),  # the same, rounds from any lane
]


@pytest.mark.parametrize("shape,dtype,source", CASES)
def test_emulated_kernel_equals_cpu_decoder(emulator, shape, dtype, source):
    x = with_specials(kv_like(shape, dtype if dtype.itemsize > 1 else torch.float32, seed=len(shape)).to(dtype))
    pred = kv_like(shape, torch.bfloat16, seed=5) if source == "external" else None
    meta, sections = encode_tensor(x, pred, source, version=2)
    assert meta["lanes"] == 32 and kvctx_device.gpu_decodable(meta)
    assert meta.get("mag", 0) == int(dtype.itemsize == 1 and source == "external")
    codec = "kvctx" if source == "none" else "predictive"
    blob = blob_of(meta, sections, x, codec, pred is not None)
    assert same_bits(kvcodec.decompress(blob, prediction=pred), x)  # the CPU decoder
    out, status, checks = emulated_decode(emulator, blob, pred)
    assert not status.any()
    assert same_bits(out, x)
    for t, crc, _ in checks:  # the prediction's checksum, as the CPU computes it
        assert zlib.crc32(t.contiguous().view(torch.uint8).numpy()) == crc


@pytest.mark.parametrize("shape,dtype,source", [((2, 128, 64), torch.bfloat16, "none"),
                                                ((1, 130, 130), torch.float16, "previous_token")])
def test_emulated_kernel_with_a_forced_magnitude_flag(emulator, shape, dtype, source):
    """A 16-bit stream with the "mag" flag forced (codec.encode_tensor's mag=True: not a default, but a valid
    stream): the kernel's flagged instances of 16-bit outputs decode it as the CPU does."""
    x = with_specials(kv_like(shape, dtype, seed=9))
    meta, sections = encode_tensor(x, None, source, version=2, mag=True)
    assert meta["mag"] == 1 and kvctx_device.gpu_decodable(meta)
    blob = blob_of(meta, sections, x, "kvctx" if source == "none" else "predictive", False)
    out, status, _ = emulated_decode(emulator, blob)
    assert not status.any() and same_bits(out, x)


@pytest.mark.parametrize("shape", [(2, 128, 64), (1, 130, 130)])
def test_emulated_kernel_with_four_rounds_per_batch(emulator, shape):
    """NR = 4 (a benchmark variant): rounds past D idle, D not a multiple of 32 rotates the lanes."""
    x = with_specials(kv_like(shape, seed=7))
    out, status, _ = emulated_decode(emulator, kvcodec.compress(x, layout="kv"), nr=4)
    assert not status.any() and same_bits(out, x)


def test_emulated_kernel_on_real_kv(emulator):
    from kvcodec.data import load_kv_sample

    keys = load_kv_sample().keys[:1]  # [layers, heads, tokens, head_dim] bf16: 49152 values, one chunk
    blob = kvcodec.compress(keys, layout="kv")
    out, status, _ = emulated_decode(emulator, blob)
    assert not status.any() and same_bits(out, keys)


def cpu_accepts(blob: bytes, x: torch.Tensor) -> bool:
    """Whether the CPU decoder decodes a (damaged) blob to ``x`` (a flip in a padding bit) or raises."""
    try:
        return same_bits(kvcodec.decompress(blob), x)
    except CorruptStreamError:
        return False


def test_emulated_kernel_flags_damaged_streams(emulator):
    """Payload or raw-bit words flipped (checksums recomputed): the kernel flags the chunk or its output
    differs (the tensor's crc32 catches it) exactly where the CPU decoder refuses the stream; it never
    runs out of bounds or hangs."""
    x = kv_like((2, 128, 64))
    blob = kvcodec.compress(x, layout="kv")
    kind, meta, sections = container.loads(blob)
    rng = np.random.default_rng(0)
    for trial in range(2):
        secs = {k: np.array(v) for k, v in sections.items()}
        name = ("payload", "bits")[trial % 2]
        words = secs[name]
        words[int(rng.integers(0, words.size))] ^= words.dtype.type(1 << int(rng.integers(0, 8 * words.itemsize)))
        forged = container.dumps(kind, meta, secs)
        out, status, _ = emulated_decode(emulator, forged)
        assert (not status.any() and same_bits(out, x)) == cpu_accepts(forged, x)


def test_checks_name_what_failed():
    """device_container.Checks.read (CPU tensors: checked on the host) says which check failed by name: a
    damaged section, an extra or early (tensor, crc32) pair, a decode status, the header of a cached plan."""
    x = kv_like((2, 128, 64))
    blob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8)
    header, end = device_container.read_header(blob)
    crc = header["meta"]["crc32"]
    secs, gaps = device_container.sections(blob, header, end)
    head_crc = zlib.crc32(blob[:end].numpy().tobytes())
    clean = device_container.Checks(blob, secs, gaps, (end, head_crc), [(x, crc)]).read([(x, crc)], torch.zeros(2))
    assert clean == device_container.Failed([], [False], [False], False, False, False)
    name = list(secs)[-1]
    bad = blob.clone()
    bad[secs[name].offset] ^= 1
    secs, gaps = device_container.sections(bad, header, end)
    got = device_container.Checks(bad, secs, gaps, (end, head_crc ^ 1), [(x, crc)]).read([(x, crc ^ 1)],
                                                                                     torch.tensor([0, 3]))
    assert got == device_container.Failed([name], [True], [False], False, True, True)


def test_emulated_api_path_decodes_and_checks(emulated_api):
    """api._decompress_on_device's kvctx branch: decoded, prediction and damage checked on the device."""
    x = kv_like((2, 128, 64))
    blob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8)
    assert same_bits(api._decompress_on_device(blob, torch.device("cpu"), None), x)
    pred = kv_like((2, 128, 64), seed=9)
    pblob = torch.frombuffer(bytearray(kvcodec.compress(x, prediction=pred)), dtype=torch.uint8)
    assert same_bits(api._decompress_on_device(pblob, torch.device("cpu"), None, pred), x)
    assert api._decompress_on_device(pblob, torch.device("cpu"), None) is None  # no prediction: the CPU raises
    with pytest.raises(CorruptStreamError, match="prediction differs"):
        api._decompress_on_device(pblob, torch.device("cpu"), None, pred + 1)
    kind, meta, sections = container.loads(blob.numpy().tobytes())
    secs = {k: np.array(v) for k, v in sections.items()}
    secs["payload"][len(secs["payload"]) // 2] ^= 1
    forged = torch.frombuffer(bytearray(container.dumps(kind, meta, secs)), dtype=torch.uint8)
    with pytest.raises(CorruptStreamError):
        api._decompress_on_device(forged, torch.device("cpu"), None)
    flipped = blob.clone()
    flipped[-1] ^= 1
    with pytest.raises(CorruptStreamError, match="checksum"):
        api._decompress_on_device(flipped, torch.device("cpu"), None)
    meta["crc32"] ^= 1  # every section intact, the tensor's crc32 not
    wrong = torch.frombuffer(bytearray(container.dumps(kind, meta, sections)), dtype=torch.uint8)
    with pytest.raises(CorruptStreamError, match="decoded tensor fails its checksum"):
        api._decompress_on_device(wrong, torch.device("cpu"), None)


def test_blobs_the_kernel_cannot_take_are_left_to_the_cpu():
    small = kv_like((2, 16, 64))  # chunks under 16384 values: 8 lanes
    meta, _ = encode_tensor(small, None, "none", version=2)
    assert meta["lanes"] == 8 and not kvctx_device.gpu_decodable(meta)
    meta1, _ = encode_tensor(kv_like((2, 128, 64)), None, "none", version=1)
    assert not kvctx_device.gpu_decodable(meta1)
    raw, _ = encode_tensor(torch.arange(20000, dtype=torch.int32).reshape(2, 100, 100), None, "none", version=2)
    assert not kvctx_device.gpu_decodable(raw)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_kernel_compiles_with_nvcc(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    proc = build.nvcc_compile(kd.SOURCE, kd.instance_declarations(), arch, tmp_path, extra=("-Xptxas", "-v"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bytes spill" not in proc.stderr or " 0 bytes spill stores" in proc.stderr


# ------------------------------------------------------------------------------------ GPU


@pytest.fixture
def gpu_calls(monkeypatch):
    """Counts kvctx_device.decode calls that reached the kernel (not a CPU fallback)."""
    calls = []
    real = kvctx_device.decode

    def counting(*a, **k):
        res = real(*a, **k)
        calls.append(res is not None)
        return res

    monkeypatch.setattr(kvctx_device, "decode", counting)
    return calls


GPU_CASES = [((2, 4, 256, 64), torch.bfloat16), ((3, 700, 40), torch.bfloat16), ((2, 2048, 16), torch.float16),
             ((4, 256, 64), torch.float32), ((1, 8, 2100), torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("shape,dtype", GPU_CASES)
@pytest.mark.parametrize("specials", [False, True])
def test_gpu_kvctx_decode_is_bit_exact(shape, dtype, specials, gpu_calls):
    x = kv_like(shape, dtype, seed=len(shape))
    x = with_specials(x) if specials else x
    blob = kvcodec.compress(x, layout="kv")
    host = kvcodec.decompress(blob)
    on_gpu = kvcodec.decompress(blob, device="cuda")  # host bytes, uploaded
    on_dev = kvcodec.decompress(torch.frombuffer(bytearray(blob), dtype=torch.uint8).cuda())  # device blob
    assert on_gpu.is_cuda and on_dev.is_cuda and gpu_calls == [True, True]
    assert same_bits(on_gpu, host) and same_bits(on_dev, x)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("nr,warps", [(1, 4), (2, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("shape", [(2, 4, 256, 64), (3, 700, 40)])
def test_gpu_kernel_variants_are_bit_exact(nr, warps, shape):
    """Every rounds-per-batch / warps-per-block instance the benchmark sweeps decodes the same bits."""
    from functools import partial

    x = with_specials(kv_like(shape, seed=4))
    blob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8).cuda()
    header, end = device_container.read_header(blob)
    secs, _ = device_container.sections(blob, header, end)
    out, status, _ = kvctx_device.decode(header["meta"]["codec_meta"], secs, blob.device,
                                         launch=partial(kd.launch, nr=nr, warps=warps))
    assert not status.any() and same_bits(out, x)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FP8])
def test_gpu_predictive_sources(dtype, gpu_calls):
    shape = (3, 2, 128, 64)
    x = with_specials(kv_like(shape, torch.float32).to(dtype))
    pred = kv_like(shape, torch.bfloat16, seed=3).cuda()
    for kw in ({"prediction": pred}, {"predictor": "previous_token"}, {"predictor": "neighbour_layer"}):
        meta, sections = encode_tensor(x, kw.get("prediction"), kw.get("predictor", "external"), version=2)
        blob = blob_of(meta, sections, x, "predictive", "prediction" in kw)
        out = kvcodec.decompress(blob, prediction=kw.get("prediction"), device="cuda")
        assert out.is_cuda and same_bits(out, x)
    assert gpu_calls == [True] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_decodes_flagged_streams(gpu_calls):
    """Streams with the "mag" flag: fp8 with a prediction (the default there) and a bf16 one with the flag forced
    (the flagged 16-bit instances, compiled on first use), decoded by the kernel bit for bit."""
    shape = (2, 4, 256, 64)
    pred = kv_like(shape, torch.bfloat16, seed=3)
    for dtype, mag in ((torch.float8_e4m3fn, None), (torch.float8_e5m2, None), (torch.bfloat16, True)):
        x = with_specials(kv_like(shape, torch.float32, seed=2).to(dtype))
        meta, sections = encode_tensor(x, pred, "external", version=2, mag=mag)
        assert meta["mag"] == 1
        out = kvcodec.decompress(blob_of(meta, sections, x, "predictive", True), prediction=pred.cuda(), device="cuda")
        assert out.is_cuda and same_bits(out, x)
    assert gpu_calls == [True] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_real_kv_and_wrong_prediction(gpu_calls):
    from kvcodec.data import load_kv_sample

    s = load_kv_sample()
    for t in (s.keys, s.values):
        blob = kvcodec.compress(t, layout="kv")
        assert same_bits(kvcodec.decompress(blob, device="cuda"), t)
    pred = s.keys.cuda().roll(1, -1)
    blob = kvcodec.compress(s.keys, prediction=pred.cpu())
    assert same_bits(kvcodec.decompress(blob, prediction=pred), s.keys)
    with pytest.raises(CorruptStreamError, match="prediction"):
        kvcodec.decompress(blob, prediction=pred + 1)
    assert all(gpu_calls)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_falls_back_for_blobs_it_cannot_take(gpu_calls):
    small = kv_like((2, 16, 64))  # 8 lanes
    fp8 = kv_like((2, 128, 64), torch.float32).to(torch.float8_e4m3fn)  # format 1 (the CPU decodes it)
    for t, version in ((small, None), (fp8, 1)):
        out = kvcodec.decompress(kvcodec.compress(t, layout="kv", version=version), device="cuda")
        assert out.is_cuda and same_bits(out, t)
    assert not any(gpu_calls)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_damaged_blobs_raise():
    x = kv_like((2, 4, 256, 64))
    blob = kvcodec.compress(x, layout="kv")
    host = np.frombuffer(blob, np.uint8)
    rng = np.random.default_rng(2)
    for trial in range(60):
        bad = host.copy()
        if trial % 3 == 0:
            pos = int(rng.integers(0, bad.size))
            bad[pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        elif trial % 3 == 1:
            bad = bad[: int(rng.integers(0, bad.size))]
        else:
            bad = np.concatenate([bad, rng.integers(0, 256, int(rng.integers(1, 40))).astype(np.uint8)])
        with pytest.raises(CorruptStreamError):
            kvcodec.decompress(torch.from_numpy(bad).cuda())
    kind, meta, sections = container.loads(blob)
    for trial in range(40):  # streams damaged with every checksum recomputed: the kernel's own checks
        secs = {k: np.array(v) for k, v in sections.items()}
        name = ("payload", "bits", "model")[trial % 3]
        words = secs[name]
        words[int(rng.integers(0, words.size))] ^= words.dtype.type(1 << int(rng.integers(0, 8 * words.itemsize)))
        forged = container.dumps(kind, meta, secs)
        try:
            gpu_ok = same_bits(kvcodec.decompress(torch.frombuffer(bytearray(forged), dtype=torch.uint8).cuda()), x)
        except CorruptStreamError:
            gpu_ok = False
        assert gpu_ok == cpu_accepts(forged, x)
    torch.cuda.synchronize()  # no illegal memory access left behind
    assert same_bits(kvcodec.decompress(blob, device="cuda"), x)


def test_emulated_kernel_decodes_model_parts(emulator, monkeypatch):
    """A stream whose model bytes are coded in parts (meta "mfields") decodes on the GPU path as on the
    CPU; the same tensor with one model stream (the original layout) too."""
    x = with_specials(kv_like((2, 128, 64), seed=9))
    for part in (format2.MODEL_PART_BYTES, 40):
        monkeypatch.setattr(format2, "MODEL_PART_BYTES", part)
        monkeypatch.setattr(format2, "FIELD_PART_BYTES", part)
        meta, sections = encode_tensor(x, None, "none", version=2)
        assert ("mfields" in meta) == (part == 40)
        blob = blob_of(meta, sections, x, "kvctx", False)
        assert same_bits(kvcodec.decompress(blob), x)
        out, status, _ = emulated_decode(emulator, blob)
        assert not status.any() and same_bits(out, x)


def test_emulated_api_reuses_the_plan_and_sees_writes_torch_does_not_count(emulated_api, monkeypatch):
    """A blob tensor decoded again reuses its header and plan (``BlobCache``); bytes changed behind
    torch's back (no ``_version`` bump) are still caught: a section by its crc32, the header by the
    entry's header crc32 (then decoded afresh, which refuses the damaged header)."""
    plans = []
    real = kvctx_device.plan
    monkeypatch.setattr(kvctx_device, "plan", lambda *a: plans.append(1) or real(*a))
    x = kv_like((2, 128, 64))
    blob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8)
    cpu = torch.device("cpu")
    for _ in range(3):
        assert same_bits(api._decompress_on_device(blob, cpu, None), x)
    assert len(plans) == 1
    raw = blob.numpy()  # writes through it leave blob._version alone
    for pos in (raw.size - 7, 40):  # the last section's payload, a byte of the JSON header
        raw[pos] ^= 1
        with pytest.raises(CorruptStreamError):
            api._decompress_on_device(blob, cpu, None)
        raw[pos] ^= 1
    assert same_bits(api._decompress_on_device(blob, cpu, None), x)
    blob[0] ^= 0  # an in-place torch write: the entry is not used
    assert same_bits(api._decompress_on_device(blob, cpu, None), x) and len(plans) >= 2
    key = id(blob)
    assert key in api._blob_plans._entries
    del blob  # the entry holds nothing that keeps the blob alive, and goes with it
    gc.collect()
    assert key not in api._blob_plans._entries


def test_emulated_api_reads_the_front_once(emulated_api, monkeypatch):
    """A first decode copies the blob's front once (header and model section together); a model section
    past the front is copied on its own; the window follows what the previous big blob needed."""
    reads = []
    real = device_container.download
    monkeypatch.setattr(device_container, "download", lambda t: reads.append(t.numel()) or real(t))
    monkeypatch.setattr(kvctx_device, "download", lambda t: reads.append(-t.numel()) or real(t))
    monkeypatch.setattr(api, "_blob_plans", device_container.BlobCache())  # nothing learned yet
    x = kv_like((2, 128, 64))
    blob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8)
    assert same_bits(api._decompress_on_device(blob, torch.device("cpu"), None), x)
    assert reads == [blob.numel()]  # a small blob: all of it, in one copy
    header, end = device_container.read_header(blob)
    secs, _ = device_container.sections(blob, header, end)
    reads.clear()
    ps, _ = kvctx_device.plan(header["meta"]["codec_meta"], secs, blob[:end].numpy())
    assert reads == [-secs["model"].nbytes] and ps.v2.lanes == 32  # past the front: its own copy
    n = 170 << 20
    plans = device_container.BlobCache()
    assert plans.front_window(n) == n // 128
    plans.note_front(n, 1 << 20)
    assert plans.front_window(n) == int(n * (1 << 20) * 1.02 / n)
    plans.note_front(1000, 900)  # a small blob teaches nothing
    plans.note_front(n, n)  # at most 1/16 of a blob, and at most _FRONT_MAX bytes
    assert plans.front_window(n) == min(n // 16, device_container._FRONT_MAX)
    assert plans.front_window(1 << 40) == device_container._FRONT_MAX
