"""The planes codec on a GPU (kvcodec.lossless.planes_device, kvcodec.lossless.cuda.planes_codec / crc32).

CPU checks (always): the CRC decomposition of crc32.cu against zlib, a lane-by-lane numpy emulation of
the encode kernel against the CPU encoder, the kernels compile for sm_90 and sm_100, and the device
reader's header checks. GPU checks (marked gpu, run on the device): GPU blobs equal CPU blobs byte for
byte, round trips for every dtype and special value, blobs cross devices, and damaged blobs raise
CorruptStreamError without a crash.
"""

from __future__ import annotations

import math
import shutil
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec import container
from kvcodec.device import build
from kvcodec.device import crc32 as gcrc
from kvcodec.entropy import rans_lanes
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import compress, decompress, planes, planes_device
from kvcodec.lossless.api import compress_device
from kvcodec.lossless.cuda import planes_codec as pc

from test_lossless_planes import assert_bit_exact, random_bits, weights_like

GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401
except Exception:
    GPU = False


# ------------------------------------------------------------------------------------ CPU checks
@pytest.mark.parametrize("n,ptr", [(0, 0), (1, 3), (15, 1), (16, 0), (17, 15), (300, 7), (16385, 5), (40000, 9)])
def test_crc_decomposition_equals_zlib(n, ptr):
    data = np.random.default_rng(n).integers(0, 256, n).astype(np.uint8).tobytes()
    assert gcrc.reference(data, ptr) == zlib.crc32(data)


