"""Tiny random decoders of every installed transformers architecture whose cache holds attention K/V.

``zoo()`` lists the entries; ``build(name, **overrides)`` returns ``(model, config)``: a float32 model in
eval mode, built with ``AutoModelForCausalLM.from_config`` from the architecture's own config class
(``attn_implementation`` left at the default), seeded with ``torch.manual_seed``. Each entry keeps the
architecture's distinctive attention features at sizes where they matter: sliding windows and attention
chunks of 8 tokens (shorter than a 40-token prompt) mixed with full layers where the architecture has ``layer_types``,
learned sinks, logit soft-capping, attention multipliers, MLA with K and V head dims that differ, hybrid
stacks with at least one attention layer, MQA, fused QKV projections, head_dim from 16 to 256.

An entry whose config class is missing from the installed transformers reports ``available() == False``
(older 5.x releases lack some architectures).

``python tests/model_zoo.py`` builds every entry and prints, per architecture: the attention module
classes, whether each has an int ``layer_idx``, their projection names, the name of the forward argument
that takes the cache, and the cache layer classes a ``DynamicCache(config=...)`` holds after a forward (or
the model's own cache class where generate takes no DynamicCache).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import time

import torch
import transformers

from kvcodec.cache_argument import cache_kwargs

VOCAB = 160
HIDDEN = 64
SEED = 0

# Feature tags. "sliding": some layer attends to a window shorter than the 40-token test prompt;
# "sinks": learned per-head sink logits; "softcap": attention logit soft-capping; "mla": multi-head latent
# attention, K head dim != V head dim; "hybrid": non-attention layers (SSM, linear attention, conv) beside
# attention layers; "fused_qkv": one projection produces Q, K and V; "mqa": one K/V head; "gqa": 1 < K/V
# heads < Q heads; "nope": some attention layer has no rotary position embedding; "bias": Q/K/V projections
# have biases; "alibi": ALiBi position bias; "learned_pos": absolute learned positions, no rotary;
# "qk_norm": norms on Q and K; "moe": mixture-of-experts MLP; "multiplier": a non-default attention
# scale; "chunked": chunked local attention; "partial_rotary": rotary on part of the head dim;
# "gated_attn": a sigmoid gate on the attention output; "parallel": attention and MLP in parallel;
# "diff_attn": differential attention; "clip_qkv": Q/K/V clipped; "head_dim_256", "head_dim_128",
# "head_dim_32", "head_dim_16": the head dim; "kv_shared": later layers reuse an earlier layer's K/V (their
# cache layer holds nothing); "k_eq_v": full layers use K as V (no v_proj); "kv_dims_differ": V head dim !=
# K head dim without MLA; "shared_attn": one attention block shared by several layers; "ssm": no attention.


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    config_class: str
    kwargs: dict
    features: frozenset
    attention_kv: bool = True
    llama_like: bool = True  # takes the common vocab/hidden/intermediate/layers/heads kwargs
    skip: str | None = None  # why transformers cannot run it on CPU

    def config_cls(self):
        return getattr(transformers, self.config_class, None)

    def available(self) -> bool:
        return self.config_cls() is not None

    def __call__(self, **overrides):
        """build(self.name, **overrides)"""
        return build(self.name, **overrides)


def _common(layers=2, heads=4, kv_heads=2, head_dim=None, intermediate=128):
    kw = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    if head_dim is not None:
        kw["head_dim"] = head_dim
    return kw


def _e(name, cls, kwargs, features, **rest):
    return Entry(name, cls, kwargs, frozenset(features.split()), **rest)


SW = 8  # sliding window (tokens)
SLIDE_FULL = ["sliding_attention", "full_attention"]

_ENTRIES = [
    # --- dense rotary decoders ---
    _e("llama", "LlamaConfig", dict(head_dim=16), "gqa head_dim_16"),
    _e("llama_mqa_hd128", "LlamaConfig", dict(num_key_value_heads=1, head_dim=128), "mqa head_dim_128"),
    _e("mistral", "MistralConfig", dict(sliding_window=SW, head_dim=16), "sliding gqa head_dim_16"),
    _e("ministral", "MinistralConfig", dict(head_dim=16, sliding_window=SW, layer_types=SLIDE_FULL), "sliding gqa"),
    _e("qwen2", "Qwen2Config", dict(use_sliding_window=True, sliding_window=SW, max_window_layers=1,
                                    layer_types=["full_attention", "sliding_attention"]), "sliding gqa bias"),
    _e("qwen3", "Qwen3Config", dict(head_dim=32, use_sliding_window=True, sliding_window=SW, max_window_layers=1,
                                    layer_types=["full_attention", "sliding_attention"]),
       "sliding gqa qk_norm head_dim_32"),
    _e("olmo", "OlmoConfig", dict(num_key_value_heads=4, clip_qkv=0.5), "clip_qkv"),
    _e("olmo2", "Olmo2Config", dict(num_key_value_heads=4), "qk_norm"),
    _e("olmo3", "Olmo3Config", dict(num_hidden_layers=4, sliding_window=SW,
                                    layer_types=["sliding_attention"] * 3 + ["full_attention"]), "sliding qk_norm"),
    _e("cohere", "CohereConfig", dict(use_qk_norm=True, logit_scale=0.5), "parallel qk_norm"),
    _e("cohere2", "Cohere2Config", dict(num_hidden_layers=4, sliding_window=SW,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),
       "sliding nope parallel"),
    _e("granite", "GraniteConfig", dict(attention_multiplier=0.05, embedding_multiplier=2.0,
                                        residual_multiplier=0.5, logits_scaling=4.0), "multiplier gqa"),
    _e("smollm3", "SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=4, use_sliding_window=False),
       "nope gqa"),
    _e("starcoder2", "Starcoder2Config", dict(sliding_window=SW, use_bias=True), "sliding bias gqa"),
    _e("gemma", "GemmaConfig", dict(num_key_value_heads=1, head_dim=256, num_attention_heads=2),
       "mqa head_dim_256"),
    _e("gemma2", "Gemma2Config", dict(head_dim=32, sliding_window=SW, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=30.0, query_pre_attn_scalar=32,
                                      layer_types=SLIDE_FULL), "sliding softcap gqa head_dim_32"),
    _e("gemma3_text", "Gemma3TextConfig", dict(num_hidden_layers=4, head_dim=32, sliding_window=SW,
                                               query_pre_attn_scalar=32,
                                               layer_types=["sliding_attention"] * 3 + ["full_attention"]),
       "sliding qk_norm gqa head_dim_32"),
    _e("vaultgemma", "VaultGemmaConfig", dict(head_dim=32, sliding_window=SW, attn_logit_softcapping=5.0,
                                              query_pre_attn_scalar=32, layer_types=SLIDE_FULL),
       "sliding softcap head_dim_32"),
    _e("exaone4", "Exaone4Config", dict(num_hidden_layers=4, sliding_window=SW, sliding_window_pattern=4,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),
       "sliding qk_norm nope gqa"),
    _e("phi3", "Phi3Config", dict(sliding_window=SW), "fused_qkv sliding gqa"),
    _e("phi", "PhiConfig", dict(num_key_value_heads=4, qk_layernorm=True), "bias partial_rotary parallel"),
    _e("stablelm", "StableLmConfig", dict(num_key_value_heads=4, use_qkv_bias=True, qk_layernorm=True),
       "bias partial_rotary qk_norm"),
    _e("persimmon", "PersimmonConfig", dict(num_key_value_heads=4, qk_layernorm=True),
       "fused_qkv bias partial_rotary qk_norm"),
    _e("nemotron", "NemotronConfig", dict(), "partial_rotary gqa"),
    _e("glm", "GlmConfig", dict(head_dim=16), "partial_rotary bias gqa"),
    _e("glm4", "Glm4Config", dict(head_dim=16), "partial_rotary bias gqa"),
    _e("helium", "HeliumConfig", dict(head_dim=16), "gqa"),
    _e("ernie4_5", "Ernie4_5Config", dict(head_dim=16), "gqa"),
    _e("seed_oss", "SeedOssConfig", dict(head_dim=16, attention_bias=True), "bias gqa"),
    _e("hunyuan_v1_dense", "HunYuanDenseV1Config", dict(head_dim=16), "qk_norm gqa"),
    _e("apertus", "ApertusConfig", dict(head_dim=16), "qk_norm gqa"),
    _e("arcee", "ArceeConfig", dict(head_dim=16), "gqa"),
    _e("cwm", "CwmConfig", dict(head_dim=16, sliding_window=SW, layer_types=SLIDE_FULL), "sliding gqa"),
    _e("diffllama", "DiffLlamaConfig", dict(head_dim=16), "diff_attn gqa"),
    _e("bitnet", "BitNetConfig", dict(head_dim=16), "gqa"),
    _e("granite_swa", "GraniteSWAConfig", dict(head_dim=16, sliding_window=SW, layer_types=SLIDE_FULL,
                                               attention_multiplier=0.05), "sliding multiplier gqa"),
    _e("gemma3n_text", "Gemma3nTextConfig", dict(num_hidden_layers=4, head_dim=32, sliding_window=SW,
                                                 layer_types=["sliding_attention", "full_attention"] * 2,
                                                 num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                                                 hidden_size_per_layer_input=8, laurel_rank=8,
                                                 intermediate_size=[128] * 4,
                                                 activation_sparsity_pattern=[0.0] * 4),
       "sliding kv_shared qk_norm head_dim_32"),
    _e("gemma4_text", "Gemma4TextConfig", dict(num_hidden_layers=4, head_dim=32, sliding_window=SW,
                                               layer_types=["sliding_attention", "full_attention"] * 2,
                                               num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                                               hidden_size_per_layer_input=8, attention_k_eq_v=True),
       "sliding kv_shared k_eq_v qk_norm head_dim_32"),
    _e("glm4_moe", "Glm4MoeConfig", dict(head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                         topk_group=1, use_qk_norm=True), "moe partial_rotary qk_norm gqa"),
    _e("hunyuan_v1_moe", "HunYuanMoEV1Config", dict(head_dim=16, num_experts=4, moe_topk=2), "moe qk_norm gqa"),
    _e("ernie4_5_moe", "Ernie4_5_MoeConfig", dict(head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                                                  moe_layer_start_index=1), "moe gqa"),
    _e("mimo_v2_flash", "MiMoV2FlashConfig", dict(head_dim=32, v_head_dim=16, sliding_window=SW, layer_types=SLIDE_FULL,
                                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  mlp_layer_types=["dense", "sparse"], n_group=1, topk_group=1),
       "sliding moe kv_dims_differ gqa"),
    _e("glm4_moe_lite", "Glm4MoeLiteConfig", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  mlp_layer_types=["dense", "sparse"], n_group=1, topk_group=1),
       "mla moe"),
    _e("longcat_flash", "LongcatFlashConfig", dict(num_layers=1, num_hidden_layers=2, q_lora_rank=32, kv_lora_rank=32,
                                                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                                   head_dim=8, ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=4,
                                                   moe_topk=2, zero_expert_num=1), "mla moe"),
    _e("lfm2_moe", "Lfm2MoeConfig", dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                         num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32), "hybrid moe qk_norm gqa"),
    _e("minimax", "MiniMaxConfig", dict(num_hidden_layers=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                        num_local_experts=4, num_experts_per_tok=2, block_size=16),
       "hybrid moe gqa"),
    _e("olmo_hybrid", "OlmoHybridConfig", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                               linear_num_key_heads=2, linear_num_value_heads=2,
                                               linear_key_head_dim=16, linear_value_head_dim=16),
       "hybrid qk_norm gqa"),
    _e("nemotron_h", "NemotronHConfig", dict(num_hidden_layers=3, layers_block_type=["mamba", "attention", "mlp"],
                                             head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                                             n_groups=1, chunk_size=16), "hybrid nope gqa"),
    _e("zamba2", "Zamba2Config", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3,
                                      layers_block_type=["mamba", "hybrid", "mamba"], num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=128, mamba_d_state=8, n_mamba_heads=4,
                                      mamba_ngroups=1, chunk_size=16, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2),
       "hybrid shared_attn", llama_like=False),
    # --- mixture of experts ---
    _e("mixtral", "MixtralConfig", dict(sliding_window=SW, num_local_experts=4, num_experts_per_tok=2,
                                        head_dim=16), "sliding moe gqa"),
    _e("qwen2_moe", "Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64), "moe bias gqa"),
    _e("qwen3_moe", "Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           head_dim=16), "moe qk_norm gqa"),
    _e("granitemoe", "GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                              attention_multiplier=0.05), "moe multiplier gqa"),
    _e("gpt_oss", "GptOssConfig", dict(head_dim=16, sliding_window=SW, num_local_experts=4, num_experts_per_tok=2,
                                       layer_types=SLIDE_FULL, attention_bias=True),
       "sinks sliding moe bias gqa"),
    _e("dots1", "Dots1Config", dict(head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1),
       "moe qk_norm gqa"),
    _e("llama4_text", "Llama4TextConfig", dict(num_hidden_layers=4, head_dim=16, num_local_experts=2,
                                               num_experts_per_tok=1, intermediate_size_mlp=128,
                                               attention_chunk_size=SW, no_rope_layer_interval=4,
                                               interleave_moe_layer_step=2),
       "chunked nope qk_norm moe gqa"),
    # --- multi-head latent attention ---
    _e("deepseek_v2", "DeepseekV2Config", dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                               first_k_dense_replace=1, n_group=1, topk_group=1,
                                               topk_method="greedy"), "mla moe"),
    _e("deepseek_v3", "DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                               first_k_dense_replace=1, n_group=1, topk_group=1),
       "mla moe"),
    _e("minicpm3", "MiniCPM3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
       "mla"),
    # --- hybrid stacks (at least one attention layer) ---
    _e("qwen3_next", "Qwen3NextConfig", dict(num_hidden_layers=4, head_dim=32, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32, linear_num_key_heads=2,
                                             linear_num_value_heads=4, linear_key_head_dim=16,
                                             linear_value_head_dim=16,
                                             layer_types=["linear_attention"] * 3 + ["full_attention"]),
       "hybrid gated_attn qk_norm partial_rotary moe head_dim_32"),
    _e("qwen3_5_text", "Qwen3_5TextConfig", dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=16,
                                                 linear_value_head_dim=16,
                                                 layer_types=["linear_attention"] * 3 + ["full_attention"]),
       "hybrid gated_attn qk_norm partial_rotary head_dim_32"),
    _e("jamba", "JambaConfig", dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                    expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                    num_experts_per_tok=2, use_mamba_kernels=False, mamba_d_state=8,
                                    mamba_dt_rank=8), "hybrid moe nope gqa"),
    _e("falcon_h1", "FalconH1Config", dict(num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                                           mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                           mamba_chunk_size=16), "hybrid parallel multiplier gqa"),
    _e("bamba", "BambaConfig", dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                                    mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16),
       "hybrid partial_rotary gqa"),
    _e("lfm2", "Lfm2Config", dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                  block_auto_adjust_ff_dim=False), "hybrid qk_norm gqa"),
    _e("granitemoehybrid", "GraniteMoeHybridConfig", dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                                          num_local_experts=4, num_experts_per_tok=2,
                                                          shared_intermediate_size=64, attention_multiplier=0.05,
                                                          position_embedding_type="nope", mamba_n_heads=4,
                                                          mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
                                                          mamba_chunk_size=16),
       "hybrid moe multiplier nope gqa"),
    # --- fused QKV / GPT-style ---
    _e("gpt2", "GPT2Config", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=256,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2),
       "fused_qkv bias learned_pos head_dim_16", llama_like=False),
    _e("gpt_bigcode", "GPTBigCodeConfig", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=256,
                                               multi_query=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
       "fused_qkv mqa bias learned_pos head_dim_16", llama_like=False),
    _e("gpt_neox", "GPTNeoXConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
       "fused_qkv bias partial_rotary parallel head_dim_16", llama_like=False),
    _e("gpt_neo", "GPTNeoConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4,
                                       attention_types=[[["local", "global"], 1]], window_size=SW,
                                       max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2), "sliding learned_pos head_dim_16", llama_like=False),
    _e("gptj", "GPTJConfig", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=8, n_positions=256,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
       "partial_rotary parallel head_dim_16", llama_like=False),
    _e("codegen", "CodeGenConfig", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=8,
                                        n_positions=256, n_ctx=256, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2, tie_word_embeddings=False),
       "fused_qkv partial_rotary parallel head_dim_16", llama_like=False),
    _e("falcon", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                      multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2), "fused_qkv mqa parallel head_dim_16", llama_like=False),
    _e("falcon_alibi", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                            num_attention_heads=4, alibi=True, multi_query=False, bias=True,
                                            new_decoder_architecture=False, parallel_attn=False,
                                            max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2), "fused_qkv alibi bias head_dim_16", llama_like=False),
    _e("falcon_gqa", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                          num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                          max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2), "fused_qkv gqa parallel head_dim_16", llama_like=False),
    _e("bloom", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=2), "fused_qkv alibi bias head_dim_16",
       llama_like=False),
    _e("mpt", "MptConfig", dict(vocab_size=VOCAB, d_model=HIDDEN, n_heads=4, n_layers=2, expansion_ratio=2,
                                max_seq_len=256, attn_config={"alibi": True}, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2), "fused_qkv alibi head_dim_16", llama_like=False,
       skip="MptForCausalLM.generate with a caller's DynamicCache fails in transformers itself: on 5.25 the "
            "cache grows faster than the tokens (get_seq_length() 123 after a 40-token prompt and 3 new "
            "tokens) and the position bias then fails to broadcast; on 5.0 the causal mask is built 81 wide "
            "for 41 keys; generate with no cache argument runs"),
    _e("opt", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=128, num_hidden_layers=2,
                                num_attention_heads=4, word_embed_proj_dim=HIDDEN, max_position_embeddings=256,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2), "bias learned_pos head_dim_16",
       llama_like=False),
    _e("dbrx", "DbrxConfig", dict(vocab_size=VOCAB, d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=256,
                                  attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                                  ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2),
       "fused_qkv clip_qkv moe gqa head_dim_16", llama_like=False),
    # --- no attention K/V in the cache ---
    _e("mamba", "MambaConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, state_size=8,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2),
       "ssm", attention_kv=False, llama_like=False),
]


def zoo() -> list[tuple[str, Entry]]:
    """(name, entry) for every entry, available in the installed transformers or not; ``entry(**overrides)``
    builds it like ``build(name, **overrides)``."""
    return [(e.name, e) for e in _ENTRIES]


def entry(name: str) -> Entry:
    for e in _ENTRIES:
        if e.name == name:
            return e
    raise KeyError(name)


def make_config(name: str, **overrides):
    e = entry(name)
    cls = e.config_cls()
    if cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {e.config_class}")
    kw = _common() if e.llama_like else {}
    kw.update(e.kwargs)
    kw.update(overrides)
    return cls(**kw)


def build(name: str, seed: int = SEED, **overrides):
    """(model, config): tiny random float32 model of entry ``name`` in eval mode; ``overrides`` go to the config."""
    config = make_config(name, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.eval()
    return model, model.config


# --- introspection (used by the table below and by tests) ---

CACHE_ARG_NAMES = ("past_key_values", "past_key_value", "cache", "layer_past", "cache_params")


def attention_modules(model):
    """(qualified name, module) of every attention module: class name ending in "Attention"."""
    out = []
    for qn, m in model.named_modules():
        cn = type(m).__name__
        if cn.endswith("Attention") or cn.endswith("Attn") or cn.endswith("MLA"):
            if "Mamba" in cn or "Linear" in cn or "Lightning" in cn or "GatedDelta" in cn:
                continue
            out.append((qn, m))
    # keep the outermost attention module when one wraps another
    names = [qn for qn, _ in out]
    return [(qn, m) for qn, m in out if not any(qn != o and qn.startswith(o + ".") for o in names)]


def cache_arg(module) -> str | None:
    params = inspect.signature(module.forward).parameters
    for n in CACHE_ARG_NAMES:
        if n in params:
            return n
    return None


def projections(module) -> list[str]:
    return sorted(n for n, c in module.named_children()
                  if isinstance(c, torch.nn.Linear) or type(c).__name__ in ("Conv1D", "AutoBitLinear", "BitLinear"))


def describe(model) -> dict:
    attn = attention_modules(model)
    classes = sorted({type(m).__name__ for _, m in attn})
    return dict(
        classes=classes,
        n=len(attn),
        layer_idx_int=all(isinstance(getattr(m, "layer_idx", None), int) for _, m in attn) if attn else None,
        projections=sorted({",".join(projections(m)) for _, m in attn}),
        cache_arg=sorted({str(cache_arg(m)) for _, m in attn}),
    )


def cache_layer_classes(model, tokens=40) -> list[str]:
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
    layers = getattr(cache, "layers", [])
    return [type(layer).__name__ for layer in layers]


def own_cache_classes(model) -> list[str]:
    """Cache classes that the model's modeling module defines for itself (e.g. MiniMaxCache)."""
    mod = sys.modules[type(model).__module__]
    return sorted(k for k, v in vars(mod).items()
                  if isinstance(v, type) and v.__module__ == mod.__name__ and k.endswith("Cache"))


