"""Lloyd-Max codebooks against independent numerical integration."""

import math

import numpy as np
import pytest

from kvcodec.quant.codebooks import coordinate_density, expected_distortion, lloyd_max_codebook, lloyd_max_thresholds

PAPER_D128 = {1: 0.361, 2: 0.116, 3: 0.034, 4: 0.0093}


def _grid(dim, n=400_001):
    x = np.linspace(-1, 1, n)
    return x, coordinate_density(x, dim)


@pytest.mark.parametrize("dim", [8, 64, 128, 256])
def test_density_integrates_to_one_with_variance_one_over_d(dim):
    x, f = _grid(dim)
    assert np.trapezoid(f, x) == pytest.approx(1.0, abs=1e-6)
    assert np.trapezoid(x * x * f, x) == pytest.approx(1.0 / dim, rel=1e-5)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_codebook_satisfies_lloyd_conditions_by_trapezoid(dim, bits):
    c = lloyd_max_codebook(dim, bits)
    t = lloyd_max_thresholds(dim, bits)
    assert np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1])
    assert np.allclose(t, (c[1:] + c[:-1]) / 2)
    lo = np.concatenate([[-1.0], t])
    hi = np.concatenate([t, [1.0]])
    mse = 0.0
    for i in range(c.size):  # centroid condition c_i = E[X | X in cell i], by trapezoid on each cell
        x = np.linspace(lo[i], hi[i], 20_001)
        f = coordinate_density(x, dim)
        mass = np.trapezoid(f, x)
        assert np.trapezoid(x * f, x) / mass == pytest.approx(c[i], rel=1e-6, abs=1e-9)
        mse += np.trapezoid((x - c[i]) ** 2 * f, x)
    assert mse * dim == pytest.approx(expected_distortion(dim, bits), rel=1e-5)


@pytest.mark.parametrize("bits,value", list(PAPER_D128.items()))
def test_distortion_matches_paper(bits, value):
    assert expected_distortion(128, bits) == pytest.approx(value, rel=0.03)


def test_one_bit_centroids_are_mean_absolute_value():
    # b = 1: c = +-E|X| which tends to sqrt(2/(pi d)); exact value via the Beta law
    d = 128
    e_abs = math.exp(math.lgamma(d / 2) - math.lgamma((d - 1) / 2)) / math.sqrt(math.pi) / ((d - 1) / 2)
    assert lloyd_max_codebook(d, 1)[1] == pytest.approx(e_abs, rel=1e-10)
    assert e_abs == pytest.approx(math.sqrt(2 / (math.pi * d)), rel=0.01)


def test_dimension_three_is_the_uniform_quantizer():
    # in R^3 one coordinate is uniform on [-1, 1]: Lloyd-Max is the uniform quantizer
    for bits in (1, 3, 6):
        levels = 1 << bits
        expect = -1 + (2 * np.arange(levels) + 1) / levels
        assert np.allclose(lloyd_max_codebook(3, bits), expect, atol=1e-9)
        assert expected_distortion(3, bits) == pytest.approx(1 / levels**2, rel=1e-6)


def test_distortion_decreases_about_4x_per_bit():
    for dim in (96,):
        d = [expected_distortion(dim, b) for b in range(1, 9)]
        assert all(a > b for a, b in zip(d, d[1:]))
        assert d[7] < (math.sqrt(3) * math.pi / 2) * 4.0**-8  # paper's upper bound


@pytest.mark.parametrize("dim,bits", [(2, 3), (64, 0), (64, 9), (64, 2.5), ("64", 2)])
def test_bad_arguments(dim, bits):
    with pytest.raises(ValueError):
        lloyd_max_codebook(dim, bits)
