"""CompressedCache semantics on tiny random Llama / Qwen2 decoders (GQA 1, 3, 4, 8; head_dim 64, 128).

The "none" method with ``decoded_attention`` switched off runs the real compressed-attention path
(blocks, sink, window, online softmax) on exact blocks, so every generate mode must reproduce
DynamicCache up to float rounding.
"""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache
from kvcodec.hf.encodings import ExactEncoding

VOCAB = 97


def tiny_model(arch="llama", heads=4, kv_heads=2, head_dim=64, layers=2, seed=0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=heads * 8, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=None, bos_token_id=1,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompt(batch=1, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=g)


@pytest.fixture
def compressed_path(monkeypatch):
    """Make the exact encoding go through attend_store (scores / weighted_sum per block)."""
    monkeypatch.setattr(ExactEncoding, "decoded_attention", False)


SHAPES = [("llama", 4, 4, 64), ("llama", 9, 3, 64), ("qwen2", 8, 2, 128), ("qwen2", 8, 1, 64)]


def _gen(model, ids, cache, **kw):
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("do_sample", False)
    return model.generate(ids, **cache_kwargs(model, cache), return_dict_in_generate=True, output_scores=True, **kw)


def _cache(model, **kw):
    kw.setdefault("method", "none")
    kw.setdefault("residual", 4)
    kw.setdefault("block_size", 3)
    return CompressedCache(model, **kw)


@pytest.mark.parametrize("arch,heads,kv,hd", SHAPES)
def test_greedy_matches_dynamic_cache(compressed_path, arch, heads, kv, hd):
    model = tiny_model(arch, heads, kv, hd)
    ids = prompt(2, 10)
    ref = _gen(model, ids, DynamicCache(config=model.config))
    cache = _cache(model, sink=2)
    out = _gen(model, ids, cache)
    assert torch.equal(ref.sequences, out.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 10 + 12 - 1
    assert any(layer.store.blocks for layer in cache.layers)  # compressed blocks were attended


def test_sampling_matches_dynamic_cache(compressed_path):
    model = tiny_model()
    ids = prompt(1, 8)
    torch.manual_seed(5)
    ref = _gen(model, ids, DynamicCache(config=model.config), do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(5)
    out = _gen(model, ids, _cache(model), do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(ref.sequences, out.sequences)


def test_beam_search_matches_dynamic_cache(compressed_path):
    model = tiny_model("llama", 9, 3, 64)
    ids = prompt(2, 9, seed=3)
    ref = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), num_beams=3, max_new_tokens=10,
                         do_sample=False, num_return_sequences=2)
    out = model.generate(ids, **cache_kwargs(model, _cache(model)), num_beams=3, max_new_tokens=10, do_sample=False,
                         num_return_sequences=2)
    assert torch.equal(ref, out)


def test_padded_batch_matches_dynamic_cache(compressed_path):
    model = tiny_model("qwen2", 8, 2, 64)
    ids = prompt(3, 11, seed=4)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 7]):  # left padding
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    ref = _gen(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    out = _gen(model, ids, _cache(model), attention_mask=mask)
    assert torch.equal(ref.sequences, out.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-4, rtol=1e-4)
    # each padded row equals the same prompt run alone, unpadded
    alone = _gen(model, ids[2:, 7:], DynamicCache(config=model.config))
    assert torch.equal(alone.sequences[0, 4:], out.sequences[2, 11:])


@torch.no_grad()
def _logits(model, ids, cache):
    return model(ids, **cache_kwargs(model, cache), use_cache=True).logits


@pytest.mark.parametrize("crop_arg", [-7, 16])
def test_crop_then_continue_matches_fresh_cache(compressed_path, crop_arg):
    model = tiny_model("llama", 4, 2, 64)
    ids = prompt(1, 23, seed=6)
    cache = _cache(model, sink=2)
    _logits(model, ids, cache)
    for t in range(3):  # a few decode steps so blocks and window both exist
        _logits(model, prompt(1, 1, seed=10 + t), cache)
    full = torch.cat([ids] + [prompt(1, 1, seed=10 + t) for t in range(3)], dim=1)
    cache.crop(crop_arg)
    keep = 26 + crop_arg if crop_arg < 0 else crop_arg
    assert cache.get_seq_length() == keep
    nxt = prompt(1, 2, seed=20)
    got = _logits(model, nxt, cache)
    fresh = DynamicCache(config=model.config)
    _logits(model, full[:, :keep], fresh)
    torch.testing.assert_close(got, _logits(model, nxt, fresh), atol=1e-4, rtol=1e-4)


def test_crop_into_compressed_blocks_and_sink(compressed_path):
    model = tiny_model()
    cache = _cache(model, sink=3, residual=2, block_size=4)
    _logits(model, prompt(1, 20), cache)
    store = cache.layers[0].store
    assert store.sink_len == 3 and store.compressed_len == 12 and store.window_len == 5
    cache.crop(-10)  # through the window and into the compressed tokens
    assert cache.get_seq_length() == 10 and store.compressed_len == 7 and store.window_len == 0
    cache.crop(2)  # inside the sink
    assert cache.get_seq_length() == 2 and not store.blocks and store.window_len == 0
    cache.crop(0)
    assert cache.get_seq_length() == 2


def test_batch_repeat_and_select_follow_dynamic_cache(compressed_path):
    model = tiny_model()
    ids = prompt(2, 13)
    ref, cache = DynamicCache(config=model.config), _cache(model)
    _logits(model, ids, ref)
    _logits(model, ids, cache)
    for c in (ref, cache):
        c.batch_repeat_interleave(2)
        c.batch_select_indices(torch.tensor([3, 0, 2]))
    nxt = prompt(3, 1, seed=9)
    torch.testing.assert_close(_logits(model, nxt, cache), _logits(model, nxt, ref), atol=1e-4, rtol=1e-4)
    cache.reorder_cache(torch.tensor([2, 2, 1]))
    ref.reorder_cache(torch.tensor([2, 2, 1]))
    torch.testing.assert_close(_logits(model, nxt, cache), _logits(model, nxt, ref), atol=1e-4, rtol=1e-4)


def test_reset_empties_every_layer():
    model = tiny_model()
    cache = _cache(model)
    _logits(model, prompt(1, 9), cache)
    assert cache.nbytes() > 0
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    _logits(model, prompt(1, 4), cache)
    assert cache.get_seq_length() == 4


def test_nbytes_is_the_sum_of_held_tensors():
    model = tiny_model("llama", 9, 3, 64)
    cache = _cache(model, sink=2, residual=5, block_size=4)
    _logits(model, prompt(2, 30), cache)
    held = 0
    for layer in cache.layers:
        st = layer.store
        tensors = [st.sink_k, st.sink_v, st.win_k, st.win_v] + [t for b in st.blocks for t in (b.key, b.value)]
        held += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    assert cache.nbytes() == held == 2 * 2 * 3 * 30 * 64 * 4 * 2  # layers * batch * heads * tokens * D * fp32 * (K,V)
    rep = cache.memory_report()
    assert len(rep) == 2 and rep[0]["tokens"] == 30 and rep[0]["sink"] == 2 * 2 * 3 * 2 * 64 * 4


def test_without_kvcodec_attention_falls_back_to_dense():
    model = tiny_model()
    model.set_attn_implementation("sdpa")
    ids = prompt(1, 10)
    ref = _gen(model, ids, DynamicCache(config=model.config))
    out = _gen(model, ids, CompressedCache(model.config, method="none", residual=3, block_size=2))
    assert torch.equal(ref.sequences, out.sequences)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="zip"), "unknown method"),
        (dict(method="none", key_bits=0), "key_bits"),
        (dict(method="none", key_bits=4, value_bits=9), "value_bits"),
        (dict(method="none", key_bits=2.5), "key_bits"),
        (dict(method="none", residual=-1), "residual"),
        (dict(method="none", block_size=0), "block_size"),
        (dict(method="none", key_mode="l2"), "key_mode"),
        (dict(method="none", outliers=64), "outliers"),
    ],
)
def test_bad_configuration_raises_at_construction(kwargs, match):
    config = tiny_model().config
    with pytest.raises(ValueError, match=match):
        CompressedCache(config, **kwargs)


def test_sliding_window_layers_follow_the_window_rule():
    """A window longer than residual + 2 * block_size is a compressed sliding layer; a shorter one stays
    transformers' exact window layer (tests/test_hf_models.py runs both through generate)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from kvcodec.hf.layer import SlidingCompressedLayer

    config = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16, max_window_layers=0,
                         hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    short = CompressedCache(config, method="none", residual=4, block_size=8)
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in short.layers)
    long = CompressedCache(config, method="none", residual=4, block_size=4)
    assert all(isinstance(layer, SlidingCompressedLayer) and layer.sliding_window == 16 for layer in long.layers)
