"""The kvctx / predictive GPU decode kernel's own paths (kvcodec/lossless/cuda/kvctx_decode.cu): the instance the
launcher picks per layout and dtype, and unary (bin-0) depths deep enough that their running sum leaves the
64-bit windows read ahead (the kernel then reads the ring), on the CPU emulation of the kernel and, marked
gpu, on the device."""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec.lossless.cuda import kvctx_decode as kd
from kvcodec.lossless.predictive.bins import bin_grid
from test_kvctx_device import GPU, emulated_decode, emulator, same_bits  # noqa: F401


def grid_of(dtype) -> tuple:
    g = bin_grid(dtype)
    return g.width, g.sign, g.mb, g.maxmag, g.eoff


def test_launcher_picks_layout_and_grid():
    bf16, fp16 = grid_of(torch.bfloat16), grid_of(torch.float16)
    assert kd.BF16_GRID == bf16
    assert kd.variant(2, bf16, 64, 2) == (kd.REGS, True)
    assert kd.variant(2, fp16, 128, 2) == (kd.ALIGNED, False)
    assert kd.variant(2, bf16, 64, 4) == (kd.GENERAL, True)
    assert kd.variant(4, bf16, 40, 2) == (kd.GENERAL, True)  # float32: bf16 upper halves
    assert kd.variant(1, grid_of(torch.float8_e4m3fn), 64, 2) == (kd.REGS, False)


def deep_unary(shape=(1, 256, 64), seed=1) -> torch.Tensor:
    """Every third token ~2**-14 of the others (every fifth ~2**-9): many values of a token in bin 0 at
    depths ~9-14, so a batch's depths add up past a 64-bit window."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(shape[-2])
    scale[::3] = 2.0 ** -14
    scale[1::5] = 2.0 ** -9
    return (torch.randn(shape, generator=g) * scale[:, None]).to(torch.bfloat16)


def test_emulated_kernel_deep_unary_chains(emulator):
    x = deep_unary()
    out, status, _ = emulated_decode(emulator, kvcodec.compress(x, layout="kv"))
    assert not status.any() and same_bits(out, x)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("shape", [(2, 4, 256, 64), (2, 512, 128), (3, 700, 40)])
def test_gpu_deep_unary_chains(shape):
    x = deep_unary(shape)
    blob = torch.frombuffer(bytearray(kvcodec.compress(x, layout="kv")), dtype=torch.uint8).cuda()
    assert same_bits(kvcodec.decompress(blob), x)


def test_locate_fraction_of_negative_locations_by_one_subtraction():
    """kx_locate_tail takes a negative location's fraction as the rounded 1 - f (|y - (u + 1)|, the same rounding) where
    the CPU computes f + (1 - 2 f): the two give
    the same fine class q = min(floor(4 x), 3) for every f in [0, 1) (the kernel's comment has the proof); checked
    here at every binade's quarter boundaries, their neighbours and random fractions."""
    import numpy as np

    rng = np.random.default_rng(0)
    ks = np.arange(1, 70, dtype=np.float64)
    near = [b + s * 2.0 ** -ks for b in (0.125, 0.25, 0.5, 0.75, 1.0) for s in (-1, 1)]
    near += [b - 2.0 ** -ks - 2.0 ** -(ks + 30) for b in (0.25, 0.5, 0.75, 1.0)]
    steps = [b + np.arange(-300, 301) * np.spacing(b) for b in (0.25, 0.5, 0.75, 1.0)]
    y = rng.random(200_000) * 2.0 ** rng.integers(-40, 19, 200_000)
    f = np.concatenate([*near, *steps, rng.random(200_000), rng.random(50_000) * 2.0 ** -rng.integers(0, 60, 50_000),
                        y - np.trunc(y), [0.0]])
    f = f[(f >= 0) & (f < 1)]
    cpu = np.minimum(np.floor(4 * (f + (1 - 2 * f))), 3)
    assert np.array_equal(cpu, np.minimum(np.floor(4 * (1 - f)), 3))


def test_kernel_locate_equals_cpu_locate(cpu_emulator):
    """kx_locate_ep (the decoder's bin coordinate in one fma, the negative fraction as |y - (u + 1)|) and kx_locate (the
    encoder's) against bins.locate's float64 steps written out in C++, on 10**6 locations a grid built near every edge
    (eu against ep, quarter boundaries of the fraction, rounding of the steps sum, zeros, subnormals, both signs);
    3 * 10**5 more with the "mag" flag (a negative location's fraction by magnitude: its instances)."""
    import ctypes

    lib = cpu_emulator("kvctx_locate_check")
    lib.kx_locate_mismatches.restype = ctypes.c_longlong
    lib.kx_locate_mismatches.argtypes = [ctypes.c_longlong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int]
    for mb in (0, 2, 3, 7, 10):  # e8m0, e5m2, e4m3, bf16, fp16
        assert lib.kx_locate_mismatches(1_000_000, mb, 1 + mb, 0) == 0
        assert lib.kx_locate_mismatches(300_000, mb, 101 + mb, 1) == 0
