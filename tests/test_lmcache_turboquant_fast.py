"""The compiled CPU kernels of kvcodec.quant.turboquant_fast give the same integers, bytes and
floats as the torch implementations they replace (turboquant_fast.disabled() runs those)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.quant import TurboQuantMSE, TurboQuantOutlier, turboquant_fast
from kvcodec.quant.codebooks import lloyd_max_codebook
from kvcodec.quant.packing import lookup_group, pack_bits, packed_width, unpack_bits, unpack_values, value_table

SETTINGS = settings(max_examples=60, deadline=None)


def both(fn):
    """(compiled result, torch result) of ``fn()``."""
    fast = fn()
    with turboquant_fast.disabled():
        slow = fn()
    return fast, slow


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8) if a.dtype == torch.float32
                                                                              else a, b.view(torch.uint8) if b.dtype == torch.float32 else b))


@SETTINGS
@given(bits=st.integers(1, 8), rows=st.integers(0, 40), n=st.integers(1, 300), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]))
def test_pack_bits_same_bytes(bits, rows, n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    hi = min(1 << bits, 256 if dtype == torch.uint8 else 1 << 30)
    v = torch.randint(0, hi, (rows, n), generator=g).to(dtype)
    fast, slow = both(lambda: pack_bits(v, bits))
    assert fast.dtype == slow.dtype == torch.uint8 and torch.equal(fast, slow)
    if rows:
        assert torch.equal(unpack_bits(fast, bits, n), v.long())


@SETTINGS
@given(bits=st.integers(1, 8), lead=st.lists(st.integers(1, 5), min_size=0, max_size=3), dim=st.integers(4, 160),
       seed=st.integers(0, 2**31))
def test_unpack_values_same_floats(bits, lead, dim, seed):
    width = packed_width(dim, bits)
    group = lookup_group(bits, width)
    if group is None:
        return
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*lead, 7, width), generator=g, dtype=torch.int64).to(torch.uint8)
    cb = tuple(float(x) for x in lloyd_max_codebook(max(dim, 3), bits).astype(np.float32))
    table = value_table(cb, bits, group, "cpu")
    fast, slow = both(lambda: unpack_values(packed, table, group, dim))
    assert same(fast, slow)


@SETTINGS
@given(bits=st.integers(1, 8), rows=st.integers(1, 600), dim=st.integers(4, 130), seed=st.integers(0, 2**31),
       special=st.booleans())
def test_bucketize_same_indices(bits, rows, dim, seed, special):
    g = torch.Generator().manual_seed(seed)
    cb = torch.from_numpy(lloyd_max_codebook(dim, bits).astype(np.float32))
    thr = (cb[1:] + cb[:-1]) / 2
    y = torch.randn(rows, dim, generator=g) / dim ** 0.5
    if special:  # exact thresholds, centroids, the ends and NaN
        picks = torch.cat([thr, cb, torch.tensor([-2.0, 2.0, 0.0, -0.0, float("nan")])])
        y.view(-1)[: min(picks.numel(), y.numel())] = picks[: y.numel()]
    (fi, fv), (si, sv) = both(lambda: turboquant_fast.bucketize(y, thr, cb))
    assert torch.equal(fi, si) and fi.dtype == si.dtype
    assert same(fv, sv)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=25, deadline=None)
@given(bits=st.integers(1, 8), lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), tokens=st.integers(1, 700),
       dim=st.sampled_from([4, 16, 24, 64, 80, 128]), pre=st.sampled_from(["none", "center", "scale"]),
       scale=st.sampled_from([1e-3, 1.0, 40.0]), seed=st.integers(0, 2**31),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_turboquant_same_bytes_and_reconstruction(threads, bits, lead, tokens, dim, pre, scale, seed, dtype):
    """Whole quantize/dequantize: every stored tensor byte-identical, the reconstruction bit-identical."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, tokens, dim, generator=g) * scale).to(dtype)
    q = TurboQuantMSE(dim, bits, seed=seed % 7, precondition=pre)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fast, slow = both(lambda: q.quantize(x).to_dict())
        assert fast["meta"] == slow["meta"] and fast["tensors"].keys() == slow["tensors"].keys()
        for name, t in fast["tensors"].items():
            assert t.dtype == slow["tensors"][name].dtype and torch.equal(t, slow["tensors"][name]), name
        c = q.quantize(x)
        rf, rs = both(lambda: q.dequantize(c))
    finally:
        torch.set_num_threads(before)
    assert same(rf, rs)


def test_outlier_split_same_bytes():
    x = torch.randn(2, 3, 300, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = TurboQuantOutlier(64, 8, 5, 4, seed=1, precondition="center")
    fast, slow = both(lambda: q.quantize(x).to_dict())
    for name, t in fast["tensors"].items():
        assert torch.equal(t, slow["tensors"][name]), name
