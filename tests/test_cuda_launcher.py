"""CPU checks of the decode launcher's host side (no GPU): which kernel a plan picks (the one-launch
``tq_decode_fused`` or prep/split/merge), its grid, scratch and counters, the split-size model, and
that ``run`` passes every kernel exactly the arguments its C++ signature declares (count and types:
CuPy would otherwise turn a Python int into a 64-bit value and shift every later argument)."""

from __future__ import annotations

import contextlib
import math
import re

import numpy as np
import pytest
import torch

import cuda_cases
from kvcodec.device import build
from kvcodec.device.plans import PlanCache
from kvcodec.quant.cuda import attention, decode_kernels, fallback, split_size
from kvcodec.quant.cuda.decode_kernels import KernelVariant


class _Recorder:
    """Stands in for a compiled CuPy kernel: records its launches."""

    def __init__(self, name):
        self.name, self.calls = name, []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


@pytest.fixture
def stub(monkeypatch):
    kernels = {}

    def get_function(source, name, defines=(), arch=None):
        return kernels.setdefault((name, tuple(defines)), _Recorder(name))

    monkeypatch.setattr(build, "get_function", get_function)
    monkeypatch.setattr(build, "cupy_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(split_size, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention, "_plans", PlanCache("decode attention", attention.MAX_PLANS))
    return kernels


def _case(b=1, hq=32, hkv=8, ql=1, t=4096, d=128, kb=4, vb=4, qjl=False):
    g = torch.Generator().manual_seed(0)
    case = dict(query=torch.randn(b, hq, ql, d).to(torch.bfloat16),
                k_codes=torch.randint(0, 256, (b, hkv, t, d * kb // 8), generator=g, dtype=torch.uint8),
                v_codes=torch.randint(0, 256, (b, hkv, t, d * vb // 8), generator=g, dtype=torch.uint8),
                k_norms=torch.rand(b, hkv, t, generator=g).half(), v_norms=torch.rand(b, hkv, t, generator=g).half(),
                seq_lens=torch.full((b,), t, dtype=torch.int32))
    kw = dict(k_rotation=cuda_cases.hadamard_rotation(d, 1), v_rotation=cuda_cases.hadamard_rotation(d, 2),
              k_codebook=cuda_cases.codebook_tensor(kb, d), v_codebook=cuda_cases.codebook_tensor(vb, d))
    if qjl:
        case["k_qjl"] = torch.randint(0, 256, (b, hkv, t, d // 8), generator=g, dtype=torch.uint8)
        case["k_rnorms"] = torch.rand(b, hkv, t, generator=g).half()
        kw["qjl_matrix"] = torch.randn(d, d, generator=g)
    return case, kw, (kb, vb)


def _plan(case, kw, bits, tokens_per_warp=None, variant=decode_kernels.DEFAULT_VARIANT):
    c = case
    return attention.plan(c["query"], c["k_codes"], c["k_norms"], c["v_codes"], c["v_norms"], c["seq_lens"],
                          kw["k_rotation"], kw["v_rotation"], kw["k_codebook"], kw["v_codebook"], *bits, 0.088,
                          c.get("k_qjl"), c.get("k_rnorms"), kw.get("qjl_matrix"), None, None, tokens_per_warp,
                          variant)


def _arg_types(signature: str) -> list:
    """The CuPy argument type each C++ parameter needs: pointers as Python ints, int as np.int32,
    float as np.float32."""
    out = []
    for p in re.sub(r"^\(|\)$", "", signature).split(","):
        p = p.strip()
        out.append(int if "*" in p else np.int32 if p in ("int", "unsigned int") else np.float32)
    assert all(p.strip() for p in signature.split(","))
    return out


def _check_args(args, signature):
    want = _arg_types(signature)
    assert len(args) == len(want)
    for i, (a, w) in enumerate(zip(args, want)):
        assert type(a) is w, (i, type(a), w)


def test_small_batch_plans_use_the_one_launch_kernel(stub):
    case, kw, bits = _case(b=1, t=32768)
    p = _plan(case, kw, bits)
    assert p.fused_fn is not None and p.split_fn is None and p.prep_fn is None
    (nblk, bh, rt), block, scalars, smem = p.fused_launch
    nsplit = int(scalars[-1])
    assert (bh, rt, block) == (8, 1, (128,)) and nblk == -(-nsplit // 4) <= decode_kernels.FUSED_MAX_BLOCKS
    assert nsplit * p.tokens_per_warp >= 32768 > (nsplit - 1) * p.tokens_per_warp
    assert p.counters.dtype == torch.int32 and p.counters.shape == (8,) and not p.counters.any()
    # scratch: one partial [rows, D] fp32 and one (m, l) pair per row and block
    assert p.scratch[-1] >= 8 * nblk * 4 * 128 * 4 + 8 * nblk * 4 * 2 * 4
    # symmetric Lloyd-Max codebooks; narrow 4/4-bit d128 tiles: the lane tables with their 64 KB
    assert stub[(p.fused_fn.name, ("TQ_REG_LUT_SYM=1", "TQ_LANE_LUT=1", "TQ_FUSED_WARP_ROTATE=1",
                                   "TQ_FUSED_STAGES=2"))] is p.fused_fn
    assert smem == decode_kernels.LANE_LUT_BYTES == p.fused_fn.max_dynamic_shared_size_bytes


def test_prod_keys_and_forced_variants_take_three_launches(stub):
    case, kw, bits = _case(b=1, t=2048, kb=3, qjl=True)
    p = _plan(case, kw, bits, variant=KernelVariant(fused=True))  # no QJL in the one-launch kernel
    assert p.fused_fn is None and p.split_fn is not None and p.prep_fn is not None
    case, kw, bits = _case(b=1, t=2048)
    assert _plan(case, kw, bits, variant=KernelVariant(fused=False)).fused_fn is None
    assert _plan(case, kw, bits, variant=KernelVariant(fused=True)).fused_fn is not None
    # more splits than the last block can merge: three launches even when asked for one
    case, kw, bits = _case(b=1, t=8192)
    p = _plan(case, kw, bits, tokens_per_warp=16, variant=KernelVariant(fused=True))
    assert p.fused_fn is None and int(p.split_launch[2][-1]) == 512


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", [dict(b=1, t=300), dict(b=2, hq=40, hkv=2, t=200), dict(b=2, hq=9, hkv=3, ql=2, d=64)])
def test_run_passes_the_declared_arguments(stub, fused, shape):
    case, kw, bits = _case(**shape)
    p = _plan(case, kw, bits, variant=KernelVariant(fused=fused))
    c = case
    out, lse = attention.run(p, c["query"], c["k_codes"], c["k_norms"], c["v_codes"], c["v_norms"], c["seq_lens"],
                             None, None, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == c["query"].shape and lse.shape == c["query"].shape[:-1]
    if fused:
        ((grid, block, args, smem),) = p.fused_fn.calls
        _check_args(args, decode_kernels.FUSED_SIGNATURE)
        assert smem == p.fused_launch[3]
        assert args[1] == 2 and args[-2] == 2  # bf16 query in, bf16 out
        assert args[-4] == p.counters.data_ptr() and grid == p.fused_launch[0]
    else:
        for fn, sig in ((p.prep_fn, decode_kernels.PREP_SIGNATURE), (p.split_fn, decode_kernels.SPLIT_SIGNATURE),
                        (p.merge_fn, decode_kernels.MERGE_SIGNATURE)):
            ((grid, block, args, _),) = fn.calls
            _check_args(args, sig)


def test_fused_instances_follow_the_split_instances():
    decls = decode_kernels.instance_declarations([(128, 4, 4, False, True, False, True), (64, 3, 4, True, False, True, False)])
    assert "__global__ void tq_decode_fused<128, 4, 4, false, true, true>" + decode_kernels.FUSED_SIGNATURE in decls
    assert not any("tq_decode_fused<64" in d for d in decls)  # prod keys: no one-launch instance


def test_split_model_for_the_one_launch_kernel():
    # capped at what the last block merges; small batches get more, shorter splits than large ones
    for bh, cap in ((8, 4096), (8, 32768), (8, 131072), (64, 32768), (256, 131072)):
        tpw, us = split_size.best_split(bh, cap, 132, 4, True)
        assert tpw % 16 == 0 and -(-cap // tpw) <= 4 * decode_kernels.FUSED_MAX_BLOCKS and us > 0
        assert us == pytest.approx(split_size.modelled_us(bh, cap, 132, 4, tpw, True))
    assert split_size.best_split(8, 32768, 132, 4, True)[0] < split_size.best_split(64, 32768, 132, 4, True)[0]
    # the one launch saves the two small kernels: modelled faster at batch 1, never far slower
    assert split_size.best_split(8, 32768, 132, 4, True)[1] < split_size.best_split(8, 32768, 132, 4, False)[1]
    for bh, cap in ((64, 32768), (256, 131072)):
        assert split_size.best_split(bh, cap, 132, 4, True)[1] < 1.05 * split_size.best_split(bh, cap, 132, 4, False)[1]


def _fwht_rows(buf, d):
    """tq::fwht_rows op for op (the kernel's butterfly index arithmetic)."""
    lg = 0
    while (1 << lg) < d:
        h = 1 << lg
        for k in range(d // 2):
            lo = ((k >> lg) << (lg + 1)) + (k & (h - 1))
            a, b = buf[:, lo].copy(), buf[:, lo + h].copy()
            buf[:, lo], buf[:, lo + h] = a + b, a - b
        lg += 1


@pytest.mark.parametrize("rounds", [1, 2])
def test_hadamard_butterflies_equal_the_rotation_matrix(rounds):
    """tq::hadamard_forward / hadamard_inverse (emulated) give R q and R^T y for the rotations the
    launcher recognises (signs from attention._hadamard)."""
    d = 64
    h = fallback.hadamard_matrix(d)
    g = torch.Generator().manual_seed(rounds)
    s1, s2 = torch.randint(0, 2, (2, d), generator=g).to(torch.float64) * 2 - 1
    rot = (h * s1 / math.sqrt(d)) if rounds == 1 else (h * s2) @ (h * s1) / d
    signs, n = attention._hadamard(rot.to(torch.float32), "cpu")
    assert n == rounds and signs.shape == (rounds, d)
    sg = signs.double().numpy()
    x = np.random.default_rng(0).standard_normal((3, d))
    scale = 1 / math.sqrt(d) if rounds == 1 else 1 / d
    buf = x.copy()
    for rd in range(rounds):  # forward: dst = R src
        buf = (buf * scale if rd == 0 else buf) * sg[rd]
        _fwht_rows(buf, d)
    np.testing.assert_allclose(buf, x @ rot.numpy().T, atol=1e-12)
    buf = x.copy()
    for rd in reversed(range(rounds)):  # inverse: buf = R^T buf = buf @ R (row vectors)
        _fwht_rows(buf, d)
        buf = buf * sg[rd] * (scale if rd == 0 else 1.0)
    np.testing.assert_allclose(buf, x @ rot.numpy(), atol=1e-12)
    assert attention._hadamard(torch.linalg.qr(torch.randn(d, d))[0], "cpu") == (None, 0)
