"""CPU-side checks of the CUDA kernels (kvcodec.quant.cuda, kvcodec.lossless.cuda, kvcodec.entropy.cuda,
kvcodec.device): nvcc compiles every kernel for Hopper and Blackwell, and the
torch reference / index bookkeeping the kernels rely on is right (no GPU needed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cuda_cases
from kvcodec.device import build
from kvcodec.device.plans import PlanCache
from kvcodec.quant.cuda import attention, decode_kernels, fallback, pack, split_size
from kvcodec.quant.cuda.attention import decode_attention
from kvcodec.quant.cuda.decode_kernels import key_permutation

# The template instances the launchers use most; each is compiled for both targets.
SPLIT_CONFIGS = [
    (128, 4, 4, False, False, False, True),
    (128, 4, 4, False, False, False, False),
    (128, 4, 2, False, False, False, True),
    (128, 3, 3, False, False, False, True),
    (128, 3, 4, True, True, True, False),
    (64, 4, 4, False, False, False, True),
    (64, 3, 3, False, True, False, False),
    (64, 1, 2, False, False, True, True),
]
# (dim, bits, in_code, norm_bf16, rounds, nc): every dim 64/128/256 x bits 2/3/4 x rounds 1/2 x nc, the input
# types and norm dtypes spread over them, plus the edges (dim 32 / 512 / 1024, bits 1 and 5-8).
PACK_CONFIGS = [(d, b, (2, 1, 0)[i % 3], i % 4 == 1, r, nc) for i, (d, b, r, nc) in enumerate(
    (d, b, r, nc) for d in (64, 128, 256) for b in (2, 3, 4) for r in (1, 2) for nc in (False, True))] + [
    (128, 4, 2, False, 1, False), (32, 3, 2, False, 1, True), (32, 1, 0, False, 2, False), (512, 4, 2, False, 2, True),
    (1024, 8, 1, True, 1, False), (1024, 4, 0, False, 2, True), (128, 8, 2, False, 1, True), (64, 5, 0, False, 2, True),
    (128, 6, 2, True, 1, False), (256, 7, 1, False, 2, True)]


ARCHS = ("sm_90", "sm_100")  # every build below is checked for Hopper and for Blackwell


def spill_lines(stderr: str) -> list[str]:
    """ptxas -v lines that report a spill (every kernel's line says "0 bytes spill stores" when none)."""
    return [line for line in stderr.splitlines() if "spill" in line and " 0 bytes spill stores" not in line]


def cubin(proc) -> Path:
    return Path(proc.args[proc.args.index("-o") + 1])


# nvcc_build parameters: (source, instances, targets, extra flags), built in the background (tests/conftest.py)
@pytest.mark.parametrize("nvcc_build", [
    (decode_kernels.SOURCE, tuple(decode_kernels.instance_declarations(SPLIT_CONFIGS)), ARCHS, ("-Xptxas", "-warn-spills")),
    (pack.SOURCE, tuple(pack.instance_declarations(PACK_CONFIGS)), ARCHS, ("-Xptxas", "-warn-spills")),
], ids=["split", "pack"])
def test_kernels_compile_with_nvcc(nvcc_result):
    for arch, proc in nvcc_result.items():
        assert proc.returncode == 0, f"{arch}: {proc.stderr[-4000:]}"
        assert "spill" not in proc.stderr.lower() or "0 bytes spill" in proc.stderr, f"{arch}: {proc.stderr[-2000:]}"
        assert cubin(proc).name.endswith(f"_{arch}.cubin") and cubin(proc).stat().st_size > 1000


# The split kernel with the symmetric register codebooks (TQ_REG_LUT_SYM=1: what the launcher builds for
# the Lloyd-Max codebooks; the builds above are its asymmetric-codebook ones) builds for both targets
# without spills, on the instances it uses.
SYM_CONFIGS = [
    (128, 4, 4, False, False, False, True),
    (128, 4, 4, False, False, False, False),
    (128, 4, 4, False, True, False, True),
    (64, 4, 4, False, False, False, True),
    (128, 3, 3, False, False, False, True),
    (128, 3, 4, True, True, True, False),
]
SYM_DEFINES = ("TQ_REG_LUT_SYM=1",)


def _sym_build() -> tuple:
    # the one-launch kernel shares the split kernel's code: its two d128 4/4 instances cover the macro
    decls = decode_kernels.instance_declarations(SYM_CONFIGS, fused_configs=SYM_CONFIGS[:2])
    return decode_kernels.SOURCE, tuple(decls), ARCHS, tuple(f"-D{d}" for d in SYM_DEFINES) + ("-Xptxas", "-v,-warn-spills")


@pytest.mark.parametrize("nvcc_build", [_sym_build()], ids=["REG_LUT_SYM=1"])
def test_symmetric_codebook_builds_compile_without_spills(nvcc_result):
    for arch, proc in nvcc_result.items():
        assert proc.returncode == 0, f"{arch}: {proc.stderr[-4000:]}"
        assert not spill_lines(proc.stderr), f"{arch}: " + "\n".join(spill_lines(proc.stderr))
    assert "prmt.b32" in build.source_text(decode_kernels.SOURCE)


def _gpu_kernels_benchmark():
    """benchmarks/gpu_kernels.py as a module (its check modes; nothing runs without a GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("_gpu_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_macros_are_compiled_here():
    """Every macro the benchmark's check modes set is one whose builds the compile tests here cover."""
    mod = _gpu_kernels_benchmark()
    covered = set(SYM_DEFINES) | {d for ds in LANE_DEFINES for d in ds}
    covered |= {"TQ_REG_LUT_SYM=0", "TQ_LANE_LUT=0", "TQ_FUSED_WARP_ROTATE=0", "TQ_FUSED_STAGES=3"}  # the defaults
    used = {d for _, ds, _, _ in mod.CHECK_MODES + mod.FUSED_CHECK_MODES for d in ds}
    assert used <= covered, used - covered
    assert mod.CHECK_MODES[0] == ("", (), True, None)


def _lane_build(defines: tuple[str, ...], archs=ARCHS) -> tuple:
    decls = [f"__global__ void {decode_kernels.fused_name(128, 4, 4, False, vbf, True)}{decode_kernels.FUSED_SIGNATURE}"
             for vbf in (False, True)]
    return (decode_kernels.SOURCE, tuple(decls), archs,
            tuple(f"-D{d}" for d in defines) + ("-DTQ_REG_LUT_SYM=1", "-Xptxas", "-v,-warn-spills"))


# the launcher's lane-table build (decode_kernels.fused_defines), and the tables with the shared-memory
# rotations and 3 stages (TQ_FUSED_WARP_ROTATE=0: benchmarks/gpu_kernels.py FUSED_CHECK_MODES)
LANE_DEFINES = [("TQ_LANE_LUT=1", "TQ_FUSED_WARP_ROTATE=1", "TQ_FUSED_STAGES=2"), ("TQ_LANE_LUT=1",)]


@pytest.mark.parametrize("nvcc_build", [_lane_build(d) for d in LANE_DEFINES], ids=["lut rotate stages2", "lut"])
def test_lane_tables_compile_without_spills_and_leave_room_for_three_blocks(nvcc_result):
    """The one-launch kernel with lane-private pair tables (TQ_LANE_LUT): the d128 narrow 4/4-bit
    instances build without spills and their static shared memory plus the tables' 64 KB (plus the 1 KB
    the runtime reserves per block) fits 3 blocks in an SM's 228 KB, the blocks their registers allow."""
    import re

    for arch, proc in nvcc_result.items():
        assert proc.returncode == 0, f"{arch}: {proc.stderr[-4000:]}"
        assert not spill_lines(proc.stderr), f"{arch}: " + "\n".join(spill_lines(proc.stderr))
        usage = re.findall(r"Used (\d+) registers, used \d+ barriers, (\d+) bytes smem", proc.stderr)
        assert len(usage) == 2, f"{arch}: {proc.stderr[-2000:]}"
        for regs, smem in usage:
            assert int(regs) <= 168 and 3 * (int(smem) + decode_kernels.LANE_LUT_BYTES + 1024) <= 228 * 1024, arch


def test_fused_defines_add_lane_tables_only_where_the_kernel_uses_them():
    fd = decode_kernels.fused_defines
    lane = ("TQ_LANE_LUT=1", "TQ_FUSED_WARP_ROTATE=1", "TQ_FUSED_STAGES=2")
    assert fd((), 128, 4, 4, True) == lane
    assert fd(("TQ_REG_LUT_SYM=1",), 128, 4, 4, True) == ("TQ_REG_LUT_SYM=1",) + lane
    # the companions come with the tables unless set: an explicit one stays as given
    assert fd(("TQ_FUSED_STAGES=3",), 128, 4, 4, True) == ("TQ_FUSED_STAGES=3", "TQ_LANE_LUT=1",
                                                           "TQ_FUSED_WARP_ROTATE=1")
    # wide tiles, other bit widths, head_dim 64 or 256: none
    assert fd((), 128, 4, 4, False) == fd((), 128, 4, 2, True) == fd((), 64, 4, 4, True) == ()
    assert fd((), 256, 4, 4, True) == ()
    # an explicit choice stays
    assert fd(("TQ_LANE_LUT=0",), 128, 4, 4, True) == ("TQ_LANE_LUT=0",)
    # the launcher passes the tables' memory exactly when the macro is on
    assert decode_kernels.fused_shared_bytes(lane) == decode_kernels.LANE_LUT_BYTES == 65536
    assert decode_kernels.fused_shared_bytes(("TQ_LANE_LUT=0",)) == decode_kernels.fused_shared_bytes(()) == 0


def test_explicit_target_route_options_and_cache_key():
    opts = build.nvrtc_arch_options("sm_90a", ("TQ_REG_LUT_SYM=1",))
    assert "--gpu-architecture=sm_90a" in opts and "-DTQ_REG_LUT_SYM=1" in opts and "-std=c++17" in opts
    with pytest.raises(ValueError):
        build.nvrtc_arch_options("compute_90; rm -rf /")
    # nvcc takes an arch-specific target in the -gencode form
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.nvcc_command("w.cu", "sm_90a", "o.cubin")
    text = build.source_text(decode_kernels.SOURCE)
    name = decode_kernels.fused_name(128, 4, 4, False, False, True)
    key = build.cubin_key(text, name, opts, "nvrtc 13.0")
    assert key == build.cubin_key(text, name, opts, "nvrtc 13.0")
    others = {build.cubin_key(text + " ", name, opts, "nvrtc 13.0"),
              build.cubin_key(text, name.replace("128", "64"), opts, "nvrtc 13.0"),
              build.cubin_key(text, name, build.nvrtc_arch_options("sm_100a", ("TQ_REG_LUT_SYM=1",)), "nvrtc 13.0"),
              build.cubin_key(text, name, opts, "nvrtc 13.1")}
    assert key not in others and len(others) == 4


def test_source_text_inlines_common_header():
    text = build.source_text(decode_kernels.SOURCE)
    assert '#include "tq_common.cuh"' not in text
    assert "tq_mma16816" in text and "tq_decode_split" in text


def test_key_permutation_matches_mma_fragment_layout():
    """Emulate the m16n8k16 fragments: A[16s+kk] is the permuted query, thread t = lane % 4 holds
    B[16s+2t+e] = its coordinate 4s+e and B[16s+2t+8+e] = 4s+2+e; the dot product must be exact."""
    rng = np.random.default_rng(0)
    for d in (32, 64, 128, 256):
        perm = key_permutation(d)
        q, k = rng.standard_normal(d), rng.standard_normal(d)
        ck = d // 4
        b = np.empty(d)
        for s in range(d // 16):
            for t in range(4):
                for e in range(2):
                    b[16 * s + 2 * t + e] = k[t * ck + 4 * s + e]
                    b[16 * s + 2 * t + 8 + e] = k[t * ck + 4 * s + 2 + e]
        assert np.isclose(q[perm] @ b, q @ k)


@settings(max_examples=25, deadline=None)
@given(bits=st.integers(1, 8), dim=st.sampled_from([8, 24, 32, 64, 128]), rows=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_pack_unpack_roundtrip(bits, dim, rows, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, dim), generator=g)
    packed = fallback.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, (dim * bits + 7) // 8)
    assert torch.equal(fallback.unpack_codes(packed, bits, dim), codes)


def test_pack_bit_order_is_little_endian_stream():
    # coordinate j occupies bits [j*b, (j+1)*b); row bit i is bit i % 8 of byte i // 8
    codes = torch.tensor([[0b101, 0b011, 0b111]])
    packed = fallback.pack_codes(codes, 3)
    stream = 0b101 | (0b011 << 3) | (0b111 << 6)
    assert packed.tolist() == [[stream & 0xFF, stream >> 8]]
    words = np.frombuffer(fallback.pack_codes(torch.arange(16).view(1, 16) % 16, 4).numpy().tobytes(), "<u4")
    assert int(words[0]) & 0xF == 0 and (int(words[0]) >> 4) & 0xF == 1 and (int(words[1]) >> 28) == 15


def test_unpack_rejects_bad_rows():
    with pytest.raises(ValueError):
        fallback.unpack_codes(torch.zeros(2, 5, dtype=torch.uint8), 4, 8)
    with pytest.raises(ValueError):
        fallback.unpack_codes(torch.zeros(2, 4, dtype=torch.int32), 4, 8)


def test_hadamard_signs_roundtrip_and_rejects_other_rotations():
    rot = cuda_cases.hadamard_rotation(64, seed=3)
    s = fallback.hadamard_signs(rot)
    assert s is not None and torch.allclose(rot, (fallback.hadamard_matrix(64) * s / 8).float())
    q, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))
    assert fallback.hadamard_signs(q.float()) is None
    assert torch.allclose(rot @ rot.T, torch.eye(64), atol=1e-5)


