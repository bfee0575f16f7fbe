"""The GPU encoder's host model step: format2.code_model's bytes equal a reference built from the
documented layout with the per-part coder (``rans_fast.encode_table``), and that coder's grouped
one-table kernel equals the pure-Python spec (``entropy.rans``), on random inputs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.entropy import rans, rans_fast
from kvcodec.entropy.freq import count_symbols, quantize_frequencies
from kvcodec.lossless.predictive import format2 as f2
from kvcodec.lossless.predictive.tables import table_bytes


def reference_model(fields: np.ndarray, tables: np.ndarray) -> tuple[bytes, dict]:
    """code_model's layout, spelled out: u32 field bytes, u32 table bytes, the frequencies, the payload
    lengths, each part's ``encode_table`` payload, the table bytes."""
    raw = np.concatenate([fields, tables])
    if raw.size <= f2.MODEL_PART_BYTES:  # one rans_lanes stream: u32 count, u16 table length, table, words
        freq = quantize_frequencies(count_symbols(raw), 12).reshape(1, 256)
        tab = table_bytes(freq).tobytes()
        words = rans.encode_ctx(raw, np.zeros(raw.size, np.int64), list(freq), 12, f2.MODEL_LANES)
        return raw.size.to_bytes(4, "little") + len(tab).to_bytes(2, "little") + tab + words, {"mlanes": f2.MODEL_LANES}
    parts = max(1, min(f2.MAX_FIELD_PARTS, -(-fields.size // f2.FIELD_PART_BYTES)))
    freqs = quantize_frequencies(count_symbols(fields), f2.FIELD_PRECISION).astype("<u2")
    payloads = [rans_fast.encode_table(p, freqs, f2.FIELD_PRECISION, f2.FIELD_STATES)
                for p in np.array_split(fields, parts)]
    lens = np.array([p.size for p in payloads], "<u4")
    head = np.array([fields.size, tables.size], "<u4").tobytes() + freqs.tobytes() + lens.tobytes()
    return head + b"".join(p.tobytes() for p in payloads) + tables.tobytes(), {"mfields": parts}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.sampled_from([0, 1, 1000, 65000, 70001, 200_003, 400_000]),
       spread=st.sampled_from([0.3, 4.0, 60.0]), n_tables=st.integers(0, 2000))
def test_code_model_matches_reference(seed, size, spread, n_tables):
    rng = np.random.default_rng(seed)
    fields = (np.abs(rng.normal(0, spread, size)) % 256).astype(np.uint8)  # skewed, like the fields
    tables = rng.integers(0, 256, n_tables, dtype=np.uint8)
    if size + n_tables == 0:
        return
    assert f2.code_model(fields, tables) == reference_model(fields, tables)


def test_code_model_strided_fields():
    """A non-contiguous view of the fields gives the bytes of its contiguous copy."""
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 7, (2, 90_000), dtype=np.uint8)
    tables = rng.integers(0, 256, 300, dtype=np.uint8)
    assert f2.code_model(wide[:, ::2].reshape(-1)[::1], tables) == reference_model(
        np.ascontiguousarray(wide[:, ::2]).reshape(-1), tables)
    assert f2.code_model(wide[0, ::2], tables) == reference_model(np.ascontiguousarray(wide[0, ::2]), tables)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300), n_streams=st.sampled_from([1, 5, 32]),
       precision=st.integers(1, 16), alphabet=st.sampled_from([2, 256, 300, 65536]))
def test_table_kernel_matches_the_spec(seed, n, n_streams, precision, alphabet):
    """The grouped one-table encoder (float division) == the pure-Python spec, every precision and N."""
    rng = np.random.default_rng(seed)
    used = rng.choice(alphabet, size=min(alphabet, 1 << precision, int(rng.integers(1, 40))), replace=False)
    counts = np.zeros(alphabet, np.int64)
    counts[used] = rng.integers(1, 1000, used.size) ** rng.integers(1, 3)
    freqs = quantize_frequencies(counts, precision)
    dtype = np.uint8 if alphabet <= 256 else np.uint16
    symbols = rng.choice(used, size=n, p=counts[used] / counts[used].sum()).astype(dtype)
    got = rans_fast.encode_table(symbols, freqs, precision, n_streams).tobytes()
    assert got == rans.encode(symbols, freqs, precision, n_streams)


