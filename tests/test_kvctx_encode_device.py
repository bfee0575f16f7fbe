"""The kvctx / predictive format 2 GPU encoder (kvcodec.lossless.kvctx_device_encode, kvcodec/lossless/cuda/kvctx_encode.cu).

CPU checks (always): the kernel source itself runs on the CPU (``tests/cuda_emulation/kvctx_encode_emulator.cpp``:
g++ with the CUDA names defined there, 32 threads per warp meeting at every warp collective) through the real
driver (fit, tables, model section, chunk layout); its streams must decode with the CPU decoder bit-exactly
(every dtype, special values, the sources it takes) and compress within ~1% of the CPU encoder; the kernels
compile for sm_90 and sm_100. GPU checks (marked gpu, run on the device): ``compress`` of CUDA tensors
encodes on the GPU; the blob decodes on the CPU and on the GPU; damaged blobs raise CorruptStreamError.
"""

from __future__ import annotations

import ctypes
import shutil
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from test_kvctx_device import GPU, blob_of, kv_like, same_bits, with_specials

import kvcodec
from kvcodec.device import build
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import api
from kvcodec.lossless import kvctx_device_encode as kde
from kvcodec.lossless.cuda import kvctx_encode as ke
from kvcodec.lossless.predictive.codec import encode_tensor



@pytest.fixture(scope="module")
def emulator(cpu_emulator):
    """The encoder's kernels compiled for the CPU (skipped without g++)."""
    return cpu_emulator("kvctx_encode_emulator")


def _c(v):
    """A launcher argument as the ctypes value of its C type."""
    if isinstance(v, np.uint64):
        return ctypes.c_uint64(int(v))
    if isinstance(v, np.int64):
        return ctypes.c_longlong(int(v))
    return ctypes.c_int(int(v))


def emulated_runner(lib):
    """A stand-in for ``kvctx_encode.gpu_runner`` running the kernels on CPU tensors."""

    def run(name, grid, block, args, device, smem=0):
        base, _, tmpl = name.rstrip(">").partition("<")
        flags = {"true": 1, "false": 0}
        extra = () if base in ("ke_encode", "ke_bits") or not tmpl else tuple(
            ctypes.c_int(flags.get(v.strip(), None) if v.strip() in flags else int(v)) for v in tmpl.split(","))
        getattr(lib, base + "_emu")(ctypes.c_int(grid), ctypes.c_int(block), *extra, *(_c(a) for a in args))

    return run


def emulated_gather(scratch, cap, lens, dst_off, dst):
    """planes_codec.gather on CPU tensors: stream j = the last lens[j] words of scratch slot j."""
    for j, (n, off) in enumerate(zip(lens.tolist(), dst_off.tolist())):
        dst[off:off + n] = scratch[(j + 1) * cap - n:(j + 1) * cap]


@pytest.fixture
def zlib_crc(monkeypatch):
    from kvcodec.device import crc32 as gcrc

    monkeypatch.setattr(gcrc, "crc32_many", lambda bufs: torch.tensor(
        [zlib.crc32(b.contiguous().view(torch.uint8).numpy().tobytes()) for b in bufs]))


_NP = {torch.uint8: np.uint8, torch.int16: np.uint16, torch.int32: np.uint32}


def host_sections(sections: dict) -> dict:
    """Device-encoder sections as the numpy sections the CPU writes (uint8 / uint16 / uint32)."""
    return {k: v.cpu().numpy().view(_NP[v.dtype]) for k, v in sections.items()}


def emulated_blob(lib, x, pred, source):
    meta, sections = kde.encode(x, pred, source, runner=emulated_runner(lib), gather=emulated_gather)
    codec = "kvctx" if source == "none" else "predictive"
    return meta, host_sections(sections), blob_of(meta, host_sections(sections), x, codec, pred is not None)


def compressed_size(sections: dict) -> int:
    return sum(v.nbytes for v in sections.values())


CASES = [  # (shape, dtype, source): every chunk >= 16384 values (32 lanes)
    ((2, 128, 64), torch.bfloat16, "none"),  # shared or per-(g, d): the cost decides
    ((1, 1024, 24), torch.bfloat16, "none"),  # per-(g, d); D < 32: warps of columns of several lanes' tokens
    ((10, 16, 1024), torch.bfloat16, "none"),  # chunks of 4 g's, the last of 2; shared parameters
    ((1, 2100, 32), torch.float16, "external"),  # token blocks of 2048 and 52
    ((4, 64, 64), torch.float32, "none"),  # f32split: the lo16 section
    ((2, 128, 64), torch.float8_e5m2, "previous_token"),
    ((3, 2, 64, 128), torch.bfloat16, "neighbour_layer"),  # chunks within a layer, the gain fitted
    ((2, 128, 64), torch.float8_e4m3fn, "external"),  # symbols counted by magnitude (meta "mag": 1), as on the CPU
    ((1, 200, 96), torch.float8_e5m2, "external"),
]


