"""GPU checks of the fused kernels against the float64 torch reference (skipped without CUDA + CuPy).

Outputs are poisoned first: the caching allocator is filled with NaN so any element a kernel fails
to write shows up as NaN in the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

import cuda_cases
import kvcodec.quant.cuda as kc
from kvcodec.quant.cuda import fallback

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kc.is_available(), reason="needs a CUDA GPU and CuPy")]


poison_allocator = cuda_cases.poison_allocator
codebook = cuda_cases.codebook_tensor
make_case = cuda_cases.random_decode_case

def check(case, kw, tol=4e-3, **extra):
    poison_allocator()
    out, lse = kc.decode_attention(**case, **kw, **extra, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = fallback.decode_attention_reference(**case, **kw, **{k: v for k, v in extra.items()
                                                                       if k not in ("tokens_per_warp", "variant")})
    assert torch.isfinite(out).all(), "kernel left NaN/inf in the output"
    err = (out.double() - ref).abs().max().item() / ref.abs().max().clamp_min(1e-6).item()
    assert err < tol, err
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d,kb,vb", [(128, 4, 4), (128, 4, 2), (128, 3, 3), (64, 4, 4), (64, 3, 3), (64, 2, 1)])
def test_decode_matches_reference_bits_and_dims(d, kb, vb, fused):
    # fused: the one-launch kernel (prep, split-KV and merge in one launch); else three launches
    case, kw = make_case(3, 8, 2, 1, 300, d, kb, vb, [300, 17, 0])
    check(case, kw, tokens_per_warp=64, variant=kc.KernelVariant(fused=fused))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("narrow", [True, False])
@pytest.mark.parametrize("hq,hkv,ql", [(9, 3, 1), (32, 8, 1), (8, 1, 3), (40, 2, 1), (4, 4, 2)])
def test_decode_gqa_groups_and_query_lengths(hq, hkv, ql, narrow, fused):
    # narrow: tiles of <= 8 query rows use the transposed-P.V kernel; off: the general one
    case, kw = make_case(2, hq, hkv, ql, 200, 64, 4, 2, [200, 131])
    check(case, kw, variant=kc.KernelVariant(narrow=narrow, fused=fused))


def test_fused_random_shapes_lengths_and_windows():
    """The one-launch kernel on random shapes: batch, GQA group, q_len, head_dim, bits, norm dtypes,
    lengths 0 / 1 / odd / full, split sizes (one block per tile up to the merge limit), windows."""
    rng = torch.Generator().manual_seed(11)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=rng))]

    for i in range(14):
        b, hkv, grp, ql = pick([1, 2, 3]), pick([1, 2, 3, 8]), pick([1, 3, 4, 5, 8, 12]), pick([1, 1, 2, 3])
        d, kb, vb = pick([64, 128]), pick([2, 3, 4, 4]), pick([1, 2, 4, 4])
        tcap = int(torch.randint(1, 2500, (1,), generator=rng))
        lens = [pick([0, 1, tcap, tcap - 1 if tcap > 1 else 1, max(0, tcap // 2 - 1) | 1]) for _ in range(b)]
        norm = pick([torch.float16, torch.bfloat16])
        case, kw = make_case(b, hkv * grp, hkv, ql, tcap, d, kb, vb, lens, norm_dtype=norm, seed=i)
        extra = dict(variant=kc.KernelVariant(fused=True), tokens_per_warp=pick([None, 16, 48, 256]))
        if i % 3 == 0:
            w = pick([1, 5, 8])
            extra.update(window_k=torch.randn(b, hkv, w, d, device="cuda", dtype=torch.bfloat16),
                         window_v=torch.randn(b, hkv, w, d, device="cuda", dtype=torch.bfloat16),
                         window_lens=torch.tensor([pick(list(range(w + 1))) for _ in range(b)], device="cuda"))
        check(case, kw, **extra)


@pytest.mark.parametrize("rotation", ["orthogonal", "hadamard2"])
def test_fused_dense_and_two_round_rotations(rotation):
    """The one-launch kernel reads a dense rotation matrix, and runs randomized Hadamard rotations
    (one round: the other tests; two rounds here) as butterflies: both against the reference."""
    from benchmarks.gpu_kernels import with_rotations

    for d, hq, hkv, ql in ((128, 32, 8, 1), (64, 9, 3, 2), (128, 40, 2, 1)):
        case, kw = make_case(2, hq, hkv, ql, 600, d, 4, 4, [600, 257])
        check(case, with_rotations(kw, rotation, d, seed=d), variant=kc.KernelVariant(fused=True))


def test_fused_graph_replay_resets_its_counters():
    """A captured one-launch call replayed with new queries and lengths equals the reference every
    time: the last block of each tile returns its counter to 0 for the next launch."""
    from kvcodec.quant.cuda import attention

    for b, hq, hkv, t, kb, vb in ((1, 32, 8, 3000, 4, 4), (3, 40, 2, 900, 4, 2)):  # narrow; wide, 2 row tiles
        case, kw = make_case(b, hq, hkv, 1, t, 128, kb, vb, [t] * b)
        v = kc.KernelVariant(fused=True)
        args = lambda: kc.decode_attention(**case, **kw, variant=v, return_lse=True)  # noqa: E731
        args()  # plan, compile and counters outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            args()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = args()
        plans = [p for p in attention._plans.values()
                 if isinstance(p, attention.DecodePlan) and p.fused_fn is not None and p.tcap == t]
        assert plans
        gen = torch.Generator(device="cuda").manual_seed(5)
        for step in range(4):
            case["query"].copy_(torch.randn(case["query"].shape, device="cuda", generator=gen))
            case["seq_lens"].copy_(torch.randint(0, t + 1, (b,), device="cuda", generator=gen, dtype=torch.int32))
            if step == 3:
                case["seq_lens"][0] = 0
            graph.replay()
            torch.cuda.synchronize()
            ref, ref_lse = fallback.decode_attention_reference(**case, **kw)
            err = (out.double() - ref).abs().max().item() / ref.abs().max().clamp_min(1e-6).item()
            assert torch.isfinite(out).all() and err < 4e-3, (step, err)
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(lse))
            assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=2e-3, rtol=1e-3)
            assert all(not p.counters.any() for p in plans)


def test_fused_output_dtype_is_the_query_dtype():
    case, kw = make_case(2, 8, 2, 1, 500, 128, 4, 4, [500, 250])
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        case["query"] = case["query"].to(dt)
        out = kc.decode_attention(**case, **kw, variant=kc.KernelVariant(fused=True))
        ref, _ = fallback.decode_attention_reference(**case, **kw)
        assert out.dtype == dt
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 6e-3


def test_decode_bf16_norms_qjl_and_window():
    case, kw = make_case(2, 8, 2, 2, 160, 128, 3, 4, [160, 45], norm_dtype=torch.bfloat16, qjl=True)
    wk = torch.randn(2, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    wv = torch.randn(2, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    check(case, kw, window_k=wk, window_v=wv, window_lens=torch.tensor([8, 5], device="cuda"))


def test_quantize_pack_matches_reference_bytes():
    for d, bits in ((128, 4), (128, 3), (64, 2)):
        x = torch.randn(4096, d, device="cuda", dtype=torch.bfloat16) * 3
        rot = cuda_cases.hadamard_rotation(d, 7).cuda()
        cb = codebook(bits, d).cuda()
        codes, norms = kc.quantize_pack(x, rot, cb, bits)
        rc, rn = fallback.quantize_reference(x, rot, cb, bits)
        # the norm's float32 sum order differs: at most one fp16 ulp apart, on rare rows
        assert ((norms.float() - rn.float()).abs() <= rn.float().abs() * 2**-10).all()
        got = fallback.unpack_codes(codes, bits, d)
        want = fallback.unpack_codes(rc, bits, d)
        assert (got != want).float().mean().item() < 1e-3
        assert ((got - want).abs() <= 1).all()  # a mismatch is a neighbour at a float-rounding tie


@pytest.mark.parametrize("prod,precondition", [(False, "none"), (True, "scale")])
def test_attend_on_quant_objects_matches_quant_package(prod, precondition):
    from kvcodec.quant import TurboQuantMSE, TurboQuantProd
    from kvcodec.quant.cuda.quantized import attend

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
    got, want = fallback.unpack_codes(codes, 4, 128), fallback.unpack_codes(qt.token["codes"], 4, 128)
    assert (got != want).float().mean().item() < 1e-3 and ((got - want).abs() <= 1).all()
    # the corrected norm is ||x|| / <y, c>: rows with the same codes agree to fp16 rounding; a code one
    # level off at a float-rounding tie moves <y, c> (and the norm) by up to a few percent
    rel = (norms.float() - qt.token["norms"].float()).abs() / qt.token["norms"].float()
    same = (got == want).all(-1)
    assert (rel[same] <= 2e-3).all() and (rel <= 0.05).all()


# ---- the sm_90a build route


def _capability():
    return torch.cuda.get_device_capability() if kc.is_available() else (0, 0)


@pytest.mark.skipif(_capability() != (9, 0), reason="an sm_90a cubin runs on Hopper (compute capability 9.0) only")
def test_sm90a_route_compiles_caches_and_matches(tmp_path, monkeypatch):
    """build.compile_cubin: NVRTC for sm_90a, cached on disk (a second call compiles nothing), loaded
    with cupy.RawModule(path=...); the one-launch kernel built so equals the reference."""
    from kvcodec.device import build
    from kvcodec.quant.cuda import decode_kernels

    monkeypatch.setenv("KVCODEC_CUBIN_CACHE", str(tmp_path))
    name = decode_kernels.fused_name(128, 4, 4, False, False, True)
    defines = decode_kernels.fused_defines(("TQ_REG_LUT_SYM=1",), 128, 4, 4, True)
    path, lowered = build.compile_cubin(decode_kernels.SOURCE, name, "sm_90a", defines)
    assert path.parent == tmp_path and path.stat().st_size > 10000 and lowered.startswith("_Z15tq_decode_fused")
    stamp = path.stat().st_mtime_ns
    assert build.compile_cubin(decode_kernels.SOURCE, name, "sm_90a", defines) == (path, lowered)
    assert path.stat().st_mtime_ns == stamp
    case, kw = make_case(2, 32, 8, 1, 1024, 128, 4, 4, [1024, 513])
    check(case, kw, variant=kc.KernelVariant((), True, True, "sm_90a"))
