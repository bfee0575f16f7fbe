"""Each numba decoder compiles once whatever buffer the caller gives: numba types a read-only array
(``np.frombuffer`` of ``bytes``) apart from a writable one (of a ``bytearray``, or a fresh array),
so a decoder handed both would compile twice (seconds each); the decoders pass their byte and word
inputs as read-only views (``kvcodec.kernel_inputs.readonly``)."""

from __future__ import annotations

import numpy as np
import torch
from numba import types

import kvcodec
from kvcodec import entropy
from kvcodec.entropy import models
from kvcodec.entropy import range_coder_fast, rans_fast, rans_lanes, rans_unrolled, stream, tans_fast
from kvcodec.lossless import predictive
from kvcodec.lossless.predictive import binned, format2, kernels


def _decoders():
    """The kernels the decodes below run that take the caller's buffer (or a slice of it)."""
    singles = [range_coder_fast._decode_lut, range_coder_fast._decode_quant, rans_fast._read_states,
               rans_fast._decode_kernel, rans_unrolled._main_loop_32, tans_fast._decode_kernel,
               stream._freq_table, format2._chunk_counts, kernels._decode_chunks]
    return singles + list(rans_lanes._DECODERS.values()) + list(binned._DECODERS.values())


def _writable(sig: tuple) -> tuple:
    return tuple(t.copy(readonly=False) if isinstance(t, types.Array) else t for t in sig)


def test_decoders_compile_once_for_bytes_bytearray_and_arrays():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    pred = (x.float() + 0.01 * torch.randn_like(x.float())).to(torch.bfloat16)
    blobs = [(kvcodec.compress(x, pred), pred), (kvcodec.compress(x, pred, version=1), pred),
             (kvcodec.compress(x, codec="planes"), None)]
    sym = np.random.default_rng(0).integers(0, 40, 5000).astype(np.uint8)
    streams = [entropy.encode(sym, coder, streams=32 if coder == "rans" else None)
               for coder in ("rans", "tans", "arith")]
    laplace = models.Laplace(np.zeros(300), 2.0, -50, 50)
    values = np.arange(300) % 101 - 50
    payload = range_coder_fast.encode(values, laplace)
    # (the form a codec blob takes, the form an entropy stream takes: bytes-like only)
    forms = ((bytes, bytes), (bytearray, bytearray),
             (lambda b: np.frombuffer(bytearray(b), np.uint8), lambda b: memoryview(bytearray(b))))
    for form, stream_form in forms:
        for blob, p in blobs:
            assert torch.equal(kvcodec.decompress(form(blob), p).view(torch.int16), x.view(torch.int16))
        for s in streams:
            assert np.array_equal(entropy.decode(stream_form(s)), sym)
        assert np.array_equal(range_coder_fast.decode(form(payload), laplace, 300), values)
    # the 32-lane coder's own entry points, with every table array once writable and once read-only (a
    # planes blob's row contexts come from its bytes, a one-class plane's are built by the decoder)
    n, d = 3000, 64
    rowctx = np.arange(n // d + 2, dtype=np.uint8) % 2
    freqs = np.zeros((2, 256), np.uint32)
    freqs[:, :40] = (1 << rans_lanes.PRECISION) // 40
    freqs[:, 0] += (1 << rans_lanes.PRECISION) - freqs[0].sum()
    words = np.empty(n + 64, np.uint16)
    start = rans_lanes.encode(sym[:n], 0, d, rowctx, freqs, rans_lanes.cumulative(freqs), 32, words)
    tabs = rans_lanes.decode_tables(freqs)
    side, hi, lo = sym[:n] ^ 7, np.arange(256, dtype=np.uint16) << 8, np.arange(256, dtype=np.uint16)
    out, out16 = np.empty(n, np.uint8), np.empty(n, np.uint16)
    for form in (np.copy, lambda a: np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape)):
        assert rans_lanes.decode(words[start:], 0, d, form(rowctx), form(tabs), 32, out) == 0
        assert np.array_equal(out, sym[:n])
        assert rans_lanes.decode_merged(words[start:], 0, d, form(rowctx), form(tabs), 32, form(side), form(hi),
                                        form(lo), out16) == 0
        assert np.array_equal(out16, hi[sym[:n]] | side)
    # a format 2 decode of every chunk (chunk_layout's read-only arrays) and of a token range whose
    # chunks are not consecutive (copies of them), then a neighbour-layer decode (one call, rounds)
    y = torch.randn(2, 200, 512).to(torch.bfloat16)
    meta, sections = predictive.encode_tensor(y, None, "none", 1, version=2)
    assert all(not a.flags.writeable for a in format2.chunk_layout(2, 200, 512, meta["tb"], 2))
    for tokens in (None, (150, 200)):
        got = predictive.decode_tensor(meta, sections, None, 1, tokens=tokens)
        assert torch.equal(got.view(torch.int16), y[:, slice(*(tokens or (0, 200)))].view(torch.int16))
    meta, sections = predictive.encode_tensor(y.reshape(2, 1, 200, 512), None, "neighbour_layer", 1, version=2)
    assert torch.equal(predictive.decode_tensor(meta, sections, None, 1).view(torch.int16), y.view(torch.int16)[:, None])
    twice = [f"{d.__module__}.{d.__name__}" for d in _decoders()
             if len({_writable(s) for s in d.signatures}) < len(d.signatures)]
    assert not twice, f"compiled for read-only and writable inputs alike: {twice}"


