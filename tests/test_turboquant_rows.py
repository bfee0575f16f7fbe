"""kvcodec.quant.turboquant_rows (one compiled pass per row, Hadamard rotations as fast transforms)
against the torch path of TurboQuantMSE on random inputs: the same format, codes equal except where a
rotated coordinate lies within float32 rounding of a centroid boundary (then the neighbouring code),
norms equal to their storage rounding, reconstructions equal to float32 rounding; bad input raises
the torch path's error; every reader decodes what it writes."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec.quant import TurboQuantMSE, TurboQuantProd, turboquant_fast, turboquant_rows

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _rotated(q: TurboQuantMSE, x: torch.Tensor) -> torch.Tensor:
    """The torch path's unit rotated rows (what the centroid search sees)."""
    from kvcodec.quant.turboquant import resolve_precond

    xp = resolve_precond(q, x, None).apply(x.float())
    n = torch.linalg.vector_norm(xp, dim=-1, keepdim=True)
    return (xp / torch.where(n > 0, n, torch.ones_like(n))) @ q.rotation.T


def _codes(q: TurboQuantMSE, c) -> torch.Tensor:
    from kvcodec.quant.packing import unpack_bits

    return unpack_bits(c.token["codes"], q.bits, q.dim).long()


def _compare(q: TurboQuantMSE, x: torch.Tensor) -> None:
    ref = q.quantize(x)
    got = turboquant_rows.quantize(q, x)
    assert got.config == ref.config and got.lead_shape == ref.lead_shape and got.num_tokens == ref.num_tokens
    assert set(got.token) == set(ref.token) == {"codes", "norms"}
    assert got.token["codes"].shape == ref.token["codes"].shape and got.token["codes"].dtype == torch.uint8
    assert got.token["norms"].dtype == ref.token["norms"].dtype
    for k in ref.side:
        assert torch.equal(got.side[k], ref.side[k])
    a, b = _codes(q, ref), _codes(q, got)
    differ = a != b
    if differ.any():  # only next to a boundary, and only to the neighbouring centroid
        assert ((a - b).abs()[differ] == 1).all()
        y = _rotated(q, x)[differ]
        thr = (q.codebook[1:] + q.codebook[:-1]) / 2
        gap = (y.unsqueeze(-1) - thr).abs().amin(-1)
        assert float(gap.max()) < 1e-5
    rows_same = ~differ.any(-1)
    na, nb = ref.token["norms"].float()[rows_same], got.token["norms"].float()[rows_same]
    ulp = torch.finfo(ref.token["norms"].dtype).eps
    assert torch.allclose(na, nb, rtol=2 * ulp, atol=0)
    # either reader decodes either writer's output to the same floats (to float32 rounding)
    for c in (ref, got):
        d_ref, d_rows = c.dequantize(), turboquant_rows.dequantize(c)
        scale = d_ref.abs().amax().clamp_min(1e-30)
        assert float((d_ref - d_rows).abs().amax() / scale) < 1e-5


@SETTINGS
@given(dim=st.sampled_from([16, 32, 64, 128, 256]), bits=st.integers(1, 8), rotation=st.sampled_from(["hadamard", "hadamard2"]),
       precondition=st.sampled_from(["none", "center", "scale"]), correct=st.booleans(), seed=st.integers(0, 5),
       tokens=st.integers(1, 70), heads=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       data_seed=st.integers(0, 2**31 - 1))
def test_rows_match_the_torch_path(dim, bits, rotation, precondition, correct, seed, tokens, heads, dtype, data_seed):
    q = TurboQuantMSE(dim, bits, seed=seed, rotation=rotation, precondition=precondition, norm_correction=correct)
    g = torch.Generator().manual_seed(data_seed)
    x = (torch.randn(heads, tokens, dim, generator=g) * torch.rand(heads, 1, dim, generator=g) * 5).to(dtype)
    _compare(q, x)


