"""The README's tour runs as written, and what it says about the window is what the cache does."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvcodec.cache_argument import cache_kwargs
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
        model(torch.randint(1, 64, (1, prompt)), **cache_kwargs(model, cache), use_cache=True)
    report = cache.memory_report()[0]
    assert report["tokens"] == prompt
    assert (report["compressed_keys"] > 0) == compressed


def _tour_blocks() -> list[str]:
    tour = README.read_text().split("\n## Tour\n", 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in tour.split("```python\n")[1:]]


def test_the_tour_runs_as_written(tmp_path):
    """Every python block of "Tour" runs in a fresh interpreter, each with only its own names."""
    blocks = _tour_blocks()
    assert len(blocks) >= 4
    runner = tmp_path / "run_tour.py"
    runner.write_text(
        "import sys\n"
        f"blocks = {blocks!r}\n"
        "for i, block in enumerate(blocks):\n"
        "    exec(compile(block, f'README.md (Tour block {i + 1})', 'exec'), {'__name__': '__main__'})\n"
        "print('tour ok')\n")
    done = subprocess.run([sys.executable, str(runner)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "tour ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    assert (tmp_path / "prefix.kvc").is_file()


def test_the_readme_test_command_is_what_ci_runs():
    """The README's test command is a line of .ci/run, character for character."""
    commands = [line for line in README.read_text().splitlines() if "python -m pytest -q" in line and line.startswith("pip ")]
    assert len(commands) == 1
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci
