"""The plane codec and the compress/decompress API: bit-exact for every bit pattern, safe on bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcodec import CorruptStreamError, container
from kvcodec.lossless import api, planes, registry
from kvcodec.lossless.api import compress, decode_blob_chunk, decompress

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
OTHER_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float64, torch.bool]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def random_bits(dtype, shape, seed=0) -> torch.Tensor:
    """Uniformly random bit patterns: every NaN payload, +-Inf, -0.0 and subnormal shows up."""
    n = int(np.prod(shape))
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def weights_like(dtype, shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45, 65504.0, 3.0e38, -7.5]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_special_values_and_nan_payloads_are_bit_exact(dtype):
    t = torch.tensor(SPECIALS * 50, dtype=torch.float32).to(dtype)
    raw = t.view(torch.uint8) if dtype.itemsize == 1 else t.view({2: torch.int16, 4: torch.int32}[dtype.itemsize])
    raw[::7] |= 1  # odd low bits, including NaN payloads
    assert_bit_exact(decompress(compress(t)), t)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + OTHER_DTYPES)
@pytest.mark.parametrize("kind", ["random_bits", "weights"])
def test_round_trip_all_dtypes_multi_chunk_threads(dtype, kind):
    shape = (37, 129)
    t = random_bits(dtype, shape, 3) if kind == "random_bits" or dtype in OTHER_DTYPES else weights_like(dtype, shape)
    for threads in (1, 2):
        blob = compress(t, threads=threads, chunk_bytes=1000)
        assert_bit_exact(decompress(blob, threads=threads), t)


@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (1,), (3,), (5, 0, 2)])
def test_empty_and_scalar_tensors(shape):
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        t = random_bits(dtype, shape, 1)
        assert_bit_exact(decompress(compress(t)), t)


def _modes(blob):
    return [p["mode"] for p in container.loads(blob)[1]["codec_meta"]["planes"]]


def test_row_contexts_pay_on_rows_of_different_scale():
    g = torch.Generator().manual_seed(5)
    scales = torch.logspace(-4, 0, 256)[torch.randperm(256, generator=g)]
    t = (torch.randn(256, 512, generator=g) * scales[:, None]).to(torch.bfloat16)
    with_ctx, without = compress(t), compress(t, max_classes=1)
    assert len(with_ctx) < 0.97 * len(without)
    _, meta, sections = container.loads(with_ctx)
    assert len(meta["codec_meta"]["planes"][0]["tables"]) > 1 and "p0.ctx" in sections
    assert_bit_exact(decompress(with_ctx), t)
    odd = t[:, :333].contiguous()  # rows not a multiple of the 4 interleaved states
    assert_bit_exact(decompress(compress(odd, chunk_bytes=1000)), odd)


def test_bf16_weights_compress_and_mantissa_plane_stays_raw():
    t = weights_like(torch.bfloat16, (512, 512))
    blob = compress(t)
    assert len(blob) < 0.70 * t.numel() * 2  # exponent ~2.6 bits + 8 raw bits: about 1.5x
    _, meta, _ = container.loads(blob)
    assert meta["codec"] == "planes" and _modes(blob) == ["rans", "raw"]
    # a low mantissa bit that is 0 70% of the time: the sign/mantissa plane saves ~1.5% (< min_gain)
    g = np.random.default_rng(0)
    u = t.view(torch.int16).numpy().copy()
    u &= np.where(g.random(u.shape) < 0.4, ~np.int16(1), np.int16(-1)).astype(np.int16)
    skewed = torch.from_numpy(u).view(torch.bfloat16)
    assert _modes(compress(skewed)) == ["rans", "raw"]
    all_coded = compress(skewed, min_gain=0.0)
    assert _modes(all_coded) == ["rans", "rans"]
    assert_bit_exact(decompress(all_coded), skewed)


def test_constant_and_incompressible_tensors():
    const = torch.full((3000,), 1.25, dtype=torch.bfloat16)
    blob = compress(const)
    assert len(blob) < 1600
    assert_bit_exact(decompress(blob), const)
    noise = random_bits(torch.bfloat16, (4000,), 9)
    assert _modes(compress(noise, codec="planes")) == ["raw", "raw"]
    assert api.describe(compress(noise))["codec"] == "raw"  # "auto": the planes blob would exceed the raw bytes
    assert _modes(blob) == ["const", "const"]


def test_non_contiguous_and_views():
    base = weights_like(torch.bfloat16, (64, 96))
    for t in (base.t(), base[:, ::3], base[5:9]):
        assert_bit_exact(decompress(compress(t)), t.contiguous())


def test_single_chunk_decodes_alone():
    t = weights_like(torch.bfloat16, (100, 100))
    blob = compress(t, chunk_bytes=4096)  # 2048 elements per chunk
    _, meta, sections = container.loads(blob)
    codec = planes.PlaneCodec()
    flat = t.reshape(-1)
    for c in (0, 3, 4):
        assert_bit_exact(codec.decode_chunk(meta["codec_meta"], sections, c), flat[c * 2048 : (c + 1) * 2048])
    with pytest.raises(ValueError):
        codec.decode_chunk(meta["codec_meta"], sections, 5)
    assert_bit_exact(decode_blob_chunk(blob, 2), flat[2 * 2048 : 3 * 2048])
    with pytest.raises(ValueError):
        decode_blob_chunk(compress(t, codec="raw"), 0)


def test_describe():
    t = weights_like(torch.float16, (10, 20))
    info = api.describe(compress(t, codec="planes"))  # "auto" stores a tensor this small raw
    assert info["codec"] == "planes" and info["shape"] == (10, 20) and info["raw_bytes"] == 400


def test_bad_arguments():
    t = weights_like(torch.bfloat16, (10,))
    with pytest.raises(ValueError):
        compress([1, 2])
    with pytest.raises(ValueError):
        compress(t, codec="nope")
    with pytest.raises(ValueError):
        compress(t, threads=-1)
    with pytest.raises(ValueError):
        compress(t, chunk_bytes=1)
    with pytest.raises(ValueError):
        compress(t, prediction=torch.zeros(3))
    with pytest.raises(ValueError):
        compress(t, layout="weird")
    with pytest.raises(ValueError):
        compress(t, codec="raw", chunk_bytes=4096)  # an option the codec does not take


def _reforge(blob: bytes, edit) -> bytes:
    """Rewrite a blob's meta/sections with valid container checksums, to hit the codec's own checks."""
    kind, meta, sections = container.loads(blob)
    sections = {k: (np.array(v) if isinstance(v, np.ndarray) else bytes(v)) for k, v in sections.items()}
    edit(meta, sections)
    return container.dumps(kind, meta, sections)


def _flip_stream_word(m, s):
    s["p0"] = s["p0"].copy()
    s["p0"][len(s["p0"]) // 2] ^= 0x0100


@pytest.mark.parametrize(
    "edit",
    [
        lambda m, s: m["codec_meta"]["planes"][0].update(mode="raw"),
        lambda m, s: m["codec_meta"]["planes"].pop(),
        lambda m, s: m["codec_meta"]["planes"][1].update(mode="const", value=3),
        lambda m, s: s.update({"p0.len": s["p0.len"][::-1].copy()}),
        lambda m, s: s.update({"p0.len": np.array([0, 8], np.uint32)}),
        lambda m, s: s.update({"p0.len": s["p0.len"] - np.uint32(1)}),
        lambda m, s: s.pop("p0.len"),
        lambda m, s: m["codec_meta"]["planes"][0].update(offsets=[0, 8]),
        lambda m, s: m["codec_meta"]["planes"][0]["tables"][0].__setitem__(1, 5000),
        lambda m, s: m["codec_meta"]["planes"][0]["tables"][0].__setitem__(0, 300),
        lambda m, s: m["codec_meta"]["planes"][0].update(tables=[]),
        lambda m, s: m["codec_meta"]["planes"][0]["tables"].append(m["codec_meta"]["planes"][0]["tables"][0]),
        lambda m, s: m["codec_meta"].update(chunk=0),
        lambda m, s: m["codec_meta"].update(chunk=7),
        lambda m, s: m["codec_meta"].update(chunk=2 ** 30),
        lambda m, s: m["codec_meta"].update(layout="f32"),
        lambda m, s: m["codec_meta"].update(v=99),
        lambda m, s: m.update(shape=[3, 3]),
        lambda m, s: m["codec_meta"].update(shape=[2 ** 40]),
        lambda m, s: m.update(codec="unknown"),
        lambda m, s: m.update(dtype="object"),
        lambda m, s: m.update(crc32=m["crc32"] ^ 1),
        lambda m, s: s.update({"p0": s["p0"][:-1].copy()}),
        lambda m, s: s.update({"extra": b"x"}),
        lambda m, s: s.pop("p1"),
        _flip_stream_word,
    ],
)
def test_forged_streams_raise_corrupt_stream_error(edit):
    t = weights_like(torch.bfloat16, (64, 64))
    blob = compress(t, chunk_bytes=2048)
    with pytest.raises(CorruptStreamError):
        decompress(_reforge(blob, edit))


def test_format2_blobs_still_decode():
    t = weights_like(torch.bfloat16, (64, 64))
    old = planes.format2_blob(compress(t, chunk_bytes=2048))
    assert container.loads(old)[1]["codec_meta"]["v"] == 2
    assert_bit_exact(decompress(old), t)
    with pytest.raises(CorruptStreamError):  # format 2 offsets checked as before
        decompress(_reforge(old, lambda m, s: m["codec_meta"]["planes"][0].update(offsets=[0, 8])))


def test_max_output_bytes_refuses_declared_giants():
    zeros = torch.zeros(1 << 20, dtype=torch.bfloat16)
    blob = compress(zeros)
    assert len(blob) < 2000  # constant planes: legitimately tiny
    assert_bit_exact(decompress(blob, max_output_bytes=2 << 20), zeros)
    with pytest.raises(CorruptStreamError):
        decompress(blob, max_output_bytes=1 << 20)
    giant = _reforge(blob, lambda m, s: (m.update(shape=[1 << 40]), m["codec_meta"].update(shape=[1 << 40])))
    with pytest.raises(CorruptStreamError):
        decompress(giant, max_output_bytes=1 << 30)


def test_truncated_and_flipped_blobs():
    t = weights_like(torch.bfloat16, (50, 50))
    blob = compress(t)
    for cut in (0, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptStreamError):
            decompress(blob[:cut])
    rng = np.random.default_rng(0)
    for _ in range(20):
        b = bytearray(blob)
        i = int(rng.integers(len(b)))
        b[i] ^= 1 << int(rng.integers(8))
        with pytest.raises(CorruptStreamError):
            decompress(bytes(b))


class _XorCodec:
    """Test-only codec that stores tensor XOR prediction: exercises the API's original-bytes crc."""

    name = "test-xor"

    def encode(self, t, prediction, threads):
        a = api.tensor_bytes(t)
        p = api.tensor_bytes(prediction.to(t.dtype).contiguous())
        return {"dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape)}, {"x": a ^ p}

    def decode(self, meta, sections, prediction, threads):
        dtype = container.torch_dtypes()[meta["dtype"]]
        p = api.tensor_bytes(prediction.to(dtype).contiguous())
        return torch.from_numpy(sections["x"] ^ p).view(dtype).reshape(meta["shape"])


def test_wrong_prediction_is_detected_by_the_original_crc():
    registry.register(_XorCodec(), replace=True)
    t = weights_like(torch.bfloat16, (8, 8))
    pred = t + 0.001
    blob = compress(t, prediction=pred, codec="test-xor")
    assert_bit_exact(decompress(blob, prediction=pred), t)
    with pytest.raises(CorruptStreamError):
        decompress(blob, prediction=pred + 1)
    with pytest.raises(ValueError):
        decompress(blob)


def test_registry_rules():
    with pytest.raises(ValueError):
        registry.register(planes.PlaneCodec())  # name taken by another instance
    with pytest.raises(KeyError):
        registry.get("no-such-codec")
    assert "planes" in registry.available() and "raw" in registry.available()
    t = weights_like(torch.float32, (5, 5))
    assert_bit_exact(decompress(compress(t, codec="raw")), t)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES + OTHER_DTYPES),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    seed=st.integers(0, 1000),
    scale=st.sampled_from([None, 1e-3, 1.0, 1e4]),
    chunk_bytes=st.sampled_from([64, 1000, 1 << 20]),
)
def test_round_trip_property(dtype, shape, seed, scale, chunk_bytes):
    if scale is None or dtype in OTHER_DTYPES:
        t = random_bits(dtype, shape, seed)
    else:
        t = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    assert_bit_exact(decompress(compress(t, chunk_bytes=chunk_bytes)), t)