@pytest.mark.parametrize("case", ["zeros", "tiny", "huge", "constant", "one_hot"])
def test_rows_on_edge_values(case):
    q = TurboQuantMSE(64, 3, precondition="none")
    x = torch.zeros(2, 17, 64)
    if case == "tiny":
        x = torch.randn(2, 17, 64) * 1e-30
    elif case == "huge":
        x = torch.randn(2, 17, 64) * 1e30
    elif case == "constant":
        x = torch.full((2, 17, 64), 3.0)
    elif case == "one_hot":
        x[..., 5] = 2.0
    _compare(q, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rows_refuse_what_the_torch_path_refuses(bad):
    q = TurboQuantMSE(64, 4)
    x = torch.randn(1, 8, 64)
    x[0, 3, 7] = bad
    with pytest.raises(ValueError) as ref:
        q.quantize(x)
    with pytest.raises(ValueError) as got:
        turboquant_rows.quantize(q, x)
    assert str(got.value) == str(ref.value)


def test_other_quantizers_and_devices_take_their_own_path():
    for q in (TurboQuantMSE(64, 4, rotation="qr"), TurboQuantProd(64, 4), TurboQuantMSE(80, 4)):
        x = torch.randn(2, 9, q.dim)
        assert not turboquant_rows.applies(q, x)
        got, ref = turboquant_rows.quantize(q, x), q.quantize(x)
        assert all(torch.equal(got.token[k], ref.token[k]) for k in ref.token)
        assert torch.equal(turboquant_rows.dequantize(ref), q.dequantize(ref))
    q, x = TurboQuantMSE(64, 4), torch.randn(2, 9, 64)
    assert turboquant_rows.applies(q, x)
    with turboquant_fast.disabled():
        assert not turboquant_rows.applies(q, x)


def _same_f16_or_next(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float16 tensors equal, or one rounding step apart (a statistic on a rounding boundary)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return bool(((ai - bi).abs() <= 1).all())


@SETTINGS
@given(dim=st.sampled_from([32, 64, 128]), bits=st.integers(1, 8), rotation=st.sampled_from(["hadamard", "hadamard2"]),
       precondition=st.sampled_from(["none", "center", "scale"]), layers=st.integers(1, 3), heads=st.integers(1, 3),
       tokens=st.integers(1, 40), first=st.integers(0, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       threads=st.sampled_from([1, 2]), data_seed=st.integers(0, 2**31 - 1))
def test_a_chunk_part_read_in_place(dim, bits, rotation, precondition, layers, heads, tokens, first, dtype, threads,
                                    data_seed):
    """quantize_chunk of an LMCache chunk part [layers, T, heads * D] is quantize of its tokens [first, T) as
    [layers, heads, T - first, D]: the preconditioner to float16 rounding, and with that preconditioner the
    same codes and norms, bit for bit."""
    from kvcodec.quant.precondition import ChannelPreconditioner, calibrate

    first = min(first, tokens - 1)
    q = TurboQuantMSE(dim, bits, rotation=rotation, precondition=precondition)
    g = torch.Generator().manual_seed(data_seed)
    part = (torch.randn(layers, tokens, heads * dim, generator=g) * torch.rand(1, 1, heads * dim, generator=g) * 4
            + torch.randn(1, 1, heads * dim, generator=g)).to(dtype)
    x = part[:, first:].reshape(layers, tokens - first, heads, dim).transpose(1, 2).float()
    with turboquant_fast.workers(threads):
        got = turboquant_rows.quantize_chunk(q, part, first, heads)
        ref_pre = calibrate(x, precondition)
        ref = turboquant_rows.quantize(q, x, ChannelPreconditioner.from_side(got.side) if got.side else None)
    assert set(got.side) == set(ref_pre.side_fields())
    for k, t in ref_pre.side_fields().items():
        assert got.side[k].shape == t.shape and _same_f16_or_next(got.side[k], t), k
    assert got.lead_shape == (layers, heads) and got.num_tokens == tokens - first
    for k in ("codes", "norms"):
        assert torch.equal(got.token[k], ref.token[k]), k


def test_a_chunk_part_the_kernels_do_not_read_is_left_to_the_caller():
    q = TurboQuantMSE(64, 4)
    part = torch.randn(2, 8, 128)
    assert turboquant_rows.quantize_chunk(q, part.half(), 0, 2) is None  # float16: through the float32 copy
    assert turboquant_rows.quantize_chunk(q, part.transpose(0, 1), 0, 2) is None  # not contiguous
    assert turboquant_rows.quantize_chunk(q, part, 0, 3) is None  # heads * D is not the hidden size
    assert turboquant_rows.quantize_chunk(q, part, 8, 2) is None  # no token left
    assert turboquant_rows.quantize_chunk(TurboQuantMSE(64, 4, rotation="qr"), part, 0, 2) is None
    part[1, 5, 70] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        turboquant_rows.quantize_chunk(q, part, 0, 2)


def test_threads_split_rows_to_the_same_bytes():
    q = TurboQuantMSE(128, 4, precondition="scale")
    x = torch.randn(4, 600, 128)
    with turboquant_fast.workers(1):
        one = turboquant_rows.quantize(q, x)
        d1 = turboquant_rows.dequantize(one)
    with turboquant_fast.workers(2):
        two = turboquant_rows.quantize(q, x)
        d2 = turboquant_rows.dequantize(one)
    assert all(torch.equal(one.token[k], two.token[k]) for k in one.token)
    assert torch.equal(d1, d2)


def test_hadamard_signs_give_the_rotation_matrix():
    from kvcodec.quant.rotations import hadamard_signs, rotation_matrix, sylvester_hadamard

    for kind in ("hadamard", "hadamard2"):
        for dim in (4, 64, 256):
            signs = hadamard_signs(dim, 7, kind)
            h = sylvester_hadamard(dim)
            r = h * signs[0] / np.sqrt(dim) if kind == "hadamard" else (h * signs[1]) @ (h * signs[0]) / dim
            assert torch.equal(rotation_matrix(dim, 7, kind), torch.from_numpy(r.astype(np.float32)))
    with pytest.raises(ValueError):
        hadamard_signs(80, 0, "hadamard2")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first", [0, 3])
def test_decode_into_an_lmcache_chunk_part(dtype, first):
    """Codes of [layers, heads, T, D] written straight into tokens [first, first + T) of a chunk part
    [layers, tokens, heads * D]: the same values as dequantize, transposed and rounded by torch."""
    layers, heads, d, tokens = 3, 2, 64, 40
    q = TurboQuantMSE(d, 4, precondition="scale")
    x = torch.randn(layers, heads, tokens - first, d)
    x[1, 0] *= 1000.0  # another scale in one head
    c = q.quantize(x)
    want = turboquant_rows.dequantize(c).transpose(1, 2).reshape(layers, tokens - first, heads * d).to(dtype)
    out = torch.full((layers, tokens, heads * d), float("nan"), dtype=dtype)
    with turboquant_fast.workers(2):
        assert turboquant_rows.dequantize_into_chunk(c, out, first)
    assert torch.equal(out[:, first:].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert out[:, :first].isnan().all()  # the tokens before stay as they were
    assert not turboquant_rows.dequantize_into_chunk(c, torch.empty(layers, tokens, heads * d, dtype=torch.float16), 0)
    assert not turboquant_rows.dequantize_into_chunk(c, out, tokens - first + 1)  # past the end: not written


def test_bf16_rounding_is_torchs():
    """The kernel's float32 -> bfloat16 rounding against torch's on edge bit patterns (ties to even,
    the largest finite values, infinities, subnormals); a NaN stays a NaN (torch's own NaN bits depend on
    its code path: its scalar and vector conversions differ)."""
    import numpy as np

    bits = np.array([0, 0x80000000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                     0x7FC00001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x3F7FFFFF], np.uint32)
    vals = torch.from_numpy(bits.view(np.float32).copy())
    with np.errstate(over="ignore"):  # the Python form wraps in uint32 as the compiled one does (NaN patterns)
        got = [turboquant_rows._bf16_bits.py_func(np.uint32(b)) for b in bits]
    want = vals.to(torch.bfloat16)
    got = torch.from_numpy(np.array(got, np.uint16).view(np.int16)).view(torch.bfloat16)
    nan = vals.isnan()
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)) and got[nan].isnan().all()
