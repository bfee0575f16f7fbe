"""Hostile input for entropy.decode and kvcodec.decompress: mutated streams whose checksums are
recomputed (a checksum is not a signature), so the decoders themselves see the damage.

Every outcome must be CorruptStreamError or a correct result: never another exception, a crash,
an allocation over the cap, or silent garbage (tensor blobs carry the original's crc32).
"""

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import kvcodec
from kvcodec import CorruptStreamError, container, entropy
from kvcodec.entropy import stream
from kvcodec.lossless import api

CAP = 1 << 20  # every decode in this file may produce at most 1 MiB

HOSTILE = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**63, 2**64]),
    st.floats(allow_nan=False), st.text(max_size=12), st.none(), st.booleans(),
    st.lists(st.integers(-5, 2**40), max_size=12), st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.sampled_from(["bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2", "int64", "complex128", "planes", "raw",
                     "kvctx", "predictive", "rans", "f16", "f32", "bytes", "external", "none"]),
)


# ----------------------------------------------------------------------------- entropy streams
def _streams():
    rng = np.random.default_rng(7)
    x8 = (rng.geometric(0.3, 3000) % 256).astype(np.uint8)
    x16 = (rng.geometric(0.01, 700) % 65536).astype(np.uint16)
    out = [entropy.encode(x8, "rans", streams=s) for s in (1, 8, 32)]
    out += [entropy.encode(x8, "tans"), entropy.encode(x8, "arith"), entropy.encode(x16, "rans"),
            entropy.encode(np.zeros(5000, np.uint8), "rans"), entropy.encode(np.zeros(0, np.uint8))]
    return out


STREAMS = _streams()


def _rebuild(head: bytearray, payload: bytes) -> bytes:
    """A stream with this header body (ending before the payload length) and payload, CRCs recomputed."""
    h = bytearray(head)
    stream._put_varint(h, len(payload))
    h += zlib.crc32(h).to_bytes(4, "little")
    h += zlib.crc32(payload).to_bytes(4, "little")
    return bytes(h) + payload


def _split(blob: bytes) -> tuple[bytearray, bytes]:
    """(header body before the payload-length varint, payload) of a valid stream."""
    h, payload = stream.parse(blob)
    body = blob[: h.header_len - 8]
    i = len(body) - 1
    while i > 0 and body[i - 1] >= 0x80:
        i -= 1
    return bytearray(body[:i]), bytes(payload)


def _decode_checked(blob, impl="fast"):
    try:
        out = entropy.decode(blob, impl=impl, max_output_bytes=CAP)
    except CorruptStreamError:
        return None
    assert isinstance(out, np.ndarray) and out.ndim == 1 and out.nbytes <= CAP
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(STREAMS) - 1), data=st.data())
def test_mutated_entropy_streams_raise_corrupt_stream_error(which, data):
    head, payload = _split(STREAMS[which])
    kind = data.draw(st.sampled_from(["header_byte", "count", "payload_flip", "truncate", "extend"]))
    if kind == "header_byte" and len(head) > 4:
        i = data.draw(st.integers(4, len(head) - 1))
        head[i] = data.draw(st.integers(0, 255))
    elif kind == "count":  # the symbol count varint right after the fixed fields
        _, pos = stream._get_varint(head, stream._FIXED, "n")
        new = bytearray()
        stream._put_varint(new, data.draw(st.sampled_from([0, 1, 2**20, 2**31, 2**31 + 1, 2**40, 2**63])))
        head = head[: stream._FIXED] + new + head[pos:]
    elif kind == "payload_flip" and payload:
        b = bytearray(payload)
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= 1 << data.draw(st.integers(0, 7))
        payload = bytes(b)
    elif kind == "truncate":
        payload = payload[: data.draw(st.integers(0, len(payload)))]
    else:
        payload = payload + data.draw(st.binary(min_size=1, max_size=9))
    blob = _rebuild(head, payload)
    out = _decode_checked(blob)
    if out is not None and len(payload) < 4096:
        ref = _decode_checked(blob, "reference")
        assert ref is not None and np.array_equal(ref, out)  # fast and reference agree on every input


def test_a_short_stream_declaring_2_31_symbols_is_refused_by_a_cap():
    """One near-certain symbol: ~40 bytes can legally declare 2**31 symbols (a decompression bomb)."""
    freqs = np.zeros(256, np.uint32)
    freqs[0], freqs[1] = (1 << 16) - 1, 1
    head = bytearray(stream.MAGIC) + bytes([stream.VERSION, 1, 1, 16, 1])
    stream._put_varint(head, 1 << 31)
    head += stream._pack_freqs(freqs)
    blob = _rebuild(head, (1 << 16).to_bytes(4, "little"))
    assert len(blob) < 48
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):
        entropy.decode(blob, max_output_bytes=1 << 30)  # refused before the 2 GiB output is allocated
    with pytest.raises(ValueError):
        entropy.decode(blob, max_output_bytes=-1)
    from kvcodec import validate

    assert entropy.DEFAULT_MAX_OUTPUT_BYTES == api.DEFAULT_MAX_OUTPUT_BYTES == validate.DEFAULT_MAX_OUTPUT_BYTES


