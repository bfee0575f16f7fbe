"""``model.generate`` with the static compressed cache, the way users call it, on CPU.

Every flow runs twice, once with the eager ``CompressedCache`` and once with the static one
(``max_cache_len=``), and must give the same tokens: fresh caches of other lengths, left-padded
batches, beams, sampling, a cache reused to continue a conversation, and generate's own compile
route (``compile_config``; on CPU through dynamo with ``fullgraph=True``, so a graph break or an
untraceable step fails here before it fails on a GPU). The kernels are the custom ops' CPU
reference, so this is the route ``tests/test_hf_static_gpu.py`` runs on CUDA.
"""

import pytest
import torch

from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache
from kvcodec.quant.cuda import ops

from test_hf_cache import VOCAB, tiny_model

KW = dict(method="turboquant", key_bits=4, value_bits=3, residual=4, block_size=4)


@pytest.fixture(scope="module")
def model():
    return tiny_model(heads=4, kv_heads=2, head_dim=32, layers=2)


def _ids(batch, length, seed):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_padded(lengths, seed):
    """A left-padded batch (ids, attention_mask) of rows of the given lengths."""
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = _ids(1, n, seed + i)[0]
        mask[i, T - n:] = 1
    return ids, mask


def _generate(model, ids, static, new, options=KW, **kw):
    size = ids.shape[1] + new if static else None
    cache = CompressedCache(model, **options, max_cache_len=size)
    return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new, disable_compile=True, **kw)


@pytest.mark.parametrize("options", [
    dict(KW, key_bits=2, value_bits=3),
    dict(KW, key_bits=(1, 4), value_bits=(3, 2)),  # per-layer widths, as the presets give
    dict(KW, key_bits=3, value_bits=3, key_precondition="none", value_precondition="center"),
    dict(preset="2.5bit", residual=4, block_size=4),
], ids=["k2v3", "per-layer", "center-values", "preset"])
def test_the_configurations_users_pick_give_the_eager_tokens(model, options):
    ids, mask = _left_padded([11, 7], 5)
    eager = _generate(model, ids, False, 10, options, attention_mask=mask, do_sample=False)
    static = _generate(model, ids, True, 10, options, attention_mask=mask, do_sample=False)
    assert torch.equal(static, eager)


def test_fresh_caches_of_other_lengths_give_the_eager_tokens(model):
    for length, new in ((9, 8), (23, 13), (6, 17)):  # compaction inside the prompt, during decode, both
        ids = _ids(2, length, length)
        eager = _generate(model, ids, False, new, do_sample=False)
        static = _generate(model, ids, True, new, do_sample=False)
        assert torch.equal(static, eager), (length, new)


def test_left_padded_batch_gives_the_eager_tokens(model):
    ids, mask = _left_padded([14, 5, 9], 3)  # pads inside the sink, the compressed part and the window
    eager = _generate(model, ids, False, 12, attention_mask=mask, do_sample=False)
    static = _generate(model, ids, True, 12, attention_mask=mask, do_sample=False)
    assert torch.equal(static, eager)


def test_padding_is_masked_not_attended(model):
    """A row padded in a batch gives the tokens it gives alone, up to what padding changes in the
    compressed cache (the preconditioner is fitted over the batch): with lossless-width keys the
    shortest row must match itself alone."""
    kw = dict(KW, key_bits=4, value_bits=4, residual=64, block_size=16)  # nothing is compressed: exact
    ids, mask = _left_padded([12, 5], 8)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, disable_compile=True,
                           **cache_kwargs(model, CompressedCache(model, **kw, max_cache_len=40)))
    alone = model.generate(ids[1:, -5:], max_new_tokens=6, do_sample=False, disable_compile=True,
                           **cache_kwargs(model, CompressedCache(model, **kw, max_cache_len=40)))
    assert torch.equal(batch[1, -6:], alone[0, -6:])


def test_beam_search_gives_the_eager_tokens(model):
    ids, mask = _left_padded([10, 7], 5)
    eager = _generate(model, ids, False, 9, attention_mask=mask, num_beams=3, do_sample=False)
    static = _generate(model, ids, True, 9, attention_mask=mask, num_beams=3, do_sample=False)
    assert torch.equal(static, eager)


def test_sampling_gives_the_eager_tokens(model):
    ids = _ids(2, 11, 4)
    out = []
    for static in (False, True):
        torch.manual_seed(123)
        out.append(_generate(model, ids, static, 10, do_sample=True, top_k=20, temperature=0.9))
    assert torch.equal(out[0], out[1])


def test_a_reused_cache_continues_the_conversation(model):
    """Turn 1, then turn 2 appended to turn 1's output with the same cache object: as eager."""
    turn2 = _ids(1, 5, 9)
    runs = []
    for static in (False, True):
        cache = CompressedCache(model, **KW, max_cache_len=64) if static else CompressedCache(model, **KW)
        first = model.generate(_ids(1, 10, 7), **cache_kwargs(model, cache), max_new_tokens=7, do_sample=False,
                               disable_compile=True)
        ids = torch.cat([first, turn2], dim=1)
        runs.append(model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False,
                                   disable_compile=True))
    assert torch.equal(runs[1], runs[0])