def test_table_kernel_names_the_last_symbol_without_frequency():
    freqs = np.zeros(256, np.int64)
    freqs[[1, 2]] = [3000, 1096]
    symbols = np.array([1, 7, 2, 1, 9, 2, 1], np.uint8)
    with pytest.raises(ValueError, match="symbol 9 at position 4"):
        rans_fast.encode_table(symbols, freqs, 12, 4)


def reference_table_bytes(freq: np.ndarray) -> np.ndarray:
    """tables.table_bytes' layout in Python: per row [0] (unused), [0xFFFF, esc] (only ESC) or
    [n, lo, the n frequencies from lo, esc], each value as one byte or 255 and two bytes."""
    from kvcodec.lossless.predictive.bins import ESC

    values = []
    for row in freq:
        nz = np.flatnonzero(row[:ESC])
        if not row.any():
            values += [0]
        elif nz.size == 0:
            values += [0xFFFF, int(row[ESC])]
        else:
            lo, hi = int(nz[0]), int(nz[-1]) + 1
            values += [hi - lo, lo, *row[lo:hi].tolist(), int(row[ESC])]
    return np.array([b for v in values for b in ([v] if v < 255 else [255, v & 0xFF, v >> 8])], np.uint8)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 70))
def test_compiled_table_bytes_match_the_layout(seed, rows):
    """tables.table_bytes (compiled) == the documented layout: unused rows, ESC-only rows, one symbol,
    gaps, values past 254 (two-byte form)."""
    from kvcodec.lossless.predictive import tables

    rng = np.random.default_rng(seed)
    freq = rng.integers(0, 4097, (rows, 256)) * (rng.random((rows, 256)) < rng.random((rows, 1)) ** 3)
    freq[rng.random(rows) < 0.2] = 0
    freq[rng.random(rows) < 0.2, :255] = 0
    assert np.array_equal(tables.table_bytes(freq), reference_table_bytes(freq))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), g=st.integers(1, 40), tt=st.integers(1, 3000), d=st.sampled_from([8, 64, 128]),
       n_parts=st.integers(0, 5))
def test_launch_tables_match_their_formulas(seed, g, tt, d, n_parts):
    """kvctx_device_encode._chunk_descriptors and _launch_tables (one compiled pass, one buffer) == the
    payload launches' arguments spelled out in numpy: chunk descriptors, cap, table words, reciprocals."""
    from kvcodec.entropy import rans_lanes
    from kvcodec.lossless import kvctx_device_encode as kde
    from kvcodec.lossless.predictive.format2 import chunk_layout

    rng = np.random.default_rng(seed)
    freq = rng.integers(0, 4097, (int(rng.integers(1, 70)), 256)) * (rng.random((1, 256)) < 0.3)
    tb = min(tt, 2048)
    cg0, cng, ct0, cnt = chunk_layout(g, tt, d, tb, g)
    desc, cap = kde._chunk_descriptors((cg0, cng, ct0, cnt), tt, d)
    assert np.array_equal(desc, np.stack([(cg0 * tt + ct0) * d, cng, cnt * d, np.full_like(cng, tt * d)], 1))
    assert cap == int((cng * cnt).max()) * d
    parts = rng.integers(0, 1 << 20, (n_parts, 4))
    parts_d, ftab, rcp = kde._launch_tables(freq, parts, "cpu")
    f = freq.reshape(-1).astype(np.uint64)
    assert np.array_equal(parts_d.numpy(), parts)
    assert np.array_equal(ftab.numpy().view(np.uint32),
                          (f | (rans_lanes.cumulative(freq).reshape(-1).astype(np.uint64) << 16)).astype(np.uint32))
    assert np.array_equal(rcp.numpy().view(np.uint32), np.where(f >= 2, (1 << 32) // np.maximum(f, 1), 0xFFFFFFFF))
