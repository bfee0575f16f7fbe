"""The compiled helpers that cut a small tensor's fixed decode cost equal the numpy code they
replaced (kept here as the reference): rANS slot tables, varint arrays, the two-level predictive
tables built without the full ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from kvcodec.entropy import rans_fast, stream
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive import format2, tables
from kvcodec.lossless.predictive.bins import N_CLASSES
from test_predictive_decode_fast import reference_compact


def _slot_tables_reference(freq: np.ndarray, precision: int, out_dtype):
    """The numpy construction rans_fast.decode_tables used before its compiled fill."""
    t = np.atleast_2d(freq).astype(np.uint64)
    m = 1 << precision
    cum = np.zeros_like(t)
    np.cumsum(t[:, :-1], axis=1, out=cum[:, 1:])
    sym = np.empty((t.shape[0], m), out_dtype)
    packed = np.empty((t.shape[0], m), np.uint32)
    slots = np.arange(m, dtype=np.uint64)
    for k in range(t.shape[0]):
        s = np.repeat(np.arange(t.shape[1]), t[k].astype(np.int64))
        sym[k] = s
        packed[k] = ((t[k][s] - 1) << np.uint64(16)) | (slots - cum[k][s])
    return sym, packed


def _random_freq(rng, rows: int, alphabet: int, precision: int) -> np.ndarray:
    out = np.zeros((rows, alphabet), np.int64)
    for k in range(rows):
        cuts = np.sort(rng.integers(0, (1 << precision) + 1, size=alphabet - 1))
        out[k] = np.diff(np.concatenate([[0], cuts, [1 << precision]]))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 3), alphabet=st.sampled_from([1, 2, 7, 256, 300]),
       precision=st.integers(8, 14))
def test_rans_slot_tables_equal_numpy_reference(seed, rows, alphabet, precision):
    freq = _random_freq(np.random.default_rng(seed), rows, alphabet, precision)
    dtype = np.uint16 if alphabet > 256 else np.uint8
    got = rans_fast.decode_tables(freq, precision, dtype)
    want = _slot_tables_reference(freq, precision, dtype)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def _varints_reference(buf: np.ndarray, pos: int, count: int, max_bytes: int):
    """The vectorised numpy reader stream._read_varint_array was before its compiled pass."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), pos
    window = buf[pos: pos + count * max_bytes]
    ends = np.flatnonzero(window < 0x80)[:count]
    if ends.size < count:
        raise CorruptStreamError("frequency table is truncated")
    lengths = np.diff(ends, prepend=-1)
    if lengths.max() > max_bytes:
        raise CorruptStreamError("frequency table holds an oversized value")
    if np.any((lengths > 1) & (window[ends] == 0)):
        raise CorruptStreamError("frequency table holds an overlong varint")
    used = window[: ends[-1] + 1].astype(np.int64)
    starts = ends - lengths + 1
    idx = np.arange(used.size) - np.repeat(starts, lengths)
    vals = np.add.reduceat((used & 0x7F) << (7 * idx), starts)
    return vals, pos + int(ends[-1]) + 1


def _read_varints(buf, pos, count, max_bytes):
    """stream._varints_at with its error as the CorruptStreamError the parser raises."""
    vals, end, err = stream._varints_at(buf, pos, count, max_bytes)
    if err:
        raise CorruptStreamError(stream._FREQ_ERRORS[err])
    return vals, end


def _outcome(fn, *args):
    try:
        vals, end = fn(*args)
        return "ok", vals.tolist(), end
    except CorruptStreamError as e:
        return "error", str(e)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=40), pos=st.integers(0, 8), count=st.integers(0, 12), max_bytes=st.integers(1, 3),
       valid=st.booleans())
def test_varint_array_equals_numpy_reference(data, pos, count, max_bytes, valid):
    """Same values and end, or the same error, on valid varints and on arbitrary bytes."""
    if valid:  # real varints (bytes below 0x80 end a value) with a random prefix
        vals = np.frombuffer(data, np.uint8).astype(np.int64) * 131 % (1 << (7 * max_bytes))
        data = data[:pos] + stream._varint_array(vals)
    buf = np.frombuffer(data, np.uint8)
    pos = min(pos, buf.size)
    assert _outcome(_read_varints, buf, pos, count, max_bytes) == \
        _outcome(_varints_reference, buf, pos, count, max_bytes)


