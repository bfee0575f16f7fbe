"""Format 2 CPU decode fast paths against their references: the one-pass table builder
(``tables.decode_tables`` / ``compact_tables``), the vector rANS step (``binned.rans_step8`` /
``rans_step16``) against the scalar step on any states and words, and the symbol loop's two forms in
``binned.decode_chunks`` (lane-aligned tokens as vector steps, else one value at a time, clamped)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from numba import njit

from kvcodec import CorruptStreamError
from kvcodec.entropy import rans_lanes
from kvcodec.lossless import predictive
from kvcodec.lossless.predictive import binned, bins, format2, tables

N_CLASSES = bins.N_CLASSES


def reference_tables(freq: np.ndarray) -> np.ndarray:
    """The decode tables of ``rans_lanes`` row by row; an unused class decodes every slot as ESC."""
    full = freq.copy()
    full[~full.any(axis=1), bins.ESC] = rans_lanes.M
    return rans_lanes.decode_tables(full)


def reference_compact(tabs: np.ndarray) -> np.ndarray:
    """The two-level form from the full tables, entry by entry (numpy, no kernel): per class the
    4096 slot symbols, then per symbol ``freq | cum << 16`` as little-endian uint32."""
    t = tabs.reshape(N_CLASSES, rans_lanes.M).astype(np.int64)
    freq_cum = np.zeros((N_CLASSES, 256), np.int64)
    k, slot = np.nonzero((t & 0xFFF) == 0)  # each symbol's first slot
    freq_cum[k, t[k, slot] >> 24] = (((t[k, slot] >> 12) & 0xFFF) + 1) | (slot << 16)
    return np.concatenate([(t >> 24).astype(np.uint8), freq_cum.astype("<u4").view(np.uint8)], axis=1).reshape(-1)


@st.composite
def frequency_tables(draw):
    """[N_CLASSES, 256] frequencies: some classes unused (all 0), the others summing to 4096."""
    freq = np.zeros((N_CLASSES, 256), np.int64)
    for k in draw(st.sets(st.integers(0, N_CLASSES - 1), max_size=12)):
        syms = draw(st.lists(st.integers(0, 255), min_size=1, max_size=40, unique=True))
        cuts = sorted(draw(st.lists(st.integers(1, rans_lanes.M - 1), min_size=len(syms) - 1,
                                    max_size=len(syms) - 1, unique=True)))
        freq[k, syms] = np.diff([0, *cuts, rans_lanes.M])
    return freq


@settings(max_examples=40, deadline=None)
@given(freq=frequency_tables())
def test_one_pass_tables_match_the_row_by_row_reference(freq):
    tabs = tables.decode_tables(freq)
    assert np.array_equal(tabs, reference_tables(freq))
    want = reference_compact(tabs)
    assert tables.COMPACT_STRIDE * N_CLASSES == want.size
    assert np.array_equal(tables.compact_tables(freq), want)  # the two-level form of the same tables


@njit
def _vector_symbols(xs, tbase, compact, words, ptr, sym):
    """A token's symbols by the decoder's vector steps (16 lanes at a time with 32 lanes, else 8)."""
    lanes = xs.size
    for d in range(0, tbase.size, 16 if lanes == 32 else 8):
        if lanes == 32:
            ptr = binned.rans_step16(xs, d & (lanes - 1), tbase, d, compact, words, ptr, sym)
        else:
            ptr = binned.rans_step8(xs, d & (lanes - 1), tbase, d, compact, words, ptr, sym)
    return ptr


def reference_symbols(xs, tbase, compact, words, ptr):
    """The scalar rANS step (``rans_lanes``' decode) value by value: (symbols, states, word position)."""
    xs, sym = [int(x) for x in xs], []
    for d, tb in enumerate(tbase.tolist()):
        x = xs[d % len(xs)]
        slot = x & (rans_lanes.M - 1)
        s = int(compact[tb + slot])
        e = int(compact[tb + rans_lanes.M + 4 * s:tb + rans_lanes.M + 4 * s + 4].view("<u4")[0])
        x = (e & 0xFFFF) * (x >> 12) + slot - (e >> 16)
        if x < rans_lanes.RANS_L:
            x, ptr = (x << 16) | int(words[ptr]), ptr + 1
        xs[d % len(xs)] = x
        sym.append(s)
    return sym, xs, ptr


@settings(max_examples=25, deadline=None)
@given(freq=frequency_tables(), lanes=st.sampled_from([8, 32]), tokens_of_lanes=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_vector_rans_step_equals_the_scalar_step(freq, lanes, tokens_of_lanes, seed):
    """Any 32-bit states (a corrupt stream's too: below 2**16, or 0), any words, classes used or not:
    the same symbols, states and words consumed as the scalar step."""
    rng = np.random.default_rng(seed)
    compact = tables.compact_tables(freq)
    d_n = lanes * tokens_of_lanes
    tbase = rng.integers(0, N_CLASSES, d_n) * tables.COMPACT_STRIDE
    xs = rng.integers(0, 2**32, lanes, dtype=np.uint32)
    xs[rng.random(lanes) < 0.2] = rng.integers(0, 2**16)
    words = rng.integers(0, 2**16, d_n + 5, dtype=np.uint16)
    want_sym, want_xs, want_ptr = reference_symbols(xs, tbase, compact, words, 3)
    sym = np.full(d_n, -1, np.int64)
    got_ptr = _vector_symbols(xs, tbase, compact, words, 3, sym)
    assert (sym.tolist(), xs.tolist(), got_ptr) == (want_sym, want_xs, want_ptr)


def test_tables_refuse_rows_that_do_not_sum_to_4096():
    freq = np.zeros((N_CLASSES, 256), np.int64)
    freq[3, 7] = rans_lanes.M - 1
    with pytest.raises(ValueError):
        tables.decode_tables(freq)
    freq[3, 7], freq[3, 8] = rans_lanes.M + 1, -1
    with pytest.raises(ValueError):
        tables.decode_tables(freq)


@settings(max_examples=12, deadline=None)
@given(d=st.sampled_from([1, 7, 8, 24, 32, 40, 64]), tokens=st.integers(1, 300), seed=st.integers(0, 2**16),
       predicted=st.booleans())
def test_decode_is_exact_with_and_without_lane_aligned_tokens(d, tokens, seed, predicted):
    """Channel counts that are and are not multiples of the lane count (8 or 32 lanes by chunk
    size): the vector symbol steps and the clamped scalar loop give the same exact values, a
    stream cut short raises instead of reading past its words, and wrong words at its end never
    make the raw-bit reads leave the section."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, tokens, d, generator=g) * torch.rand(d, generator=g) * 3).to(torch.bfloat16)
    x.view(torch.int16).reshape(-1)[::53] = 0x7FC0  # NaN: escaped values too
    pred = x.float() + 0.05 * torch.randn(x.shape, generator=g) if predicted else None
    meta, sections = predictive.encode_tensor(x, pred, "external" if predicted else "none", 1, version=2)
    out = predictive.decode_tensor(meta, sections, pred, 1)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    payload = sections["payload"]
    if payload.size > 2 * meta["lanes"] + 1:  # the last chunk loses its last word: no overread, an error
        counts = sections["model"].copy()
        nc = (counts.size - 4 - int.from_bytes(counts[:4].tobytes(), "little")) // 8
        wlen = counts[counts.size - 8 * nc:counts.size - 4 * nc].view("<u4")
        wlen[nc - 1] -= 1
        with pytest.raises(CorruptStreamError):
            predictive.decode_tensor(meta, dict(sections, model=counts, payload=payload[:-1]), pred, 1)
    # wrong symbols in the last chunk: its raw bits may run past the section's end (read as zeros from
    # the padded copy of its last bytes), never a crash; a wrong value is the container's crc32 to catch
    rng = np.random.default_rng(seed)
    bad = payload.copy()
    bad[-min(bad.size, 64):] = rng.integers(0, 2**16, min(bad.size, 64), dtype=np.uint16)
    try:
        wrong = predictive.decode_tensor(meta, dict(sections, payload=bad), pred, 1)
    except CorruptStreamError:
        return
    assert wrong.shape == x.shape and wrong.dtype == x.dtype


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float32]), layers=st.integers(2, 4),
       tokens=st.integers(1, 40), seed=st.integers(0, 2**16), correlated=st.booleans())
def test_neighbour_layer_decode_reads_bf16_layers_as_their_own_prediction(dtype, layers, tokens, seed, correlated):
    """The decoder predicts a bf16 layer from the previous layer's bit patterns, the encoder from
    its value table (non-finite as 0): NaN, Inf, -0.0 and subnormals must give the same model. Layers
    that follow the one before keep their fitted gains (one kernel call, a round per layer); a stream
    without gains decodes without the prediction, and the chained decode of it gives the same values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, tokens, 16, generator=g) * 2
    if correlated:
        for layer in range(1, layers):
            x[layer] = 0.9 * x[layer - 1] + 0.05 * torch.randn(x[layer].shape, generator=g)
    x = x.to(dtype)
    flat = x.reshape(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3e-39])
    idx = torch.randint(0, flat.numel(), (specials.numel(),), generator=g)
    flat[idx] = specials.to(dtype)
    meta, sections = predictive.encode_tensor(x, None, "neighbour_layer", 1, version=2)
    out = predictive.decode_tensor(meta, sections, None, 1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.view(bits), x.view(bits))
    ps = predictive.codec.parse_stream(meta, sections)
    if correlated and tokens >= 8:
        assert ps.v2.margs[1].any()  # the gains pay
    if not ps.v2.margs[1].any():  # the chained decode (as with gains) of a stream without them: the same patterns
        p2 = ps.v2
        chained = np.empty((layers * 2, tokens, 16), np.uint16)
        err = format2.decode(p2, p2.grid, range(p2.wlen.size), chained, 0, None, 0, 0, layer_g=2)
        plain = np.empty_like(chained)
        assert not err.any() and not format2.decode(p2, p2.grid, range(p2.wlen.size), plain, 0, None, 0, 0).any()
        assert np.array_equal(chained, plain)
