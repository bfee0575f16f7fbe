"""The GPU encoder's host model step: format2.code_model's bytes equal a reference built from the
documented layout with the per-part coder (``rans_fast.encode_table``), and that coder's grouped
one-table kernel equals the pure-Python spec (``entropy.rans``), on random inputs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import entropy
from kvcodec.entropy import rans, rans_fast
from kvcodec.entropy.freq import count_symbols, quantize_frequencies
from kvcodec.lossless.predictive import format2 as f2


def reference_model(fields: np.ndarray, tables: np.ndarray) -> tuple[bytes, dict]:
    """code_model's layout, spelled out: u32 field bytes, u32 table bytes, the frequencies, the payload
    lengths, each part's ``encode_table`` payload, the table bytes."""
    raw = np.concatenate([fields, tables])
    if raw.size <= f2.MODEL_PART_BYTES:
        return entropy.encode(raw, coder="rans"), {}
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
