"""Probability models for the range coders: a model knows probabilities, a coder knows bits.

* ``Categorical(probs)`` / ``Categorical.from_freqs(freqs)``: explicit per-symbol (or shared) rows.
* ``Gaussian(mean, scale, lo, hi)`` / ``Laplace(...)``: quantized continuous families with
  per-symbol parameters over a bounded integer alphabet (up to 2**30 symbols).
* ``Mixture(base, wide_weight)``: the base plus a uniform component for outliers.

All integer distributions are bit-exact across machines (see ``_qmath`` and docs/range_coder.md).
"""

from ._qmath import GAUSSIAN, LAPLACE, PRECISION
from .base import CumulativeTables, Model, QuantizedFamily
from .categorical import Categorical, quantize_probs
from .quantized import Gaussian, Laplace, Mixture, QuantizedModel, quantize_mean, quantize_scale, quantize_weight

__all__ = [
    "Model",
    "CumulativeTables",
    "QuantizedFamily",
    "Categorical",
    "Gaussian",
    "Laplace",
    "Mixture",
    "QuantizedModel",
    "quantize_probs",
    "quantize_mean",
    "quantize_scale",
    "quantize_weight",
    "GAUSSIAN",
    "LAPLACE",
    "PRECISION",
]