def supports_dynamic_cache(model) -> bool:
    """Whether generate builds (and so accepts) a DynamicCache for this model in the installed transformers."""
    probe = getattr(type(model), "_supports_default_dynamic_cache", None)
    return True if probe is None else bool(probe())


def _main():
    import warnings

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    total = 0.0
    rows = []
    for name, e in zoo():
        if not e.available():
            rows.append((name, "-", "absent", "", "", "", ""))
            continue
        t0 = time.perf_counter()
        try:
            model, _ = build(name)
        except Exception as exc:  # report and go on
            rows.append((name, "-", f"build failed: {type(exc).__name__}: {exc}"[:120], "", "", "", ""))
            continue
        dt = time.perf_counter() - t0
        total += dt
        d = describe(model)
        if not supports_dynamic_cache(model):
            layer_summary = "own cache: " + ",".join(own_cache_classes(model))
        else:
            try:
                layers = cache_layer_classes(model)
                layer_summary = ",".join(sorted(set(layers))) + f" x{len(layers)}"
            except Exception as exc:
                layer_summary = f"forward failed: {type(exc).__name__}: {exc}"[:100]
        rows.append((name, f"{dt:.2f}s", ",".join(d["classes"]), str(d["layer_idx_int"]),
                     " | ".join(d["projections"]), ",".join(d["cache_arg"]), layer_summary))
    w = [max(len(r[i]) for r in rows) for i in range(7)]
    head = ("arch", "build", "attention classes", "int layer_idx", "projections", "cache arg", "DynamicCache layers")
    w = [max(a, len(b)) for a, b in zip(w, head)]
    for r in [head] + rows:
        print("  ".join(c.ljust(k) for c, k in zip(r, w)).rstrip())
    print(f"total build time {total:.2f}s over {sum(1 for _, e in zoo() if e.available())} entries")


if __name__ == "__main__":
    sys.exit(_main())
