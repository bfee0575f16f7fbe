"""Bit packing (tq layout v1 bit order) and rotations."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.quant.packing import lookup_group, pack_bits, packed_width, unpack_bits, unpack_values, value_table
from kvcodec.quant.rotations import rotation_matrix, sylvester_hadamard


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(1, 140), rows=st.integers(0, 4), seed=st.integers(0, 2**31))
def test_pack_roundtrip(bits, n, rows, seed):
    """unpack_bits inverts pack_bits; the table-lookup unpack gives exactly values[unpack_bits(...)]
    wherever it applies."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 1 << bits, (rows, n), generator=g)
    p = pack_bits(v, bits)
    assert p.dtype == torch.uint8 and p.shape == (rows, packed_width(n, bits))
    assert torch.equal(unpack_bits(p, bits, n), v)
    group = lookup_group(bits, p.shape[-1])
    if group is None:
        assert 8 % bits and (24 % bits or p.shape[-1] % 3)
        return
    values = torch.randn(1 << bits, generator=g)
    table = value_table(tuple(values.tolist()), bits, group, "cpu")
    assert torch.equal(unpack_values(p, table, group, n), values[v])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7])
def test_bit_order_is_a_little_endian_stream(bits):
    n = 64
    v = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    p = pack_bits(v, bits).numpy()
    stream = int.from_bytes(p.tobytes(), "little")  # the row as one little-endian integer
    for j in range(n):
        assert (stream >> (j * bits)) & ((1 << bits) - 1) == int(v[j])
    words = np.frombuffer(p.tobytes() + b"\0" * (-len(p) % 4), dtype="<u4")  # same stream as uint32 words
    assert sum(int(w) << (32 * i) for i, w in enumerate(words)) == stream


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(4), 2)
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 3, 16)  # needs 6 bytes
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(4, dtype=torch.int64), 9)


@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256])
def test_rotation_is_orthogonal_and_deterministic(dim):
    r = rotation_matrix(dim, seed=3)
    assert r.dtype == torch.float32 and r.shape == (dim, dim)
    assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)
    assert torch.equal(r, rotation_matrix(dim, seed=3))
    assert not torch.allclose(r, rotation_matrix(dim, seed=4))


def test_randomized_hadamard_structure():
    d = 64
    h = torch.from_numpy(sylvester_hadamard(d)).float()
    r = rotation_matrix(d, 1, "hadamard")
    signs = (r * h).sum(0) / d**0.5  # R = H diag(s) / sqrt(D)
    assert torch.allclose(signs.abs(), torch.ones(d), atol=1e-5)
    assert torch.allclose(r, h * signs / d**0.5, atol=1e-6)
    # two rounds: a one-hot input is no longer flat
    y1 = rotation_matrix(d, 1, "hadamard")[:, 0]
    y2 = rotation_matrix(d, 1, "hadamard2")[:, 0]
    assert torch.allclose(y1.abs(), torch.full((d,), d**-0.5))
    assert y2.abs().std() > 0.3 * d**-0.5


def test_rotation_bad_arguments():
    with pytest.raises(ValueError):
        rotation_matrix(80, 0, "hadamard")
    with pytest.raises(ValueError):
        rotation_matrix(64, 0, "dct")
    with pytest.raises(ValueError):
        rotation_matrix(64, -1)
