"""Static compressed cache on CUDA: graph replay and torch.compile against the eager step (skipped without a GPU)."""

import pytest
import torch

from kvcodec.cache_argument import cache_kwargs
from kvcodec.quant.cuda import is_available, ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not is_available(), reason="needs CUDA and CuPy")]

KW = dict(method="turboquant", key_bits=4, value_bits=4, residual=16, block_size=16)


def _model(heads, kv_heads, head_dim, layers=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=1)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _stepper(model, cache, batch):
    """A decode step on fixed token/position buffers (what a graph or compiled step replays)."""
    from kvcodec.hf import use

    tok = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    logits = torch.zeros(batch, model.config.vocab_size, device="cuda")

    def step(forward=model.forward):
        with use(model, cache):  # model.forward skips the binding hooks: bind by hand
            out = forward(input_ids=tok, position_ids=pos.view(1, 1).expand(batch, 1), cache_position=pos,
                          **cache_kwargs(model, cache), use_cache=True).logits
        logits.copy_(out[:, -1].float())
        tok.copy_(out[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)

    return step, tok, pos, logits


def _prefilled(model, ids, max_len):
    from kvcodec.hf import CompressedCache

    cache = CompressedCache(model, **KW, max_cache_len=max_len)
    first = model(ids, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
    return cache, first


@pytest.mark.parametrize("seed", range(3))
def test_graph_replay_equals_the_eager_static_step(seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv, d = [(4, 2, 64), (8, 2, 128), (6, 6, 64)][seed]
    batch = int(torch.randint(1, 4, (1,), generator=g))
    length = int(torch.randint(20, 90, (1,), generator=g))
    n = 40  # crosses at least two block boundaries
    model = _model(heads, kv, d, seed=seed)
    ids = torch.randint(2, 256, (batch, length), generator=g).cuda()
    with torch.no_grad():
        plain, first = _prefilled(model, ids, length + n + 8)
        step, tok, pos, logits = _stepper(model, plain, batch)
        tok.copy_(first)
        pos.fill_(length)
        ref = []
        for _ in range(n):
            step()
            ref.append(logits.clone())
        graphed, first = _prefilled(model, ids, length + n + 8)
        step, tok, pos, logits = _stepper(model, graphed, batch)
        tok.copy_(first)
        pos.fill_(length)
        step()  # eager first step (plans, kernels compiled), then capture the next one
        got = [logits.clone()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(n - 1):
            graph.replay()
            got.append(logits.clone())
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), rtol=0, atol=0)
    layer = graphed.layers[0]
    assert int(layer.seen) == length + n and int(layer.comp) > 0


def test_static_step_matches_the_eager_compressed_cache():
    """Same tokens through the static cache (kernels as custom ops) and the eager cache: logits agree to
    bf16 rounding (the quantize kernel and torch's quantizer differ on ~1e-6 of the codes)."""
    from kvcodec.hf import CompressedCache, enable
    from kvcodec.hf.static_cache import enable_static

    model = _model(8, 2, 128)
    ids = torch.randint(2, 256, (2, 70), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        eager = CompressedCache(model, **KW, max_cache_len=None)
        e = [model(ids, **cache_kwargs(model, eager)).logits[:, -1].float()]
        static, _ = _prefilled(model, ids, 128)
        s = []
        toks = torch.randint(2, 256, (2, 30), generator=torch.Generator().manual_seed(6)).cuda()
        for i in range(30):
            enable(model)
            e.append(model(toks[:, i:i + 1], **cache_kwargs(model, eager)).logits[:, -1].float())
            enable_static(model)
            s.append(model(toks[:, i:i + 1], **cache_kwargs(model, static)).logits[:, -1].float())
    e, s = torch.stack(e[1:]), torch.stack(s)
    assert float((e - s).abs().max() / e.abs().max()) < 2e-2


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_compile_fullgraph_reduce_overhead_matches_eager():
    """torch.compile(fullgraph=True) raises on any graph break; the compiled steps (teacher-forced: the
    same tokens in, so a near-tie cannot send the two down different paths) match the eager ones."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _model(8, 2, 128)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 256, (2, 50), generator=gen).cuda()
    feed = torch.randint(2, 256, (2, 24), generator=gen).cuda()
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    runs = []
    with torch.no_grad():
        for fwd in (model.forward, forward):
            cache, _ = _prefilled(model, ids, 50 + feed.shape[1] + 8)
            step, tok, pos, logits = _stepper(model, cache, 2)
            pos.fill_(50)
            out = []
            for i in range(feed.shape[1]):  # crosses a block boundary
                tok.copy_(feed[:, i:i + 1])
                step(fwd)
                out.append(logits.clone())
            runs.append(torch.stack(out))
    # inductor fuses the model's elementwise ops differently: bf16 rounding, not bits
    ref, got = runs
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_generate_compiles_the_static_cache_through_compile_config():
    """HF's own route: generate() sees a compileable cache on CUDA and compiles the decode step."""
    from transformers import CompileConfig

    from kvcodec.hf import CompressedCache

    model = _model(8, 2, 128)
    ids = torch.randint(2, 256, (1, 40), generator=torch.Generator().manual_seed(8)).cuda()
    plain = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW, max_cache_len=80)),
                           max_new_tokens=20, do_sample=False, disable_compile=True)
    compiled = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW, max_cache_len=80)),
                              max_new_tokens=20, do_sample=False, compile_config=CompileConfig(fullgraph=True))
    assert (plain == compiled).float().mean() > 0.9  # greedy on random weights: near-ties may flip late tokens


