"""The container: exact round trips of every dtype, and every damaged blob raises CorruptStreamError."""

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcodec import CorruptStreamError, checksum
from kvcodec import container

TORCH_DTYPES = sorted(container.torch_dtypes())
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _random_tensor(dtype_name: str, shape, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    dt = container.torch_dtypes()[dtype_name]
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return torch.empty(shape, dtype=dt)
    raw = g.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    if dtype_name == "bool":
        raw &= 1
    return torch.from_numpy(raw).view(dt).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        == b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )


@pytest.mark.parametrize("dtype_name", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 5)])
def test_every_torch_dtype_round_trips_bit_exact(dtype_name, shape):
    t = _random_tensor(dtype_name, shape, seed=len(shape) * 31 + len(dtype_name))
    kind, meta, out = container.loads(container.dumps("t", {"k": [1, "a", None, True, 2.5]}, {"x": t}))
    assert kind == "t" and meta == {"k": [1, "a", None, True, 2.5]}
    assert _same_bits(out["x"], t)


def test_numpy_bytes_and_big_endian():
    arr = np.arange(10, dtype=">u2").reshape(2, 5)
    blob = container.dumps("k", {}, {"a": arr, "b": b"\x00\x01abc", "c": np.zeros((0, 4), np.float64)})
    _, _, out = container.loads(blob)
    assert out["a"].dtype == np.dtype("<u2") and (out["a"] == arr).all()
    assert bytes(out["b"]) == b"\x00\x01abc"
    assert out["c"].shape == (0, 4)


def test_sections_are_aligned_and_blob_is_deterministic():
    tensors = {"a": b"xyz", "b": np.arange(3, dtype=np.int64)}
    blob = container.dumps("k", {"m": 1}, tensors)
    assert blob == container.dumps("k", {"m": 1}, tensors)
    header, _ = container.read_header(blob)
    assert all(s["offset"] % container.ALIGN == 0 for s in header["sections"])


def test_expect_kind():
    blob = container.dumps("a", {}, {})
    assert container.loads(blob, expect_kind="a")[0] == "a"
    with pytest.raises(CorruptStreamError):
        container.loads(blob, expect_kind="b")


@pytest.mark.parametrize(
    "kind, meta, tensors",
    [
        ("", {}, {}),
        ("k", {"x": float("nan")}, {}),
        ("k", {"x": object()}, {}),
        ("k", [], {}),
        ("k", {}, {"": b""}),
        ("k", {}, {"a": np.zeros(2, dtype="U3")}),
        ("k", {}, {"a": 5}),
    ],
)
def test_bad_arguments_raise_value_error(kind, meta, tensors):
    with pytest.raises(ValueError):
        container.dumps(kind, meta, tensors)


def _forge(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    prefix = struct.pack("<4sHHI", container.MAGIC, container.VERSION, 0, len(raw))
    crc = zlib.crc32(raw, zlib.crc32(prefix))
    head = prefix + struct.pack("<I", crc) + raw
    return head + b"\x00" * (container._align(len(head)) - len(head)) + body


@pytest.mark.parametrize(
    "section",
    [
        {"dtype": "object"},
        {"type": "pickle"},
        {"shape": [1 << 40]},
        {"shape": [-1]},
        {"nbytes": 1 << 40, "shape": [1 << 40]},
        {"offset": 0},
        {"crc32": 1},
        {"shape": [2]},
        {"name": 3},
    ],
)
def test_forged_headers_with_valid_checksum_are_rejected(section):
    good = {"name": "a", "type": "bytes", "dtype": "uint8", "shape": [4], "offset": 0, "nbytes": 4,
            "crc32": zlib.crc32(b"abcd")}
    # find the offset the real writer would use, then apply the forgery
    probe = _forge({"kind": "k", "meta": {}, "sections": [good]})
    good["offset"] = len(probe)
    assert container.loads(_forge({"kind": "k", "meta": {}, "sections": [good]}, b"abcd"))[2]["a"] == b"abcd"
    bad = {**good, **section}
    with pytest.raises(CorruptStreamError):
        container.loads(_forge({"kind": "k", "meta": {}, "sections": [bad]}, b"abcd"))


def test_non_json_constants_and_deep_nesting_are_rejected():
    for raw in (b'{"kind":"k","meta":{"a":NaN},"sections":[]}', b"[" * 100000 + b"]" * 100000):
        prefix = struct.pack("<4sHHI", container.MAGIC, container.VERSION, 0, len(raw))
        blob = prefix + struct.pack("<I", zlib.crc32(raw, zlib.crc32(prefix))) + raw
        with pytest.raises(CorruptStreamError):
            container.loads(blob)


def test_non_bytes_input():
    with pytest.raises(CorruptStreamError):
        container.loads(12345)


_sections = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(
        st.binary(max_size=300),
        st.builds(lambda n, s: np.random.default_rng(s).standard_normal(n).astype(np.float32),
                  st.integers(0, 40), st.integers(0, 99)),
        st.builds(lambda d, n, s: _random_tensor(d, (n,), s),
                  st.sampled_from(TORCH_DTYPES), st.integers(0, 30), st.integers(0, 99)),
    ),
    max_size=4,
)
_meta = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-(2**60), 2**60), st.text(max_size=5),
                                                       st.booleans(), st.none()), max_size=4)


def _equal(a, b) -> bool:
    if isinstance(a, (bytes, bytearray)):
        return bytes(b) == bytes(a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return _same_bits(a, b)


@settings(max_examples=60, deadline=None)
@given(meta=_meta, tensors=_sections)
def test_round_trip_property(meta, tensors):
    kind, meta2, out = container.loads(container.dumps("kind", meta, tensors))
    assert kind == "kind" and meta2 == meta and list(out) == list(tensors)
    assert all(_equal(tensors[k], out[k]) for k in tensors)


@settings(max_examples=60, deadline=None)
@given(tensors=_sections, data=st.data())
def test_any_truncation_or_bit_flip_is_detected(tensors, data):
    blob = container.dumps("kind", {"m": 1}, tensors)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptStreamError):
        container.loads(blob[:cut])
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    flipped = bytearray(blob)
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptStreamError):
        container.loads(bytes(flipped))
    with pytest.raises(CorruptStreamError):
        container.loads(blob + b"\x00")


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_random_bytes_raise_corrupt_stream_error(junk, with_magic):
    blob = (container.MAGIC + b"\x01\x00" + junk) if with_magic else junk
    with pytest.raises(CorruptStreamError):
        container.loads(blob)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_matches_crc_of_concatenation(a, b):
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_parallel_matches_serial():
    data = np.random.default_rng(0).integers(0, 256, 9 << 20, dtype=np.uint8)
    assert checksum.crc32_parallel(data, threads=3, min_piece=1 << 20) == zlib.crc32(data)
    assert checksum.crc32_parallel(b"abc", threads=8) == zlib.crc32(b"abc")
