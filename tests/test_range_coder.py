"""Range coder: round trips, reference == numba byte for byte, near-ideal length, corrupt input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.entropy import models
from kvcodec.entropy import range_coder as ref
from kvcodec.entropy import range_coder_fast as fast
from kvcodec.errors import CorruptStreamError

CODERS = [ref, fast]


def random_quantized(rng, n, alphabet=None, kind=None):
    """A random per-symbol quantized model and symbols drawn from (roughly) it, with outliers."""
    alphabet = alphabet or int(rng.choice([2, 3, 17, 256, 1000, 2**16, 2**17]))
    lo = int(rng.integers(-(2**18), 2**18))
    hi = lo + alphabet - 1
    center = rng.uniform(lo - 0.3 * alphabet, hi + 0.3 * alphabet, n)  # some means outside the range
    scale = np.exp(rng.uniform(np.log(1e-3), np.log(4.0 * alphabet), n))  # tiny to huge
    kind = kind or str(rng.choice(["gauss", "laplace", "mix", "mix_per_symbol", "uniform"]))
    if kind == "gauss":
        m = models.Gaussian(center, scale, lo, hi)
    elif kind == "laplace":
        m = models.Laplace(center, scale, lo, hi)
    elif kind == "mix":
        m = models.Mixture(models.Gaussian(center, scale, lo, hi), 1e-3)
    elif kind == "uniform":  # the wide component alone: the decoder's Gaussian guess is far off
        m = models.Mixture(models.Gaussian(center, scale, lo, hi), 1.0)
    else:
        m = models.Mixture(models.Laplace(center, scale, lo, hi), rng.uniform(0, 0.2, n))
    x = np.rint(rng.normal(center, scale)).astype(np.int64)
    out = rng.random(n) < 0.02
    x[out] = rng.integers(lo, hi + 1, int(out.sum()))
    return m, np.clip(x, lo, hi)


def random_categorical(rng, n):
    a = int(rng.choice([2, 5, 64, 300]))
    probs = rng.random((n, a)) ** rng.uniform(1, 8)
    m = models.Categorical(probs, int(rng.integers(max(9, a.bit_length() + 1), 17)))
    p = m.freqs / m.freqs.sum(axis=1, keepdims=True)
    x = np.array([rng.choice(a, p=row) for row in p], dtype=np.int64)
    return m, x


@pytest.mark.parametrize("kind", ["gauss", "laplace", "mix", "mix_per_symbol", "uniform"])
@pytest.mark.parametrize("alphabet", [2, 255, 2**17])
def test_quantized_round_trip_fast(kind, alphabet):
    rng = np.random.default_rng(alphabet + len(kind))
    m, x = random_quantized(rng, 20000, alphabet, kind)
    payload = fast.encode(x, m)
    y = fast.decode(payload, m, len(x))
    assert y.dtype == np.int32
    assert np.array_equal(x, y)


def test_categorical_round_trip_fast():
    rng = np.random.default_rng(7)
    m, x = random_categorical(rng, 5000)
    assert np.array_equal(fast.decode(fast.encode(x, m), m, len(x)), x)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 60), categorical=st.booleans())
def test_reference_and_fast_emit_identical_bytes(seed, n, categorical):
    rng = np.random.default_rng(seed)
    m, x = random_categorical(rng, n) if categorical else random_quantized(rng, n)
    payload = ref.encode(x, m)
    assert fast.encode(x, m) == payload
    assert np.array_equal(ref.decode(payload, m, n), x)
    assert np.array_equal(fast.decode(payload, m, n), x)


@pytest.mark.parametrize("seed", range(6))
def test_code_length_is_near_ideal(seed):
    """Bytes within 0.1% + 4 bytes of the sum of -log2 q(x) under the model's own integer distribution."""
    rng = np.random.default_rng(100 + seed)
    n = 30000
    if seed == 5:
        m, x = random_categorical(rng, n)
    else:
        mu = rng.normal(0, 1000, n)
        sigma = np.exp(rng.uniform(0, 7, n))
        lo, hi = -(2**16), 2**16 - 1
        x = np.clip(np.rint(rng.normal(mu, sigma)), lo, hi).astype(np.int64)
        m = models.Laplace(mu, sigma, lo, hi) if seed % 2 else models.Gaussian(mu, sigma, lo, hi)
        if seed >= 3:
            m = models.Mixture(m, 1e-3)
    ideal = m.ideal_bits(x)
    got = 8 * len(fast.encode(x, m))
    assert got <= ideal * 1.001 + 32, (got, ideal)


def test_stored_integer_parameters_give_the_same_bytes():
    rng = np.random.default_rng(21)
    m, x = random_quantized(rng, 3000, 2**16, "mix_per_symbol")
    again = models.QuantizedModel.from_quantized(m.family, m.mean_q, m.scale_idx, m.lo, m.hi, m.weight_q)
    payload = fast.encode(x, m)
    assert fast.encode(x, again) == payload
    assert np.array_equal(fast.decode(payload, again, len(x)), x)