def test_static_cache_saved_on_cuda_loads_and_continues_identically(tmp_path):
    """save() of a CUDA static cache (on-append quantized codes) -> load(max_cache_len=) on CUDA: the
    loaded cache replays the same steps bit for bit; the same file loads as an eager cache too."""
    from kvcodec.hf import CompressedCache

    model = _model(8, 2, 128)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(2, 256, (2, 60), generator=gen).cuda()
    feed = torch.randint(2, 256, (2, 20), generator=gen).cuda()
    with torch.no_grad():
        cache, _ = _prefilled(model, ids, 128)
        for i in range(10):
            model(feed[:, i:i + 1], **cache_kwargs(model, cache))
        cache.save(tmp_path / "c.kvc")
        loaded = CompressedCache.load(tmp_path / "c.kvc", model, device="cuda", max_cache_len=128)
        runs = []
        for c in (cache, loaded):
            runs.append(torch.stack([model(feed[:, i:i + 1], **cache_kwargs(model, c)).logits[:, -1].float()
                                     for i in range(10, 20)]))
        assert type(CompressedCache.load(tmp_path / "c.kvc", model.config, device="cuda")) is CompressedCache
    assert torch.equal(runs[0], runs[1])


def _same_run(ref, got, rtol=2e-2):
    """Two generate runs (``output_logits=True``) agree: the same tokens, or logits within ``rtol`` of
    the reference up to the first differing token, where the reference's top two were within that
    difference (a near-tie of random weights, which bf16 rounding may flip)."""
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        a, b = a.float(), b.float()
        diff = float((a - b).abs().max())
        assert diff <= rtol * float(a.abs().max()), (step, diff)
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            top = a.topk(2, dim=-1).values
            margin = float((top[:, 0] - top[:, 1])[a.argmax(-1) != b.argmax(-1)].min())
            assert margin <= 2 * diff, (step, margin, diff)
            return
    assert torch.equal(ref.sequences, got.sequences)


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_generate_fast_path_the_way_users_call_it():
    """``model.generate`` compiles the static cache's decode step itself (reduce-overhead: cudagraph
    trees): fresh caches of other lengths, a left-padded batch, beams, sampling; each run agrees with
    the same cache uncompiled, and no tensor outlives a captured step, also when the launcher's plan
    cache was filled by other work just before (its plans are pinned to the layers)."""
    import torch._dynamo

    from kvcodec.hf import CompressedCache
    from kvcodec.quant.cuda import attention

    torch._dynamo.reset()
    model = _model(8, 2, 128, layers=3)
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(21)

    def ids_of(lengths):
        T = max(lengths)
        ids = torch.zeros(len(lengths), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, T - n:] = torch.randint(2, 256, (n,), generator=gen)
            mask[i, T - n:] = 1
        return ids.cuda(), mask.cuda()

    cases = [([40], 20, {}), ([57, 57], 33, {}), ([50, 23, 37], 24, {}), ([45, 30], 16, {"num_beams": 3}),
             ([38], 18, {"do_sample": True, "top_k": 20})]
    for lengths, new, kw in cases:
        ids, mask = ids_of(lengths)
        for i in range(attention.MAX_PLANS - 2):  # other work fills the plan cache: the next plans evict it
            attention._plans.get(("other work", i), lambda: object())
        runs = []
        for compiled in (False, True):
            torch.manual_seed(5)
            cache = CompressedCache(model, **KW, max_cache_len=ids.shape[1] + new)
            runs.append(model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=new,
                                       disable_compile=not compiled, output_logits=True,
                                       return_dict_in_generate=True, **{"do_sample": False, **kw}))
        _same_run(*runs)
    attention._plans.clear()  # the stand-ins for other work's plans
    torch._dynamo.reset()


