"""CompressedCache on every decoder architecture of the installed transformers (tests/model_zoo.py).

Per architecture, on a tiny random model with its distinctive features (sliding windows shorter than the
prompt, sinks, soft-capping, MLA head dims, hybrid layer stacks, fused QKV projections):

* lossless gives DynamicCache's greedy tokens and per-step logits;
* TurboQuant 4/4 runs, holds fewer bytes than DynamicCache, and its kvcodec attention on the compressed
  form matches the same compressed cache read densely (decoded K/V through the model's own attention);
* a left-padded batch, beam search, and a cache reused to continue;
* the model gives its own outputs again afterwards: a cache never leaves it changed.

A model with no attention K/V is refused when the cache is built.
"""

import pytest
import torch
from model_zoo import VOCAB, build, supports_dynamic_cache, zoo
from transformers import DynamicCache

from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache

PROMPT, NEW = 40, 6
ENTRIES = [e for _, e in zoo() if e.available() and e.attention_kv]
PARAMS = [pytest.param(e.name, marks=pytest.mark.skip(reason=e.skip) if e.skip else ()) for e in ENTRIES]


def _ids(batch=1, length=PROMPT, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, **kw):
    kw.setdefault("max_new_tokens", NEW)
    out = model.generate(ids, **cache_kwargs(model, cache), do_sample=False, return_dict_in_generate=True,
                         output_scores=True, **kw)
    return out.sequences, torch.stack(out.scores)


_MODELS = {}


def _model(name):
    if name not in _MODELS:
        _MODELS.clear()  # one model alive at a time
        _MODELS[name] = build(name)[0]
    if not supports_dynamic_cache(_MODELS[name]):  # refused when built: tested below
        pytest.skip(f"{type(_MODELS[name]).__name__} runs only on a cache class of its own")
    return _MODELS[name]


@pytest.mark.parametrize("name", PARAMS)
def test_lossless_equals_dynamic_cache_and_leaves_the_model_as_it_was(name):
    model = _model(name)
    ids = _ids()
    impl = model.config._attn_implementation
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    ref_tokens, ref_scores = _generate(model, ids, DynamicCache(config=model.config))
    tokens, scores = _generate(model, ids, CompressedCache(model, method="lossless"))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=0)
    # nothing of the cache is left on the model
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, plain, rtol=0, atol=0)
    again_tokens, _ = _generate(model, ids, DynamicCache(config=model.config))
    assert torch.equal(again_tokens, ref_tokens)


