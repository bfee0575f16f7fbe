"""Probability models: integer distributions are valid, deterministic and close to the real laws."""

import math

import numpy as np
import pytest

from kvcodec.entropy import models
from kvcodec.entropy.models import _qmath as q


# ---------------------------------------------------------------- categorical
def test_quantize_probs_rows_sum_and_floor():
    rng = np.random.default_rng(1)
    p = rng.random((50, 37)) ** 6
    p[:, 3] = 0.0
    f = models.quantize_probs(p, 12)
    assert f.shape == p.shape
    assert np.all(f.sum(axis=1) == 4096)
    assert f.min() >= 1
    # close to the request: KL(p || f) small
    pn = p / p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.nansum(np.where(pn > 0, pn * np.log2(pn / (f / 4096)), 0.0), axis=1)
    assert kl.max() < 0.02


def test_quantize_probs_is_scale_invariant_and_deterministic():
    p = np.array([0.1, 0.2, 0.3, 0.4])
    a = models.quantize_probs(p, 16)
    assert np.array_equal(a, models.quantize_probs(p * 8.0, 16))  # power-of-2 scaling is exact
    assert np.array_equal(a, models.quantize_probs(p.copy(), 16))
    assert a.sum() == 65536


@pytest.mark.parametrize(
    "probs, bits",
    [([[0.5, float("nan")]], 16), ([[-1.0, 2.0]], 16), ([[0.0, 0.0]], 16), (np.ones(5), 2), (np.ones(3), 17), (np.ones(3), 0)],
)
def test_quantize_probs_rejects_bad_input(probs, bits):
    with pytest.raises(ValueError):
        models.quantize_probs(probs, bits)


def test_categorical_from_freqs_validation():
    with pytest.raises(ValueError):
        models.Categorical.from_freqs(np.array([1, 2, 3]), 4)  # sum != 16
    with pytest.raises(ValueError):
        models.Categorical.from_freqs(np.array([0.5, 15.5]), 4)  # not integers
    m = models.Categorical.from_freqs(np.array([0, 16], dtype=np.uint32), 4)
    with pytest.raises(ValueError):
        m.steps(0, 0)  # zero frequency cannot be coded
    assert m.dtype == np.uint8


# ---------------------------------------------------------------- fixed-point parameters
def test_scale_index_is_round_of_32_log2():
    rng = np.random.default_rng(2)
    s = np.exp(rng.uniform(-5, 16, 10000))
    sidx = models.quantize_scale(s)
    want = np.rint(32 * np.log2(s))
    frac = np.abs(32 * np.log2(s) - np.floor(32 * np.log2(s)) - 0.5)
    ok = frac > 1e-9  # away from exact ties the two agree
    assert np.array_equal(sidx[ok], want[ok])
    assert models.quantize_scale([1.0, 2.0, 0.5, 1e-30, 1e30]).tolist() == [0, 32, -32, q.SIDX_MIN, q.SIDX_MAX]


def test_scale_index_is_exact_at_the_grid_thresholds():
    from kvcodec.entropy.models import _tables

    th = np.array(_tables.SCALE_THRESHOLDS)
    vals = np.concatenate([th, np.nextafter(th, 0), np.nextafter(th, 2), [1.0, np.nextafter(2.0, 0)]])
    vals = np.concatenate([vals * 2.0**e for e in (-7, -1, 0, 3, 20)])
    got = models.quantize_scale(vals)
    mant, expo = np.frexp(vals)
    want = (expo - 1) * 32 + np.searchsorted(th, 2 * mant, side="right")  # the defining comparison
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_scale_must_be_positive_finite(bad):
    with pytest.raises(ValueError):
        models.Gaussian(0.0, bad, -10, 10)


def test_mean_quantization():
    got = models.quantize_mean([0.5, 1.5, -0.5, 1 / 512, 3 / 512, 1e30, -1e30], -10, 10)
    assert got.tolist() == [128, 384, -128, 0, 2, (10 + 2**31) * 256, (-10 - 2**31) * 256]  # rint: half to even


