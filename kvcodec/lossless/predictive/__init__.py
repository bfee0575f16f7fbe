"""Predictor-driven lossless coding of float tensors (codec ``"predictive"``) and its engine.

Why: a KV scalar is far cheaper to code when both sides know roughly where it lies. Each scalar
``x[g, t, d]`` of a tensor laid out ``[..., tokens, channels]`` (``g``: the leading axes
flattened, ``t``: axis -2, ``d``: axis -1) gets a continuous density on the real line::

    base = m[g, d] + c[g, d] * P[g, t, d]                       # P: a prediction, or 0
    mu   = base + a[g, d] * (x[g, t-1, d] - base[g, t-1, d])    # previous-token residual
    x    ~ G((x - mu) / s[g, d])                                # G: a fitted, stored CDF table

and (format 1) a bit pattern's probability is the mass of its rounding bin on the dtype's float grid under
that density, plus one unit (out of 2**28) for every pattern, so NaN payloads, +-Inf, -0.0,
subnormals and far outliers always round-trip. All parameters are quantised and stored; the
per-symbol CDF is exact integer arithmetic after a few correctly rounded float64 adds and
multiplies (numba without fast-math: nothing fused or reordered), so encoder and decoder build
identical frequencies and the decoder never refits anything.

How a value's probability is found is the stream format. Format 2 (written by default;
``bins``, ``tables``, ``binned``, ``format2``): the value's bin relative to mu's bin is one byte
symbol coded by table lookup in the 32-lane rANS of :mod:`kvcodec.entropy.rans_lanes` (one 12-bit
table per class: the scale-to-bin ratio and where mu lies in its bin; for fp8 with a prediction the
symbols counted by magnitude, meta ``"mag"``: ``bins.magnitude_symbol``), the position inside the
bin is raw bits; 3-7x faster than format 1. Format 1 (the density above evaluated at every
pattern's rounding-bin edges, coded with the 64-bit rANS of :mod:`kvcodec.entropy.rans64`;
``grid``, ``cdf``, ``kernels``) is still read, and written on request (``version=1``). Chunks are independent, coded
in parallel and decode alone.

Modules: ``params`` (the fitted per-channel parameters), ``bins`` / ``tables`` / ``binned`` /
``format2`` (format 2), ``grid`` / ``cdf`` / ``kernels`` (format 1), ``codec`` (tensor layout,
encode/decode, the registered codec).

Prediction sources (``P``): an external tensor (a cheaper model's KV, e.g. an fp8-weight copy;
gain c = 1), ``"previous_token"`` (mu = the previous token's value) or ``"neighbour_layer"``
(P = the previous layer's decoded values, axis 0 = layers, per-channel fitted gain c). The kvctx
codec (:mod:`kvcodec.lossless.kv_context`) is the same engine with P = 0 (channel location and
fitted previous-token correlation).

Dtypes: every 8- and 16-bit float (bf16, fp16, the fp8 family) is modelled; float32 codes its
upper 16 bits as bf16 with the model and stores the low 16 bits verbatim; other dtypes are stored
verbatim (these codecs are for float KV caches; use the ``planes`` codec for the rest).
"""

from kvcodec.lossless import registry
from kvcodec.lossless.predictive.codec import (
    FORMAT_VERSION,
    PREDICTORS,
    PredictiveCodec,
    decode_tensor,
    encode_tensor,
    kv_layout,
    token_block,
)
from kvcodec.lossless.predictive.grid import FloatGrid, grid_for, value_table
from kvcodec.lossless.predictive.params import ChannelParams, fit_params

__all__ = [
    "FORMAT_VERSION", "PREDICTORS", "ChannelParams", "FloatGrid", "PredictiveCodec", "decode_tensor",
    "encode_tensor", "fit_params", "grid_for", "kv_layout", "token_block", "value_table",
]

registry.register(PredictiveCodec(), replace=True)