def test_hadamard2_signs_recovers_quant_rotation():
    from kvcodec.quant.rotations import rotation_matrix

    for d in (64, 128):
        rot = rotation_matrix(d, 3, "hadamard2")
        s = fallback.hadamard2_signs(rot)
        assert s is not None and s.shape == (2, d)
        h = fallback.hadamard_matrix(d)
        rebuilt = (h * s[1].double()) @ (h * s[0].double()) / d
        assert torch.allclose(rebuilt.float(), rot, atol=1e-6)
        assert fallback.hadamard2_signs(rotation_matrix(d, 3, "qr")) is None
        assert fallback.hadamard_signs(rot) is None


def test_reference_quantize_matches_quant_package_bytes():
    from kvcodec.quant import TurboQuantMSE

    for d, bits, nc in ((64, 3, False), (128, 4, True)):
        qz = TurboQuantMSE(d, bits, seed=5, precondition="none", norm_correction=nc)
        x = torch.randn(2, 3, 40, d) * 2
        qt = qz.quantize(x)
        codes, norms = fallback.quantize_reference(x, qz.rotation, qz.codebook, bits, norm_correction=nc)
        assert torch.equal(codes, qt.token["codes"])
        assert torch.allclose(norms.float(), qt.token["norms"].float(), rtol=1e-3)