@pytest.mark.skipif(not ops.HAVE_CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4")
def test_generate_compile_route_traces_the_whole_step(model):
    """generate's own compile (``compile_config``) over the static cache, with ``fullgraph=True``:
    two calls on fresh caches of other lengths, a padded batch among them, the eager cache's tokens."""
    import torch._dynamo
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # generate compiles only on accelerators unless told
    torch._dynamo.reset()
    try:
        for ids, mask, new in ((_ids(1, 9, 1), None, 10), (*_left_padded([13, 6], 2), 7)):
            kw = dict(max_new_tokens=new, do_sample=False, attention_mask=mask)
            eager = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW)), disable_compile=True, **kw)
            cache = CompressedCache(model, **KW, max_cache_len=ids.shape[1] + new)
            compiled = model.generate(ids, **cache_kwargs(model, cache), compile_config=config, **kw)
            assert torch.equal(compiled, eager)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled route ran
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("first_len,on_append", [(5, False), (5, True), (14, True)])
def test_a_long_continuation_stores_what_eager_stores(model, monkeypatch, first_len, on_append):
    """More than block_size new tokens in one forward after the prefill (the host-side path): same
    logits as eager, and afterwards the same compressed bytes; before the preconditioner's fit (a
    first turn too short to compact) and after it, on the CPU's block path and the CUDA path's
    quantize-on-arrival (forced here)."""
    from kvcodec.hf.static_cache import StaticCompressedLayer
    from test_hf_static import _assert_same_bytes

    if on_append:
        monkeypatch.setattr(StaticCompressedLayer, "on_append", property(lambda self: not self.device_fit))
    first, second, third = _ids(2, first_len, 1), _ids(2, 11, 2), _ids(2, 1, 3)
    logits = []
    with torch.no_grad():
        caches = (CompressedCache(model, **KW), CompressedCache(model, **KW, max_cache_len=64))
        for cache in caches:
            out = [model(ids, **cache_kwargs(model, cache)).logits[:, -1] for ids in (first, second, third)]
            logits.append(torch.stack(out))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    _assert_same_bytes(*caches)


@pytest.fixture
def small_pages(monkeypatch):
    """Growable caches with 8-token pages and 4 tokens of headroom: short generations grow often."""
    from kvcodec.hf import static_cache

    monkeypatch.setattr(static_cache, "PAGE", 8)
    monkeypatch.setattr(static_cache, "HEADROOM", 4)


def test_grown_capacity_doubles_from_a_page_rounded_first_size():
    from kvcodec.hf.static_cache import grown_capacity

    assert grown_capacity(100) == 4096 and grown_capacity(32768) == 36864 and grown_capacity(32769) == 40960
    assert grown_capacity(4097, 4096) == 8192 and grown_capacity(20000, 4096) == 32768
    assert grown_capacity(10, 4096) == 4096


def test_a_growable_cache_gives_the_eager_tokens_across_growths(model, small_pages):
    """``max_cache_len=None``: the buffers grow while generate runs (fresh caches, padded, beams),
    the tokens stay the eager cache's."""
    from kvcodec.hf.static_cache import StaticCompressedCache

    ids, mask = _left_padded([9, 4], 6)
    for kw in ({}, {"num_beams": 2}):
        eager = _generate(model, ids, False, 30, attention_mask=mask, do_sample=False, **kw)
        cache = StaticCompressedCache(model, **KW, max_cache_len=None)
        grown = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=30,
                               do_sample=False, disable_compile=True, **kw)
        assert torch.equal(grown, eager)
        assert cache.layers[0].max_cache_len == 64  # 9 + 4 -> 16, then 32, then 64 for 39 tokens


def test_a_growable_cache_compiles_with_a_bounded_number_of_graphs(model, small_pages):
    """generate's compile route over a growable cache (the room check is a graph break before the
    step): the eager tokens, and a bounded number of compiled graphs however many tokens it makes."""
    import torch._dynamo
    from transformers import CompileConfig

    from kvcodec.hf.static_cache import StaticCompressedCache

    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        ids = _ids(1, 7, 2)
        eager = _generate(model, ids, False, 40, do_sample=False)
        cache = StaticCompressedCache(model, **KW, max_cache_len=None)
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=40, do_sample=False,
                             compile_config=config)
        assert torch.equal(out, eager)
        assert cache.layers[0].max_cache_len == 64  # grew 16 -> 32 -> 64
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 8
    finally:
        torch._dynamo.reset()