@pytest.mark.parametrize("name", PARAMS)
def test_turboquant_compresses_and_attends_on_the_compressed_form(name):
    model = _model(name)
    ids = _ids()
    ref = DynamicCache(config=model.config)
    _generate(model, ids, ref)
    kw = dict(method="turboquant", key_bits=4, value_bits=4, residual=8, block_size=8)
    cache = CompressedCache(model, **kw)
    tokens, scores = _generate(model, ids, cache)
    assert torch.isfinite(scores).all()
    dynamic_bytes = sum(t.numel() * t.element_size() for layer in ref.layers
                        for t in vars(layer).values() if isinstance(t, torch.Tensor))
    if cache.compressed_layers():
        assert 0 < cache.nbytes() < dynamic_bytes
        assert any(row.get("compressed_keys", 0) > 0 for row in cache.memory_report())
    else:  # every layer slides over a window too short to compress: transformers' exact layers
        assert cache.nbytes() == dynamic_bytes
    # the same compressed state read densely: a cache built from the config alone decodes the history
    # and hands it to the model's own attention; after the prompt, the next step attends compressed blocks
    bound, dense = CompressedCache(model, **kw), CompressedCache(model.config, **kw)
    step = _ids(1, 1, seed=5)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, bound), use_cache=True)
        model(ids, **cache_kwargs(model, dense), use_cache=True)
        a = model(step, **cache_kwargs(model, bound), use_cache=True).logits
        b = model(step, **cache_kwargs(model, dense), use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


# one architecture per feature the generate paths could trip on (the full matrix runs above)
FLOWS = [n for n in ("llama", "mistral", "gemma2", "gemma3_text", "gpt_oss", "phi3", "gpt2", "falcon",
                     "deepseek_v3", "qwen3_next", "jamba", "falcon_h1", "gemma3n_text", "llama4_text", "bloom")
         if n in {e.name for e in ENTRIES if not e.skip}]


@pytest.mark.parametrize("name", FLOWS)
def test_padded_batch_beams_and_reuse(name):
    model = _model(name)
    ids = _ids(3, PROMPT)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 11)):  # left padding of three lengths
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    ref, _ = _generate(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    got, _ = _generate(model, ids, CompressedCache(model, method="lossless"), attention_mask=mask)
    assert torch.equal(got, ref)
    one = _ids()
    ref_b = model.generate(one, **cache_kwargs(model, DynamicCache(config=model.config)), num_beams=2,
                           max_new_tokens=4, do_sample=False)
    got_b = model.generate(one, **cache_kwargs(model, CompressedCache(model, method="lossless")), num_beams=2,
                           max_new_tokens=4, do_sample=False)
    assert torch.equal(got_b, ref_b)
    # a cache reused to continue a conversation: the second turn sees the first
    cache = CompressedCache(model, method="lossless")
    first, _ = _generate(model, one, cache)
    second, _ = _generate(model, torch.cat([first, _ids(1, 5, seed=3)], dim=1), cache)
    dyn = DynamicCache(config=model.config)
    first_d, _ = _generate(model, one, dyn)
    second_d, _ = _generate(model, torch.cat([first_d, _ids(1, 5, seed=3)], dim=1), dyn)
    assert torch.equal(second, second_d)


def test_models_without_attention_kv_are_refused_when_the_cache_is_built():
    for _, e in zoo():
        if e.available() and not e.attention_kv:
            model = build(e.name)[0]
            with pytest.raises(ValueError, match="attention|cache class of its own"):
                CompressedCache(model, method="turboquant")


def test_models_with_a_cache_class_of_their_own_are_refused_when_the_cache_is_built():
    for _, e in zoo():
        if e.available() and e.attention_kv and not e.skip:
            model = build(e.name)[0]
            if not supports_dynamic_cache(model):
                with pytest.raises(ValueError, match="cache class of its own"):
                    CompressedCache(model, method="turboquant")


@pytest.mark.parametrize("method", ["lossless", "turboquant"])
def test_compressed_sliding_layers_keep_their_window(method):
    """Mistral with a 48-token window (> residual + 2 * block_size): every layer is a compressed sliding
    layer; lossless gives DynamicCache's tokens, and the layers hold less than one block beyond the window."""
    model = build("mistral", sliding_window=48)[0]
    kw = dict(method=method, residual=8, block_size=8)
    ids = _ids(1, 100)
    ref, _ = _generate(model, ids, DynamicCache(config=model.config), max_new_tokens=20)
    cache = CompressedCache(model, **kw)
    got, scores = _generate(model, ids, cache, max_new_tokens=20)
    assert len(cache.compressed_layers()) == len(cache.layers)
    assert all(layer.is_sliding for layer in cache.layers)
    if method == "lossless":
        assert torch.equal(got, ref)
    else:
        assert torch.isfinite(scores).all()
    for row, layer in zip(cache.memory_report(), cache.layers):
        assert row["tokens"] < 48 - 1 + 8
        assert layer.get_seq_length() == 120 - 1
    assert cache.get_seq_length() == 119


def test_static_mode_refuses_what_it_cannot_serve_when_built():
    model = build("lfm2")[0]
    with pytest.raises(ValueError, match="full-attention and sliding-window layers only"):
        CompressedCache(model, method="turboquant", max_cache_len=128)
    model = build("mistral")[0]  # every layer a sliding window: nothing to compress
    with pytest.raises(ValueError, match="no full-attention layer"):
        CompressedCache(model, method="turboquant", max_cache_len=128)
    model = build("gemma2")[0]
    with pytest.raises(ValueError, match="soft-caps"):
        CompressedCache(model, method="turboquant", max_cache_len=128)
    model = build("llama")[0]
    CompressedCache(model, method="turboquant", max_cache_len=128)  # accepted


@pytest.mark.parametrize("name", PARAMS)
def test_static_mode_serves_the_eager_tokens_or_refuses_when_built(name):
    """The static mode (the default on CUDA, run here on the CPU through the kernels' reference) either
    refuses the architecture when the cache is built, naming why (sliding or hybrid layers, MLA, sinks
    or soft-capping, attention outside transformers' interface, K/V transformed after the cache), or
    gives the eager cache's greedy tokens and per-step logits."""
    from kvcodec.hf.static_cache import StaticCompressedCache

    model = _model(name)
    kw = dict(method="turboquant", key_bits=4, value_bits=4, residual=4, block_size=4)
    try:
        static = StaticCompressedCache(model, **kw, max_cache_len=64)
    except ValueError as exc:
        assert "static mode" in str(exc)
        return
    ids = _ids()
    with torch.no_grad():
        eager_tokens, eager_scores = _generate(model, ids, CompressedCache(model, **kw, max_cache_len=None),
                                               max_new_tokens=4, disable_compile=True)
        tokens, scores = _generate(model, ids, static, max_new_tokens=4, disable_compile=True)
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(scores, eager_scores, rtol=0, atol=1e-5)