@pytest.mark.parametrize("shape,dtype,source", CASES)
def test_emulated_encoder_streams_decode_on_the_cpu(emulator, zlib_crc, shape, dtype, source):
    x = with_specials(kv_like(shape, torch.float32, seed=len(shape) + 1).to(dtype))
    pred = kv_like(shape, torch.bfloat16, seed=5) if source == "external" else None
    meta, secs, blob = emulated_blob(emulator, x, pred, source)
    cpu_meta, cpu_secs = encode_tensor(x, pred, source, version=2)
    assert meta == cpu_meta | {"shared": meta["shared"]}  # the same fields (sharing: chosen on its own sums)
    assert same_bits(kvcodec.decompress(blob, prediction=pred), x)
    assert compressed_size(secs) <= 1.01 * compressed_size(cpu_secs) + 64


def test_emulated_encoder_shared_parameters_chosen_on_the_device(emulator, zlib_crc):
    """Equal rows under every g: the shared parameters cost less, chosen without a host round trip
    (kvctx_device_fit.choose); the stream stores only their D channels and decodes bit-exactly."""
    x = kv_like((1, 128, 64), seed=8).to(torch.bfloat16).expand(3, 128, 64).contiguous()
    meta, secs, blob = emulated_blob(emulator, x, None, "none")
    assert meta["shared"] is True and same_bits(kvcodec.decompress(blob), x)
    y = x.clone()
    y[1] = y[1] * 64  # scales that differ per g: per-(g, d) parameters
    meta, secs, blob = emulated_blob(emulator, y, None, "none")
    assert meta["shared"] is False and same_bits(kvcodec.decompress(blob), y)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]),
       source=st.sampled_from(["none", "external", "previous_token"]), d=st.sampled_from([16, 48, 64]),
       extra=st.integers(0, 90), g=st.integers(1, 2), noise=st.floats(0.0, 0.3), seed=st.integers(0, 2**31 - 1))