@pytest.mark.parametrize("used", [0, 1, 5, N_CLASSES])
def test_compact_tables_are_the_two_level_form_of_the_full_tables(used):
    rng = np.random.default_rng(used)
    freq = np.zeros((N_CLASSES, 256), np.int64)
    rows = rng.choice(N_CLASSES, used, replace=False)
    freq[rows] = _random_freq(rng, used, 256, 12) if used else freq[rows]
    freq[rows[:1], :] = 0
    if used:
        freq[rows[0], 255] = 4096  # a class of ESC only
    compact = tables.compact_tables(freq)
    full = tables.decode_tables(freq)
    assert np.array_equal(compact, reference_compact(full))  # entry by entry from the full tables


def _decode_outcome(fn):
    try:
        return "ok", fn().tobytes()
    except CorruptStreamError as e:
        return "error", str(e)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), alphabet=st.sampled_from([1, 3, 256, 300]),
       precision=st.integers(8, 14), flip=st.integers(-1, 200))
def test_short_single_state_decode_equals_slot_table_decode(seed, n, alphabet, precision, flip):
    """decode_table's per-symbol path (short payloads) decodes what the per-slot tables decode and
    fails the same way on damaged payloads (a flipped byte, a cut)."""
    rng = np.random.default_rng(seed)
    freq = _random_freq(rng, 1, alphabet, precision)[0]
    dtype = np.uint16 if alphabet > 256 else np.uint8
    p = freq / freq.sum()
    x = rng.choice(alphabet, size=n, p=p).astype(dtype)
    payload = bytearray(rans_fast.encode_table(x, freq, precision, 1))
    if 0 <= flip < len(payload):
        payload[flip] ^= 0x5A
    elif flip > 150:
        payload = payload[:max(0, len(payload) - 2)]
    payload = np.frombuffer(bytes(payload), np.uint8)
    full = rans_fast.decode_tables(freq, precision, dtype)
    got = _decode_outcome(lambda: rans_fast.decode_table(payload, freq, precision, n, 1, dtype))
    assert got == _decode_outcome(lambda: rans_fast.decode_prepared(payload, full, precision, n, 1))
    if flip == -1:
        assert got == ("ok", x.tobytes())


def _parse_freqs_reference(buf: np.ndarray, pos: int, alphabet: int):
    """The numpy frequency-table reader stream._parse_freqs was before its compiled pass."""
    lo, pos = stream._get_varint(buf, pos, "frequency table")
    span, pos = stream._get_varint(buf, pos, "frequency table")
    if span < 1 or lo + span > alphabet:
        raise CorruptStreamError("frequency table range is outside the alphabet")
    if pos >= buf.size:
        raise CorruptStreamError("frequency table is truncated")
    mode, pos = int(buf[pos]), pos + 1
    freqs = np.zeros(alphabet, dtype=np.uint32)
    if mode == stream._TABLE_DENSE:
        vals, pos = _read_varints(buf, pos, span, 3)
        idx = np.arange(span)
    elif mode == stream._TABLE_BITMAP:
        nbytes = (span + 7) // 8
        if pos + nbytes > buf.size:
            raise CorruptStreamError("frequency table is truncated")
        idx = np.flatnonzero(np.unpackbits(buf[pos:pos + nbytes], bitorder="little")[:span])
        vals, pos = _read_varints(buf, pos + nbytes, idx.size, 3)
    elif mode == stream._TABLE_GAPS:
        k, pos = stream._get_varint(buf, pos, "frequency table")
        if not 1 <= k <= span:
            raise CorruptStreamError("frequency table symbol count out of range")
        gaps, pos = _read_varints(buf, pos, k - 1, 3)
        idx = np.concatenate(([0], np.cumsum(gaps + 1)))
        if idx[-1] >= span:
            raise CorruptStreamError("frequency table symbol outside its range")
        vals, pos = _read_varints(buf, pos, k, 3)
    elif mode in (stream._TABLE_RUNS, stream._TABLE_RUNS_RICE):
        k, pos = stream._get_varint(buf, pos, "frequency table")
        if not 1 <= k <= span:
            raise CorruptStreamError("frequency table run count out of range")
        gaps, pos = _read_varints(buf, pos, k, 3)
        lens, pos = _read_varints(buf, pos, k, 3)
        ends = np.cumsum(gaps + lens + 1)
        if ends[-1] > span:
            raise CorruptStreamError("frequency table run outside its range")
        idx = np.concatenate([np.arange(e - n - 1, e) for e, n in zip(ends, lens)])
        if mode == stream._TABLE_RUNS:
            vals, pos = _read_varints(buf, pos, idx.size, 3)
        else:
            if pos >= buf.size:
                raise CorruptStreamError("frequency table is truncated")
            if buf[pos] > 16:
                raise CorruptStreamError("bad Rice parameter in frequency table")
            vals = np.empty(idx.size, dtype=np.int64)
            pos = stream._rice_read(buf, pos + 1, idx.size, int(buf[pos]), vals)
            if pos < 0:
                raise CorruptStreamError("frequency table codes are truncated or malformed")
            vals += 1
    else:
        raise CorruptStreamError(f"unknown frequency table mode {mode}")
    if vals.size and vals.max() > 1 << 16:
        raise CorruptStreamError("frequency out of range")
    freqs[lo + idx] = vals
    if freqs[lo] == 0 or freqs[lo + span - 1] == 0:
        raise CorruptStreamError("frequency table range does not start and end at used symbols")
    return freqs, pos


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), used=st.integers(1, 256), run=st.integers(1, 20), damage=st.integers(0, 3),
       alphabet=st.sampled_from([256, 65536]))
