"""Static entropy coders: round trips, reference == fast bytes, code length, corrupt input."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec import CorruptStreamError, entropy
from kvcodec.entropy import freq, rans, rans_fast, stream, tans, tans_fast

CODERS = ["rans", "tans", "arith"]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def symbol_arrays(draw, max_size=300):
    """Small arrays with skewed, uniform, tiny or large alphabets."""
    dtype = draw(st.sampled_from([np.uint8, np.uint16]))
    n = draw(st.integers(0, max_size))
    hi = draw(st.sampled_from([1, 2, 3, 17, 256] + ([3000, 65536] if dtype == np.uint16 else [])))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        x = rng.integers(0, hi, n)
    else:  # geometric-ish: a few common symbols and a long tail
        x = np.minimum(rng.geometric(draw(st.sampled_from([0.05, 0.3, 0.9])), n) - 1, hi - 1)
    offset = draw(st.integers(0, np.iinfo(dtype).max - hi + 1))
    return (x + offset).astype(dtype)


def _random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.uint8)


# ------------------------------------------------------------------------- frequencies
def _brute_force_optimal(counts, f, precision) -> bool:
    """No single-unit move between two symbols lowers the code length."""
    base = freq.code_length_bits(counts, f, precision)
    used = np.flatnonzero(counts)
    for i, j in itertools.permutations(used, 2):
        if f[j] > 1:
            g = f.copy()
            g[i] += 1
            g[j] -= 1
            if freq.code_length_bits(counts, g, precision) < base - 1e-7:
                return False
    return True


@SETTINGS
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=24), st.integers(5, 12))
def test_quantize_frequencies_is_exact_and_optimal(counts, precision):
    counts = np.array(counts, dtype=np.int64)
    if counts.sum() == 0 or np.count_nonzero(counts) > 1 << precision:
        with pytest.raises(ValueError):
            freq.quantize_frequencies(counts, precision)
        return
    f = freq.quantize_frequencies(counts, precision)
    assert f.dtype == np.uint32 and int(f.sum()) == 1 << precision
    assert np.array_equal(f > 0, counts > 0)
    assert _brute_force_optimal(counts, f.astype(np.int64), precision)


def test_quantize_frequencies_many_symbols_and_tiny_probabilities():
    counts = np.zeros(65536, dtype=np.int64)
    counts[:65536] = 1
    f = freq.quantize_frequencies(counts, 16)
    assert np.all(f == 1)
    counts = np.array([10**7, 1, 1, 3])  # probabilities ~1e-7 stay codable
    f = freq.quantize_frequencies(counts, 12)
    assert f.sum() == 4096 and f.min() >= 1
    with pytest.raises(ValueError):
        freq.quantize_frequencies(np.ones(65537, dtype=np.int64), 16)


@SETTINGS
@given(x=symbol_arrays(max_size=2000))
def test_count_symbols_matches_bincount(x):
    a = 256 if x.dtype == np.uint8 else 65536
    assert np.array_equal(freq.count_symbols(x), np.bincount(x, minlength=a))


def test_choose_precision_fits_alphabet():
    for d in (1, 2, 255, 256, 4000, 65536):
        p = freq.choose_precision(d)
        assert (1 << p) >= d and 1 <= p <= 16
        assert (1 << entropy.choose_table_log(d)) >= d


# ------------------------------------------------------------------------- round trips
# rANS stream counts drawn by the tests: one state, the decoders' unrolled 8 and 32, and counts that leave a
# partial last group. The fast encoder is compiled once per count (a constant, so its group loops
# vectorise); any count from 1 to 32 drawing a fresh compile made these tests mostly numba's compile time.
STREAMS = st.sampled_from([1, 2, 3, 8, 13, 32])


@pytest.mark.parametrize("coder", CODERS)
@SETTINGS
@given(x=symbol_arrays(), data=st.data())
def test_round_trip_and_reference_equals_fast(coder, x, data):
    kw = {"streams": data.draw(STREAMS)} if coder == "rans" else {}
    fast = entropy.encode(x, coder, **kw)
    ref = entropy.encode(x, coder, impl="reference", **kw)
    assert fast == ref
    for impl in ("fast", "reference"):
        y = entropy.decode(fast, impl=impl)
        assert y.dtype == x.dtype and np.array_equal(y, x)


EDGE_CASES = {
    "empty_u8": np.zeros(0, np.uint8),
    "empty_u16": np.zeros(0, np.uint16),
    "one_symbol": np.array([200], np.uint8),
    "one_symbol_u16": np.array([65535], np.uint16),
    "one_distinct_long": np.full(100_000, 9, np.uint8),
    "all_256": np.arange(256, dtype=np.uint8).repeat(3),
    "two_symbols_skewed": np.r_[np.zeros(200_000, np.uint8), np.ones(1, np.uint8)],  # p ~ 5e-6
    "long_runs": np.repeat(np.arange(50, dtype=np.uint8), 2000),
    "u16_thousands": (np.random.default_rng(0).geometric(0.001, 50_000) % 65536).astype(np.uint16),
    "u16_extremes": np.array([0, 65535] * 500 + [0], np.uint16),
}


@pytest.mark.parametrize("coder", CODERS)
@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases_round_trip(coder, name):
    x = EDGE_CASES[name]
    blob = entropy.encode(x, coder)
    y = entropy.decode(blob)
    assert y.dtype == x.dtype and np.array_equal(y, x)
    if x.size <= 5000:
        assert entropy.encode(x, coder, impl="reference") == blob
        assert np.array_equal(entropy.decode(blob, impl="reference"), x)


def test_one_distinct_symbol_is_almost_free():
    blob = entropy.encode(np.full(1_000_000, 5, np.uint8), "rans", streams=1)
    assert len(blob) < 40
    assert len(entropy.encode(np.full(1_000_000, 5, np.uint8), "tans")) < 40


@pytest.mark.parametrize("streams", [1, 2, 7, 32])
@pytest.mark.parametrize("precision", [9, 12, 16])
def test_rans_params_round_trip(streams, precision):
    x = np.random.default_rng(streams).geometric(0.1, 20_000).clip(0, 255).astype(np.uint8)
    blob = entropy.encode(x, "rans", streams=streams, precision=precision)
    h = entropy.inspect(blob)
    assert (h.streams, h.param) == (streams, precision)
    assert np.array_equal(entropy.decode(blob), x)


@pytest.mark.parametrize("precision", [1, 2, 3])
@pytest.mark.parametrize("coder", ["rans", "arith"])
def test_tiny_precisions_round_trip(coder, precision):
    x = (np.random.default_rng(precision).random(5000) < 0.3).astype(np.uint8)
    blob = entropy.encode(x, coder, precision=precision)
    assert np.array_equal(entropy.decode(blob), x)
    assert entropy.encode(x[:300], coder, precision=precision, impl="reference") == entropy.encode(
        x[:300], coder, precision=precision
    )


@pytest.mark.parametrize("table_log", [5, 8, 11, 16])
def test_tans_table_logs_round_trip(table_log):
    x = np.random.default_rng(table_log).geometric(0.3, 20_000).clip(1, 20).astype(np.uint8)
    blob = entropy.encode(x, "tans", table_log=table_log)
    assert entropy.inspect(blob).param == table_log
    assert np.array_equal(entropy.decode(blob), x)


# ------------------------------------------------------------------------- code length
def _laplace_bytes(n, scale, seed=0):
    v = np.random.default_rng(seed).laplace(0, scale, n)
    return np.clip(np.round(v), -128, 127).astype(np.int8).view(np.uint8)


@pytest.mark.parametrize("coder,tolerance", [("rans", 0.005), ("tans", 0.015), ("arith", 0.005)])
@pytest.mark.parametrize("scale", [0.3, 6.0, 40.0])
def test_code_length_close_to_entropy(coder, tolerance, scale):
    x = _laplace_bytes(200_000, scale)
    h = freq.entropy_bits(np.bincount(x, minlength=256))
    blob = entropy.encode(x, coder)
    payload_bits = 8 * entropy.inspect(blob).payload_len
    assert payload_bits <= x.size * h * (1 + tolerance) + 256


def test_u16_code_length_close_to_entropy():
    bits = np.random.default_rng(0).standard_normal(200_000).astype(np.float32).view(np.uint32)
    x = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # bf16, round to nearest even
    h = freq.entropy_bits(np.bincount(x, minlength=65536))
    for coder, tol in (("rans", 0.005), ("tans", 0.015)):
        blob = entropy.encode(x, coder)
        assert 8 * entropy.inspect(blob).payload_len <= x.size * h * (1 + tol) + 256


# ------------------------------------------------------------------------- low level
def _tables(x, precision, contexts=1, seed=0):
    rng = np.random.default_rng(seed)
    a = 256 if x.dtype == np.uint8 else 65536
    out = []
    for _ in range(contexts):
        counts = np.bincount(x, minlength=a) + (rng.integers(0, 3, a) * (rng.random(a) < 0.1))
        out.append(freq.quantize_frequencies(counts, precision))
    return np.stack(out)


@SETTINGS
@given(x=symbol_arrays(max_size=200), streams=STREAMS, contexts=st.integers(1, 5), seed=st.integers(0, 99))
def test_rans_ctx_reference_equals_fast(x, streams, contexts, seed):
    if x.size == 0:
        return
    tables = _tables(x, 16, contexts, seed)
    ctx = np.random.default_rng(seed).integers(0, contexts, x.size)
    fast = rans_fast.encode_ctx(x, ctx, tables, 16, streams)
    assert fast.tobytes() == rans.encode_ctx(x, ctx, tables, 16, streams)
    y = rans_fast.decode_ctx(fast, ctx, tables, 16, streams, out_dtype=x.dtype)
    assert np.array_equal(y, x)
    assert rans.decode_ctx(fast.tobytes(), ctx, tables, 16, streams) == x.tolist()


def test_rans_ctx_large_round_trip():
    rng = np.random.default_rng(3)
    ctx = rng.integers(0, 64, 300_000)
    x = (rng.geometric(0.02 + ctx / 200.0) % 256).astype(np.uint8)  # per-context distributions
    counts = np.zeros((64, 256), dtype=np.int64)
    np.add.at(counts, (ctx, x), 1)
    tables = np.stack([freq.quantize_frequencies(c + (c.sum() == 0), 12) for c in counts])
    payload = rans_fast.encode_ctx(x, ctx, tables, 12, 8)
    assert np.array_equal(rans_fast.decode_ctx(payload, ctx, tables, 12, 8), x)
    one_table = rans_fast.encode_table(x, freq.quantize_frequencies(counts.sum(0), 12), 12, 8)
    assert payload.size < one_table.size  # the contexts carry information


def test_decode_prepared_reuses_tables():
    x = _laplace_bytes(10_000, 4)
    f = freq.quantize_frequencies(np.bincount(x, minlength=256), 13)
    tables = rans_fast.decode_tables(f, 13)
    for streams in (1, 5):
        p = rans_fast.encode_table(x, f, 13, streams)
        assert np.array_equal(rans_fast.decode_prepared(p, tables, 13, x.size, streams), x)
    tt = tans_fast.decode_tables(f, 13)
    assert np.array_equal(tans_fast.decode_prepared(tans_fast.encode_table(x, f, 13), tt, 13, x.size), x)


def test_low_level_bad_arguments():
    x = np.array([0, 1, 2], np.uint8)
    f = np.zeros(256, np.uint32)
    f[:2] = 2048
    with pytest.raises(ValueError, match="frequency 0"):
        rans_fast.encode_table(x, f, 12)
    with pytest.raises(ValueError, match="frequency 0"):
        rans.encode(x, f, 12)
    with pytest.raises(ValueError, match="frequency 0"):
        tans_fast.encode_table(x, f, 12)
    with pytest.raises(ValueError, match="frequency 0"):
        tans.encode(x, f, 12)
    with pytest.raises(ValueError):
        rans_fast.encode_table(x, f, 11)  # does not sum to 2**11
    with pytest.raises(ValueError):
        rans_fast.encode_table(x[:2], f, 12, n_streams=33)
    with pytest.raises(ValueError):
        rans_fast.encode_ctx(x[:2], np.array([0, 1]), f, 12)  # ctx out of range
    with pytest.raises(ValueError):
        tans_fast.encode_table(x[:2], f, 4)
    with pytest.raises(ValueError):
        rans_fast.decode_table(b"\0" * 8, f, 12, -1)


@pytest.mark.parametrize(
    "bad",
    [
        dict(symbols=np.zeros(3, np.int32)),
        dict(symbols=np.zeros((2, 2), np.uint8)),
        dict(symbols=[1, 2, 3]),
        dict(coder="huffman"),
        dict(impl="gpu"),
        dict(streams=0),
        dict(streams=33),
        dict(coder="tans", streams=4),
        dict(coder="tans", table_log=4),
        dict(coder="tans", precision=12),
        dict(precision=17),
        dict(precision=2),  # 17 distinct symbols do not fit in 4 slots
    ],
)
def test_encode_rejects_bad_arguments(bad):
    args = dict(symbols=np.arange(17, dtype=np.uint8), coder="rans")
    args.update(bad)
    symbols, coder = args.pop("symbols"), args.pop("coder")
    with pytest.raises(ValueError):
        entropy.encode(symbols, coder, **args)


# ------------------------------------------------------------------------- corrupt input
def _small_streams():
    x = _laplace_bytes(300, 3, seed=5)
    y = (np.random.default_rng(1).geometric(0.01, 200) % 65536).astype(np.uint16)
    return [
        entropy.encode(x, "rans", streams=3),
        entropy.encode(x, "tans"),
        entropy.encode(y, "rans"),
        entropy.encode(y, "arith"),
        entropy.encode(np.zeros(0, np.uint8), "tans"),
    ]


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_every_truncation_is_rejected(impl):
    for blob in _small_streams():
        for k in range(len(blob)):
            with pytest.raises(CorruptStreamError):
                entropy.decode(blob[:k], impl=impl)
        with pytest.raises(CorruptStreamError):
            entropy.decode(blob + b"\0", impl=impl)


def test_every_single_bit_flip_is_rejected():
    for blob in _small_streams():
        for bit in range(8 * len(blob)):
            bad = bytearray(blob)
            bad[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(CorruptStreamError):
                entropy.decode(bytes(bad))


@SETTINGS
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_are_rejected(data, with_magic):
    blob = (stream.MAGIC + bytes([1]) + data) if with_magic else data
    with pytest.raises(CorruptStreamError):
        entropy.decode(blob)


def _reseal(header_fields: bytes, payload: bytes) -> bytes:
    """A stream with valid checksums around arbitrary header fields (an adversarial writer)."""
    head = bytearray(header_fields)
    stream._put_varint(head, len(payload))
    head += zlib.crc32(head).to_bytes(4, "little") + zlib.crc32(payload).to_bytes(4, "little")
    return bytes(head) + payload


def _fields(coder, n, param, streams, freqs):
    head = bytearray(stream.MAGIC + bytes([1, stream.CODER_IDS[coder], 1, param, streams]))
    stream._put_varint(head, n)
    head += stream._pack_freqs(freqs)
    return bytes(head)


def test_huge_declared_length_is_rejected_before_allocating():
    f = freq.quantize_frequencies(np.ones(256, np.int64), 12)
    for coder, streams, payload in (("rans", 1, b"\0\0\1\0"), ("tans", 1, b"\0\0"), ("arith", 1, b"\0" * 8)):
        for n in (1 << 40, stream.MAX_SYMBOLS + 1):
            with pytest.raises(CorruptStreamError, match="cap"):
                entropy.decode(_reseal(_fields(coder, n, 12, streams, f), payload))
    # Under the hard cap but far more than 4 payload bytes could hold:
    with pytest.raises(CorruptStreamError, match="at most"):
        entropy.decode(_reseal(_fields("rans", 1 << 30, 12, 1, f), b"\0\0\1\0"))
    with pytest.raises(CorruptStreamError, match="at most"):
        entropy.decode(_reseal(_fields("tans", 1 << 30, 12, 1, f), b"\0\0"))
    with pytest.raises(CorruptStreamError, match="cap"):
        entropy.decode(entropy.encode(np.zeros(100, np.uint8)), max_symbols=99)


def test_symbol_bound_holds_for_real_streams():
    for scale in (0.2, 1, 8, 60):
        x = _laplace_bytes(50_000, scale, seed=2)
        for coder in ("rans", "tans"):
            for kw in ({"streams": 1}, {"streams": 32}) if coder == "rans" else ({},):
                h = entropy.inspect(entropy.encode(x, coder, **kw))
                bound = stream.symbol_bound(coder, int(h.freqs.max()), h.param, h.streams, h.payload_len)
                assert bound is None or bound >= x.size


def test_frequency_table_modes_round_trip():
    rng = np.random.default_rng(11)
    for x in (
        rng.integers(0, 40, 5000).astype(np.uint8),  # dense
        (rng.integers(0, 300, 5000) * 200).astype(np.uint16),  # sparse and spread out: gaps
        np.r_[rng.integers(0, 2000, 20000), [65535]].astype(np.uint16),  # long range: bitmap or gaps
    ):
        f = freq.quantize_frequencies(np.bincount(x, minlength=256 if x.dtype == np.uint8 else 65536), 16)
        packed = stream._pack_freqs(f)
        back, pos = stream._parse_freqs(np.frombuffer(packed, np.uint8), 0, f.size)
        assert pos == len(packed) and np.array_equal(back, f)
        assert np.array_equal(entropy.decode(entropy.encode(x, "tans")), x)


@SETTINGS
@given(st.integers(1, 65536), st.sampled_from([0.001, 0.05, 0.5, 1.0]), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_frequency_table_pack_parse_and_truncation(alphabet_used, density, run, seed):
    rng = np.random.default_rng(seed)
    mask = np.repeat(rng.random(-(-alphabet_used // run)) < density, run)[:alphabet_used]
    mask[rng.integers(0, alphabet_used)] = True
    freqs = np.zeros(65536, np.uint32)
    freqs[: mask.size][mask] = rng.integers(1, 70000, int(mask.sum())).clip(1, 65536)
    packed = stream._pack_freqs(freqs)
    buf = np.frombuffer(packed, np.uint8)
    back, pos = stream._parse_freqs(buf, 0, 65536)
    assert pos == len(packed) and np.array_equal(back, freqs)
    for cut in sorted(set(rng.integers(0, len(packed), 20).tolist())):
        try:
            stream._parse_freqs(buf[:cut], 0, 65536)
        except CorruptStreamError:
            continue
        raise AssertionError(f"a table cut to {cut} of {len(packed)} bytes parsed")


def test_inconsistent_headers_are_rejected():
    f = freq.quantize_frequencies(np.ones(4, np.int64), 12)
    good = np.zeros(256, np.uint32)
    good[:4] = f
    x = np.array([0, 1, 2, 3] * 10, np.uint8)
    payload = rans_fast.encode_table(x, good, 12).tobytes()
    assert np.array_equal(entropy.decode(_reseal(_fields("rans", 40, 12, 1, good), payload)), x)
    cases = [
        _fields("rans", 40, 11, 1, good),  # sum != 2**11
        _fields("rans", 40, 12, 0, good),  # 0 streams
        _fields("rans", 40, 12, 33, good),
        _fields("rans", 40, 17, 1, good),
        _fields("tans", 40, 12, 2, good),
        _fields("rans", 41, 12, 1, good),  # payload holds 40 symbols, not 41
        _fields("rans", 39, 12, 1, good),
    ]
    for fields in cases:
        with pytest.raises(CorruptStreamError):
            entropy.decode(_reseal(fields, payload))


@SETTINGS
@given(st.binary(min_size=0, max_size=200), st.integers(0, 300), STREAMS, st.integers(5, 16))
def test_fast_decoders_are_safe_on_garbage_payloads(payload, n, streams, bits):
    symbols = np.frombuffer(payload + b"\1\2\3", dtype=np.uint8).astype(np.int64) % (1 << min(bits, 8))
    counts = np.bincount(symbols, minlength=256)
    f = freq.quantize_frequencies(counts, bits)
    for decode in (
        lambda: rans_fast.decode_table(payload, f, bits, n, streams),
        lambda: rans_fast.decode_ctx(payload, np.zeros(n, np.int64), f, bits, streams),
        lambda: tans_fast.decode_table(payload, f, bits, n),
    ):
        try:
            out = decode()
        except CorruptStreamError:
            continue
        assert out.shape == (n,)


def test_corrupt_payload_with_valid_checksum_never_crashes():
    rng = np.random.default_rng(7)
    x = _laplace_bytes(2000, 5, seed=9)
    for coder in ("rans", "tans"):
        blob = entropy.encode(x, coder)
        h = entropy.inspect(blob)
        head = blob[: h.header_len - 8]
        payload = bytearray(blob[h.header_len :])
        for _ in range(200):
            bad = bytearray(payload)
            bad[rng.integers(0, len(bad))] ^= 1 << int(rng.integers(0, 8))
            blob2 = _reseal(_strip_len(head), bytes(bad))
            try:
                y = entropy.decode(blob2)
            except CorruptStreamError:
                continue
            assert y.shape == x.shape


def _strip_len(head: bytes) -> bytes:
    """Header bytes without the trailing payload-length varint."""
    i = len(head) - 1
    while i > 0 and head[i - 1] >= 0x80:
        i -= 1
    return head[:i]


def test_generated_rans_main_loops_match_their_generator():
    """rans_unrolled.py is exactly what rans_fast's generator writes (regenerate, compare)."""
    from pathlib import Path

    generated = Path(rans_fast.__file__).parent / rans_fast.UNROLLED_MODULE
    assert generated.read_text() == rans_fast.unrolled_module_source()
    assert sorted(rans_fast._MAIN_LOOPS) == sorted(rans_fast.UNROLLED_LANES)
