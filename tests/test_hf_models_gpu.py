"""CompressedCache in ``model.generate`` on CUDA across architectures (tests/model_zoo.py), as users call it:
fresh caches, twice, a left-padded batch; the fused kernel where it applies (full attention, no soft-cap or
sinks) and the torch path elsewhere (sliding windows, soft-capping, sinks, MLA)."""

import pytest
import torch
from model_zoo import VOCAB, build
from transformers import DynamicCache

import kvcodec.device as kcuda
from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and kcuda.is_available()), reason="needs CUDA and CuPy")]

ARCHS = [("llama", {}), ("llama_mqa_hd128", {}), ("mistral", {"sliding_window": 48}), ("gemma2", {}),
         ("gpt_oss", {}), ("deepseek_v3", {}), ("qwen3_next", {})]


def _model(name, overrides):
    try:
        model = build(name, **overrides)[0]
    except ImportError as exc:
        pytest.skip(str(exc))
    return model.to("cuda", torch.bfloat16)


def _ids(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g).cuda()


@pytest.mark.parametrize("name,overrides", ARCHS, ids=[a for a, _ in ARCHS])
def test_generate_on_cuda_twice_and_padded(name, overrides, monkeypatch):
    model = _model(name, overrides)
    import kvcodec.hf.attention as attn

    fused_calls = []
    real = attn.fused_compressed

    def counting(*a, **kw):
        out = real(*a, **kw)
        fused_calls.append(out is not None)
        return out

    monkeypatch.setattr(attn, "fused_compressed", counting)
    for length, new in ((100, 12), (70, 20)):  # fresh caches, other prompt and output lengths
        ids = _ids(1, length, seed=length)
        ref = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=new,
                             do_sample=False)
        got = model.generate(ids, **cache_kwargs(model, CompressedCache(model, method="lossless")), max_new_tokens=new,
                             do_sample=False)
        assert torch.equal(got, ref)
        cache = CompressedCache(model, method="turboquant", key_bits=4, value_bits=4, residual=16, block_size=16,
                                max_cache_len=None)  # the eager cache (its fused path is counted)
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_scores=True)
        assert torch.isfinite(torch.stack(out.scores)).all()
        assert cache.nbytes() > 0
    if name == "llama_mqa_hd128":  # the fused kernel takes head dims 64-128 (llama's is 16)
        assert any(fused_calls), "the fused kernel never ran on a full-attention model"
    ids = _ids(3, 60, seed=7)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 9, 21)):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    ref = model.generate(ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config)),
                         max_new_tokens=8, do_sample=False)
    got = model.generate(ids, attention_mask=mask, **cache_kwargs(model, CompressedCache(model, method="lossless")),
                         max_new_tokens=8, do_sample=False)
    assert torch.equal(got, ref)