def test_one_chunk_decoder_signature_with_or_without_a_bf16_prediction():
    """A stream without a prediction and one with a bf16 prediction run the same compiled chunk decoder
    (the absent prediction is typed as a bf16 one's bit patterns): a process that decodes both compiles once."""
    torch.manual_seed(1)
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    pred = (x.float() + 0.01 * torch.randn_like(x.float())).to(torch.bfloat16)
    kernel = binned._decoder(*binned_args(torch.bfloat16), 0)[0]
    before = set(kernel.signatures)
    for p in (None, pred):
        blob = kvcodec.compress(x, p, layout="kv") if p is None else kvcodec.compress(x, p)
        assert torch.equal(kvcodec.decompress(blob, prediction=p).view(torch.int16), x.view(torch.int16))
    new = set(kernel.signatures) - before
    assert len(new) <= 1 and all(s[10].dtype == types.uint16 for s in new), new


def binned_args(dtype) -> tuple:
    """``binned._decoder``'s layout arguments for ``dtype``, from the grid arguments ``format2`` passes."""
    from kvcodec.lossless.predictive.bins import bin_grid

    width, sign, mb, maxmag, _escape, _unit, inv_unit = format2._grid_args(bin_grid(dtype))
    return width, sign, mb, maxmag, inv_unit


def test_the_range_coder_compiles_one_encoder_for_every_integer_type():
    laplace = models.Laplace(np.zeros(300), 2.0, -50, 50)
    cat = models.Categorical(np.ones(5))
    values = np.arange(300) % 101 - 50
    before = set(range_coder_fast._encode_quant.signatures), set(range_coder_fast._encode_cum.signatures)
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        payload = range_coder_fast.encode(values.astype(dtype), laplace)
        assert np.array_equal(range_coder_fast.decode(payload, laplace, 300), values)
    for dtype in (np.uint8, np.uint16, np.int64):
        sym = (np.arange(100) % 5).astype(dtype)
        assert np.array_equal(range_coder_fast.decode(range_coder_fast.encode(sym, cat), cat, 100), sym)
    # an empty list (float64 to numpy) compiles nothing new
    assert range_coder_fast.encode([], models.Gaussian(0.0, 1.0, -5, 5)) == b""
    after = set(range_coder_fast._encode_quant.signatures), set(range_coder_fast._encode_cum.signatures)
    assert all(len(a - b) <= 1 for a, b in zip(after, before)), (before, after)


def test_one_fp8_chunk_decoder_signature_for_every_prediction_source():
    """An fp8 tensor coded without a prediction and from its neighbour layer (fp8 values are bfloat16s: the
    layer before is handed over as bf16 bit patterns, the type of a stream without a prediction): one
    compiled signature of the fp8 decoder, whichever the process decodes first."""
    torch.manual_seed(2)
    x = (torch.randn(2, 2, 40, 64) * 3).to(torch.float8_e4m3fn)
    kernel = binned._decoder(*binned_args(torch.float8_e4m3fn), 0)[0]
    before = set(kernel.signatures)
    neighbour = kvcodec.compress(x, codec="predictive", predictor="neighbour_layer")
    for blob in (kvcodec.compress(x, layout="kv"), neighbour):
        assert torch.equal(kvcodec.decompress(blob).view(torch.uint8), x.view(torch.uint8))
    new = set(kernel.signatures) - before
    assert len(new) <= 1 and all(s[10].dtype == types.uint16 for s in new), new