def test_quantize_reference_picks_nearest_centroid():
    d, bits = 64, 3
    cb = torch.linspace(-0.3, 0.3, 1 << bits)
    rot = cuda_cases.hadamard_rotation(d, 1)
    x = torch.randn(50, d) * 3
    codes, norms = fallback.quantize_reference(x, rot, cb, bits)
    y = (x / x.norm(dim=-1, keepdim=True)) @ rot.T
    nearest = (y.unsqueeze(-1) - cb).abs().argmin(-1)
    assert torch.equal(fallback.unpack_codes(codes, bits, d), nearest)
    assert torch.allclose(norms.float(), x.norm(dim=-1), rtol=1e-3)


def _random_cache(b, hkv, t, d, kb, vb, seed=0, qjl=False):
    g = torch.Generator().manual_seed(seed)
    out = {
        "k_codes": fallback.pack_codes(torch.randint(0, 1 << kb, (b, hkv, t, d), generator=g), kb),
        "v_codes": fallback.pack_codes(torch.randint(0, 1 << vb, (b, hkv, t, d), generator=g), vb),
        "k_norms": (torch.rand(b, hkv, t, generator=g) * 10 + 0.5).half(),
        "v_norms": (torch.rand(b, hkv, t, generator=g) * 10 + 0.5).half(),
    }
    if qjl:
        out["k_qjl"] = fallback.pack_codes(torch.randint(0, 2, (b, hkv, t, d), generator=g), 1)
        out["k_rnorms"] = (torch.rand(b, hkv, t, generator=g)).half()
    return out


def test_cpu_fallback_matches_dense_attention_with_gqa_lengths_and_window():
    b, hq, hkv, ql, t, d, kb, vb = 2, 6, 2, 3, 20, 32, 3, 2
    cache = _random_cache(b, hkv, t, d, kb, vb, seed=1)
    kr, vr = cuda_cases.hadamard_rotation(d, 5), cuda_cases.hadamard_rotation(d, 6)
    kcb, vcb = torch.linspace(-0.4, 0.4, 1 << kb), torch.linspace(-0.3, 0.3, 1 << vb)
    q = torch.randn(b, hq, ql, d)
    lens = torch.tensor([20, 7])
    wk, wv = torch.randn(b, hkv, 4, d), torch.randn(b, hkv, 4, d)
    wl = torch.tensor([4, 3])
    out, lse = decode_attention(q, cache["k_codes"], cache["k_norms"], cache["v_codes"], cache["v_norms"], lens,
                                k_rotation=kr, v_rotation=vr, k_codebook=kcb, v_codebook=vcb, k_bits=kb,
                                v_bits=vb, window_k=wk, window_v=wv, window_lens=wl, return_lse=True)
    # independent dense computation, sequence by sequence, query by query
    k_full = fallback.dequantize_rotated(cache["k_codes"], cache["k_norms"], kcb, kb, d) @ kr.double()
    v_full = fallback.dequantize_rotated(cache["v_codes"], cache["v_norms"], vcb, vb, d) @ vr.double()
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(ql):
                n_win = int(wl[bi]) - (ql - 1) + i
                keys = torch.cat([k_full[bi, kv, : lens[bi]], wk[bi, kv, :n_win].double()])
                vals = torch.cat([v_full[bi, kv, : lens[bi]], wv[bi, kv, :n_win].double()])
                s = keys @ q[bi, h, i].double() / math.sqrt(d)
                want = torch.softmax(s, 0) @ vals
                assert torch.allclose(out[bi, h, i].double(), want, atol=1e-5), (bi, h, i)
                assert math.isclose(float(lse[bi, h, i]), float(torch.logsumexp(s, 0)), rel_tol=1e-5)


def test_cpu_fallback_qjl_term_scale():
    """The QJL term is ||r|| sqrt(pi/2)/m <S q_rot, signs>: check against a direct evaluation."""
    b, hkv, t, d = 1, 1, 5, 32
    cache = _random_cache(b, hkv, t, d, 2, 2, seed=2, qjl=True)
    kr = vr = cuda_cases.hadamard_rotation(d, 0)
    cb = torch.tensor([-0.2, -0.05, 0.05, 0.2])
    smat = torch.randn(d, d)
    q = torch.randn(b, 1, 1, d)
    out, lse = decode_attention(q, cache["k_codes"], cache["k_norms"], cache["v_codes"], cache["v_norms"],
                                torch.tensor([t]), k_rotation=kr, v_rotation=vr, k_codebook=cb, v_codebook=cb,
                                k_bits=2, v_bits=2, k_qjl=cache["k_qjl"], k_rnorms=cache["k_rnorms"],
                                qjl_matrix=smat, return_lse=True)
    q_rot = q[0, 0, 0].double() @ kr.double().T
    k_rot = fallback.dequantize_rotated(cache["k_codes"], cache["k_norms"], cb, 2, d)[0, 0]
    signs = fallback.unpack_codes(cache["k_qjl"], 1, d)[0, 0].double() * 2 - 1
    score = k_rot @ q_rot + cache["k_rnorms"][0, 0].double() * math.sqrt(math.pi / 2) / d * (signs @ (smat.double() @ q_rot))
    assert torch.allclose(lse[0, 0, 0].double(), torch.logsumexp(score / math.sqrt(d), 0), atol=1e-5)


