"""The README's tour runs as written, and what it says about the window is what the cache does."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcodec.data import load_kv_sample
from kvcodec.hf import CompressedCache

README = Path(__file__).resolve().parents[1] / "README.md"


def _tiny_model(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("prompt, compressed", [(256, False), (257, True)])
def test_a_prompt_shorter_than_the_window_compresses_nothing(prompt, compressed):
    """README: nothing is compressed until the cache holds sink + residual + block_size tokens
    (1 + 128 + 128 = 257 with the defaults), and memory_report shows it."""
    model = _tiny_model(layers=1)
    cache = CompressedCache(model, method="turboquant", key_bits=4)
    with torch.no_grad():
        model(torch.randint(1, 64, (1, prompt)), past_key_values=cache, use_cache=True)
    report = cache.memory_report()[0]
    assert report["tokens"] == prompt
    assert (report["compressed_keys"] > 0) == compressed


def test_the_tour_runs_as_written(tmp_path, monkeypatch):
    """The python block of "A tour", with real SmolLM2 keys/queries from the shipped sample
    (GQA: 9 query heads, 3 KV heads) and a small random model for the cache."""
    tour = README.read_text().split("## A tour", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    sample = load_kv_sample()
    monkeypatch.chdir(tmp_path)  # the tour saves prefix.kvc in the working folder
    names = {
        "keys": sample.keys[:2],                 # [2, 3, 256, 64] bf16: [B, Hkv, T, D]
        "keys_fp8": sample.keys_fp8pred[:2],
        "queries": sample.queries[:2].float(),   # [2, 9, 64, 64]: [B, Hq, Q, D]
        "model": _tiny_model(),
        "ids": torch.randint(1, 64, (1, 300)),
    }
    exec(compile(tour, "README.md (A tour)", "exec"), names)
    assert names["scores"].shape == (2, 9, 64, 256)
    assert torch.equal(names["keys_again"].view(torch.int16), sample.keys[:2].view(torch.int16))
    assert names["out"].shape == (1, 364) and (tmp_path / "prefix.kvc").is_file()
