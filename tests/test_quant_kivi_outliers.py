"""KIVI baseline and the outlier channel split."""

import pytest
import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant import KIVI, QuantizedTensor, TurboQuantMSE, TurboQuantOutlier, expected_distortion


def keys_with_outlier_channels(n=96, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[[3, 17, 40, 41]] = 12.0
    return torch.randn(2, 3, n, d, generator=g) * scale + torch.linspace(-1, 1, d)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_kivi_error_is_within_half_a_step(bits, axis):
    x = keys_with_outlier_channels()
    q = KIVI(bits, group_size=32, axis=axis)
    c = q.quantize(x)
    xh = q.dequantize(c)
    if axis == "channel":
        xs = x.reshape(2, 3, 3, 32, 64)
        step = (xs.amax(3) - xs.amin(3)) / (2**bits - 1)
        step = step.repeat_interleave(32, dim=2)
    else:
        xs = x.reshape(2, 3, 96, 2, 32)
        step = ((xs.amax(-1) - xs.amin(-1)) / (2**bits - 1)).repeat_interleave(32, dim=-1)
    assert bool(((xh - x).abs() <= step * 0.5 + 1e-2 * step.clamp_min(1e-3) + 2e-3).all())


def test_kivi_nbytes_and_layout():
    x = torch.randn(2, 3, 70, 64)
    k = KIVI(2, 32, "channel").quantize(x)  # 70 tokens -> 3 groups, the last one partial
    assert k.codes.shape == (2, 3, 70, 16) and k.grouped["scale"].shape == (2, 3, 3, 64)
    assert k.nbytes == 2 * 3 * (70 * 16 + 3 * 64 * 2 * 2)
    v = KIVI(4, 32, "token").quantize(x)
    assert v.token["scale"].shape == (2, 3, 70, 2)
    assert v.nbytes == 2 * 3 * 70 * (32 + 2 * 2 * 2)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_kivi_packed_ops(axis):
    q = KIVI(3, 16, axis)
    x = torch.randn(2, 2, 40, 48)
    c = q.quantize(x)
    xh = q.dequantize(c)
    qs, w = torch.randn(2, 2, 5, 48), torch.rand(2, 2, 5, 40)
    assert torch.allclose(q.scores(c, qs), qs @ xh.transpose(-1, -2), atol=1e-4)
    assert torch.allclose(q.weighted_sum(c, w), w @ xh, atol=1e-4)
    joined = QuantizedTensor.cat([c.slice_tokens(0, 32), c.slice_tokens(32)])
    assert torch.equal(joined.dequantize(), xh)
    assert torch.equal(q.dequantize(c.crop(20)), xh[:, :, :20])
    assert torch.equal(q.dequantize(c.index_select(1, torch.tensor([1]))), xh[:, 1:])
    assert torch.equal(QuantizedTensor.from_dict(c.to_dict()).dequantize(), xh)
    if axis == "channel":
        with pytest.raises(ValueError):
            c.slice_tokens(5, 20)  # not on a group boundary
        with pytest.raises(ValueError):
            QuantizedTensor.cat([c.slice_tokens(0, 20), c.slice_tokens(0, 16)])  # partial group first


def test_kivi_bad_arguments():
    for make in (lambda: KIVI(0), lambda: KIVI(3, 0), lambda: KIVI(3, 32, "row")):
        with pytest.raises(ValueError):
            make()
    with pytest.raises(ValueError):
        KIVI(2, dim=64).quantize(torch.randn(3, 32))
    with pytest.raises(ValueError):
        KIVI(2).quantize(torch.tensor([[float("nan"), 1.0]]))


def test_outlier_split_finds_the_outlier_channels_and_beats_plain_at_equal_bits():
    x = keys_with_outlier_channels(n=256)
    q = TurboQuantOutlier(64, outlier_channels=8, outlier_bits=4, bits=2)
    side = q.calibrate(x)
    assert {3, 17, 40, 41} <= set(side["perm"][0, 0, 0, :8].tolist())
    c = q.quantize(x, precond=side)
    err = float((q.dequantize(c) - x).pow(2).sum() / x.pow(2).sum())
    plain = TurboQuantMSE(64, 3, precondition="none", norm_correction=False)  # 3 bits > 2.25 bits here
    err_plain = float((plain.dequantize(plain.quantize(x)) - x).pow(2).sum() / x.pow(2).sum())
    assert c.bits_per_value() < 3.0 and err < err_plain


def test_outlier_paper_configs_bits():
    x = torch.randn(1, 2, 40, 128)
    for name, bits in (("2.5", 2.5), ("3.5", 3.5)):
        c = TurboQuantOutlier.paper(128, name).quantize(x)
        # 32 channels at b+1 bits, 96 at b bits, two fp16 norms: the paper's nominal rate, plus the int16 perm
        assert c.nbytes == 2 * 40 * (128 * bits / 8) + 2 * 128 * 2


@pytest.mark.parametrize("precondition", ["none", "center"])
def test_outlier_packed_ops(precondition):
    q = TurboQuantOutlier(96, 24, 3, 2, precondition=precondition)
    x = keys_with_outlier_channels(n=50, d=96)
    c = q.quantize(x)
    xh = q.dequantize(c)
    d = float((xh - x).pow(2).sum() / x.pow(2).sum())
    assert d < expected_distortion(72, 2)
    qs, w = torch.randn(2, 3, 4, 96), torch.rand(2, 3, 4, 50)
    assert torch.allclose(q.scores(c, qs), qs @ xh.transpose(-1, -2), atol=2e-3)
    assert torch.allclose(q.weighted_sum(c, w), w @ xh, atol=2e-3)
    more = q.quantize(x, precond=c)
    assert torch.allclose(QuantizedTensor.cat([c, more]).dequantize(), torch.cat([xh, xh], -2), atol=1e-5)
    assert torch.allclose(q.dequantize(c.index_select(0, torch.tensor([1, 0]))), xh[[1, 0]])
    back = QuantizedTensor.from_dict(c.to_dict())
    assert torch.equal(back.dequantize(), xh)
    bad = c.to_dict()
    bad["tensors"]["side.perm"] = torch.zeros_like(bad["tensors"]["side.perm"])
    with pytest.raises(CorruptStreamError):
        QuantizedTensor.from_dict(bad)
