"""kvcodec.recording.record_qkv on tiny random Hugging Face decoders (Llama, Qwen2): the keys and values
it records are what a cache receives, the queries are post-RoPE, and the model computes what it does
with SDPA."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvcodec.cache_argument import cache_kwargs  # noqa: E402
from kvcodec.recording import record_qkv  # noqa: E402


def _model(arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**common)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_recorded_kv_is_what_the_cache_holds_and_logits_are_unchanged(arch):
    model = _model(arch)
    ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        want = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
    logits = []
    hook = model.register_forward_hook(lambda mod, args, out: logits.append(out.logits))
    try:
        rec = record_qkv(model, ids, layers=[0, 2])
    finally:
        hook.remove()
    assert model.config._attn_implementation == "sdpa"  # restored after recording
    assert torch.equal(logits[0], want)  # the recorder runs transformers' SDPA unchanged
    assert sorted(rec["k"]) == sorted(rec["v"]) == sorted(rec["q"]) == [0, 2]
    for layer in (0, 2):
        assert torch.equal(rec["k"][layer], cache.layers[layer].keys)
        assert torch.equal(rec["v"][layer], cache.layers[layer].values)
        assert tuple(rec["q"][layer].shape) == (1, 4, 21, 16)


def test_recorded_queries_are_post_rope():
    """Layer 0's query is q_proj of the normed embedding with the model's rotary embedding applied."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _model("llama")
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    rec = record_qkv(model, ids, layers=[0])
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        q = attn.q_proj(x).view(1, 9, 4, 16).transpose(1, 2)
        k = attn.k_proj(x).view(1, 9, 2, 16).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(9)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rec["q"][0], q)
    torch.testing.assert_close(rec["k"][0], k)
    assert not torch.allclose(rec["q"][0], attn.q_proj(x).view(1, 9, 4, 16).transpose(1, 2))  # RoPE did rotate


def test_bad_arguments_are_refused_and_the_model_is_left_as_it_was():
    model = _model("llama")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="layers must lie in"):
        record_qkv(model, ids, layers=[3])
    with pytest.raises(ValueError, match=r"shaped \[1, T\]"):
        record_qkv(model, torch.zeros(2, 4, dtype=torch.long))
    assert model.config._attn_implementation == "sdpa"
