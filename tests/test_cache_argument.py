"""kvcodec's own forwards pass a model's cache by the name its forward declares (``cache`` from
transformers 5.24, ``past_key_values`` before; the old name warns from 5.24 and is removed in 5.40), so
calibration and sensitivity run without transformers' deprecation warnings on every version allowed."""

import inspect
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

from kvcodec.cache_argument import NEW, OLD, cache_keyword, cache_kwargs, output_cache


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=97)
    return transformers.LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_the_keyword_is_the_one_the_forward_takes_and_the_output_holds_the_cache():
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")  # the old name's deprecation
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        again = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=2,
                               do_sample=False, return_dict_in_generate=True)
    assert output_cache(out) is cache and cache.get_seq_length() == 6
    assert output_cache(again).get_seq_length() == 7  # 6 prompt tokens + the first new token's K/V


def test_a_forward_that_names_neither_gets_the_name_transformers_decoders_use():
    class Wrapped(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return kwargs

    llama_word = cache_keyword(tiny_llama())
    assert cache_keyword(Wrapped()) == llama_word
    assert llama_word == (NEW if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24) else OLD)


@pytest.mark.filterwarnings("error:.*past_key_values.*")
@torch.no_grad()
def test_calibration_and_sensitivity_forwards_raise_no_deprecation():
    from kvcodec.hf.calibrate import capture_prefill, layer_sensitivity
    from kvcodec.transform import sensitivity

    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    kv, _ = capture_prefill(model, ids)
    assert len(kv) == 2 and kv[0][0].shape[-2] == 40
    found = layer_sensitivity(model, ids, prefix=32, levels=(2, 4), sink=1, residual=4)
    assert len(found) and all(v == v for v in found.values())
    keys, values = sensitivity._prefix_kv(model, ids[:, :32])
    assert keys.shape[-2] == 32 and values.shape == keys.shape


def test_the_keyword_is_remembered_per_forward_function_not_per_call_site():
    """cache_keyword memoizes by the forward's function: each class, and an instance whose forward was
    replaced (as accelerate's hooks do), keeps its own keyword."""
    import functools

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return cache

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return past_key_values

    def old_style(module, input_ids, past_key_values=None):
        return past_key_values

    replaced = New()
    replaced.forward = functools.partial(old_style, replaced)
    for _ in range(2):  # the second round reads the memo
        assert cache_keyword(New()) == NEW and cache_keyword(Old()) == OLD and cache_keyword(replaced) == OLD
        assert cache_kwargs(New(), 7) == {NEW: 7}
