"""GPU benchmark of the fused TurboQuant kernels: correctness vs float64, decode latency vs bf16 SDPA,
achieved bandwidth vs device copy bandwidth, quantize+pack vs the bf16 write it replaces.

    PYTHONPATH=. python3 benchmarks/gpu_kernels.py [--quick] [--out DIR] [--fused]

``--fused``: the one-launch kernel's study only (checks of every launch mode, graph replays, kernel
table of the one-launch, three-launch and automatic paths against bf16 flash SDPA, split sizes,
per-kernel device times).

Writes ``gpu_kernels.json``/``.md`` under ``$OUT`` (if set) and ``benchmarks/results``; the last thing
printed is a short table. Bytes counted for the fused kernel are the bytes it must read: packed K and V
codes, their norms (and QJL bits/norms), for every valid token; SDPA reads bf16 K and V.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_record, save_with_out  # noqa: E402
from benchmarks import cuda_cases  # noqa: E402
from kvcodec.quant.cuda import KernelVariant, fallback  # noqa: E402
import kvcodec.quant.cuda as kc  # noqa: E402

L2_ROTATE_BYTES = 512 << 20  # rotate among input sets until this many bytes: no timing out of L2


def log(*a):
    print(*a, flush=True)


def cuda_time_ms(fns, reps: int = 20, rounds: int = 5, graphs: bool = True) -> tuple[float, str]:
    """Median over ``rounds`` of (CUDA-event time of ``reps`` back-to-back calls) / reps, in ms.

    ``fns`` is a list of zero-argument callables cycled through (distinct input sets, so that small
    shapes are not timed out of L2). Each is captured as a CUDA graph when possible (launch gaps of
    the Python launcher removed, as in a serving engine); otherwise called eagerly. Returns (ms, mode).
    """
    if callable(fns):
        fns = [fns]
    for f in fns:  # warm-up: compile, allocate, cache
        f()
    torch.cuda.synchronize()
    mode = "eager"
    calls = list(fns)
    if graphs:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(side)
            gs = []
            for f in fns:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    f()
                gs.append(g)
            calls = [g.replay for g in gs]
            for c in calls:
                c()
            torch.cuda.synchronize()
            mode = "graph"
        except Exception as e:  # capture unsupported: time eagerly
            log(f"graph capture failed ({type(e).__name__}: {str(e)[:120]}); timing eagerly")
            torch.cuda.synchronize()
            calls = list(fns)
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(reps):
            calls[i % len(calls)]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    times.sort()
    return times[len(times) // 2], mode


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = cuda_time_ms(lambda: dst.copy_(src), reps=10, graphs=False)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e12


codebook = cuda_cases.codebook_tensor
make_case = cuda_cases.random_decode_case


def with_rotations(kw: dict, kind: str, d: int, seed: int = 0) -> dict:
    """kw with other K and V rotations than random_decode_case's one-round Hadamard ones: "orthogonal"
    (dense random: the one-launch kernel reads the matrix) or "hadamard2" (H diag(s2) H diag(s1) / D,
    kvcodec.quant's default: two rounds of butterflies)."""
    kw = dict(kw)
    for i, name in enumerate(("k_rotation", "v_rotation")):
        g = torch.Generator().manual_seed(seed * 2 + i)
        if kind == "orthogonal":
            rot = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
        else:
            s1, s2 = (torch.randint(0, 2, (2, d), generator=g).to(torch.float64) * 2 - 1)
            h = fallback.hadamard_matrix(d)
            rot = (h * s2) @ (h * s1) / d
        kw[name] = rot.to(torch.float32).to(kw[name].device)
    return kw

CHECKS = [
    # name, (b, hq, hkv, ql, tcap, d, kb, vb, lens), options
    ("d128 k4v4 g4", (3, 8, 2, 1, 300, 128, 4, 4, [300, 17, 0]), {}),
    ("d128 k4v2 g4", (3, 8, 2, 1, 300, 128, 4, 2, [300, 17, 0]), {}),
    ("d128 k3v3 g4", (3, 8, 2, 1, 300, 128, 3, 3, [300, 17, 0]), {}),
    ("d128 k2v2 g4", (2, 8, 2, 1, 300, 128, 2, 2, [250, 300]), {}),
    ("d64 k4v4 g3", (2, 9, 3, 1, 500, 64, 4, 4, [500, 33]), {}),
    ("d64 k3v3 g3", (2, 9, 3, 1, 500, 64, 3, 3, [499, 250]), {}),
    ("d64 k2v1 g3", (2, 9, 3, 1, 500, 64, 2, 1, [64, 480]), {}),
    ("d128 g1 (MHA)", (2, 4, 4, 1, 200, 128, 4, 4, [200, 100]), {}),
    ("d128 g8", (2, 64, 8, 1, 1000, 128, 4, 4, [1000, 999]), {}),
    ("d128 g20 (2 row tiles)", (2, 40, 2, 1, 300, 128, 4, 2, [300, 7]), {}),
    ("d128 q_len 4 (spec)", (2, 32, 8, 4, 300, 128, 4, 4, [300, 150]), {}),
    ("d128 bf16 norms", (2, 8, 2, 1, 300, 128, 4, 4, [300, 150]), {"norm_dtype": torch.bfloat16}),
    ("d128 prod keys (QJL)", (2, 8, 2, 1, 300, 128, 3, 4, [300, 150]), {"qjl": True}),
    ("d64 prod keys (QJL)", (2, 9, 3, 1, 300, 64, 1, 2, [300, 150]), {"qjl": True}),
    ("d128 long split", (1, 32, 8, 1, 20000, 128, 4, 4, [19999]), {}),
    ("d64 q_len 2 g3 (6 rows)", (2, 9, 3, 2, 300, 64, 4, 4, [300, 100]), {}),
    ("d128 g5 q_len 2 (10 rows)", (2, 10, 2, 2, 300, 128, 4, 4, [300, 100]), {}),
    ("d128 g4 bf16 norms 3/2", (2, 16, 4, 1, 300, 128, 3, 2, [257, 300]), {"norm_dtype": torch.bfloat16}),
    ("d128 lens 0/1/odd", (4, 32, 8, 1, 1000, 128, 4, 4, [0, 1, 777, 1000]), {}),
    ("d64 g3 window", (2, 9, 3, 1, 400, 64, 4, 4, [400, 33]), {}),
    ("d128 long split b1", (1, 32, 8, 1, 33000, 128, 4, 4, [32999]), {}),
    ("d128 dense rotations", (2, 32, 8, 1, 700, 128, 4, 4, [700, 301]), {"rotation": "orthogonal"}),
    ("d64 hadamard2 rotations g3", (2, 9, 3, 2, 700, 64, 4, 4, [699, 0]), {"rotation": "hadamard2"}),
    ("d128 hadamard2 g20 window", (2, 40, 2, 1, 500, 128, 4, 4, [500, 77]), {"rotation": "hadamard2"}),
    ("d128 hadamard2 g4 (narrow: lane tables)", (2, 16, 4, 1, 600, 128, 4, 4, [600, 255]), {"rotation": "hadamard2"}),
]


def _make_check_case(shape, opts):
    opts = dict(opts)
    rotation = opts.pop("rotation", None)
    case, kw = make_case(*shape, **opts)
    return case, (with_rotations(kw, rotation, shape[5]) if rotation else kw)


def run_checks() -> list[dict]:
    rows = []
    for prefix, defines, narrow, fused in CHECK_MODES:
        rows += _run_checks(prefix, KernelVariant(defines, narrow, fused))
    return rows


# prefix, macros, narrow kernel allowed, one-launch kernel (None: the launcher decides); "no sign
# symmetry": the builds the launcher makes for an asymmetric 4-bit codebook
CHECK_MODES = [("", (), True, None), ("one-launch: ", (), True, True), ("three-launch: ", (), True, False),
               ("wide-only: ", (), False, False), ("wide-only one-launch: ", (), False, True),
               ("no sign symmetry: ", ("TQ_REG_LUT_SYM=0",), True, None)]


def _run_checks(prefix: str, variant: KernelVariant, checks=CHECKS) -> list[dict]:
    rows = []
    for name, shape, opts in checks:
        row = {"check": prefix + name}
        try:
            opts = dict(opts)
            tpw = opts.pop("tpw", None)
            case, kw = _make_check_case(shape, opts)
            extra = {} if tpw is None else {"tokens_per_warp": tpw}
            if "g4" in name and "k4v4" in name:
                extra["tokens_per_warp"] = 64
            if "window" in name or name.startswith("d128 q_len"):
                b, hq, hkv, ql, tcap, d = shape[:6]
                extra["window_k"] = torch.randn(b, hkv, 8, d, device="cuda", dtype=torch.bfloat16)
                extra["window_v"] = torch.randn(b, hkv, 8, d, device="cuda", dtype=torch.bfloat16)
            cuda_cases.poison_allocator()
            out, lse = kc.decode_attention(**case, **kw, **extra, variant=variant, return_lse=True)
            torch.cuda.synchronize()
            ref, ref_lse = fallback.decode_attention_reference(
                **case, **kw, **{k: v for k, v in extra.items() if k != "tokens_per_warp"})
            rel = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            fin = torch.isfinite(ref_lse)
            lse_err = (lse[fin].double() - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
            row.update(max_rel_err=rel, lse_abs_err=lse_err, nan_out=int((~torch.isfinite(out)).sum()),
                       lse_inf_match=bool(torch.equal(fin, torch.isfinite(lse))),
                       ok=bool(rel < 4e-3 and lse_err < 5e-3 and torch.isfinite(out).all()))
        except Exception as e:  # keep going: one broken configuration must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        log("check", row)
        rows.append(row)
    return rows


def run_quant_checks(variant: KernelVariant) -> list[dict]:
    """kvcodec.quant.cuda.quantized.attend on the GPU vs the quant package's own scores + weighted_sum."""
    rows = []
    try:
        from kvcodec.quant import TurboQuantMSE, TurboQuantProd
        from kvcodec.quant.cuda.quantized import attend
    except Exception as e:
        return [{"quant_check": "import", "ok": False, "error": str(e)[:200]}]
    for prod, pre, d in ((False, "none", 128), (True, "scale", 128), (False, "center", 64), (True, "none", 64)):
        row = {"quant_check": f"d{d} {'prod' if prod else 'mse'} keys, precondition={pre}"}
        try:
            b, hkv, g, t = 2, 4, 4, 700
            gen = torch.Generator(device="cuda").manual_seed(3)
            k = torch.randn(b, hkv, t, d, device="cuda", generator=gen) * 2
            v = torch.randn(b, hkv, t, d, device="cuda", generator=gen)
            q = torch.randn(b, hkv * g, 1, d, device="cuda", generator=gen).to(torch.bfloat16)
            kq = (TurboQuantProd if prod else TurboQuantMSE)(d, 4, seed=1, precondition=pre)
            vq = TurboQuantMSE(d, 4, seed=2, precondition=pre)
            kt, vt = kq.quantize(k), vq.quantize(v)
            cuda_cases.poison_allocator()
            out = attend(q, kt, vt, kq, vq, variant=variant).float()
            s = kq.scores(kt, q.float().reshape(b, hkv, g, d)) / math.sqrt(d)
            want = vq.weighted_sum(vt, torch.softmax(s, -1)).reshape(b, hkv * g, 1, d)
            rel = ((out - want).abs().max() / want.abs().max()).item()
            row.update(max_rel_err=rel, ok=bool(rel < 1e-2 and torch.isfinite(out).all()))
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        log("quant", row)
        rows.append(row)
    return rows


def run_pack_checks() -> list[dict]:
    rows = []
    for d, bits, dtype, strided in ((128, 4, torch.bfloat16, False), (128, 3, torch.float16, False),
                                    (128, 2, torch.float32, False), (64, 4, torch.bfloat16, False),
                                    (64, 3, torch.bfloat16, False), (32, 4, torch.bfloat16, False),
                                    (256, 4, torch.float32, False), (512, 3, torch.float16, False),
                                    (1024, 2, torch.bfloat16, False), (128, 4, torch.bfloat16, True),
                                    (64, 5, torch.float16, True)):
        row = {"pack_check": f"d{d} b{bits} {str(dtype)[6:]}" + (" strided" if strided else "")}
        try:
            x = (torch.randn(1 << 16, d + strided, device="cuda") * 3).to(dtype)
            x = x[:, 1:] if strided else x  # a row stride of d + 1 elements: not 16-byte aligned
            rot = cuda_cases.hadamard_rotation(d, 7).cuda()
            cb = codebook(bits, d).cuda()
            cuda_cases.poison_allocator()
            codes, norms = kc.quantize_pack(x, rot, cb, bits)
            rc, rn = fallback.quantize_reference(x, rot, cb, bits)
            got = fallback.unpack_codes(codes, bits, d)
            want = fallback.unpack_codes(rc, bits, d)
            row.update(code_mismatch_rate=(got != want).float().mean().item(),
                       max_code_diff=int((got - want).abs().max()),
                       norm_mismatch=int((norms != rn).sum()), ok=bool((got - want).abs().max() <= 1))
            try:  # the quant package's own torch path (default "hadamard2" rotation: two rounds)
                from kvcodec.quant import TurboQuantMSE

                qz = TurboQuantMSE(d, bits, seed=7, precondition="none")  # norm_correction on (default)
                qt = qz.quantize(x)
                codes2, norms2 = kc.quantize_pack(x, qz.rotation.cuda(), qz.codebook.cuda(), bits,
                                                  norm_dtype=qt.token["norms"].dtype, norm_correction=True)
                g2 = fallback.unpack_codes(codes2, bits, d)
                w2 = fallback.unpack_codes(qt.token["codes"].cuda(), bits, d)
                row["vs_quant_mismatch_rate"] = (g2 != w2).float().mean().item()
                row["vs_quant_max_diff"] = int((g2 - w2).abs().max())
                row["vs_quant_norm_max_rel"] = ((norms2.float() - qt.token["norms"].float()).abs()
                                                / qt.token["norms"].float().clamp_min(1e-30)).max().item()
            except Exception as e:
                row["vs_quant"] = f"n/a ({type(e).__name__}: {str(e)[:80]})"
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        log("pack", row)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- timing
def compressed_bytes(b, hkv, t, d, kb, vb) -> int:
    return b * hkv * t * (d * kb // 8 + d * vb // 8 + 2 + 2)


def time_decode(b, t, hq, hkv, d, kb, vb, *, variant: KernelVariant, tokens_per_warp=None, sdpa=True,
                rotation=None) -> dict:
    """One decode shape timed (and bf16 flash SDPA beside it); ``rotation``: see with_rotations
    (default: one-round Hadamard rotations, which the one-launch kernel runs as butterflies)."""
    row = dict(batch=b, ctx=t, heads=f"{hq}/{hkv}", d=d, bits=f"{kb}/{vb}")
    per_set = compressed_bytes(b, hkv, t, d, kb, vb)
    nsets = max(1, min(8, L2_ROTATE_BYTES // per_set))
    sets = []
    for i in range(nsets):
        case, kw = make_case(b, hq, hkv, 1, t, d, kb, vb, [t] * b, seed=i)
        sets.append((case, with_rotations(kw, rotation, d, seed=i) if rotation else kw))
    fns = [lambda c=c, k=k: kc.decode_attention(**c, **k, tokens_per_warp=tokens_per_warp, variant=variant)
           for c, k in sets]
    ms, mode = cuda_time_ms(fns)
    row["fused_ms"] = ms
    row["mode"] = mode
    row["fused_TBps"] = per_set / (ms * 1e-3) / 1e12
    del sets
    if sdpa:
        bf_bytes = 2 * b * hkv * t * d * 2
        nsets = max(1, min(4, L2_ROTATE_BYTES // bf_bytes))
        kv = [(torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16),
               torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)) for _ in range(nsets)]
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def base(k, v):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        ms_b, _ = cuda_time_ms([lambda k=k, v=v: base(k, v) for k, v in kv])
        row["sdpa_ms"] = ms_b
        row["sdpa_TBps"] = bf_bytes / (ms_b * 1e-3) / 1e12
        row["speedup"] = ms_b / ms
        del kv
    torch.cuda.empty_cache()
    return row


def time_pack(n_rows, d, bits) -> dict:
    x = torch.randn(n_rows, d, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    rot = cuda_cases.hadamard_rotation(d, 3).cuda()
    cb = codebook(bits, d).cuda()
    ms, mode = cuda_time_ms(lambda: kc.quantize_pack(x, rot, cb, bits))
    ms_copy, _ = cuda_time_ms(lambda: dst.copy_(x))
    return dict(pack_rows=n_rows, d=d, bits=bits, pack_ms=ms, bf16_write_ms=ms_copy, pack_vs_write=ms_copy / ms,
                mode=mode)


def sweep(quick: bool, variant: KernelVariant):
    heads = [(32, 8, 128), (9, 3, 64)]
    bits = [(4, 4), (4, 2), (3, 3)]
    batches = [1, 8] if quick else [1, 8, 32]
    ctxs = [4096, 32768] if quick else [4096, 32768, 131072]
    free = torch.cuda.mem_get_info()[0]
    rows = []
    for hq, hkv, d in heads:
        for b in batches:
            for t in ctxs:
                bf_bytes = 2 * b * hkv * t * d * 2
                if bf_bytes * 1.3 > free * 0.8:
                    log("skip (memory)", b, t, hq, hkv, d)
                    continue
                for kb, vb in bits:
                    try:
                        row = time_decode(b, t, hq, hkv, d, kb, vb, variant=variant, sdpa=(kb, vb) == (4, 4))
                    except Exception as e:
                        row = dict(batch=b, ctx=t, heads=f"{hq}/{hkv}", d=d, bits=f"{kb}/{vb}",
                                   error=f"{type(e).__name__}: {e}"[:200])
                        traceback.print_exc()
                        torch.cuda.empty_cache()
                    log("time", row)
                    rows.append(row)
    return rows


TPW_SHAPES = [(1, 32768, 32, 8, 128, 4, 4), (8, 32768, 32, 8, 128, 4, 4), (32, 32768, 32, 8, 128, 4, 4),
              (8, 131072, 32, 8, 128, 4, 4), (8, 32768, 9, 3, 64, 4, 4), (32, 131072, 9, 3, 64, 4, 4)]
TPW_GRID = (256, 512, 1024, 2048)


def tpw_sweep(variant: KernelVariant, shapes=TPW_SHAPES, grid=TPW_GRID, max_warps: int | None = None,
              tag: str = "tpw") -> list[dict]:
    """Split size (tokens per warp) grid with the chosen variant, the launcher's choice (None) first,
    for fitting the launcher's model; sizes needing more than ``max_warps`` warps are left out."""
    rows = []
    for shp in shapes:
        for tpw in (None,) + tuple(grid):
            if tpw and max_warps is not None and -(-shp[1] // tpw) > max_warps:
                continue
            try:
                row = time_decode(*shp, variant=variant, tokens_per_warp=tpw, sdpa=False)
                row["tpw"] = tpw or "auto"
            except Exception as e:
                row = dict(shape=str(shp), tpw=tpw, error=f"{type(e).__name__}: {e}"[:200])
            log(tag, row)
            rows.append(row)
    return rows


def profile_one() -> None:
    """One decode call (b8 t32k 32/8 d128 4/4) for an external profiler (ncu) to look at."""
    case, kw = make_case(8, 32, 8, 1, 32768, 128, 4, 4, [32768] * 8)
    for _ in range(3):
        kc.decode_attention(**case, **kw)
    torch.cuda.synchronize()


def kernel_breakdown(variant: KernelVariant) -> list[dict]:
    """Device time per kernel (torch profiler, CUPTI sees the CuPy launches too) for two shapes."""
    return _breakdown("", variant)


def _breakdown(label: str, variant: KernelVariant,
               shapes=((8, 32768, 32, 8, 128, 4, 4), (1, 4096, 32, 8, 128, 4, 4))) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for shp in shapes:
        b, t, hq, hkv, d, kb, vb = shp
        case, kw = make_case(b, hq, hkv, 1, t, d, kb, vb, [t] * b)
        for _ in range(3):
            kc.decode_attention(**case, **kw, variant=variant)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                kc.decode_attention(**case, **kw, variant=variant)
            torch.cuda.synchronize()
        row = {"shape": f"{label}b{b} t{t} {hq}/{hkv} d{d} {kb}/{vb}"}
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                row[ev.key[:40]] = ev.device_time_total / 10 / 1000  # ms per call
        log("breakdown", row)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the one-launch kernel
ONE, THREE = KernelVariant(fused=True), KernelVariant(fused=False)
# automatic, one-launch, three-launch, wide-only (both), no sign symmetry; the one-launch kernel with 2
# load stages everywhere, without the lane tables, and with them but the shared-memory rotations
FUSED_CHECK_MODES = CHECK_MODES + [("one-launch 2 stages: ", ("TQ_FUSED_STAGES=2",), True, True),
                                   ("one-launch no lane tables: ", ("TQ_LANE_LUT=0",), True, True),
                                   ("one-launch shared-memory rotations, 3 stages: ",
                                    ("TQ_FUSED_WARP_ROTATE=0", "TQ_FUSED_STAGES=3"), True, True)]
TABLE_SHAPES = [(b, t, 32, 8, 128, 4, 4) for b in (1, 8, 32) for t in (4096, 32768, 131072)] + [
    (1, 32768, 32, 8, 128, 3, 3), (8, 32768, 32, 8, 128, 3, 3), (1, 32768, 32, 8, 128, 4, 2),
    (1, 32768, 9, 3, 64, 4, 4), (8, 32768, 9, 3, 64, 4, 4), (8, 131072, 9, 3, 64, 4, 4)]
FUSED_TPW_SHAPES = [(1, 32768, 32, 8, 128, 4, 4), (1, 131072, 32, 8, 128, 4, 4), (8, 4096, 32, 8, 128, 4, 4),
                    (8, 32768, 32, 8, 128, 4, 4), (32, 32768, 32, 8, 128, 4, 4)]
FUSED_TPW_GRID = (32, 64, 128, 256, 512, 1024, 2048)
# Shapes of the dense-rotation rows (what a rotation that is no Hadamard transform costs).
# (Builds of the one-launch kernel measured away and no longer timed here: tail batch 8, values in
# registers, the L2 256B prefetch hint, no query rotation, 1 stage and copy-engine L2 prefetches, lane
# tables for values only, 192 tokens per warp, the final merge staged in shared memory by cp.async,
# the four warps merged in parallel buffers: CHANGELOG.md, 2026-11-24; the plain [rows, D] warp merge
# and __threadfence publish, the lane index from %laneid, the bulk-copy ring: docs/cuda.md.)
FUSED_VARIANT_SHAPES = [(1, 32768, 32, 8, 128, 4, 4), (1, 131072, 32, 8, 128, 4, 4), (8, 4096, 32, 8, 128, 4, 4),
                        (8, 32768, 32, 8, 128, 4, 4), (8, 131072, 32, 8, 128, 4, 4), (32, 32768, 32, 8, 128, 4, 4)]


def _compile_one(job) -> str:
    name, defines, arch = job
    from kvcodec.device import build as _build
    from kvcodec.quant.cuda.decode_kernels import SOURCE

    _build.get_function(SOURCE, name, tuple(defines), arch)
    return name


def precompile(calls) -> int:
    """Compile every kernel instance the decode calls ``calls`` (list of (case, kw, extra)) will need,
    in parallel processes: CuPy's disk cache then serves them here (NVRTC in one process compiles one
    instance at a time). The instances are found by building each call's plan with the compiler
    replaced by a recorder; those plans are dropped again."""
    import multiprocessing
    import types
    from concurrent.futures import ProcessPoolExecutor

    from kvcodec.device import build
    from kvcodec.quant.cuda import attention

    from kvcodec.device.plans import PlanCache

    jobs = set()
    real, saved = build.get_function, attention._plans
    attention._plans = PlanCache("recorded decode attention", attention.MAX_PLANS)  # dropped afterwards

    def record(source, name, defines=(), arch=None):
        jobs.add((name, tuple(defines), arch))
        return types.SimpleNamespace(num_regs=None)

    build.get_function = record
    try:
        for case, kw, extra in calls:
            c = case
            attention.plan(c["query"], c["k_codes"], c["k_norms"], c["v_codes"], c["v_norms"], c["seq_lens"],
                           kw["k_rotation"], kw["v_rotation"], kw["k_codebook"], kw["v_codebook"], kw["k_bits"],
                           kw["v_bits"], 1.0 / math.sqrt(c["query"].shape[-1]), c.get("k_qjl"), c.get("k_rnorms"),
                           kw.get("qjl_matrix"), None, None, extra.get("tokens_per_warp"), extra["variant"])
    finally:
        build.get_function = real
        attention._plans = saved
    if jobs:
        with ProcessPoolExecutor(min(16, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as ex:
            list(ex.map(_compile_one, sorted(jobs, key=str)))
    return len(jobs)


def _check_calls(modes, checks=CHECKS) -> list:
    """The decode calls of ``_run_checks`` for each mode (prefix, macros, narrow, fused[, arch])."""
    calls = []
    for prefix, defines, narrow, fused, *arch in modes:
        for name, shape, opts in checks:
            opts = dict(opts)
            tpw = opts.pop("tpw", None)
            case, kw = _make_check_case(shape, opts)
            extra = {"variant": KernelVariant(defines, narrow, fused, *arch), "tokens_per_warp": tpw}
            if "g4" in name and "k4v4" in name:
                extra["tokens_per_warp"] = 64
            calls.append((case, kw, extra))
    return calls


def _table_calls() -> list:
    calls = []
    for b, t, hq, hkv, d, kb, vb in TABLE_SHAPES:
        case, kw = make_case(b, hq, hkv, 1, 64, d, kb, vb, [64] * b)
        calls += [(case, kw, {"variant": v}) for v in (ONE, THREE)]
    return calls


def fused_variants() -> list[dict]:
    """Both paths with dense rotation matrices on FUSED_VARIANT_SHAPES (what a rotation that is no
    Hadamard transform costs; the default build's numbers: the table and split sweep)."""
    rows = []
    for shp in FUSED_VARIANT_SHAPES:
        for label, v in (("dense rotations, one-launch", ONE), ("dense rotations, three-launch", THREE)):
            try:
                row = time_decode(*shp, variant=v, sdpa=False, rotation="orthogonal")
                row.update(variant=label, tpw="auto")
            except Exception as e:
                row = dict(shape=str(shp), variant=label, error=f"{type(e).__name__}: {e}"[:200])
            log("fused variant", row)
            rows.append(row)
    return rows


def auto_path(t) -> str:
    """The path the launcher picks for a decode call (MSE keys, automatic split size)."""
    from kvcodec.quant.cuda import attention

    return "one-launch" if attention.use_fused(KernelVariant(), False, t, None) else "three-launch"


def fused_table() -> list[dict]:
    """Kernel table: the one-launch and three-launch paths and bf16 flash SDPA on the same shapes;
    ``fused_ms`` is the path the launcher picks by default."""
    rows = []
    free = torch.cuda.mem_get_info()[0]
    for shp in TABLE_SHAPES:
        b, t, hq, hkv, d, kb, vb = shp
        if 2 * b * hkv * t * d * 2 * 1.3 > free * 0.8:
            log("skip (memory)", shp)
            continue
        try:
            one = time_decode(*shp, variant=ONE, sdpa=(kb, vb) == (4, 4))
            three = time_decode(*shp, variant=THREE, sdpa=False)
            path = auto_path(t)
            row = dict(one)
            row.update(path=path, one_launch_ms=one["fused_ms"], three_launch_ms=three["fused_ms"],
                       one_vs_three=three["fused_ms"] / one["fused_ms"])
            if path == "three-launch":
                row["fused_ms"], row["fused_TBps"] = three["fused_ms"], three["fused_TBps"]
            if "sdpa_ms" in row:
                row["speedup"] = row["sdpa_ms"] / row["fused_ms"]
        except Exception as e:
            row = dict(batch=b, ctx=t, heads=f"{hq}/{hkv}", d=d, bits=f"{kb}/{vb}", error=f"{type(e).__name__}: {e}"[:200])
            traceback.print_exc()
            torch.cuda.empty_cache()
        log("table", row)
        rows.append(row)
    return rows


def fused_tpw_sweep() -> list[dict]:
    """Split sizes of the one-launch kernel (for its cost model), the launcher's choice first."""
    from kvcodec.quant.cuda.decode_kernels import FUSED_MAX_BLOCKS, WARPS_PER_BLOCK

    return tpw_sweep(ONE, FUSED_TPW_SHAPES, FUSED_TPW_GRID, WARPS_PER_BLOCK * FUSED_MAX_BLOCKS, "fused tpw")


def run_fused_study(out_dir: str) -> dict:
    """``--fused``: checks of every launch mode, kernel table, split sizes, per-kernel device times.
    The launcher's automatic choice picks the one-launch kernel wherever it applies (what ships)."""
    t0 = time.time()
    rec = machine_record()
    rec["gpu"] = torch.cuda.get_device_name(0)
    rec["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    log("device", rec["gpu"], "SMs", rec["sms"], "torch", torch.__version__)
    n = precompile(_check_calls(FUSED_CHECK_MODES) + _table_calls())
    log(f"precompiled {n} kernel instances in parallel: {time.time() - t0:.0f}s")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw:.3f} TB/s (read+write)")
    checks = []
    for prefix, defines, narrow, fused in FUSED_CHECK_MODES:
        checks += _run_checks(prefix, KernelVariant(defines, narrow, fused))
    quant_checks = run_quant_checks(KernelVariant())
    log(f"checks done {time.time() - t0:.0f}s: {sum(bool(c.get('ok')) for c in checks)}/{len(checks)}")
    breakdown = []
    for label, v in (("one-launch ", ONE), ("three-launch ", THREE)):
        try:
            breakdown += _breakdown(label, v, ((1, 32768, 32, 8, 128, 4, 4), (8, 32768, 32, 8, 128, 4, 4)))
        except Exception as e:
            breakdown.append({"error": f"{type(e).__name__}: {e}"[:200]})
    table = fused_table()
    log(f"table done {time.time() - t0:.0f}s")
    tpw_rows = fused_tpw_sweep()
    variant_rows = fused_variants()
    for r in table + tpw_rows + variant_rows:
        if "fused_TBps" in r:
            r["pct_copy_bw"] = 100 * r["fused_TBps"] / bw
    result = {
        "suite": "gpu_kernels", "rows": table, "checks": checks, "quant_checks": quant_checks,
        "tpw_sweep": tpw_rows, "fused_variants": variant_rows, "breakdown": breakdown, "copy_TBps": bw,
        "machine": rec,
        "notes": [f"GPU {rec['gpu']}, copy bandwidth {bw:.2f} TB/s (read+write); q_len 1 decode, CUDA-graph timed; "
                  "fused_ms = the path the launcher picks (column path); one_launch_ms = tq_decode_fused, "
                  "three_launch_ms = prep + split + merge; bytes = packed codes + fp16 norms of K and V; "
                  "sdpa = flash backend on bf16 K/V (4/4 rows)",
                  f"checks ok: {sum(bool(c.get('ok')) for c in checks)}/{len(checks)}; "
                  f"quant attend checks ok: {sum(bool(c.get('ok')) for c in quant_checks)}/{len(quant_checks)}",
                  f"total {time.time() - t0:.0f}s"],
    }
    cols = ["batch", "ctx", "heads", "d", "bits", "path", "fused_ms", "one_launch_ms", "three_launch_ms", "fused_TBps",
            "pct_copy_bw", "sdpa_ms", "speedup"]
    save_with_out(result, out_dir, columns=cols)
    return result


def run(quick: bool = False, out_dir: str = "benchmarks/results", fused_only: bool = False) -> dict:
    """The whole suite; on a machine without a CUDA GPU + CuPy it prints a skip message and returns
    an empty result without writing anything (the committed GPU results stay as they are)."""
    if not kc.is_available():
        msg = "gpu_kernels: skipped (needs a CUDA GPU and CuPy); measured results: benchmarks/results/gpu_kernels.md"
        print(msg)
        return {"suite": "gpu_kernels", "rows": [], "notes": [msg]}
    if fused_only:
        return run_fused_study(out_dir)
    t0 = time.time()
    rec = machine_record()
    rec["gpu"] = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    rec["sms"] = props.multi_processor_count
    log("device", rec["gpu"], "SMs", rec["sms"], "torch", torch.__version__)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw:.3f} TB/s (read+write)")
    checks = run_checks()
    chosen = KernelVariant()
    packs = run_pack_checks()
    quant_checks = run_quant_checks(chosen)
    log(f"checks done {time.time() - t0:.0f}s")
    try:
        breakdown = kernel_breakdown(chosen)
    except Exception as e:
        breakdown = [{"error": f"{type(e).__name__}: {e}"[:200]}]
    tpw_rows = tpw_sweep(chosen)
    timing = sweep(quick, chosen)
    pack_rows = []
    for n, d, bits in ((8 * 8 * 32768, 128, 4), (8 * 3 * 32768, 64, 4), (64, 128, 4)):
        try:
            pack_rows.append(time_pack(n, d, bits))
        except Exception as e:
            pack_rows.append(dict(pack_rows=n, d=d, error=str(e)[:200]))
        log("pack time", pack_rows[-1])
    for r in timing:
        if "fused_TBps" in r:
            r["pct_copy_bw"] = 100 * r["fused_TBps"] / bw
    result = {
        "suite": "gpu_kernels",
        "rows": timing,
        "checks": checks,
        "pack_checks": packs,
        "quant_checks": quant_checks,
        "tpw_sweep": tpw_rows,
        "breakdown": breakdown,
        "pack_timing": pack_rows,
        "copy_TBps": bw,
        "machine": rec,
        "notes": [f"GPU {rec['gpu']}, copy bandwidth {bw:.2f} TB/s (read+write); batch of q_len=1 decode; "
                  "fused = tq_decode_split + tq_decode_merge (incl. query rotation/permutation in torch); "
                  "bytes = packed codes + fp16 norms of K and V; sdpa = flash backend on bf16 K/V (4/4 rows)",
                  f"checks ok: {sum(bool(c.get('ok')) for c in checks)}/{len(checks)}; "
                  f"pack checks ok: {sum(bool(c.get('ok')) for c in packs)}/{len(packs)}; "
                  f"quant attend checks ok: {sum(bool(c.get('ok')) for c in quant_checks)}/{len(quant_checks)}",
                  f"total {time.time() - t0:.0f}s"],
    }
    cols = ["batch", "ctx", "heads", "d", "bits", "fused_ms", "fused_TBps", "pct_copy_bw", "sdpa_ms", "speedup"]
    save_with_out(result, out_dir, columns=cols)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--profile-one", action="store_true", help="one decode call, for ncu")
    ap.add_argument("--fused", action="store_true", help="the one-launch kernel's study only")
    args = ap.parse_args()
    if args.profile_one:
        profile_one()
        sys.exit(0)
    run(quick=args.quick, out_dir=args.out, fused_only=args.fused)