def test_far_outliers_use_the_two_step_uniform_index():
    """An escape over more than 2**16 symbols is coded as (high, low) uniform steps."""
    lo, hi = -(2**17), 2**17 - 1
    m = models.Gaussian(np.full(6, float(lo) + 3), 0.5, lo, hi)
    x = np.array([lo + 3, hi, hi - 70000, lo + 200, 0, lo])
    payload = ref.encode(x, m)
    assert payload == fast.encode(x, m)
    for coder in CODERS:
        assert np.array_equal(coder.decode(payload, m, len(x)), x)
    bits = m.symbol_bits(x)
    assert bits[0] < 0.6 and 16 + 17.5 < bits[1] < 16 + 19  # floor token + log2(2**18 - few)


def test_empty_and_single_symbol():
    m = models.Gaussian(0.0, 1.0, -5, 5)
    for coder in CODERS:
        assert coder.encode(np.zeros(0, dtype=np.int64), m) == b""
        assert coder.decode(b"", m, 0).shape == (0,)
        p = coder.encode(np.array([3]), m)
        assert coder.decode(p, m, 1).tolist() == [3]
    one = models.Gaussian(np.zeros(5), 1.0, 7, 7)  # a one-symbol alphabet costs nothing
    assert fast.encode(np.full(5, 7), one) == b""
    assert fast.decode(b"", one, 5).tolist() == [7] * 5


def test_symbols_outside_the_alphabet_are_rejected():
    m = models.Gaussian(0.0, 1.0, -5, 5)
    for coder in CODERS:
        with pytest.raises(ValueError):
            coder.encode(np.array([0, 6]), m)
    c = models.Categorical.from_freqs(np.array([0, 8, 8]), 4)
    for coder in CODERS:
        with pytest.raises(ValueError):
            coder.encode(np.array([1, 0]), c)
        with pytest.raises(ValueError):
            coder.encode(np.array([3]), c)


def test_non_integer_symbols_are_rejected():
    m = models.Gaussian(0.0, 1.0, -5, 5)
    c = models.Categorical(np.ones(4))
    for coder in CODERS:
        for model in (m, c):
            with pytest.raises(ValueError):
                coder.encode(np.array([1.5, 2.0]), model)
    assert fast.encode([], m) == ref.encode([], m) == b""  # an empty list is fine whatever its dtype


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nbytes=st.integers(0, 80), n=st.integers(0, 50))
def test_random_payloads_never_crash(seed, nbytes, n):
    rng = np.random.default_rng(seed)
    m, _ = random_quantized(rng, n) if seed % 2 else random_categorical(rng, n)
    junk = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    results = []
    for coder in CODERS:
        try:
            y = coder.decode(junk, m, n)
        except CorruptStreamError:
            results.append("corrupt")
            continue
        assert y.shape == (n,) and y.dtype == m.dtype
        results.append(y.tobytes())
    assert results[0] == results[1]  # the reference and the numba decoder agree even on junk


def test_model_length_must_match():
    m = models.Gaussian(np.zeros(4), 1.0, -5, 5)
    for coder in CODERS:
        with pytest.raises(ValueError):
            coder.encode(np.zeros(3, dtype=np.int64), m)
        with pytest.raises(ValueError):
            coder.decode(b"", m, 5)


# ---------------------------------------------------------------- static path (front door coder="arith")
@pytest.mark.parametrize("alphabet, bits", [(1, 1), (2, 1), (256, 12), (256, 16), (300, 15), (65536, 16)])
def test_static_round_trip_and_dtype(alphabet, bits):
    rng = np.random.default_rng(alphabet)
    w = rng.random(alphabet) ** 4
    w[rng.random(alphabet) < 0.2] = 0  # absent symbols may have zero frequency
    w[0] = 1.0
    if alphabet <= (1 << bits):
        f = models.quantize_probs(w + 1e-12, bits).astype(np.uint32)
    f[w == 0] = 0
    f[np.argmax(f)] += (1 << bits) - int(f.sum())
    p = f / f.sum()
    x = rng.choice(alphabet, 5000, p=p)
    payload = fast.encode_static(x, f, bits)
    assert ref.encode_static(x[:300], f, bits) == fast.encode_static(x[:300], f, bits)
    want = np.uint8 if alphabet <= 256 else np.uint16
    for coder in CODERS:
        y = coder.decode_static(payload if coder is fast else coder.encode_static(x[:300], f, bits), f, bits, 5000 if coder is fast else 300)
        assert y.dtype == want
        assert np.array_equal(y, x[: len(y)])
    ideal = -np.log2(p[x]).sum()
    assert 8 * len(payload) <= ideal * 1.001 + 32


@pytest.mark.parametrize(
    "freqs, bits", [(np.array([3, 4]), 3), (np.array([8, 8]), 0), (np.array([8, 8]), 17), (np.ones((2, 2)) * 2, 2), (np.zeros(70000), 16)]
)
def test_static_rejects_bad_tables(freqs, bits):
    for coder in CODERS:
        with pytest.raises(ValueError):
            coder.encode_static(np.array([0]), freqs, bits)