def emulate_encode(sym: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """pc_rans_encode's warp in numpy (block loads + shuffles, ballot positions, reciprocal division);
    returns the stream (uint16 words)."""
    n = sym.size
    cum = np.concatenate(([0], np.cumsum(freq)[:-1])).astype(np.int64)
    rcp = np.where(freq >= 2, (1 << 32) // np.maximum(freq, 1), 0xFFFFFFFF).astype(np.int64)
    lanes = np.arange(32)
    below = (1 << lanes) - 1

    def load(b):
        if b < 0:
            return np.zeros(32, np.int64)
        v = np.zeros(32, np.int64)
        for k in range(32):
            off = 128 * b + 4 * k
            for t in range(4):
                if off + t < n:
                    v[k] |= int(sym[off + t]) << (8 * t)
        return v

    cap = n + 64
    words = np.zeros(cap, np.int64)
    wp = cap
    x = np.full(32, 1 << 16, np.int64)
    G = (n + 31) >> 5
    blk = (G - 1) >> 2
    cur, nx1, nx2 = load(blk), load(blk - 1), load(blk - 2)
    for blk in range(blk, -1, -1):  # the kernel's loop: blocks from the top, their 4 groups unrolled
        for gi in (3, 2, 1, 0):
            g = 4 * blk + gi
            if g >= G:
                continue
            word = cur[8 * gi + (lanes >> 2)]
            s = (word >> (8 * (lanes & 3))) & 0xFF
            active = 32 * g + lanes < n
            f = freq[s]
            need = active & ((x >> 20) >= f)
            m = int(np.sum(need.astype(np.int64) << lanes))
            cnt = bin(m).count("1")
            pos = wp - cnt + np.array([bin(m & int(b)).count("1") for b in below])
            words[pos[need]] = x[need] & 0xFFFF
            x = np.where(need, x >> 16, x)
            wp -= cnt
            q = (x * rcp[s]) >> 32
            r = x - q * f
            q, r = np.where(r >= f, q + 1, q), np.where(r >= f, r - f, r)
            x = np.where(active, (q << 12) + r + cum[s], x)
        cur, nx1, nx2 = nx1, nx2, load(blk - 3)
    words[wp - 64 + 2 * lanes] = x & 0xFFFF
    words[wp - 64 + 2 * lanes + 1] = x >> 16
    return words[wp - 64:].astype(np.uint16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.one_of(st.sampled_from([1, 31, 32, 33, 127, 128, 129, 513]), st.integers(1, 1500)),
       spread=st.sampled_from([0.5, 3, 40]), seed=st.integers(0, 2**31))
def test_emulated_encode_kernel_equals_cpu_encoder(n, spread, seed):
    from kvcodec.entropy.freq import quantize_frequencies

    rng = np.random.default_rng(seed)
    sym = ((int(rng.integers(0, 256)) + np.round(rng.laplace(0, spread, n))) % 256).astype(np.uint8)
    freq = quantize_frequencies(np.bincount(sym, minlength=256), rans_lanes.PRECISION).astype(np.int64)
    words = np.empty(n + 64, np.uint16)
    start = rans_lanes.encode(sym, 0, n, np.zeros(1, np.uint8), freq[None], rans_lanes.cumulative(freq[None]), 32, words)
    assert np.array_equal(emulate_encode(sym, freq), words[start:])


def emulate_stream_desc(data, jobs, planes, n_chunks, chunk, n, pdesc, freqs, slots, tables):
    """pc_stream_desc (planes_codec.cu) in numpy: payload rows from the blob's chunk lengths, bad ones
    with byte length 0; each plane's decode table from its frequencies (the words of its own loop)."""
    assert all(isinstance(t, torch.Tensor) for t in (data, jobs, pdesc, freqs, tables))  # the kernel's pointers
    raw = data.numpy()
    for j, (loff, soff, words, ooff, toff, lo) in enumerate(jobs.numpy().reshape(-1, pc.DESC_JOB)[:planes].tolist()):
        f = freqs.numpy().reshape(-1, 256)[j].astype(np.int64)
        cum = np.concatenate(([0], np.cumsum(f)))
        s = np.arange(slots)
        sym = np.searchsorted(cum, s, side="right") - 1  # the last symbol with cum <= s
        words_ = ((sym - lo) << 24) | ((f[sym] - 1) << 12) | (s - cum[sym])
        tables.view(-1)[toff: toff + 4 * slots] = torch.from_numpy(words_.astype("<u4").view(np.uint8))
        if not n_chunks:
            continue
        lens = np.frombuffer(raw[loff: loff + 4 * n_chunks].tobytes(), "<u4").astype(np.int64)
        before = np.cumsum(lens) - lens
        ok = (lens >= 64) & (before + lens <= words)
        ok[-1] &= before[-1] + lens[-1] == words
        a = np.arange(n_chunks, dtype=np.int64) * chunk
        pdesc[j * n_chunks: (j + 1) * n_chunks] = torch.from_numpy(np.stack(
            [soff + 2 * np.where(ok, before, 0), np.where(ok, 2 * lens, 0), ooff + a, np.minimum(chunk, n - a)], 1))


def _device_rows(blob: bytes):
    """(sections, info, launch_inputs' parts, emulated device rows) of a format-3 planes blob."""
    from kvcodec.entropy.cuda.rans import LaunchPlan, build_table
    from kvcodec.lossless import device_container
    from kvcodec.lossless.planes import PlaneCodec, _dtype_shape

    bt = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    header, end = device_container.read_header(bt)
    secs, _ = device_container.sections(bt, header, end)
    meta = header["meta"]["codec_meta"]
    layout, itemsize, chunk, n_chunks, info, _ = PlaneCodec()._prepare(meta, secs, *_dtype_shape(meta), device=True)
    n = math.prod(meta["shape"])
    coded, none, table_of, tables, jobs, freqs = planes_device.launch_inputs(True, secs, info, n, chunk, n_chunks, n)
    assert none is None and coded
    pdesc = torch.zeros((len(table_of), 4), dtype=torch.int64)
    plan = LaunchPlan.build(pdesc, table_of, tables, "cpu", also=[jobs, freqs])
    emulate_stream_desc(bt, plan.also[0], len(coded), n_chunks, chunk, n, pdesc, plan.also[1], rans_lanes.M,
                        plan.table_data)
    host = [build_table(info[k][3][0], rans_lanes.PRECISION, np.uint8) for k in coded]  # the same tables
    assert [(t.mode, t.precision, t.lo, t.smem_words, t.aux, t.symbytes) for t in host] == \
        [(t.mode, t.precision, t.lo, t.smem_words, t.aux, t.symbytes) for t in tables]
    assert plan.table_data.numpy().tobytes() == b"".join(t.data.tobytes() for t in host)
    return bt, secs, info, (layout, itemsize, chunk, n_chunks, n), (coded, plan), pdesc.numpy()


def test_device_decode_launch_through_the_emulated_kernel():
    """The blob's own bytes, the device reader's sections and the payload rows made from its
    chunk-length sections (the emulated pc_stream_desc; equal to the host's rows from the same
    lengths), decoded by the lane-by-lane emulation of rans_decode.cu (tests/test_cuda_rans.py),
    merged: the original bits. Damaged lengths give the damaged chunks byte length 0."""
    from types import SimpleNamespace

    from kvcodec.lossless.planes import merge_planes

    from test_cuda_rans import emulate_launch

    odd = 0
    for dtype, shape, cb in ((torch.bfloat16, (21, 50), 256), (torch.float32, (21, 50), 256),
                             (torch.float8_e4m3fn, (60, 64), 1024)):
        t = weights_like(dtype, shape)
        blob = compress(t, codec="planes", max_classes=1, chunk_bytes=cb)
        bt, secs, info, (layout, itemsize, chunk, n_chunks, n), (coded, plan), pdesc = _device_rows(blob)
        host = [("rans", None, np.concatenate(([0], np.cumsum(secs[f"p{k}.len"].bytes.numpy().view("<u4"))))) if
                p[0] == "rans" else p for k, p in enumerate(info)]
        assert np.array_equal(pdesc, planes_device.stream_descriptors(secs, host, n, chunk, n_chunks))
        odd += int(np.sum(pdesc[:, 0] % 4 == 2))
        batch = SimpleNamespace(data=bt, pdesc=plan.pdesc, order=plan.order, blocks=plan.blocks, tdesc=plan.tdesc,
                                table_data=plan.table_data, smem_bytes=plan.smem_bytes, out_bytes=len(coded) * n,
                                n_payloads=len(pdesc))
        out, status = emulate_launch(batch)
        assert (status[: len(pdesc)] == 0).all()
        planes = [np.full(n, p[1], np.uint8) if p[0] == "const" else secs[f"p{k}"].bytes.numpy() if p[0] == "raw"
                  else out[coded.index(k) * n: (coded.index(k) + 1) * n] for k, p in enumerate(info)]
        res = np.empty(n * itemsize, np.uint8)
        merge_planes(planes, layout, itemsize, res)
        assert res.tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert odd > 0  # the 2-byte aligned load path was exercised
    kind, meta, sections = container.loads(blob)  # fp8: one coded plane of 4 chunks
    lens = sections["p0.len"]
    for bad, rows in (([lens[0] + 1, lens[1] - 1, *lens[2:]], []), ([63, lens[0] + lens[1] - 63, *lens[2:]], [0]),
                      ([*lens[:-1], lens[-1] - 2], [3]), ([lens[0] + 2, *lens[1:-1], lens[-1] - 2], [])):
        forged = container.dumps(kind, meta, dict(sections, **{"p0.len": np.array(bad, np.uint32)}))
        pdesc = _device_rows(forged)[-1]
        assert np.flatnonzero(pdesc[:, 1] == 0).tolist() == rows
    grown = container.dumps(kind, meta, dict(sections, **{"p0.len": np.array([*lens[:-1], lens[-1] + 2], np.uint32)}))
    assert _device_rows(grown)[-1][-1, 1] == 0  # past the section's end
    for bad in (np.array([*lens, 64], np.uint32), lens.astype(np.uint16), lens.astype(np.int32)):
        with pytest.raises(CorruptStreamError, match="chunk lengths"):
            _device_rows(container.dumps(kind, meta, dict(sections, **{"p0.len": bad})))


@pytest.fixture
def emulated_kernels(monkeypatch):
    """The GPU path's launchers replaced by CPU emulations (the encoder by ``rans_lanes.encode``, the
    kernels' reference; the decoder by the lane-level emulation of rans_decode.cu), so its host
    logic (modes, tables, offsets, container, checks) runs on CPU tensors without a GPU."""
    from types import SimpleNamespace

    import kvcodec.device
    from kvcodec.entropy.cuda import rans as gr
    from kvcodec.lossless.planes import merge_planes, split_planes

    from test_cuda_rans import emulate_launch

    def split_hist(raw, layout, itemsize, n_planes):
        planes = np.stack(split_planes(raw.numpy(), layout, itemsize))
        hist = np.stack([np.bincount(p, minlength=256) for p in planes])
        return torch.from_numpy(planes), torch.from_numpy(hist)

    def encode_chunks(planes, jobs, freqs, chunk):
        cap = chunk + 64
        flat = planes.numpy().reshape(-1)
        scratch = np.zeros(len(jobs) * cap, np.uint16)
        lens = np.zeros(len(jobs), np.int64)
        for j, (off, cnt, t, _) in enumerate(jobs):
            f = np.asarray(freqs[t], np.int64)[None]
            slot = scratch[j * cap: (j + 1) * cap]
            start = rans_lanes.encode(flat[off: off + cnt], 0, cnt, np.zeros(1, np.uint8), f,
                                      rans_lanes.cumulative(f), 32, slot)
            lens[j] = cap - start
        return torch.from_numpy(scratch.view(np.int16)), torch.from_numpy(lens), cap

    def gather(scratch, cap, lens, dst_off, dst):
        for j, (n, o) in enumerate(zip(lens.tolist(), dst_off)):
            dst[o: o + n] = scratch[j * cap + cap - n: (j + 1) * cap]

    def merge(planes, layout, itemsize, n, out, desc=None):
        arrs = [p.numpy() if isinstance(p, torch.Tensor) else np.full(n, p, np.uint8) for p in planes]
        res = np.empty(n * itemsize, np.uint8)
        merge_planes(arrs, layout, itemsize, res)
        out.copy_(torch.from_numpy(res))

    def launch(self, data, out, status):
        batch = SimpleNamespace(data=data, pdesc=self.pdesc, order=self.order, blocks=self.blocks, tdesc=self.tdesc,
                                table_data=self.table_data, smem_bytes=self.smem_bytes, out_bytes=out.numel(),
                                n_payloads=status.numel())
        o, st = emulate_launch(batch)
        out.view(-1).copy_(torch.from_numpy(o[: out.numel()]))
        status.copy_(torch.from_numpy(st[: status.numel()]))

    def crc32_many(bufs):
        return torch.tensor([zlib.crc32(b.contiguous().view(torch.uint8).numpy().tobytes()) for b in bufs])

    for name, fn in dict(split_hist=split_hist, encode_chunks=encode_chunks, gather=gather, merge=merge,
                         stream_desc=emulate_stream_desc).items():
        monkeypatch.setattr(pc, name, fn)
    monkeypatch.setattr(gr.LaunchPlan, "launch", launch)
    monkeypatch.setattr(gcrc, "crc32_many", crc32_many)
    monkeypatch.setattr(kvcodec.device, "is_available", lambda: True)


@pytest.mark.parametrize("dtype,shape,chunk_bytes", [(torch.bfloat16, (30, 70), 256), (torch.float32, (9, 33), 100),
                                                     (torch.float8_e4m3fn, (40, 64), 1000), (torch.int16, (5, 7), 64)])
def test_gpu_path_host_logic_on_emulated_kernels(emulated_kernels, dtype, shape, chunk_bytes):
    """compress_device's and the device decoder's own code, on CPU tensors: the blob equals the CPU
    encoder's byte for byte, decodes bit-exactly, and damage is flagged through the device checks."""
    from kvcodec.lossless import api

    t = _special(dtype, int(np.prod(shape)), 3).reshape(shape)
    blob = api._compress_on_gpu(t, {"chunk_bytes": chunk_bytes, "min_gain": 0.02})
    assert blob.numpy().tobytes() == compress(t, codec="planes", max_classes=1, chunk_bytes=chunk_bytes)
    assert_bit_exact(api._decompress_on_device(blob, torch.device("cpu"), None), t)
    assert_bit_exact(api._decompress_on_device(blob, torch.device("cpu"), None), t)  # again: the kept plan
    assert api.describe(blob) == api.validate(blob) == api.describe(blob.numpy().tobytes())  # tensor blobs
    assert_bit_exact(decompress(blob), t)
    old = torch.frombuffer(bytearray(planes.format2_blob(blob.numpy().tobytes())), dtype=torch.uint8)  # host rows
    assert_bit_exact(api._decompress_on_device(old, torch.device("cpu"), None), t)
    kind, meta, sections = container.loads(blob.numpy().tobytes())
    for k, v in sections.items():  # a stream or plane damaged, every checksum recomputed: the tensor's crc
        bad = dict(sections, **{k: np.array(v)})
        bad[k][len(bad[k]) // 2] ^= 1
        forged = torch.frombuffer(bytearray(container.dumps(kind, meta, bad)), dtype=torch.uint8)
        with pytest.raises(CorruptStreamError):
            api._decompress_on_device(forged, torch.device("cpu"), None)
    flipped = blob.clone()
    flipped[-1] ^= 1  # a section's crc32
    with pytest.raises(CorruptStreamError, match="checksum"):
        api._decompress_on_device(flipped, torch.device("cpu"), None)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_kernels_compile_without_spills(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    for source, instances in ((pc.SOURCE, pc.instance_declarations()), (gcrc.SOURCE, [])):
        proc = build.nvcc_compile(source, instances, arch, tmp_path, extra=("-Xptxas", "-v,-warn-spills"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not [ln for ln in proc.stderr.splitlines() if "spill" in ln and " 0 bytes spill stores" not in ln]


def test_gpu_decodable_only_for_32_lane_single_table_blobs():
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(256, 64, generator=g) * torch.logspace(-4, 0, 256)[:, None]).to(torch.bfloat16)
    meta = lambda blob: container.loads(blob)[1]["codec_meta"]  # noqa: E731
    assert len(meta(compress(t))["planes"][0]["tables"]) > 1
    assert not planes_device.gpu_decodable(meta(compress(t)))
    assert planes_device.gpu_decodable(meta(compress(t, codec="planes", max_classes=1)))
    from pathlib import Path

    v1 = (Path(__file__).parent / "data" / "planes_v1_bf16.kvt").read_bytes()  # 8 lanes
    assert not planes_device.gpu_decodable(meta(v1))


def test_gpu_option_is_refused_without_a_cuda_tensor():
    with pytest.raises(ValueError, match="gpu=True"):
        compress(torch.zeros(10), gpu=True)
    with pytest.raises(ValueError):
        compress(torch.zeros(10), gpu="yes")


# ------------------------------------------------------------------------------------ GPU checks
def _special(dtype, n, seed):
    """Values with NaN payloads, +-Inf, -0.0, subnormals among ordinary ones (float dtypes)."""
    t = weights_like(dtype, (n,)) if dtype.is_floating_point and dtype.itemsize > 1 else random_bits(dtype, (n,), seed)
    if dtype.is_floating_point and dtype.itemsize > 1:
        bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])
        special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0], dtype=dtype)
        t[: min(n, 5)] = special[: min(n, 5)]
        if n > 8:
            bits[5] = 1  # smallest subnormal
            bits[6] = -1  # a NaN with every payload bit set
    return t


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,chunk_bytes", [(1, 64), (33, 64), (1000, 100), (70_001, 4096), (300_000, 1 << 16)])
def test_gpu_blob_equals_cpu_blob_and_round_trips(dtype, n, chunk_bytes):
    t = _special(dtype, n, n).cuda()
    blob_gpu = compress(t, gpu=True, chunk_bytes=chunk_bytes)
    blob_cpu = compress(t, gpu=False, max_classes=1, chunk_bytes=chunk_bytes)
    assert blob_gpu == blob_cpu
    on_dev = compress_device(t, chunk_bytes=chunk_bytes)
    assert on_dev.is_cuda and on_dev.cpu().numpy().tobytes() == blob_cpu
    from kvcodec.lossless import describe

    assert describe(on_dev) == describe(blob_cpu)
    assert_bit_exact(decompress(on_dev).cpu(), t.cpu())  # decoded on the device
    assert_bit_exact(decompress(blob_cpu, device="cuda").cpu(), t.cpu())  # host blob -> GPU
    assert_bit_exact(decompress(blob_gpu, device="cpu"), t.cpu())  # GPU blob -> CPU decoder


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 5000), chunk_bytes=st.integers(64, 3000),
       skew=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**31))