def test_format_1_blobs_with_8_lanes_still_decode():
    """Blobs written by format 1 (8 rANS lanes, no "lanes" key) decode bit for bit (the crc32 of
    the original tensor is checked by decompress)."""
    from pathlib import Path

    data = Path(__file__).parent / "data"
    for name, shape, dtype in (("planes_v1_bf16.kvt", (128, 64), torch.bfloat16),
                               ("planes_v1_fp8.kvt", (40, 33), torch.float8_e4m3fn)):
        blob = (data / name).read_bytes()
        meta = container.loads(blob)[1]["codec_meta"]
        assert meta["v"] == 1 and "lanes" not in meta
        t = decompress(blob)
        assert t.dtype == dtype and tuple(t.shape) == shape
        assert_bit_exact(decompress(compress(t)), t)


def test_planes_streams_are_the_spec_rans_with_32_lanes():
    """A coded plane's chunk stream is byte for byte kvcodec.entropy.rans.encode_ctx (the
    reference) with 32 lanes and the row contexts expanded per symbol."""
    from kvcodec.entropy import rans, rans_lanes

    g = torch.Generator().manual_seed(3)
    t = (torch.randn(96, 64, generator=g) * torch.logspace(-3, 0, 96)[:, None]).to(torch.bfloat16)
    _, meta, sections = container.loads(compress(t, chunk_bytes=2048))
    cm = meta["codec_meta"]
    assert cm["v"] == planes.FORMAT_VERSION and cm["lanes"] == 32
    p0 = cm["planes"][0]
    assert p0["mode"] == "rans"
    exp = ((t.view(torch.int16).numpy().view(np.uint16).ravel() >> 7) & 0xFF).astype(np.uint8)
    tables = [planes._table_from_json(tb) for tb in p0["tables"]]
    rowctx = sections["p0.ctx"] if len(tables) > 1 else np.zeros(1, np.uint8)
    D = 64 if len(tables) > 1 else exp.size
    chunk, words = cm["chunk"], sections["p0"]
    off = np.concatenate(([0], np.cumsum(sections["p0.len"], dtype=np.int64)))
    for c in range(len(off) - 1):
        a, b = c * chunk, min(exp.size, (c + 1) * chunk)
        ctx = rans_lanes.row_contexts(a, b - a, D, rowctx)
        ref = rans.encode_ctx(exp[a:b], ctx, tables, rans_lanes.PRECISION, 32)
        assert words[off[c]:off[c + 1]].tobytes() == ref