def test_parameter_validation():
    with pytest.raises(ValueError):
        models.Gaussian(float("nan"), 1.0, -10, 10)
    with pytest.raises(ValueError):
        models.Gaussian(0.0, 1.0, 10, -10)
    with pytest.raises(ValueError):
        models.Gaussian(0.0, 1.0, 0, 2**30)  # 2**30 + 1 symbols
    with pytest.raises(ValueError):
        models.Gaussian(np.zeros(3), np.ones(4), -10, 10)
    with pytest.raises(ValueError):
        models.Mixture(models.Gaussian(0.0, 1.0, -10, 10), wide_weight=1.5)
    with pytest.raises(ValueError):
        models.Mixture(models.Categorical(np.ones(4)), wide_weight=0.1)
    with pytest.raises(ValueError):
        models.QuantizedModel.from_quantized(models.GAUSSIAN, 0, 10**6, -10, 10)


# ---------------------------------------------------------------- integer CDF
def test_cdf_matches_normal_and_laplace_and_is_symmetric():
    for fam, exact in (
        (q.GAUSSIAN, lambda z: 0.5 * math.erfc(-z / math.sqrt(2))),
        (q.LAPLACE, lambda z: 0.5 * math.exp(z) if z < 0 else 1 - 0.5 * math.exp(-z)),
    ):
        for sidx in (-40, 0, 37, 200):
            sigma = 2.0 ** (sidx / 32)
            for d in np.linspace(-7 * sigma * 256, 7 * sigma * 256, 201).astype(np.int64):
                d = int(d)
                got = q.cdf_q31(d, sidx, fam)
                assert got + q.cdf_q31(-d, sidx, fam) == q.ONE or d == 0
                assert abs(got / q.ONE - exact(d / 256 / sigma)) < 2e-5


def test_token_cdf_is_valid_for_random_parameters():
    rng = np.random.default_rng(3)
    for _ in range(300):
        lo = int(rng.integers(-(2**20), 2**20))
        hi = lo + int(rng.choice([0, 1, 5, 300, 70000, 2**22]))
        mean_q = int(rng.integers((lo - 5000) * 256, (hi + 5000) * 256))
        sidx = int(rng.integers(q.SIDX_MIN, q.SIDX_MAX + 1))
        wq = int(rng.choice([0, 1, 700, 65536]))
        fam = int(rng.integers(0, 2))
        fr = q.symbol_frame(lo, hi, mean_q, sidx, fam)
        ntok = fr[7]
        cum = np.array([q.token_cum(t, fr, lo, mean_q, sidx, wq, fam) for t in range(ntok + 1)])
        assert cum[0] == 0 and cum[-1] == 1 << q.PRECISION
        assert np.all(np.diff(cum) >= 1)
        assert ntok <= 2 * (12 * 16 + 1) + 3
        for v in rng.integers(0, 1 << q.PRECISION, 5):
            t = q.find_token(int(v), fr, lo, mean_q, sidx, wq, fam)
            assert cum[t] <= v < cum[t + 1]


