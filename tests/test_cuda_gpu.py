"""GPU checks of the fused kernels against the float64 torch reference (skipped without CUDA + CuPy).

Outputs are poisoned first: the caching allocator is filled with NaN so any element a kernel fails
to write shows up as NaN in the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcodec.cuda as kc
from kvcodec.cuda import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kc.is_available(), reason="needs a CUDA GPU and CuPy")]


poison_allocator = reference.poison_allocator
codebook = reference.codebook_tensor
make_case = reference.random_decode_case

def check(case, kw, tol=4e-3, **extra):
    poison_allocator()
    out, lse = kc.decode_attention(**case, **kw, **extra, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference.decode_attention_reference(**case, **kw, **{k: v for k, v in extra.items()
                                                                       if k not in ("tokens_per_warp", "variant")})
    assert torch.isfinite(out).all(), "kernel left NaN/inf in the output"
    err = (out.double() - ref).abs().max().item() / ref.abs().max().clamp_min(1e-6).item()
    assert err < tol, err
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("d,kb,vb", [(128, 4, 4), (128, 4, 2), (128, 3, 3), (64, 4, 4), (64, 3, 3), (64, 2, 1)])
def test_decode_matches_reference_bits_and_dims(d, kb, vb):
    case, kw = make_case(3, 8, 2, 1, 300, d, kb, vb, [300, 17, 0])
    check(case, kw, tokens_per_warp=64)


@pytest.mark.parametrize("narrow", [True, False])
@pytest.mark.parametrize("hq,hkv,ql", [(9, 3, 1), (32, 8, 1), (8, 1, 3), (40, 2, 1), (4, 4, 2)])
def test_decode_gqa_groups_and_query_lengths(hq, hkv, ql, narrow):
    # narrow: tiles of <= 8 query rows use the transposed-P.V kernel; off: the general one
    case, kw = make_case(2, hq, hkv, ql, 200, 64, 4, 2, [200, 131])
    check(case, kw, variant=kc.KernelVariant(narrow=narrow))


def test_decode_bf16_norms_qjl_and_window():
    case, kw = make_case(2, 8, 2, 2, 160, 128, 3, 4, [160, 45], norm_dtype=torch.bfloat16, qjl=True)
    wk = torch.randn(2, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    wv = torch.randn(2, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    check(case, kw, window_k=wk, window_v=wv, window_lens=torch.tensor([8, 5], device="cuda"))


def test_quantize_pack_matches_reference_bytes():
    for d, bits in ((128, 4), (128, 3), (64, 2)):
        x = torch.randn(4096, d, device="cuda", dtype=torch.bfloat16) * 3
        rot = reference.hadamard_rotation(d, 7).cuda()
        cb = codebook(bits, d).cuda()
        codes, norms = kc.quantize_pack(x, rot, cb, bits)
        rc, rn = reference.quantize_reference(x, rot, cb, bits)
        # the norm's float32 sum order differs: at most one fp16 ulp apart, on rare rows
        assert ((norms.float() - rn.float()).abs() <= rn.float().abs() * 2**-10).all()
        got = reference.unpack_codes(codes, bits, d)
        want = reference.unpack_codes(rc, bits, d)
        assert (got != want).float().mean().item() < 1e-3
        assert ((got - want).abs() <= 1).all()  # a mismatch is a neighbour at a float-rounding tie


@pytest.mark.parametrize("prod,precondition", [(False, "none"), (True, "scale")])
def test_attend_on_quant_objects_matches_quant_package(prod, precondition):
    from kvcodec.cuda.quantized import attend
    from kvcodec.quant import TurboQuantMSE, TurboQuantProd

    b, hkv, g, t, d = 2, 2, 4, 300, 128
    k = torch.randn(b, hkv, t, d, device="cuda") * 2
    v = torch.randn(b, hkv, t, d, device="cuda")
    q = torch.randn(b, hkv * g, 1, d, device="cuda")
    kq = (TurboQuantProd if prod else TurboQuantMSE)(d, 4, seed=1, precondition=precondition)
    vq = TurboQuantMSE(d, 4, seed=2, precondition=precondition)
    kt, vt = kq.quantize(k), vq.quantize(v)
    poison_allocator()
    out = attend(q, kt, vt, kq, vq)
    s = kq.scores(kt, q.reshape(b, hkv, g, d)) / math.sqrt(d)
    want = vq.weighted_sum(vt, torch.softmax(s, -1)).reshape(b, hkv * g, 1, d)
    assert ((out - want).abs().max() / want.abs().max()).item() < 1e-2


def test_quantize_pack_matches_quant_package_hadamard2():
    from kvcodec.quant import TurboQuantMSE

    # default rotation for power-of-two dims: two Hadamard rounds; norm correction on by default
    qz = TurboQuantMSE(128, 4, seed=7, precondition="none")
    x = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    qt = qz.quantize(x)
    codes, norms = kc.quantize_pack(x, qz.rotation.cuda(), qz.codebook.cuda(), 4, norm_correction=True)
    got, want = reference.unpack_codes(codes, 4, 128), reference.unpack_codes(qt.token["codes"], 4, 128)
    assert (got != want).float().mean().item() < 1e-3 and ((got - want).abs() <= 1).all()
    # the corrected norm is ||x|| / <y, c>: rows with the same codes agree to fp16 rounding; a code one
    # level off at a float-rounding tie moves <y, c> (and the norm) by up to a few percent
    rel = (norms.float() - qt.token["norms"].float()).abs() / qt.token["norms"].float()
    same = (got == want).all(-1)
    assert (rel[same] <= 2e-3).all() and (rel <= 0.05).all()