# ----------------------------------------------------------------------------- tensor blobs
def _tensors():
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(2, 2, 40, 16, generator=g) * torch.logspace(-2, 0, 16)).to(torch.bfloat16)
    return [
        kvcodec.compress(kv),
        kvcodec.compress(kv, layout="kv"),
        kvcodec.compress(kv, codec="predictive", predictor="previous_token"),
        kvcodec.compress(kv.float(), layout="kv"),
        kvcodec.compress(kv.to(torch.float8_e4m3fn)),
        kvcodec.compress(torch.arange(300, dtype=torch.int32).reshape(30, 10)),
        kvcodec.compress(kv, codec="raw"),
        kvcodec.compress(torch.zeros(64, 64, dtype=torch.float16)),
    ]


BLOBS = _tensors()
ORIGINALS = [kvcodec.decompress(b) for b in BLOBS]


def _paths(obj, prefix=()):
    """Every (path) to a value inside nested dicts/lists of a meta."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    obj[path[0]] = _set(obj[path[0]], path[1:], value)
    return obj


def _decompress_checked(blob, original):
    try:
        out = kvcodec.decompress(blob, max_output_bytes=CAP)
    except CorruptStreamError:
        return
    assert out.dtype == original.dtype and out.shape == original.shape
    assert torch.equal(out.view(torch.uint8) if out.dtype.itemsize == 1 else out.reshape(-1).view(torch.uint8),
                       original.view(torch.uint8) if original.dtype.itemsize == 1
                       else original.reshape(-1).view(torch.uint8))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(BLOBS) - 1), data=st.data())
def test_mutated_tensor_blob_meta_raises_corrupt_stream_error(which, data):
    kind, meta, sections = container.loads(BLOBS[which])
    sections = {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in sections.items()}
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(meta))[1:]
        path = data.draw(st.sampled_from(paths))
        meta = _set(meta, path, data.draw(HOSTILE))
    try:
        blob = container.dumps(kind, meta, sections)
    except ValueError:
        assume(False)  # not storable at all: no decoder can be reached with it
    _decompress_checked(blob, ORIGINALS[which])
    try:
        api.validate(blob, max_output_bytes=CAP)
    except CorruptStreamError:
        pass


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(BLOBS) - 1), data=st.data())
def test_mutated_tensor_blob_sections_raise_corrupt_stream_error(which, data):
    kind, meta, sections = container.loads(BLOBS[which])
    sections = {k: (np.array(v) if isinstance(v, np.ndarray) else bytes(v)) for k, v in sections.items()}
    name = data.draw(st.sampled_from(sorted(sections) or ["x"]))
    v = sections.get(name, b"")
    action = data.draw(st.sampled_from(["flip", "truncate", "retype", "drop", "extra"] if sections else ["extra"]))
    if action == "flip" and np.asarray(v).size:
        raw = np.frombuffer(bytes(v) if isinstance(v, bytes) else v.tobytes(), np.uint8).copy()
        raw[data.draw(st.integers(0, raw.size - 1))] ^= 1 << data.draw(st.integers(0, 7))
        sections[name] = raw.view(v.dtype) if isinstance(v, np.ndarray) else raw.tobytes()
    elif action == "truncate":
        sections[name] = v[: data.draw(st.integers(0, max(0, len(v) - 1)))]
    elif action == "retype" and isinstance(v, np.ndarray):
        sections[name] = v.view(np.uint8) if v.dtype != np.uint8 else v.astype(np.uint16)
    elif action == "drop":
        del sections[name]
    else:
        sections["x"] = np.zeros(3, np.uint8)
    _decompress_checked(container.dumps(kind, meta, sections), ORIGINALS[which])


def test_the_codec_shape_cannot_bypass_max_output_bytes():
    """The outer shape is checked against the cap and the codec's own shape must equal it."""
    kind, meta, sections = container.loads(BLOBS[7])  # a 64 x 64 zero tensor, const planes
    meta["codec_meta"]["shape"] = [1 << 14, 1 << 14, 2]
    with pytest.raises(CorruptStreamError, match="codec meta"):
        kvcodec.decompress(container.dumps(kind, meta, sections))
    meta["shape"] = [1 << 14, 1 << 14, 2]  # 1 GiB of float16, now consistent
    blob = container.dumps(kind, meta, sections)
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):
        kvcodec.decompress(blob, max_output_bytes=CAP)
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):
        api.validate(blob, max_output_bytes=CAP)
    assert math.prod(meta["shape"]) * 2 <= api.DEFAULT_MAX_OUTPUT_BYTES  # the default lets it through


def test_dtype_names_come_from_the_allow_list_only():
    kind, meta, sections = container.loads(BLOBS[2])
    for bad in ("float4_e2m1fn_x2", "Tensor", "__class__", ["bfloat16"], 5):
        meta["dtype"] = meta["codec_meta"]["dtype"] = bad
        with pytest.raises(CorruptStreamError):
            kvcodec.decompress(container.dumps(kind, meta, sections))


def test_validate_checks_every_codec_without_decoding():
    for blob in BLOBS:
        assert api.validate(blob)["compressed_bytes"] > 0
    kind, meta, sections = container.loads(BLOBS[1])  # kvctx
    sections = dict(sections)
    sections["model"] = np.array(sections["model"])[:-4]  # one chunk's word count missing
    with pytest.raises(CorruptStreamError, match="model"):
        api.validate(container.dumps(kind, meta, sections))