def test_the_default_is_the_growable_static_mode_on_cuda_where_it_holds(model, monkeypatch):
    """``CompressedCache(model, ...)``: eager on the CPU; with a CUDA model (stood in for here) the
    growable static mode, except for what that mode does not hold (KIVI, attention options)."""
    from kvcodec.hf import cache as cache_module
    from kvcodec.hf.attention import AttentionOptions
    from kvcodec.hf.static_cache import StaticCompressedCache

    assert type(CompressedCache(model, **KW)) is CompressedCache
    monkeypatch.setattr(cache_module, "_on_cuda_with_kernels", lambda m: True)
    fast = CompressedCache(model, **KW)
    assert type(fast) is StaticCompressedCache and fast.growable
    assert type(CompressedCache(model, preset="3.5bit")) is StaticCompressedCache
    assert type(CompressedCache(model, method="kivi", block_size=32)) is CompressedCache
    assert type(CompressedCache(model, **KW, attention=AttentionOptions())) is CompressedCache
    assert type(CompressedCache(model, **KW, max_cache_len=None)) is CompressedCache
    assert type(CompressedCache(model.config, **KW)) is CompressedCache
    from model_zoo import build

    sliding = build("gemma3_text")[0]  # sliding-window layers: static only when asked for
    assert type(CompressedCache(sliding, **KW)) is CompressedCache
    assert type(CompressedCache(sliding, **KW, max_cache_len=64)) is StaticCompressedCache


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3", "gpt_oss"])  # gpt_oss: sinks, eager attention
def test_sliding_window_models_give_the_eager_tokens(arch):
    """Full-attention layers compressed, sliding-window layers (8-token windows here) held exact by
    transformers' StaticSlidingWindowLayer: a left-padded batch, beams and a continued conversation
    give the eager cache's tokens (whose sliding layers are transformers' exact ones too)."""
    from model_zoo import build

    from kvcodec.hf.static_cache import StaticCompressedCache

    model = build(arch)[0]
    cache = StaticCompressedCache(model, **KW, max_cache_len=96)
    assert {type(layer).__name__ for layer in cache.layers} == {"StaticCompressedLayer", "StaticSlidingWindowLayer"}
    ids, mask = _left_padded([30, 17], 4)
    for kw in ({}, {"num_beams": 2}):
        eager = _generate(model, ids, False, 12, attention_mask=mask, do_sample=False, **kw)
        static = _generate(model, ids, True, 12, attention_mask=mask, do_sample=False, **kw)
        assert torch.equal(static, eager), kw
    runs = []
    for static in (False, True):
        cache = CompressedCache(model, **KW, max_cache_len=96) if static else CompressedCache(model, **KW)
        first = model.generate(_ids(1, 20, 7), **cache_kwargs(model, cache), max_new_tokens=6, do_sample=False,
                               disable_compile=True)
        runs.append(model.generate(torch.cat([first, _ids(1, 9, 8)], dim=1), **cache_kwargs(model, cache),
                                   max_new_tokens=6, do_sample=False, disable_compile=True))
    assert torch.equal(runs[1], runs[0])


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_a_growable_cache_of_a_sliding_window_model_gives_the_eager_tokens(arch, small_pages):
    """Growable (``max_cache_len=None``): the compressed layers grow while generate runs, the
    sliding-window layers hold their window from the start and never grow; a left-padded batch and
    beams give the eager cache's tokens."""
    from model_zoo import build

    from kvcodec.hf.static_cache import StaticCompressedCache

    model = build(arch)[0]
    ids, mask = _left_padded([21, 13], 6)
    for kw in ({}, {"num_beams": 2}):
        cache = StaticCompressedCache(model, **KW, max_cache_len=None)
        static = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=30,
                                do_sample=False, disable_compile=True, **kw)
        eager = _generate(model, ids, False, 30, attention_mask=mask, do_sample=False, **kw)
        assert torch.equal(static, eager), kw
        assert cache.first_layer.max_cache_len >= 51 > 32  # grew past its first size (21 + 4 -> 32)


def test_prompt_lookup_decoding_gives_the_eager_tokens(model):
    """Assisted generation (prompt lookup): candidates the model rejects are cropped from the cache
    (several tokens per forward, then crop); the static cache gives the eager cache's tokens."""
    ids = torch.tensor([[5, 6, 7, 8, 9] * 3 + [10, 11]])
    kw = dict(max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3, disable_compile=True)
    eager = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW)), **kw)
    static = model.generate(ids, **cache_kwargs(model, CompressedCache(model, **KW, max_cache_len=64)), **kw)
    assert torch.equal(static, eager)


def test_a_long_continuation_after_the_preconditioner_was_fitted_in_decode(model):
    """A prompt too short to compact, decode steps that fit the key preconditioner on the device, then
    more than block_size tokens at once: attended with the fitted constants (they were stale: 6e-4)."""
    with torch.no_grad():
        runs = []
        for cache in (CompressedCache(model, **KW), CompressedCache(model, **KW, max_cache_len=64)):
            out = [model(_ids(2, 5, 1), **cache_kwargs(model, cache)).logits[:, -1]]
            out += [model(_ids(2, 1, 10 + i), **cache_kwargs(model, cache)).logits[:, -1] for i in range(9)]
            out += [model(ids, **cache_kwargs(model, cache)).logits[:, -1] for ids in (_ids(2, 9, 3), _ids(2, 1, 4))]
            runs.append(torch.stack(out))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=1e-5)