def test_integer_functions_agree_with_python_semantics():
    """The compiled int64 code equals the same source run on Python's unbounded ints (no overflow)."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        lo = int(rng.integers(-(2**31), 2**31 - 2**30))
        hi = lo + int(rng.integers(0, 2**30))
        mean_q = int(rng.integers(-(2**40), 2**40))
        sidx = int(rng.integers(q.SIDX_MIN, q.SIDX_MAX + 1))
        wq = int(rng.integers(0, 65537))
        fam = int(rng.integers(0, 2))
        d = int(rng.integers(-(2**45), 2**45))
        assert q.cdf_q31(d, sidx, fam) == q.cdf_q31.py_func(d, sidx, fam)
        fr = q.symbol_frame(lo, hi, mean_q, sidx, fam)
        assert fr == q.symbol_frame.py_func(lo, hi, mean_q, sidx, fam)
        j, nsym, nb = fr[:3]
        b = int(rng.integers(0, nb + 1))
        assert q.bucket_mass(b, lo, j, nsym, nb, mean_q, sidx, wq, fam) == q.bucket_mass.py_func(
            b, lo, j, nsym, nb, mean_q, sidx, wq, fam
        )
        t = int(rng.integers(0, fr[7] + 1))
        assert q.token_cum(t, fr, lo, mean_q, sidx, wq, fam) == q.token_cum.py_func(t, fr, lo, mean_q, sidx, wq, fam)


def _pmf(model, n_alphabet):
    xs = np.arange(model.lo, model.hi + 1)
    one = model.__class__.from_quantized(model.family, model.mean_q, model.scale_idx, model.lo, model.hi, model.weight_q)
    one.size = None
    return 2.0 ** -one.symbol_bits(xs) if n_alphabet else None


@pytest.mark.parametrize("fam", [models.GAUSSIAN, models.LAPLACE])
@pytest.mark.parametrize("scale", [0.01, 0.7, 3.0, 40.0, 900.0, 5e4])
@pytest.mark.parametrize("lo, hi", [(-2000, 2000), (-3, 60), (0, 1)])
def test_pmf_sums_to_one_every_symbol_codable(fam, scale, lo, hi):
    m = models.QuantizedModel(fam, 17.3, scale, lo, hi)
    p = _pmf(m, 1)
    assert p.min() > 0
    assert abs(p.sum() - 1.0) < 1e-9


@pytest.mark.parametrize("fam", [models.GAUSSIAN, models.LAPLACE])
@pytest.mark.parametrize("scale", [0.01, 0.7, 3.0, 40.0, 900.0])
def test_pmf_tracks_the_law(fam, scale):
    """The integer model costs < 0.01 bit/symbol over the true law (on the fixed-point grid)."""
    lo, hi = -20000, 20000
    m = models.QuantizedModel(fam, 17.3, scale, lo, hi)
    p = _pmf(m, 1)
    x = np.arange(lo, hi + 1)
    mean, scale = m.mean_q[0] / 256, 2.0 ** (m.scale_idx[0] / 32)  # the law on the fixed-point grid
    if fam == models.GAUSSIAN:
        cdf = lambda t: 0.5 * np.vectorize(math.erfc)(-(t - mean) / scale / math.sqrt(2))  # noqa: E731
    else:
        cdf = lambda t: np.where(t < mean, 0.5 * np.exp((t - mean) / scale), 1 - 0.5 * np.exp(-(t - mean) / scale))  # noqa: E731
    with np.errstate(over="ignore"):
        exact = cdf(x + 0.5) - cdf(x - 0.5)
    kl = float(np.sum(np.where(exact > 0, exact * np.log2(np.maximum(exact, 1e-300) / p), 0.0)))
    assert kl < 0.01
    if scale < 16:  # one symbol per bucket: pointwise close too (wider buckets are flat inside)
        big = exact > 1e-3
        assert np.all(np.abs(np.log2(p[big] / exact[big])) < 0.05)  # 16-bit frequencies + the floor


def test_cross_entropy_close_to_gaussian_entropy():
    rng = np.random.default_rng(5)
    n = 20000
    sigma = np.exp(rng.uniform(np.log(3), np.log(3000), n))
    mu = rng.normal(0, 100, n)
    x = np.rint(rng.normal(mu, sigma)).astype(np.int64)
    bits = models.Gaussian(mu, sigma, -(2**16), 2**16).symbol_bits(x)
    h = 0.5 * np.log2(2 * np.pi * np.e * sigma**2)  # differential entropy = discrete entropy at unit bins
    assert abs(bits.mean() - h.mean()) < 0.03


def test_mixture_makes_outliers_cheap():
    n = 2**17
    base = models.Gaussian(0.0, 2.0, -n // 2, n // 2 - 1)
    mix = models.Mixture(base, wide_weight=1e-3)
    far = np.array([n // 2 - 7])
    assert base.symbol_bits(far)[0] > 30
    assert abs(mix.symbol_bits(far)[0] - (17 + math.log2(1e3))) < 1.0
    near = np.array([0])
    assert mix.symbol_bits(near)[0] - base.symbol_bits(near)[0] < 0.01


def test_per_symbol_weights_and_broadcast():
    m = models.Mixture(models.Laplace(np.zeros(3), 1.0, -100, 100), wide_weight=np.array([0.0, 0.01, 0.5]))
    assert m.size == 3
    b = m.symbol_bits(np.array([90, 90, 90]))
    assert b[0] > b[1] > b[2]


def test_generated_tables_match_their_generator():
    """_tables.py is exactly what gen_tables.render() writes (regenerate it, never edit it)."""
    from pathlib import Path

    from kvcodec.entropy.models import _tables, gen_tables

    assert Path(_tables.__file__).read_text() == gen_tables.render()