@pytest.mark.parametrize("dtype,n", [(torch.bfloat16, 1), (torch.float32, 33), (torch.int8, 70_001),
                                     (torch.bfloat16, 70_001)])
def test_a_gpu_encoders_blob_gives_way_to_raw_as_the_cpu_path_does(dtype, n):
    """``api._raw_if_smaller``, what the GPU encode routes apply to their blob (as bytes, or as a uint8
    tensor on the device): with codec "auto" an expanded blob becomes the "raw" blob the CPU path writes,
    byte for byte; a blob that saves bytes, or a codec named by the caller, stays as it is."""
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    else:
        t = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
    coded = compress(t, codec="planes", max_classes=1, chunk_bytes=4096)  # as the GPU encoder writes it
    want = compress(t, max_classes=1, chunk_bytes=4096)
    assert api._raw_if_smaller(coded, t, "auto", 1) == want
    on_device = api._raw_if_smaller(torch.from_numpy(np.frombuffer(coded, np.uint8).copy()), t, "auto", 1)
    assert isinstance(on_device, torch.Tensor) and on_device.numpy().tobytes() == want
    assert api._raw_if_smaller(coded, t, "planes", 1) == coded
    expanded = len(coded) > t.numel() * t.element_size()
    assert (container.read_header(want)[0]["meta"]["codec"] == "raw") == expanded
    assert torch.equal(decompress(want).view(torch.uint8), t.view(torch.uint8))