def test_frequency_table_parse_equals_numpy_reference(seed, used, run, damage, alphabet):
    """Same frequencies and end, or the same error, on every table mode (written by _pack_freqs, and a
    plain runs table it never picks) and on damaged, cut and random bytes."""
    rng = np.random.default_rng(seed)
    mask = np.repeat(rng.random(-(-used // run)) < rng.random(), run)[:used]
    mask[rng.integers(0, used)] = True
    freqs = np.zeros(alphabet, np.uint32)
    freqs[:used][mask] = rng.integers(1, 70000, int(mask.sum())).clip(1, 65536)
    runs = bytes([0, 5, stream._TABLE_RUNS, 2, 0, 1, 1, 1]) + stream._varint_array(np.array([4096, 100, 5, 7]))
    for table in (stream._pack_freqs(freqs), runs, rng.integers(0, 256, 30).astype(np.uint8).tobytes()):
        table = bytearray(table)
        for _ in range(damage):
            table[rng.integers(0, len(table))] = rng.integers(0, 256)
        if damage == 3:
            table = table[:rng.integers(0, len(table))]
        buf = np.frombuffer(bytes(table), np.uint8)
        assert _outcome(stream._parse_freqs, buf, 0, alphabet) == _outcome(_parse_freqs_reference, buf, 0, alphabet)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["none", "external", "previous_token", "neighbour_layer"]),
       st.booleans())
def test_stored_fields_expand_to_the_params_kernel_args(seed, source, wide):
    """StoredFields.kernel_args (one compiled pass over the stored bytes) == BinParams.kernel_args of the
    params the bytes were written from: 1- and 2-byte fields, and fields not stored (their fixed values)."""
    from kvcodec.lossless.predictive.bins import bin_grid
    from kvcodec.lossless.predictive.params import Q, stored_fields

    rng = np.random.default_rng(seed)
    gp, d = int(rng.integers(1, 4)), int(rng.integers(1, 40))
    stored = stored_fields(source)
    mq_max = format2._MQ_MAX if wide else 100
    level = rng.integers(format2._LEVEL_LO, format2._LEVEL_HI + 1, (gp, d))
    mq = rng.integers(-mq_max, mq_max + 1, (gp, d)) if "m" in stored else np.zeros((gp, d), np.int64)
    c = rng.integers(-128, 128, (gp, d)) if "c" in stored else np.full((gp, d), Q if source == "external" else 0)
    a = rng.integers(-128, 128, (gp, d)) if "a" in stored else np.full((gp, d), Q)
    bp = format2.BinParams(level=level.astype(np.int64), mq=mq.astype(np.int64), c=c.astype(np.int8),
                           a=a.astype(np.int8), shared=False)
    head, body = bp.field_bytes(source)
    fields, rest = format2.StoredFields.read(head, body, source, gp, d)
    assert rest.size == 0
    grid = bin_grid(torch.bfloat16)
    for got, want in zip(fields.kernel_args(grid), bp.kernel_args(grid)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