def test_carry_propagates_through_pending_ff_bytes():
    """Uniform bytes make carries and held-back 0xFF runs common: both coders must agree and decode."""
    f = np.full(256, 256, dtype=np.uint32)
    x = np.random.default_rng(11).integers(0, 256, 40000).astype(np.uint8)
    enc = ref.RangeEncoder()
    for v in x.tolist():
        enc.encode(v * 256, 256, 1 << 16)
    payload = enc.finish()
    assert enc.carries > 10 and enc.max_pending >= 2
    assert payload == fast.encode_static(x, f, 16)
    assert np.array_equal(fast.decode_static(payload, f, 16, len(x)), x)
    assert np.array_equal(ref.decode_static(payload, f, 16, len(x)), x)


# ---------------------------------------------------------------- corrupt payloads
def _mutations(payload, rng):
    yield bytes(rng.integers(0, 256, len(payload) or 8, dtype=np.uint8))  # random
    yield payload[: len(payload) // 2]  # truncated
    yield payload + b"\x00\x01"  # trailing garbage
    yield b"\xff" * (len(payload) + 8)
    for _ in range(6):  # bit flips
        b = bytearray(payload)
        if b:
            k = int(rng.integers(0, len(b)))
            b[k] ^= 1 << int(rng.integers(0, 8))
        yield bytes(b)


@pytest.mark.parametrize("which", ["quantized", "categorical", "static"])
def test_corrupt_payloads_raise_or_stay_bounded(which):
    rng = np.random.default_rng(len(which))
    n = 400
    if which == "quantized":
        m, x = random_quantized(rng, n, 2**17, "mix")
        lo, hi = m.lo, m.hi
    elif which == "categorical":
        m, x = random_categorical(rng, n)
        lo, hi = 0, m.alphabet - 1
    else:
        f = models.quantize_probs(rng.random(200), 12)
        m = models.Categorical.from_freqs(f, 12)
        x = rng.integers(0, 200, n)
        lo, hi = 0, 199
    payload = fast.encode(x, m)
    n_raised = 0
    for bad in _mutations(payload, rng):
        for coder in CODERS:
            try:
                y = coder.decode(bad, m, n)
            except CorruptStreamError:
                n_raised += 1
                continue
            assert y.shape == (n,) and y.dtype == m.dtype
            assert y.min() >= lo and y.max() <= hi
    assert n_raised > 0


def test_trailing_bytes_are_corrupt():
    m = models.Gaussian(np.zeros(50), 3.0, -100, 100)
    x = np.arange(50) - 25
    payload = fast.encode(x, m)
    for coder in CODERS:
        with pytest.raises(CorruptStreamError):
            coder.decode(payload + b"\x07" * 16, m, 50)  # bytes past what the decoder reads


def test_decode_accepts_bytearray_memoryview_and_numpy():
    m = models.Laplace(np.zeros(30), 2.0, -50, 50)
    x = np.arange(30) - 15
    payload = fast.encode(x, m)
    for form in (bytearray(payload), memoryview(payload), np.frombuffer(payload, dtype=np.uint8)):
        assert np.array_equal(fast.decode(form, m, 30), x)


class _Dyadic(models.Model):
    """A model the coders have never heard of: P(x) = 2**-(x+1) over 0..A-1 (the rest on the last).
    It offers the reference coder steps and the fast coder explicit tables (fast_form) and nothing
    else, so it shows a new model needs no edit of either coder."""

    def __init__(self, alphabet: int = 12, precision: int = 14):
        freqs = np.array([1 << max(precision - x - 1, 0) for x in range(alphabet)], dtype=np.int64)
        freqs[-1] += (1 << precision) - freqs.sum()
        self.table = models.Categorical.from_freqs(freqs, precision)
        self.dtype = self.table.dtype

    def steps(self, i, x):
        return self.table.steps(i, x)

    def decode_symbol(self, i, dec):
        return self.table.decode_symbol(i, dec)

    def fast_form(self):
        return models.CumulativeTables(self.table.freqs, self.table.cum, self.table.precision,
                                       self.table.alphabet, self.table.dtype)


def test_a_new_model_runs_on_both_coders_without_a_coder_edit():
    sym = np.random.default_rng(5).geometric(0.5, 3000).clip(1, 12) - 1
    model = _Dyadic()
    blob = ref.encode(sym, model)
    assert fast.encode(sym, model) == blob
    assert np.array_equal(fast.decode(blob, model, sym.size), sym)
    assert np.array_equal(ref.decode(blob, model, sym.size), sym)


def test_a_model_without_a_fast_form_is_refused_by_the_fast_coder():
    class StepsOnly(_Dyadic):
        fast_form = models.Model.fast_form

    model = StepsOnly()
    blob = ref.encode([0, 1, 2], model)
    with pytest.raises(ValueError, match="no fast coder"):
        fast.encode([0, 1, 2], model)
    with pytest.raises(ValueError, match="no fast coder"):
        fast.decode(blob, model, 3)
