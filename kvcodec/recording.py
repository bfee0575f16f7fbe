"""Record the queries, keys and values of a Hugging Face model exactly as its attention sees them.

``record_qkv(model, input_ids, layers)`` runs one forward pass with a transformers attention
function that keeps each layer's post-RoPE query, key and value (key/value as the cache returns
them, before any GQA repeat) and then runs transformers' own SDPA attention, so the model computes
what it computes with ``attn_implementation="sdpa"``. It works for any model whose attention
modules carry ``layer_idx`` and go through transformers' attention interface (Llama, Qwen2,
Mistral, ...). ``kvcodec.transform.sensitivity.fit_model`` weights keys by the queries it records.

A top-level module that imports nothing else of kvcodec: ``kvcodec.hf`` imports
``kvcodec.transform`` (a cache saved transform-coded), so a recorder inside ``kvcodec.hf`` used by
``kvcodec.transform`` would make the two packages import each other.
"""

from __future__ import annotations

import torch

RECORDER_NAME = "kvcodec_record"
_ACTIVE_RECORDING: list[dict] = []


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """Store post-RoPE query/key/value of this layer (key/value as the cache returns them, i.e.
    before any GQA repeat), then run transformers' own SDPA attention unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE_RECORDING:
        rec = _ACTIVE_RECORDING[-1]
        layer = module.layer_idx
        if layer in rec["layers"]:
            rec["q"][layer] = query.detach().clone()
            rec["k"][layer] = key.detach().clone()
            rec["v"][layer] = value.detach().clone()
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_recorder() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(RECORDER_NAME, _recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(RECORDER_NAME, sdpa_mask)


@torch.no_grad()
def record_qkv(model: torch.nn.Module, input_ids: torch.Tensor, layers=None) -> dict:
    """One forward pass over ``input_ids`` [1, T]; returns ``{"q","k","v"}`` dicts keyed by layer
    index with tensors [1, heads, T, head_dim] in the model dtype (post-RoPE, as cached).

    The model's attention implementation is switched to the recorder for the call and restored."""
    n_layers = model.config.num_hidden_layers
    layers = range(n_layers) if layers is None else layers
    layers = sorted({int(i) for i in layers})
    if not layers or layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"layers must lie in [0, {n_layers}), got {layers}")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be shaped [1, T], got {tuple(input_ids.shape)}")
    _register_recorder()
    previous = model.config._attn_implementation
    rec = {"layers": set(layers), "q": {}, "k": {}, "v": {}}
    model.set_attn_implementation(RECORDER_NAME)
    _ACTIVE_RECORDING.append(rec)
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        _ACTIVE_RECORDING.pop()
        model.set_attn_implementation(previous)
    missing = [i for i in layers if i not in rec["k"]]
    if missing:
        raise RuntimeError(f"attention of layers {missing} was not recorded")
    return {"q": rec["q"], "k": rec["k"], "v": rec["v"]}