def test_gpu_equals_cpu_on_random_inputs(dtype, n, chunk_bytes, skew, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, n * dtype.itemsize).astype(np.uint8)
    if skew:  # few distinct high bytes: coded planes
        raw[1 if dtype.itemsize > 1 else 0:: dtype.itemsize] = rng.integers(60, 60 + 3 * skew, raw[::dtype.itemsize].size)
    if dtype == torch.bool:
        raw &= 1
    t = torch.from_numpy(raw).view(dtype).cuda()
    blob = compress(t, gpu=True, chunk_bytes=chunk_bytes)
    assert blob == compress(t, gpu=False, max_classes=1, chunk_bytes=chunk_bytes)
    assert_bit_exact(decompress(compress_device(t, chunk_bytes=chunk_bytes)).cpu(), t.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_device_crc_equals_zlib():
    rng = np.random.default_rng(0)
    buf = torch.from_numpy(rng.integers(0, 256, 3_000_000).astype(np.uint8)).cuda()
    cases = [(0, 0), (1, 1), (3, 17), (5, 16), (7, 100_000), (0, 3_000_000), (13, 2_999_000), (64, 4_200_000 // 2)]
    got = gcrc.crc32_many([buf[a:a + n] for a, n in cases]).cpu().tolist()
    host = buf.cpu().numpy().tobytes()
    assert got == [zlib.crc32(host[a:a + n]) for a, n in cases]



@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not GPU, reason="needs a CUDA GPU and CuPy")])])
def test_check_many_flags_crc_mismatches_and_nonzero_padding(cuda):
    """check_many on the device (crc_finish's flags) and on CPU tensors (zlib) give the same flags:
    a wrong crc32 or a nonzero byte where zeros are required sets the buffer's slot, several
    buffers may share a slot."""
    rng = np.random.default_rng(1)
    buf = torch.from_numpy(rng.integers(0, 256, 200_000).astype(np.uint8))
    buf[1000:1040] = 0
    buf = buf.cuda() if cuda else buf
    host = buf.cpu().numpy().tobytes()
    parts = [(3, 70_000), (0, 16), (1000, 40), (1001, 7), (5, 0), (100_001, 99_999), (999, 3)]
    crc = [zlib.crc32(host[a:a + n]) for a, n in parts]
    bufs = [buf[a:a + n] for a, n in parts]
    # expected: right, wrong, zeros (right), zeros (right), empty zeros, wrong, zeros (a nonzero byte: wrong)
    expected = [crc[0], crc[1] ^ 1, None, None, None, crc[5] + 1, None]
    slots = [0, 1, 2, 2, 3, 4, 5]
    assert gcrc.check_many(bufs, expected, slots, 7).cpu().tolist() == [0, 1, 0, 0, 1, 1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_blobs_the_gpu_cannot_decode_fall_back_to_the_cpu():
    t = weights_like(torch.bfloat16, (300, 64))
    for blob in (compress(t), compress(t, chunk_bytes=1 << 21, max_classes=16)):  # row-context tables
        out = decompress(blob, device="cuda")
        assert out.is_cuda
        assert_bit_exact(out.cpu(), t)
        dev = torch.frombuffer(bytearray(blob), dtype=torch.uint8).cuda()
        assert_bit_exact(decompress(dev).cpu(), t)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_damaged_device_blobs_raise():
    t = weights_like(torch.bfloat16, (64, 1024)).cuda()
    blob = compress_device(t, chunk_bytes=4096)
    host = blob.cpu().numpy()
    rng = np.random.default_rng(1)
    n_bad = 0
    for trial in range(150):
        bad = host.copy()
        kind = trial % 3
        if kind == 0:
            pos = int(rng.integers(0, bad.size))
            bad[pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        elif kind == 1:
            bad = bad[: int(rng.integers(0, bad.size))]
        else:
            bad = np.concatenate([bad, rng.integers(0, 256, int(rng.integers(1, 40))).astype(np.uint8)])
        with pytest.raises(CorruptStreamError):
            decompress(torch.from_numpy(bad).cuda())
        n_bad += 1
    torch.cuda.synchronize()  # no illegal memory access left behind
    assert n_bad == 150
    # streams damaged with every checksum recomputed: the kernels' own checks (or the tensor's crc)
    kind, meta, sections = container.loads(host.tobytes())
    for trial in range(30):
        secs = {k: np.array(v) for k, v in sections.items()}
        words = secs["p0"]
        i = int(rng.integers(0, words.size))
        words[i] ^= np.uint16(1 << int(rng.integers(0, 16)))
        forged = container.dumps(kind, meta, secs)
        with pytest.raises(CorruptStreamError):
            decompress(torch.frombuffer(bytearray(forged), dtype=torch.uint8).cuda())
    lens = sections["p0.len"].astype(np.int64)  # chunk lengths (checked by pc_stream_desc), checksums recomputed
    for trial in range(30):
        bad = lens.copy()
        i, j = rng.integers(0, bad.size, 2)
        if trial % 3 == 0:
            bad[i] += int(rng.integers(1, 40))
        elif trial % 3 == 1:
            bad[i], bad[j] = bad[i] + 2, bad[j] - 2 + 4 * (i == j)  # same sum: streams misplaced
        else:
            bad[i] = int(rng.integers(0, 64))
        forged = container.dumps(kind, meta, dict(sections, **{"p0.len": (bad % (1 << 32)).astype(np.uint32)}))
        with pytest.raises(CorruptStreamError):
            decompress(torch.frombuffer(bytearray(forged), dtype=torch.uint8).cuda())
    torch.cuda.synchronize()
    assert_bit_exact(decompress(blob).cpu(), t.cpu())
    old = torch.from_numpy(np.frombuffer(planes.format2_blob(host.tobytes()), np.uint8).copy()).cuda()  # format 2 still decodes
    assert_bit_exact(decompress(old).cpu(), t.cpu())


def test_host_transfers_without_cuda_are_plain_copies():
    """The CPU side of kvcodec.device.transfer: bytes <-> CPU tensors (empty, read-only buffers), and
    the huge-page advice is harmless on any buffer."""
    from kvcodec.device import transfer

    for data in (b"", b"\x01", bytes(range(256)) * 9):
        t = transfer.bytes_to_device(memoryview(data), "cpu")
        assert t.dtype == torch.uint8 and t.numel() == len(data) and t.numpy().tobytes() == data
        back = transfer.device_to_bytes(t)
        assert type(back) is bytes and back == data
    buf = bytes(5 << 20)
    transfer._advise_huge_pages(transfer._address(buf), len(buf))
    assert buf == bytes(5 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("threads", [0, 1, 3])
def test_pinned_ring_transfers_round_trip(threads):
    """transfer.device_to_bytes / bytes_to_device through the pinned ring (sizes around the slot
    size and the direct-copy threshold) move every byte, also from a view at an odd offset."""
    from kvcodec.device import transfer

    rng = np.random.default_rng(threads)
    big = rng.integers(0, 256, transfer.DIRECT_BELOW + 5 * transfer.STAGE_BYTES + 12345).astype(np.uint8)
    for n in (0, 7, transfer.DIRECT_BELOW - 1, transfer.DIRECT_BELOW, transfer.DIRECT_BELOW + 3 * transfer.STAGE_BYTES,
              big.size - 1):
        host = big[1: 1 + n].tobytes()
        dev = transfer.bytes_to_device(host, "cuda", threads)
        assert dev.is_cuda and dev.numel() == n
        assert dev.cpu().numpy().tobytes() == host
        back = transfer.device_to_bytes(torch.from_numpy(big).cuda()[1: 1 + n], threads)
        assert type(back) is bytes and back == host


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_decode_again_reuses_the_plan_and_sees_writes_torch_does_not_count():
    """The second decode of a device blob reuses its header and plan; a header or payload byte changed
    through CuPy (torch's version counter does not move) still raises CorruptStreamError."""
    import cupy

    x = weights_like(torch.bfloat16, (64, 4096)).cuda()
    blob = compress_device(x)
    for _ in range(3):
        assert_bit_exact(decompress(blob).cpu(), x.cpu())
    view = cupy.asarray(blob)
    for pos in (40, blob.numel() - 5):
        view[pos] ^= 1
        with pytest.raises(CorruptStreamError):
            decompress(blob)
        view[pos] ^= 1
    assert_bit_exact(decompress(blob).cpu(), x.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("fmt", [2, 3])
def test_device_built_tables_equal_build_table(fmt):
    """pc_stream_desc's decode tables (made on the device from the frequencies) are build_table's words,
    for a blob of format 3 (rows on the device too) and 2 (rows from the host: the tables alone)."""
    from kvcodec.entropy.cuda.rans import build_table
    from kvcodec.lossless import api

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(48, 1000, generator=g) * 20).round().to(torch.int16).cuda()  # two coded planes: two tables
    blob = compress_device(x, chunk_bytes=4096)
    if fmt == 2:
        blob = torch.frombuffer(bytearray(planes.format2_blob(blob.cpu().numpy())), dtype=torch.uint8).cuda()
    api._blob_plans.clear()
    assert_bit_exact(decompress(blob).cpu(), x.cpu())
    entry = api._blob_plans.get(blob)
    plan, tables = entry["planes plan"], entry["planes streams"][3]
    meta = container.loads(blob.cpu().numpy().tobytes())[1]["codec_meta"]
    freqs = [planes._table_from_json(p["tables"][0]) for p in meta["planes"] if p["mode"] == "rans"]
    assert len(freqs) == len(tables) == 2
    want = b"".join(build_table(f, rans_lanes.PRECISION, np.uint8).data.tobytes() for f in freqs)
    assert plan.table_data.cpu().numpy().tobytes() == want