def test_emulated_encoder_on_random_bit_patterns(emulator, zlib_crc, dtype, source, d, extra, g, noise, seed):
    """KV-like values with a random share replaced by uniformly random bit patterns (NaN payloads, Inf,
    subnormals, huge values): the stream decodes bit-exactly on the CPU."""
    shape = (g, -(-16384 // d) + extra, d)
    x = kv_like(shape, torch.float32, seed=seed % 1000).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    bits = x.view(-1).view(_BITS[x.element_size()])
    hit = torch.rand(bits.numel(), generator=gen) < noise
    bits[hit] = torch.randint(-2**31, 2**31 - 1, (int(hit.sum()),), generator=gen).to(bits.dtype)
    pred = kv_like(shape, torch.bfloat16, seed=seed % 7) if source == "external" else None
    _, _, blob = emulated_blob(emulator, x, pred, source)
    assert same_bits(kvcodec.decompress(blob, prediction=pred), x)


@pytest.mark.parametrize("dtype,source", [(torch.float32, "none"), (torch.float8_e4m3fn, "external")])
def test_emulated_encoder_equals_cpu_bytes_with_the_same_model(emulator, zlib_crc, dtype, source):
    """A large-scale channel set where the fitted parameters agree: the streams are the CPU's byte for byte (fp8
    with a prediction: symbols counted by magnitude, the flag in the same place of the meta)."""
    x = kv_like((2, 256, 64), seed=3).to(dtype)
    pred = kv_like((2, 256, 64), torch.bfloat16, seed=5) if source == "external" else None
    meta, secs, _ = emulated_blob(emulator, x, pred, source)
    cpu_meta, cpu_secs = encode_tensor(x, pred, source, version=2)
    assert list(meta) == list(cpu_meta) and meta.get("mag", 0) == int(source == "external")
    if not np.array_equal(secs["model"][:200], cpu_secs["model"][:200]):
        pytest.skip("the fitted parameters differ in a last bit (allowed: they are stored)")
    assert meta == cpu_meta
    for k in cpu_secs:
        assert np.array_equal(secs[k], cpu_secs[k]), k


def test_emulated_encoder_damaged_stream_raises(emulator, zlib_crc):
    from kvcodec import container

    x = kv_like((2, 128, 64), seed=4)
    _, _, blob = emulated_blob(emulator, x, None, "none")
    kind, meta, sections = container.loads(blob)
    secs = {k: np.array(v) for k, v in sections.items()}
    secs["payload"][len(secs["payload"]) // 3] ^= 1
    with pytest.raises(CorruptStreamError):
        kvcodec.decompress(container.dumps(kind, meta, secs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_device_bin_params_equal_the_host_ones(emulator, dtype):
    """ke_bin_params (+ kvctx_device_fit.field_planes / field_bytes / plane_histograms) ==
    format2.BinParams.from_channel,
    kernel_args and field_bytes, bit for bit; with the shared row broadcast where it won."""
    from kvcodec.lossless.predictive.bins import bin_grid
    from kvcodec.lossless.predictive.format2 import BinParams
    from kvcodec.lossless.predictive.params import S_MAX, S_MIN, ChannelParams, from_bf16_bits, to_bf16_bits

    rng = np.random.default_rng(1)
    shape = (3, 500)
    s = from_bf16_bits(to_bf16_bits(np.clip(10.0 ** rng.uniform(-42, 32, shape), S_MIN, S_MAX)))
    m = from_bf16_bits(to_bf16_bits(rng.normal(size=shape) * 10.0 ** rng.uniform(-45, 38, shape)))
    c = rng.integers(-127, 128, shape).astype(np.int8)
    a = rng.integers(-64, 65, shape).astype(np.int8)
    grid = bin_grid(dtype)
    cands = kde.kfit.Candidates(m=torch.from_numpy(m.reshape(-1)), s=torch.from_numpy(s.reshape(-1)),
                                c=torch.from_numpy(c.reshape(-1)), a=torch.from_numpy(a.reshape(-1)), bits=None,
                                bounds=[0, 2, 3], choices=(False, True), d=shape[1])
    for won, rows in ((0, [0, 1]), (1, [2, 2])):
        want = BinParams.from_channel(ChannelParams(m=m[rows], s=s[rows], c=c[rows], a=a[rows], masses=None,
                                                    shared=False), grid)
        values, margs = kde.kfit.bin_params(cands, torch.tensor(won), grid, emulated_runner(emulator))
        for source in ("none", "previous_token", "neighbour_layer"):  # the stored fields' bytes
            planes, stats = kde.kfit.field_planes(values, source)
            head, body, widths = kde.kfit.field_bytes(planes, stats.numpy(), 2 * shape[1])
            body = body.numpy()
            want_head, want_body = want.field_bytes(source)
            assert head == want_head and np.array_equal(body, want_body), source
            hist = kde.kfit.plane_histograms(planes, shape[1], emulated_runner(emulator)).numpy()  # [first d, all]
            assert np.array_equal(kde.kfit.field_counts(hist[1], widths), np.bincount(want_body, minlength=256))
        km, kc, ka, es, level = want.kernel_args(grid)
        for dev_arg, host in zip(margs[:3], (km, kc, ka)):
            assert np.array_equal(dev_arg.numpy().view(np.int64), host.reshape(-1).view(np.int64))
        assert np.array_equal(margs[3].numpy(), np.stack([es.reshape(-1), level.reshape(-1)], 1))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(["none", "external", "previous_token", "neighbour_layer"]), g=st.integers(1, 3),
       t=st.integers(2, 90), noise=st.floats(0.0, 0.2), seed=st.integers(0, 2**31 - 1))
def test_fit_kernels_equal_the_host_formulas(emulator, source, g, t, noise, seed):
    """ke_fit_location / _coefficient / _scale (kvctx_device_fit.fit) on the host's own sums ==
    params.fit_params' m, s, c, a bit for bit, shared and per-(g, d), specials included."""
    from kvcodec.lossless.predictive import params
    from kvcodec.lossless.predictive.grid import grid_for

    x = kv_like((g, t, 32), torch.float32, seed=seed % 1000).to(torch.bfloat16)
    bits = x.view(torch.int16).view(-1)
    gen = torch.Generator().manual_seed(seed)
    hit = torch.rand(bits.numel(), generator=gen) < noise
    bits[hit] = torch.randint(-2**15, 2**15 - 1, (int(hit.sum()),), generator=gen).to(torch.int16)
    grid = grid_for(torch.bfloat16)
    kx = grid.k_of_bits[x.view(torch.int16).numpy().view(np.uint16)]
    pred = kv_like((g, t, 32), torch.float32, seed=3).numpy() if source in ("external", "neighbour_layer") else None
    p = pred if pred is not None else np.zeros((1, 1, 1), np.float32)
    gain = {"external": "one", "neighbour_layer": "fit"}.get(source, "zero")
    prev_coef = "one" if source == "previous_token" else "fit"
    with np.errstate(all="ignore"):
        width = np.diff(grid.edges)
        log_width = np.where(np.isfinite(width) & (width > 0), np.log2(width), np.nan)
    mom = np.zeros((g, 32, 7))
    params._fit_moments(kx, p, pred is not None, grid.valf, grid.finite, log_width, mom)

    def residuals(locs):
        out = []
        for m, c, a, sh in locs:
            res = np.zeros((g, 32, 3))
            params._fit_residuals(kx, p, pred is not None, m.numpy(), c.numpy(), a.numpy(), sh, grid.valf,
                                  grid.finite, t, np.zeros((1, 1)), res, np.zeros((g, params.SHAPE_BINS), np.int64))
            out.append(torch.from_numpy(res.sum(axis=0, keepdims=True) if sh else res))
        return out

    cands = kde.kfit.fit(torch.from_numpy(mom), residuals, gain, prev_coef, (False, True), emulated_runner(emulator))
    for k, sh in enumerate((False, True)):
        want = params.fit_params(kx, pred, grid, t, gain, prev_coef, sh, shape=False)
        rows = slice(cands.bounds[k] * 32, cands.bounds[k + 1] * 32)
        for f in ("m", "s", "c", "a"):
            got = getattr(cands, f)[rows].numpy()
            assert np.array_equal(got.view(np.uint8), np.asarray(getattr(want, f)).reshape(-1).view(np.uint8)), f


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 10, 10**6, 10**13]))
def test_parallel_tables_equal_fit_tables(seed, scale):
    """tables.fit_tables, compiled rows in one pass or on the thread pool (as the GPU encoder calls it) ==
    quantize_frequencies row by row: unused classes, one symbol, sparse and dense rows, small and huge counts."""
    from kvcodec.entropy.freq import quantize_frequencies
    from kvcodec.lossless.predictive import format2
    from kvcodec.lossless.predictive.bins import N_CLASSES
    from kvcodec.lossless.predictive.tables import fit_tables

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, scale + 1, (N_CLASSES, 256)) * (rng.random((N_CLASSES, 256)) < rng.random((N_CLASSES, 1)))
    counts[rng.random(N_CLASSES) < 0.3] = 0
    want = np.zeros((N_CLASSES, 256), np.int64)
    for k in np.flatnonzero(counts.sum(axis=1)):
        want[k] = quantize_frequencies(counts[k], 12)
    assert np.array_equal(fit_tables(counts), want)
    assert np.array_equal(fit_tables(counts, format2._pool()), want)