def test_decode_attention_rejects_bad_arguments():
    cache = _random_cache(1, 2, 8, 32, 4, 4)
    rot = cuda_cases.hadamard_rotation(32)
    cb = torch.linspace(-0.3, 0.3, 16)
    kw = dict(k_rotation=rot, v_rotation=rot, k_codebook=cb, v_codebook=cb, k_bits=4, v_bits=4)
    q = torch.randn(1, 4, 1, 32)
    lens = torch.tensor([8])
    with pytest.raises(ValueError):  # heads not a multiple
        decode_attention(torch.randn(1, 3, 1, 32), cache["k_codes"], cache["k_norms"], cache["v_codes"],
                         cache["v_norms"], lens, **kw)
    with pytest.raises(ValueError):  # wrong bytes per row for the bits
        decode_attention(q, cache["k_codes"], cache["k_norms"], cache["v_codes"], cache["v_norms"], lens,
                         **{**kw, "k_bits": 3, "k_codebook": cb[:8]})
    with pytest.raises(ValueError):  # float32 norms are not part of the layout
        decode_attention(q, cache["k_codes"], cache["k_norms"].float(), cache["v_codes"], cache["v_norms"],
                         lens, **kw)
    with pytest.raises(ValueError):
        decode_attention(q, cache["k_codes"], cache["k_norms"], cache["v_codes"], cache["v_norms"], lens,
                         **{**kw, "k_bits": 5})


def test_quantize_pack_cpu_path_is_reference():
    x = torch.randn(10, 64)
    rot = cuda_cases.hadamard_rotation(64, 2)
    cb = torch.linspace(-0.3, 0.3, 8)
    c1, n1 = pack.quantize_pack(x, rot, cb, 3)
    c2, n2 = fallback.quantize_reference(x, rot, cb, 3)
    assert torch.equal(c1, c2) and torch.equal(n1, n2)
    with pytest.raises(ValueError):
        pack.quantize_pack(x, rot, cb, 4)


@pytest.mark.parametrize("prod,precondition", [(False, "none"), (True, "scale"), (False, "center")])
def test_attend_on_quantized_tensors_matches_quant_package(prod, precondition):
    """kvcodec.quant.cuda.quantized.attend (CPU path) == softmax over the quant package's own scores and
    weighted_sum: same layout, rotation, codebook, QJL scale and preconditioning semantics."""
    from kvcodec.quant import TurboQuantMSE, TurboQuantProd
    from kvcodec.quant.cuda.quantized import attend

    b, hkv, g, ql, t, d = 2, 2, 3, 2, 24, 64
    torch.manual_seed(0)
    k = torch.randn(b, hkv, t, d) * (1 + 4 * (torch.arange(d) % 7 == 0))  # a few outlier channels
    v = torch.randn(b, hkv, t, d) + 0.5
    q = torch.randn(b, hkv * g, ql, d)
    kq = TurboQuantProd(d, 4, seed=1, precondition=precondition) if prod else TurboQuantMSE(d, 4, seed=1, precondition=precondition)
    vq = TurboQuantMSE(d, 3, seed=2, precondition=precondition)
    kt, vt = kq.quantize(k), vq.quantize(v)
    wk, wv = torch.randn(b, hkv, 3, d), torch.randn(b, hkv, 3, d)
    out, lse = attend(q, kt, vt, kq, vq, window_k=wk, window_v=wv, return_lse=True)

    qg = q.reshape(b, hkv, g * ql, d)
    s = kq.scores(kt, qg).reshape(b, hkv * g, ql, t) / math.sqrt(d)
    ws = (q @ wk.repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(d)
    ws = ws.masked_fill(torch.arange(3).view(1, 1, 1, 3) > torch.arange(ql).view(1, 1, ql, 1) + 3 - ql, float("-inf"))
    allp = torch.softmax(torch.cat([s, ws], -1), -1)
    want = vq.weighted_sum(vt, allp[..., :t].reshape(b, hkv, g * ql, t)).reshape(b, hkv * g, ql, d)
    want = want + allp[..., t:] @ wv.repeat_interleave(g, 1)
    assert torch.allclose(out, want, atol=2e-4), (out - want).abs().max()
    assert torch.allclose(lse, torch.logsumexp(torch.cat([s, ws], -1), -1), atol=1e-4)


def test_gpu_benchmark_skips_cleanly_without_a_gpu(tmp_path):
    import kvcodec.device as kc

    if kc.is_available():
        pytest.skip("a GPU is present: the suite would run for real")
    from benchmarks import gpu_kernels

    res = gpu_kernels.run(quick=True, out_dir=str(tmp_path))
    assert res["rows"] == [] and "skipped" in res["notes"][0]
    assert not any(tmp_path.iterdir())  # nothing written, committed GPU results untouched


# ---- register-resident 4-bit key codebooks: bit-exact emulation of TqRegLut4 ----------

def _prmt(a, b, c):
    """prmt.b32 default mode, vectorised over numpy uint64 arrays holding 32-bit values."""
    a, b, c = (np.asarray(x, dtype=np.uint64) & 0xFFFFFFFF for x in (a, b, c))
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=np.uint64)
    for n in range(4):
        nib = (c >> np.uint64(4 * n)) & np.uint64(0xF)
        byte = (src >> (np.uint64(8) * (nib & np.uint64(7)))) & np.uint64(0xFF)
        sign = np.where((byte >> np.uint64(7)) & np.uint64(1), np.uint64(0xFF), np.uint64(0))
        out |= np.where(nib & np.uint64(8), sign, byte) << np.uint64(8 * n)
    return out, c


class _RegLut4:
    """TqRegLut4 (tq_common.cuh) op for op."""

    def __init__(self, cb16):
        cb16 = [int(x) for x in cb16]
        self.lo = [sum((cb16[4 * i + j] & 0xFF) << (8 * j) for j in range(4)) for i in range(4)]
        self.hi = [sum((cb16[4 * i + j] >> 8) << (8 * j) for j in range(4)) for i in range(4)]

    @staticmethod
    def sel1(x):
        return x & np.uint64(0x77777777)

    @staticmethod
    def sel2(x):
        return ((x >> np.uint64(1)) & np.uint64(0x44444444)) | np.uint64(0x32103210)

    def prmt(self, a, b, c):
        out, c = _prmt(a, b, c)
        low = c & np.uint64(0xFFFF)
        for n in range(4):  # the kernel never relies on sign-replicate nibbles
            assert not ((low >> np.uint64(4 * n + 3)) & np.uint64(1)).any()
        return out

    def lut4(self, a, s2):
        p = self.prmt
        lo, hi = self.lo, self.hi
        l = p(p(lo[0], lo[1], a), p(lo[2], lo[3], a), s2)
        h = p(p(hi[0], hi[1], a), p(hi[2], hi[3], a), s2)
        return p(l, h, 0x5140), p(l, h, 0x7362)

    def lut8(self, x):
        x = np.asarray(x, dtype=np.uint64)
        a, s2 = self.sel1(x), self.sel2(x)
        o0, o1 = self.lut4(a, s2)
        o2, o3 = self.lut4(a >> np.uint64(16), s2 >> np.uint64(16))
        return [o0, o1, o2, o3]


def _cb16(bits, bf16, seed):
    cb = torch.sort(torch.randn(1 << bits, generator=torch.Generator().manual_seed(seed)) * 0.1).values
    h = cb.to(torch.bfloat16 if bf16 else torch.float16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    return h.astype(np.uint64)


@pytest.mark.parametrize("bf16", [False, True])
def test_register_lut_emulation_matches_table_lookup(bf16):
    cb = _cb16(4, bf16, seed=3)
    lut = _RegLut4(cb)
    # every 16-bit pattern (4 codes) through lut4, low half of the selectors
    x = np.arange(1 << 16, dtype=np.uint64)
    o0, o1 = lut.lut4(lut.sel1(x), lut.sel2(x))
    codes = [(x >> np.uint64(4 * k)) & np.uint64(15) for k in range(4)]
    assert np.array_equal(o0, cb[codes[0]] | (cb[codes[1]] << np.uint64(16)))
    assert np.array_equal(o1, cb[codes[2]] | (cb[codes[3]] << np.uint64(16)))
    # whole words (8 codes), upper halves through the shifted selectors
    w = np.random.default_rng(0).integers(0, 1 << 32, size=50000, dtype=np.uint64)
    out = lut.lut8(w)
    for m in range(4):
        c0 = (w >> np.uint64(8 * m)) & np.uint64(15)
        c1 = (w >> np.uint64(8 * m + 4)) & np.uint64(15)
        assert np.array_equal(out[m], cb[c0] | (cb[c1] << np.uint64(16)))


def test_register_lut_key_fragments():
    """The kernel's use of lut4/lut8 for keys: k-step s reads codes 4s..4s+3 of a thread's row chunk
    (half s & 1 of word s >> 1), against direct codebook indexing."""
    rng = np.random.default_rng(1)
    cb = _cb16(4, False, seed=5)
    lut = _RegLut4(cb)
    D = 128
    nw = D // 32  # key chunk of a thread: D/4 codes of 4 bits = D/32 words
    words = rng.integers(0, 1 << 32, size=(64, nw), dtype=np.uint64)
    codes = np.stack([(words[:, i // 8] >> np.uint64(4 * (i % 8))) & np.uint64(15) for i in range(D // 4)], 1)
    for s in range(D // 16):
        a, s2 = lut.sel1(words[:, s >> 1]), lut.sel2(words[:, s >> 1])
        if s & 1:
            a, s2 = a >> np.uint64(16), s2 >> np.uint64(16)
        b0, b1 = lut.lut4(a, s2)
        assert np.array_equal(b0, cb[codes[:, 4 * s]] | (cb[codes[:, 4 * s + 1]] << np.uint64(16)))
        assert np.array_equal(b1, cb[codes[:, 4 * s + 2]] | (cb[codes[:, 4 * s + 3]] << np.uint64(16)))


def _lut8_sym(cb16, x):
    """TqRegLut4Sym::lut8 op for op (prmt sign-replicate nibbles included)."""
    u = np.uint64
    M = u(0xFFFFFFFF)
    lo = [sum((int(cb16[4 * i + j]) & 0xFF) << (8 * j) for j in range(4)) for i in range(2)]
    hi = [sum((int(cb16[4 * i + j]) >> 8) << (8 * j) for j in range(4)) for i in range(2)]
    p = lambda a, b, c: _prmt(a, b, c)[0]
    x = np.asarray(x, dtype=u)
    a = (x ^ ((((x >> u(3)) & u(0x11111111)) * u(7)) & M)) & u(0x77777777)
    xs = (x << u(4)) & M
    s_lo, s_hi = p(xs, x, 0xD9C8), p(xs, x, 0xFBEA)
    a_hi = a >> u(16)
    for sel in (a, a_hi):  # the lookups only use plain byte-select nibbles
        for n in range(4):
            assert not ((sel >> u(4 * n + 3)) & u(1)).any()
    l0, h0 = p(lo[0], lo[1], a), p(hi[0], hi[1], a) ^ (s_lo & u(0x80808080))
    l1, h1 = p(lo[0], lo[1], a_hi), p(hi[0], hi[1], a_hi) ^ (s_hi & u(0x80808080))
    return [p(l0, h0, 0x5140), p(l0, h0, 0x7362), p(l1, h1, 0x5140), p(l1, h1, 0x7362)]


@pytest.mark.parametrize("bf16", [False, True])
def test_symmetric_register_lut_emulation(bf16):
    """TQ_REG_LUT_SYM: 8 stored entries + sign flip equals full-table indexing on a symmetric codebook
    (the Lloyd-Max ones are, bitwise, in fp16 and bf16), and the launcher's symmetry test agrees."""
    from kvcodec.quant.codebooks import lloyd_max_codebook

    cbf = torch.tensor(lloyd_max_codebook(128, 4), dtype=torch.float32)
    cb = (cbf.to(torch.bfloat16 if bf16 else torch.float16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF)
    cb = cb.astype(np.uint64)
    assert decode_kernels.codebook_is_symmetric(cbf, bf16)
    assert not decode_kernels.codebook_is_symmetric(cbf + 0.01, bf16)
    assert not decode_kernels.codebook_is_symmetric(torch.rand(16), bf16)
    w = np.concatenate([np.arange(1 << 16, dtype=np.uint64) * np.uint64(0x10001),
                        np.random.default_rng(2).integers(0, 1 << 32, size=50000, dtype=np.uint64)])
    out = _lut8_sym(cb, w)
    for m in range(4):
        c0 = (w >> np.uint64(8 * m)) & np.uint64(15)
        c1 = (w >> np.uint64(8 * m + 4)) & np.uint64(15)
        assert np.array_equal(out[m], cb[c0] | (cb[c1] << np.uint64(16)))


def test_split_defines_drop_symmetric_lookups_for_asymmetric_codebooks():
    from kvcodec.quant.codebooks import lloyd_max_codebook

    sym = torch.tensor(lloyd_max_codebook(128, 4), dtype=torch.float32)
    asym = torch.sort(torch.rand(16)).values
    d = ("TQ_FUSED_STAGES=2", "TQ_REG_LUT_SYM=1")
    assert decode_kernels.split_defines(d, 4, 4, sym, sym, False) == d
    assert decode_kernels.split_defines(d, 4, 4, sym, asym, True) == ("TQ_FUSED_STAGES=2",)
    assert decode_kernels.split_defines(d, 4, 2, sym, torch.rand(4), False) == d  # 2-bit side: tables as before
    assert decode_kernels.split_defines(("TQ_FUSED_STAGES=2",), 4, 4, asym, asym, False) == ("TQ_FUSED_STAGES=2",)
    assert decode_kernels.split_defines((), 3, 3, asym, asym, False) == ("TQ_REG_LUT_SYM=1",)  # no 4-bit side


# ---- quantize + pack (tq_pack.cu): the kernel's lane and fragment logic, emulated lane by lane ----------

_LANE = np.arange(32)
_LG, _LT = _LANE >> 2, _LANE & 3  # g = lane / 4, t = lane % 4


def _f32fma(a, b, c):  # float32 fma: exact product in float64, then rounding (double rounding is rare)
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _mma16816(acc, a, b0, b1, f16):
    """mma.m16n8k16.row.col with fp32 accumulators from per-lane fragments (a [32, 4], b0/b1 [32])."""
    def half(u, hi):
        h = (np.asarray(u, np.int64) >> (16 if hi else 0)) & 0xFFFF
        return float(np.uint16(h).view(np.float16)) if f16 else float(np.uint32(h << 16).view(np.float32))

    A, Bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[r, k], A[r, k + 1] = half(a[lane, i], 0), half(a[lane, i], 1)
        Bm[2 * t, g], Bm[2 * t + 1, g] = half(b0[lane], 0), half(b0[lane], 1)
        Bm[2 * t + 8, g], Bm[2 * t + 9, g] = half(b1[lane], 0), half(b1[lane], 1)
    C = A @ Bm
    out = acc.astype(np.float64)
    out += np.stack([C[_LG, 2 * _LT], C[_LG, 2 * _LT + 1], C[_LG + 8, 2 * _LT], C[_LG + 8, 2 * _LT + 1]], 1)
    return out.astype(np.float32)


def _emulate_quant_pack(x, signs, codebook, bits, norm_dtype=torch.float16, norm_correction=False):
    """tq_quant_pack op for op on the CPU, vectorised over the 32 lanes of a warp: the load layout, the
    B fragments (prmt), A = H16 in (rho, kappa) order, the mma fragments, the G / segment / round-2
    levels and shuffles, the cell-table search (and the binary-search fallback), the prmt byte gather,
    the piece stores and the norms. Returns (codes [N, D*bits/8] uint8, norms)."""
    u32, f32 = np.uint32, np.float32
    n_rows, D = x.shape
    x32, f16 = x.dtype == torch.float32, x.dtype == torch.float16
    signs = signs.reshape(-1, D).float().numpy()
    rounds, B = signs.shape[0], bits
    S = D // 128 if D > 128 else 1
    LSEG, R = D // S, 8 // S
    NG = LSEG // 16
    CH, NCH = 8 // NG, NG // 2
    NTH = (1 << B) - 1
    CB = B + 1 if B <= 5 else B + 2
    M, SUB, H = 1 << CB, 23 - CB, 0x4B000000
    FOLD = 0 if x32 else 1
    RB = D * B // 8
    PAIR = (2 * NG * B) % 8 != 0

    def prmt(a, b, c):
        return _prmt(np.asarray(a, np.int64), np.asarray(b, np.int64), c)[0].astype(np.int64)

    def gbits(y, a, b):
        f = np.clip(np.nan_to_num(_f32fma(y, a, b), nan=0.0), 0, 1).astype(f32)
        return _f32fma(f, 8388607.0, 8388608.0).view(u32).astype(np.int64)

    # block prologue: the map, the mapped thresholds, the cell table (and whether a cell holds two)
    thr = fallback.thresholds_of(codebook.float()).numpy().astype(f32)
    span = max(f32(thr[NTH - 1] - thr[0]), f32(4.0) * f32(1 / math.sqrt(D)))
    a_map = f32(f32(M - 3) / f32(span * f32(M - 1)))
    b_map = f32(f32(0.5) - f32(f32(0.5) * f32(thr[0] + thr[NTH - 1])) * a_map)
    s_g = gbits(thr, a_map, b_map)
    cells = (s_g - H) >> SUB
    W, slow = np.zeros(M, np.int64), False
    for c in range(M):
        base, cnt = int((cells < c).sum()), int((cells == c).sum())
        slow |= cnt > 1
        pos = int(s_g[base]) & ((1 << SUB) - 1) if cnt else (1 << SUB) - 1
        W[c] = ((base << 24) + (0xFFFFFF - pos) - (H + (c << SUB))) & 0xFFFFFFFF
    w_reg = W[(_LANE - (H >> SUB)) & (M - 1)]
    neg = signs < 0
    m1 = (np.where(neg[0], 0x80000000, 0) if x32 else np.where(neg[0, 0::2], 0x8000, 0) | np.where(neg[0, 1::2], 0x80000000, 0))
    m2 = np.where(neg[-1], 0x80000000, 0)
    cb = codebook.float().numpy().astype(f32)

    def kappa_of(k):
        t, s = (k >> 1) & 3, (k & 1) | ((k >> 3) << 1)
        return ((s // CH) * 4 + t) * CH + s % CH

    afr = np.zeros((32, 4), np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            m, k = g + 8 * (i & 1), 2 * t + 8 * (i >> 1)
            rk = 2 * m if m < 8 else 2 * (m - 8) + 1  # rho
            e = [(0x3C00 if f16 else 0x3F80) | ((bin(rk & kappa_of(kk)).count("1") & 1) << 15) for kk in (k, k + 1)]
            afr[lane, i] = e[0] | (e[1] << 16)
    afn = afr ^ 0x80008000
    seg_in = _LG % S
    rs = f32(1.0 / D) if rounds == 2 else f32(1.0 / math.sqrt(D))
    a_rs = f32(a_map * rs)
    xbits = x.numpy().view(np.int32).astype(np.int64) & 0xFFFFFFFF if x32 else x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    codes, norms = np.zeros((n_rows, RB), np.uint8), np.zeros(n_rows, f32)

    def xor_lane(v, m):
        return v[_LANE ^ m]

    def row_sum(v):
        for m in (4, 8, 16) + ((1,) if S >= 4 else ()) + ((2,) if S >= 8 else ()):
            v = (v + xor_lane(v, m)).astype(f32)
        return v

    def fwht(v, hmin, hmax):  # v [32, n], levels hmin <= h < hmax
        h = hmin
        while h < hmax:
            for e in range(v.shape[1]):
                if not e & h:
                    a, c = v[:, e].copy(), v[:, e + h].copy()
                    v[:, e], v[:, e + h] = a + c, a - c
            h <<= 1

    def bfly_lanes(v, m):  # one level across lanes: fma(v, +-1, v of lane ^ m)
        sgn = np.where(_LANE & m, -1.0, 1.0).astype(f32)[None, :, None]
        return _f32fma(v, sgn, v[:, _LANE ^ m])

    for row0 in range(0, n_rows, R):
        rin = row0 + _LG // S
        ok = rin < n_rows
        vals = np.zeros((32, NCH, 8), np.int64)  # chunk c of column g: 8 values at (4c + t) * 8
        for c in range(NCH):
            for e in range(8):
                vals[:, c, e] = np.where(ok, xbits[np.minimum(rin, n_rows - 1), seg_in * LSEG + (4 * c + _LT) * 8 + e], 0)
        acc = np.zeros((32, NG, 4), f32)
        if not x32:
            w = vals[:, :, 0::2] | (vals[:, :, 1::2] << 16)
            for c in range(NCH):
                for r in range(4):
                    w[:, c, r] ^= m1[(seg_in * LSEG + (4 * c + _LT) * 8) // 2 + r]
            bfr = np.zeros((32, NG, 2), np.int64)
            for G in range(NG):
                reg = [w[:, s // CH, ((s % CH) * NG + G) >> 1] for s in range(4)]
                sel = 0x7632 if G & 1 else 0x5410
                bfr[:, G, 0], bfr[:, G, 1] = prmt(reg[0], reg[1], sel), prmt(reg[2], reg[3], sel)
            for Gp in range(NG):
                for gl in range(1 << FOLD):
                    G = (Gp & ~((1 << FOLD) - 1)) | gl
                    a = afn if bin(Gp & gl).count("1") & 1 else afr
                    acc[:, Gp] = _mma16816(acc[:, Gp], a, bfr[:, G, 0], bfr[:, G, 1], f16)
        else:
            xf = np.zeros((32, NCH, 8), f32)
            for c in range(NCH):
                for e in range(8):
                    xf[:, c, e] = (vals[:, c, e] ^ m1[seg_in * LSEG + (4 * c + _LT) * 8 + e]).astype(u32).view(f32)
            for G in range(NG):
                parts = []
                for s0 in (0, 2):  # split3: x = hi + mid + lo, bf16 pairs
                    x0, x1, p = xf[:, s0 // CH, (s0 % CH) * NG + G], xf[:, (s0 + 1) // CH, ((s0 + 1) % CH) * NG + G], []
                    for _ in range(3):
                        h = torch.from_numpy(np.stack([x0, x1])).to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
                        p.append(h[0] | (h[1] << 16))
                        x0 = (x0 - (h[0] << 16).astype(u32).view(f32)).astype(f32)
                        x1 = (x1 - (h[1] << 16).astype(u32).view(f32)).astype(f32)
                    parts.append(p)
                for i in (2, 1, 0):
                    acc[:, G] = _mma16816(acc[:, G], afr, parts[0][i], parts[1][i], False)
        v = np.zeros((2, 32, 2 * NG), f32)  # [column 2t + col][lane][e = mb * NG + G]
        v[0, :, :NG], v[1, :, :NG], v[0, :, NG:], v[1, :, NG:] = acc[..., 0], acc[..., 1], acc[..., 2], acc[..., 3]
        fwht(v[0], 1 << FOLD, NG)
        fwht(v[1], 1 << FOLD, NG)
        if S >= 2:
            v = np.stack([v[0] + v[1], v[0] - v[1]])
        for sb in range(1, int(math.log2(S))):
            v = bfly_lanes(v, 1 << (sb - 1))
        ssp = np.zeros((2, 32), f32)
        for e in range(2 * NG):
            ssp = _f32fma(v[:, :, e], v[:, :, e], ssp)
        ss = (np.stack([row_sum(ssp[0] + ssp[1])] * 2) if S >= 2 else np.stack([row_sum(ssp[0]), row_sum(ssp[1])])) * f32(1.0 / D)
        if rounds == 2:
            for c in range(2):
                seg = (2 * _LT + c) % S
                for e in range(2 * NG):
                    v[c, :, e] = (v[c, :, e].view(u32) ^ m2[seg * LSEG + 2 * _LG * NG + e].astype(u32)).view(f32)
                fwht(v[c], 1, 2 * NG)
            if S >= 2:
                v = np.stack([v[0] + v[1], v[0] - v[1]])
            for lb in range(3 + (S >= 4) + (S >= 8)):
                v = bfly_lanes(v, 4 << lb if lb < 3 else 1 << (lb - 3))
        inv = np.where(ss > 0, 1 / np.sqrt(np.maximum(ss, 1e-38).astype(np.float64)), 0).astype(f32)
        dot = np.zeros((2, 32), f32)
        for c in range(2):
            a_row = (a_rs * inv[c]).astype(f32)
            tops = []
            for e in range(2 * NG):  # code in the top byte
                gb = gbits(v[c, :, e], a_row, b_map)
                if slow:
                    code = np.zeros(32, np.int64)
                    for step in range(B - 1, -1, -1):
                        code = np.where(gb > s_g[code + (1 << step) - 1], code + (1 << step), code)
                    top = code << 24
                elif M <= 32:  # shfl: lane index mod 32
                    top = (w_reg[(gb >> SUB) & 31] + gb) & 0xFFFFFFFF
                else:
                    top = (W[(gb >> SUB) & (M - 1)] + gb) & 0xFFFFFFFF
                if norm_correction:
                    dot[c] = _f32fma(v[c, :, e], cb[top >> 24], dot[c])
                tops.append(top)
            npiece = 2 * NG
            pw = np.zeros((32, (npiece * B + 31) // 32), np.int64)
            if 8 % B == 0 and (npiece * B) % 8 == 0:  # prmt byte gather
                cpb, nby = 8 // B, npiece * B // 8
                for wi in range(pw.shape[1]):
                    b0, accw = 4 * wi, 0
                    nb = min(nby - b0, 4)
                    for i in range(cpb):
                        top = [tops[(b0 + k) * cpb + i] for k in range(nb)]
                        if nb == 1:
                            r = top[0] >> 24
                        elif nb == 2:
                            r = prmt(top[0], top[1], 0x0073)
                        else:
                            r = prmt(prmt(top[0], top[1], 0x0073), prmt(top[2], top[3], 0x7300), 0x7610)
                        accw = r if i == 0 else (accw + (r << (i * B))) & 0xFFFFFFFF
                    pw[:, wi] = accw
            else:
                for j in range(npiece):
                    code, bit = tops[j] >> 24, j * B
                    pw[:, bit >> 5] |= (code << (bit & 31)) & 0xFFFFFFFF
                    if (bit & 31) + B > 32:
                        pw[:, (bit >> 5) + 1] |= code >> (32 - (bit & 31))
            n = 2 * _LT + c
            row = row0 + n // S
            if PAIR:  # the even lane of a pair writes both pieces (shfl_down by 4)
                other = np.where(_LANE + 4 < 32, pw[(_LANE + 4) % 32, 0], pw[:, 0])
                pw = np.stack([(pw[:, 0] | (other << (4 * B))) & 0xFFFFFFFF, other >> (32 - 4 * B)], 1)
            pby = B if PAIR else npiece * B // 8
            for lane in range(32):
                if row[lane] < n_rows and not (PAIR and _LG[lane] % 2):
                    off = _LG[lane] * B // 2 if PAIR else ((n[lane] % S) * LSEG + 2 * _LG[lane] * NG) * B // 8
                    codes[row[lane], off:off + pby] = np.frombuffer(pw[lane].astype("<u4").tobytes()[:pby], np.uint8)
        if norm_correction:
            dot = np.stack([row_sum(dot[0] + dot[1])] * 2) if S >= 2 else np.stack([row_sum(dot[0]), row_sum(dot[1])])
        for c in range(2):
            n = 2 * _LT + c
            for lane in np.nonzero((_LG == 0) & (n % S == 0) & (row0 + n // S < n_rows))[0]:
                nrm = f32(np.sqrt(ss[c, lane]))
                d = f32(f32(dot[c, lane] * rs) * inv[c, lane])
                norms[row0 + n[lane] // S] = f32(nrm / d) if norm_correction and d > 0 else nrm
    return torch.from_numpy(codes), torch.from_numpy(norms).to(norm_dtype), slow


@pytest.mark.parametrize("dim,bits,dtype,rounds,nc", [
    (128, 4, torch.bfloat16, 1, False), (128, 4, torch.bfloat16, 2, True), (64, 3, torch.float16, 1, True),
    (128, 2, torch.float32, 1, False), (256, 4, torch.bfloat16, 1, False), (256, 3, torch.float32, 2, True),
    (512, 4, torch.bfloat16, 2, False), (1024, 2, torch.float16, 1, True), (32, 3, torch.bfloat16, 1, False),
    (32, 1, torch.float32, 2, True), (64, 5, torch.bfloat16, 1, True), (256, 8, torch.float16, 2, True),
    (32, 2, torch.float16, 2, False), (128, 6, torch.bfloat16, 1, True),
])
def test_quant_pack_kernel_logic_matches_reference(dim, bits, dtype, rounds, nc):
    """The emulated kernel (layout, mma fragments, levels, cell-table search, packing, norms) gives the
    bytes of quantize_reference: codes may differ by one level at float-rounding ties only."""
    g = torch.Generator().manual_seed(dim * 10 + bits)
    x = (torch.randn(24 if dim >= 512 else 40, dim, generator=g) * 3).to(dtype)
    x[3] = 0  # a zero row: y = 0, codes = #{thresholds < 0}
    h = fallback.hadamard_matrix(dim)
    s = (torch.randint(0, 2, (rounds, dim), generator=g) * 2 - 1).float()
    rot = (h * s[0].double() / math.sqrt(dim)) if rounds == 1 else (h * s[1].double()) @ (h * s[0].double()) / dim
    cb = cuda_cases.codebook_tensor(bits, dim)
    codes, norms, slow = _emulate_quant_pack(x, s, cb, bits, torch.float16, nc)
    ref_codes, ref_norms = fallback.quantize_reference(x, rot.float(), cb, bits, torch.float16, nc)
    diff = (fallback.unpack_codes(codes, bits, dim) - fallback.unpack_codes(ref_codes, bits, dim)).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
    rel = (norms.float() - ref_norms.float()).abs() / ref_norms.float().abs().clamp_min(1e-30)
    assert float(rel.max()) < 2e-3  # fp16 rounding of the same float32 norm
    assert not slow  # Lloyd-Max codebooks: at most one threshold per cell


def test_quant_pack_kernel_logic_binary_search_fallback():
    """A codebook with clustered and tied centroids puts two thresholds in one cell: the kernel's
    binary search (same integers) gives the same codes."""
    cb = torch.sort(torch.cat([torch.randn(12, generator=torch.Generator().manual_seed(0)) * 0.05,
                               torch.tensor([0.01, 0.01, 0.0101, 0.3])])).values
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    rot = cuda_cases.hadamard_rotation(128, 4)
    codes, norms, slow = _emulate_quant_pack(x, fallback.hadamard_signs(rot)[None], cb, 4, torch.float16, True)
    ref_codes, ref_norms = fallback.quantize_reference(x, rot, cb, 4, torch.float16, True)
    assert slow
    diff = (fallback.unpack_codes(codes, 4, 128) - fallback.unpack_codes(ref_codes, 4, 128)).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
    assert float(((norms.float() - ref_norms.float()).abs() / ref_norms.float()).max()) < 2e-3


def test_pack_launch_geometry():
    """Rows per warp follow Geo<D>::R; the grid is one resident wave at most."""
    assert [pack.rows_per_warp(d) for d in (32, 64, 128, 256, 512, 1024)] == [8, 8, 8, 4, 2, 1]
    assert pack.grid_blocks(64, 128, 132, 64) == 1
    assert pack.grid_blocks(1 << 21, 128, 132, 64) == 132 * 4
    assert pack.grid_blocks(1 << 21, 128, 132, 80) == 132 * 3
    assert pack.grid_blocks(1 << 21, 256, 132, None) == 132 * 3


def test_decode_plan_is_cached_on_the_call_invariants(monkeypatch):
    """The CUDA launcher's host-side plan (pure Python, built here on CPU tensors with the compiler and
    device queries stubbed): reused for a repeated call, rebuilt when a codebook is edited in place or
    the cache grows, and a bad argument still raises."""
    monkeypatch.setattr(build, "get_function", lambda *a, **k: object())
    monkeypatch.setattr(split_size, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention, "_plans", PlanCache("decode attention", attention.MAX_PLANS))
    cache = _random_cache(1, 2, 40, 32, 4, 4)
    rot, cb = cuda_cases.hadamard_rotation(32), torch.linspace(-0.3, 0.3, 16)
    q = torch.randn(1, 4, 1, 32)

    def plan(c=cache, norms=cache["k_norms"], lens=torch.tensor([40])):
        return attention.plan(q, c["k_codes"], norms, c["v_codes"], c["v_norms"], lens, rot, rot, cb, cb,
                                     4, 4, 0.125, None, None, None, None, None, None)

    p = plan()
    assert plan() is p and plan(lens=None) is p
    assert p.tcap == 40 and p.full_lens.tolist() == [40] and p.rows == 2
    cb.mul_(1.0)  # in-place edit: new version, new plan
    assert plan() is not p
    shorter = _random_cache(1, 2, 32, 32, 4, 4)
    assert plan(shorter, shorter["k_norms"], torch.tensor([32])).tcap == 32
    with pytest.raises(ValueError):
        plan(norms=cache["k_norms"].float())
    # seq_lens=None means all Tcap slots (CPU reference path)
    kw = dict(k_rotation=rot, v_rotation=rot, k_codebook=cb, v_codebook=cb, k_bits=4, v_bits=4, return_lse=True)
    args = (q, cache["k_codes"], cache["k_norms"], cache["v_codes"], cache["v_norms"])
    for a, b in zip(decode_attention(*args, torch.tensor([40]), **kw), decode_attention(*args, None, **kw)):
        assert torch.equal(a, b)


def test_one_hadamard_for_one_seed():
    """The kernels' test rotations are kvcodec.quant's own: one generator per (dim, seed, rounds)."""
    from kvcodec.quant.rotations import rotation_matrix

    for d, seed in ((32, 0), (128, 5)):
        assert torch.equal(cuda_cases.hadamard_rotation(d, seed), rotation_matrix(d, seed, "hadamard"))
        assert torch.equal(cuda_cases.hadamard_rotation(d, seed, rounds=2), rotation_matrix(d, seed, "hadamard2"))
        assert fallback.hadamard_signs(cuda_cases.hadamard_rotation(d, seed)) is not None
        assert fallback.hadamard2_signs(cuda_cases.hadamard_rotation(d, seed, rounds=2)) is not None