def test_a_padded_batch_matches_the_eager_compressed_cache():
    """Left padding on the static path (kernel + per-row slots) against the eager compressed cache
    (torch attention under a padding mask), teacher-forced: logits agree to bf16 rounding."""
    from kvcodec.hf import CompressedCache

    model = _model(8, 2, 128)
    gen = torch.Generator().manual_seed(9)
    lengths, T = [70, 31, 52], 70
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = torch.randint(2, 256, (n,), generator=gen)
        mask[i, T - n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    feed = torch.randint(2, 256, (3, 30), generator=gen).cuda()
    pos0 = mask.sum(-1, keepdim=True)
    out = []
    with torch.no_grad():
        for cache in (CompressedCache(model, **KW, max_cache_len=None), CompressedCache(model, **KW, max_cache_len=128)):
            m = mask
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            steps = [model(ids, attention_mask=m, position_ids=pos, **cache_kwargs(model, cache)).logits[:, -1].float()]
            for i in range(feed.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                steps.append(model(feed[:, i:i + 1], attention_mask=m, position_ids=pos0 + i,
                                   **cache_kwargs(model, cache)).logits[:, -1].float())
            out.append(torch.stack(steps))
    e, s = out
    assert float((e - s).abs().max() / e.abs().max()) < 2e-2


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
def test_the_default_cache_on_cuda_is_the_compiled_static_mode():
    """``CompressedCache(model, preset=...)`` with no size on a CUDA model: the growable static mode,
    compiled by generate; its buffers grow past the first size mid-generation and the run agrees with
    a fixed-size static cache run uncompiled."""
    import torch._dynamo

    from kvcodec.hf import CompressedCache
    from kvcodec.hf import static_cache

    torch._dynamo.reset()
    model = _model(8, 2, 128, layers=2)
    ids = torch.randint(2, 256, (2, 30), generator=torch.Generator().manual_seed(4)).cuda()
    old = static_cache.PAGE, static_cache.HEADROOM
    static_cache.PAGE, static_cache.HEADROOM = 16, 8  # grows twice in 60 tokens
    try:
        cache = CompressedCache(model, preset="3.5bit")
        assert isinstance(cache, static_cache.StaticCompressedCache) and cache.growable
        runs = [model.generate(ids, **cache_kwargs(model, c), max_new_tokens=60, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, disable_compile=not compiled)
                for c, compiled in ((CompressedCache(model, preset="3.5bit", max_cache_len=96), False), (cache, True))]
        assert cache.layers[0].max_cache_len == 96  # 30 + 8 -> 48, then 96
    finally:
        static_cache.PAGE, static_cache.HEADROOM = old
        torch._dynamo.reset()
    _same_run(*runs)


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])  # sliding layers; gpt_oss: sinks, eager attention
def test_sliding_and_sink_models_on_the_compiled_static_mode(arch):
    """Models with sliding-window layers (transformers' StaticSlidingWindowLayer beside the compressed
    full-attention layers) and sink logits, through generate's own compile on CUDA: the run agrees
    with the same cache uncompiled, and the first step with the eager compressed cache."""
    import torch._dynamo
    from model_zoo import build

    from kvcodec.hf import CompressedCache

    torch._dynamo.reset()
    model = build(arch, head_dim=64)[0].to("cuda", torch.bfloat16)
    ids = torch.randint(3, 160, (2, 48), generator=torch.Generator().manual_seed(2)).cuda()
    runs = []
    for compiled in (False, True):
        cache = CompressedCache(model, **KW, max_cache_len=96)
        runs.append(model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=24, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True, disable_compile=not compiled))
    eager = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW, max_cache_len=None)),
                           max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
    torch._dynamo.reset()
    _same_run(*runs)
    first, ref = runs[0].logits[0].float(), eager.logits[0].float()
    assert float((first - ref).abs().max()) <= 2e-2 * float(ref.abs().max())


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
@pytest.mark.parametrize("options", [
    dict(KW, key_bits=2, value_bits=3),
    dict(KW, key_bits=(1, 4), value_bits=(3, 2)),  # per-layer widths, as the presets give
    dict(preset="2.5bit", residual=16, block_size=16),
], ids=["k2v3", "per-layer", "preset"])
def test_the_configurations_users_pick_on_the_compiled_fast_path(options):
    """Asymmetric widths, per-layer widths and a preset, compiled by generate over a left-padded
    batch: the run agrees with the same cache uncompiled."""
    import torch._dynamo

    from kvcodec.hf import CompressedCache

    torch._dynamo.reset()
    model = _model(8, 2, 128, layers=2)
    model.generation_config.pad_token_id = 0
    ids = torch.randint(2, 256, (2, 45), generator=torch.Generator().manual_seed(8)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    runs = [model.generate(ids, attention_mask=mask, **cache_kwargs(model, CompressedCache(model, **options)),
                           max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           disable_compile=not compiled) for compiled in (False, True)]
    torch._dynamo.reset()
    _same_run(*runs)


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="needs torch.library.custom_op")
@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_a_growable_cache_of_a_sliding_window_model_compiles_and_grows(arch):
    """The growable static mode of a model with sliding-window layers (and sinks: gpt_oss), compiled by
    generate while its compressed layers grow twice: the run agrees with the same cache uncompiled.

    gpt_oss routes each token to 2 of 2 experts here: with 2 of 4, a router near-tie that bf16 rounding
    flips between the compiled and the eager run sends a token to another expert (a 13x-tolerance
    logit jump at one step on an H100; on the CPU in bf16 too, and none with every expert routed).
    gemma3_text's bf16 logits differ compiled vs eager by up to 2.3% of the largest with transformers'
    own StaticCache (CPU, 25 steps; 2.3% at step 4 with this cache on an H100): 5% here."""
    import torch._dynamo
    from model_zoo import build

    from kvcodec.hf import static_cache
    from kvcodec.hf.static_cache import StaticCompressedCache

    torch._dynamo.reset()
    routing = dict(num_local_experts=2, num_experts_per_tok=2) if arch == "gpt_oss" else {}
    model = build(arch, head_dim=64, **routing)[0].to("cuda", torch.bfloat16)
    ids = torch.randint(3, 160, (2, 30), generator=torch.Generator().manual_seed(6)).cuda()
    old = static_cache.PAGE, static_cache.HEADROOM
    static_cache.PAGE, static_cache.HEADROOM = 16, 8  # 30 + 8 -> 48, then 96
    try:
        caches = [StaticCompressedCache(model, **KW, max_cache_len=None) for _ in range(2)]
        runs = [model.generate(ids, **cache_kwargs(model, c), max_new_tokens=60, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, disable_compile=not compiled)
                for c, compiled in zip(caches, (False, True))]
        assert caches[1].first_layer.max_cache_len == 96
    finally:
        static_cache.PAGE, static_cache.HEADROOM = old
        torch._dynamo.reset()
    _same_run(*runs, rtol=5e-2 if arch == "gemma3_text" else 2e-2)