def test_calls_the_gpu_encoder_does_not_take():
    assert kde.unsupported(torch.zeros(4), "none", None) is not None  # a CPU tensor
    meta_t = torch.empty((2, 128, 64), dtype=torch.bfloat16, device="meta")
    assert kde.unsupported(meta_t, "none", None) is not None
    assert kde.route(torch.zeros(2, 128, 64), None, "kvctx", {}, None) is None


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_kernels_compile_with_nvcc(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    proc = build.nvcc_compile(ke.SOURCE, ke.instance_declarations(), arch, tmp_path, extra=("-Xptxas", "-v"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bytes spill" not in proc.stderr or " 0 bytes spill stores" in proc.stderr


# ------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")


@pytest.fixture
def gpu_encodes(monkeypatch):
    """Counts kvctx_device_encode.encode calls (the GPU encoder was used)."""
    calls = []
    real = kde.encode

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(kde, "encode", counting)
    return calls


GPU_CASES = [((2, 4, 256, 64), torch.bfloat16, "none"), ((3, 700, 40), torch.bfloat16, "none"),
             ((2, 2048, 16), torch.float16, "none"), ((4, 256, 64), torch.float32, "none"),
             ((1, 8, 2100), torch.bfloat16, "none"), ((2, 4, 256, 64), torch.bfloat16, "external"),
             ((2, 4, 256, 64), torch.bfloat16, "previous_token"),
             ((3, 2, 256, 64), torch.float16, "neighbour_layer")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape,dtype,source", GPU_CASES)
@pytest.mark.parametrize("specials", [False, True])
def test_gpu_encode_decodes_everywhere(shape, dtype, source, specials, gpu_encodes):
    x = kv_like(shape, dtype, seed=len(shape))
    x = (with_specials(x) if specials else x).cuda()
    pred = kv_like(shape, torch.bfloat16, seed=7).cuda() if source == "external" else None
    kw = {"prediction": pred} if pred is not None else (
        {"layout": "kv"} if source == "none" else {"codec": "predictive", "predictor": source})
    blob = kvcodec.compress(x, **kw)
    dblob = api.compress_device(x, **kw)
    assert len(gpu_encodes) == 2 and bytes(dblob.cpu().numpy()) == blob
    p_cpu = pred.cpu() if pred is not None else None
    assert same_bits(kvcodec.decompress(blob, prediction=p_cpu, device="cpu"), x)  # the CPU decoder
    assert same_bits(kvcodec.decompress(dblob, prediction=pred), x)  # the GPU decoder, device blob
    cpu_blob = kvcodec.compress(x.cpu(), prediction=p_cpu, **{k: v for k, v in kw.items() if k != "prediction"})
    assert same_bits(kvcodec.decompress(cpu_blob, prediction=pred, device="cuda"), x)
    assert len(blob) <= 1.01 * len(cpu_blob) + 256


@pytest.mark.gpu
@gpu
def test_gpu_encode_fp8_version2_and_fallbacks(gpu_encodes):
    x = kv_like((2, 128, 64), torch.float32).to(torch.float8_e4m3fn).cuda()
    blob = kvcodec.compress(x, layout="kv", version=1)  # format 1: the CPU encodes it
    assert gpu_encodes == [] and same_bits(kvcodec.decompress(blob), x)
    blob2 = kvcodec.compress(x, layout="kv")  # fp8 without a prediction: format 2 by default, on the GPU
    assert gpu_encodes == [1] and same_bits(kvcodec.decompress(blob2, device="cpu"), x)
    small = kv_like((2, 16, 64)).cuda()  # 8-lane chunks: the CPU
    assert same_bits(kvcodec.decompress(kvcodec.compress(small, layout="kv")), small) and gpu_encodes == [1]
    with pytest.raises(ValueError, match="gpu=True: chunks under"):
        kvcodec.compress(small, layout="kv", gpu=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_encode_fp8_with_a_prediction_counts_by_magnitude(dtype, gpu_encodes):
    """fp8 with a prediction: the GPU encoder writes the "mag" flag where the CPU encoder does; either decoder reads
    either's stream bit for bit; with the same fitted model the codec meta (key order too) and sections are the CPU
    encoder's byte for byte."""
    from kvcodec import container

    shape = (2, 4, 256, 64)
    x = with_specials(kv_like(shape, torch.float32, seed=11).to(dtype)).cuda()
    pred = kv_like(shape, torch.bfloat16, seed=7).cuda()
    dblob = bytes(api.compress_device(x, prediction=pred).cpu().numpy())
    assert gpu_encodes == [1]
    cpu_blob = kvcodec.compress(x.cpu(), prediction=pred.cpu())
    for blob in (dblob, cpu_blob):
        assert container.loads(blob)[1]["codec_meta"]["mag"] == 1
        assert same_bits(kvcodec.decompress(blob, prediction=pred.cpu(), device="cpu"), x)
        assert same_bits(kvcodec.decompress(blob, prediction=pred, device="cuda"), x)
    (_, gm, gs), (_, cm, cs) = (container.loads(b) for b in (dblob, cpu_blob))  # (outer metas: "device" differs)
    if np.array_equal(np.asarray(gs["model"])[:200], np.asarray(cs["model"])[:200]):  # the same fitted fields (they
        assert list(gm["codec_meta"].items()) == list(cm["codec_meta"].items())  # may differ in a last bit)
        assert list(gs) == list(cs) and all(np.array_equal(np.asarray(gs[k]), np.asarray(cs[k])) for k in cs)
    assert len(dblob) <= 1.01 * len(cpu_blob) + 256


@pytest.mark.gpu
@gpu
def test_gpu_encoded_damaged_blobs_raise():
    x = kv_like((2, 4, 256, 64)).cuda()
    host = np.frombuffer(kvcodec.compress(x, layout="kv"), np.uint8)
    rng = np.random.default_rng(5)
    for trial in range(30):
        bad = host.copy()
        if trial % 2:
            bad[int(rng.integers(0, bad.size))] ^= np.uint8(1 << int(rng.integers(0, 8)))
        else:
            bad = bad[: int(rng.integers(0, bad.size))]
        for dev in ("cpu", "cuda"):
            with pytest.raises(CorruptStreamError):
                kvcodec.decompress(torch.from_numpy(bad).to(dev) if dev == "cuda" else bad.tobytes())
    torch.cuda.synchronize()


def test_emulated_encoder_writes_model_parts(emulator, zlib_crc, monkeypatch):
    """Model bytes past MODEL_PART_BYTES: the GPU encoder writes the parts layout (meta "mfields") as the
    CPU encoder does, its parts coded by the payload kernel equal ``format2.code_model``'s bytes for the
    same fields and tables (several parts of uneven sizes, partial last groups), and the stream decodes
    bit-exactly on the CPU."""
    from kvcodec.lossless.predictive import format2

    monkeypatch.setattr(format2, "MODEL_PART_BYTES", 64)
    monkeypatch.setattr(format2, "FIELD_PART_BYTES", 45)
    seen = {}
    for mod, name in ((kde.kfit, "field_bytes"), (kde, "table_bytes")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: seen.setdefault(_name, _real(*a, **k)))
    x = kv_like((2, 128, 64), seed=6)
    meta, sections, blob = emulated_blob(emulator, x, None, "none")
    cpu_meta, _ = encode_tensor(x, None, "none", version=2)
    assert meta["mfields"] > 2 and meta == cpu_meta | {"shared": meta["shared"], "mfields": meta["mfields"]}
    head, fields, _ = seen["field_bytes"]
    body, parts = format2.code_model(fields.numpy(), seen["table_bytes"])
    want = (len(head) + len(body)).to_bytes(4, "little") + head + body
    assert parts == {"mfields": meta["mfields"]} and sections["model"][:len(want)].tobytes() == want
    assert same_bits(kvcodec.decompress(blob), x)


def test_emulated_raw_bits_pack_lsb_first_and_count_miscounts(emulator):
    """ke_bits (kvctx_encode.raw_bits) == the chunks' raw codes packed LSB-first in value order (chunks of
    several g's, a stride between them); a chunk whose total disagrees with its codes' bit counts, one
    without raw bits included, is counted in n_bad."""
    rng = np.random.default_rng(7)
    g, per, stride = 3, 70, 100  # 3 chunks of 2 g's (the last of 1), each g 70 values of a 100-value row
    nb = rng.integers(0, 33, 6 * stride)
    code = rng.integers(0, 1 << 32, nb.size, dtype=np.uint64) & ((np.uint64(1) << nb.astype(np.uint64)) - np.uint64(1))
    nb[4 * stride:6 * stride] = 0  # chunk 2: no raw bits
    raw = torch.from_numpy((code << np.uint64(8) | nb.astype(np.uint64)).view(np.int64))
    desc = np.array([[0, 2, per, stride], [2 * stride, 2, per, stride], [4 * stride, 2, per, stride]], np.int64)
    order = [np.concatenate([np.arange(c[0] + k * stride, c[0] + k * stride + per) for k in range(c[1])]) for c in desc]
    totals = np.array([int(nb[o].sum()) for o in order])
    words = (totals + 31) // 32
    starts = np.concatenate([[0], np.cumsum(words)[:-1]])
    for bad in ([], [0], [2]):
        t = totals.copy()
        t[bad] += 1  # chunk 0: one bit too many; chunk 2: bits where it has none
        n_bad = torch.zeros(1, dtype=torch.int64)
        st = np.concatenate([[0], np.cumsum((t + 31) // 32)[:-1]])
        bits = ke.raw_bits(raw, torch.from_numpy(desc), torch.from_numpy(t), torch.from_numpy(st), n_bad,
                           int(((t + 31) // 32).sum()), emulated_runner(emulator)).numpy().view(np.uint32)
        assert int(n_bad[0]) == len(bad)
        for j, o in enumerate(order):
            if j in bad:
                continue
            stream = sum(int(c) << int(p) for c, p in zip(code[o], np.concatenate([[0], np.cumsum(nb[o])[:-1]])))
            want = np.array([(stream >> (32 * w)) & 0xFFFFFFFF for w in range(words[j])], np.uint32)
            assert np.array_equal(bits[st[j]:st[j] + words[j]], want), j
