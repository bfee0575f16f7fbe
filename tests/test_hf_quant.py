"""Quantized CompressedCache methods (TurboQuant MSE/prod, QJL, KIVI) on tiny random decoders.

Reference for every check: the same compressed state read densely (dequantize, then SDPA), which
is what ``update`` returns when the kvcodec attention function is not in use.
"""

import pytest
import torch
from test_hf_cache import _logits, prompt, tiny_model
from transformers import DynamicCache

from kvcodec.cache_argument import cache_kwargs
from kvcodec.hf import CompressedCache, disable
from kvcodec.hf.attention import attend_store
from kvcodec.hf.persist import cache_from_bytes, cache_to_bytes
from kvcodec.hf.methods import QUANT_METHODS

METHODS = [(m, kw) for m, kw in [("turboquant", {}), ("turboquant", {"key_mode": "prod"}), ("qjl", {}), ("kivi", {})]
           if m in QUANT_METHODS]
IDS = [m + "-" + "-".join(kw.values()) if kw else m for m, kw in METHODS]


def _block(method, small):
    return 32 if method == "kivi" else small  # KIVI keys come in groups of 32 tokens


def _dense_attention(q, k, v, scaling):
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1).double(), v.repeat_interleave(G, 1).double()
    T, Tq = k.shape[-2], q.shape[-2]
    allowed = torch.arange(T)[None, :] <= (T - Tq + torch.arange(Tq))[:, None]
    s = (q.double() @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


SHAPED = [(m, kw, 9, 3, 64) for m, kw in METHODS] + [(m, kw, 8, 2, 128) for m, kw in METHODS[:2]]


@pytest.mark.parametrize("method,kw,heads,kv_heads,dim", SHAPED)
def test_attention_on_compressed_blocks_equals_dequantize_then_softmax(method, kw, heads, kv_heads, dim):
    model = tiny_model("llama", heads, kv_heads, dim)
    cache = CompressedCache(model.config, method=method, key_bits=4, value_bits=3, residual=8,
                            block_size=_block(method, 16), sink=2, **kw)
    layer = cache.layers[0]
    torch.manual_seed(0)
    k, v = torch.randn(2, kv_heads, 70, dim), torch.randn(2, kv_heads, 70, dim)
    layer.lazy_initialization(k, v)
    layer.store.append(k, v)
    layer.store.compact()
    assert layer.store.compressed_len in (48, 32) and layer.store.sink_len == 2
    q = torch.randn(2, heads, 3, dim)
    out = attend_store(layer.store, q, None, dim**-0.5, kv_heads)
    dk, dv = layer.store.materialize(torch.float32)
    torch.testing.assert_close(out.double(), _dense_attention(q, dk, dv, dim**-0.5), atol=2e-5, rtol=2e-5)


def _fallback_twin(model, **kw):
    """The same cache options read densely: a model copy without kvcodec attention."""
    import copy

    twin = disable(copy.deepcopy(model))
    return twin, CompressedCache(twin.config, **kw)


@pytest.mark.parametrize("method,kw", METHODS, ids=IDS)
def test_generate_paths_agree_with_dense_reading(method, kw):
    model = tiny_model("qwen2", 8, 2, 64)
    opts = dict(method=method, key_bits=4, value_bits=2, residual=4, block_size=_block(method, 4), **kw)
    twin, ref_cache = _fallback_twin(model, **opts)
    cache = CompressedCache(model, **opts)
    ids = prompt(2, 38)
    a, b = _logits(model, ids, cache), _logits(twin, ids, ref_cache)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # prefill: exact K/V in both
    for t in range(6):
        nxt = prompt(2, 1, seed=30 + t)
        torch.testing.assert_close(_logits(model, nxt, cache), _logits(twin, nxt, ref_cache), atol=2e-4, rtol=2e-4)
    assert cache.layers[0].store.compressed_len == (32 if method == "kivi" else 36)


@pytest.mark.parametrize("method,kw", METHODS[:1], ids=IDS[:1])
def test_beam_search_crop_and_padding_run(method, kw):
    model = tiny_model("llama", 9, 3, 64)
    ids = prompt(2, 20, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = 0
    cache = CompressedCache(model, method=method, key_bits=4, residual=4, block_size=4, **kw)
    out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), num_beams=3, max_new_tokens=8,
                         do_sample=False)
    assert out.shape == (2, 28)
    ref = model.generate(ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config)),
                         num_beams=3, max_new_tokens=8, do_sample=False)
    assert (out[:, 20:] == ref[:, 20:]).float().mean() > 0.5  # 4-bit keys: mostly the same beams
    n = cache.get_seq_length()
    cache.crop(-5)
    assert cache.get_seq_length() == n - 5
    _logits(model, prompt(6, 1), cache)  # still usable after crop (batch 2 x 3 beams)


@pytest.mark.parametrize("method,kw", METHODS, ids=IDS)
def test_nbytes_counts_codes_once_and_side_data_once(method, kw):
    model = tiny_model("llama", 4, 2, 64)
    cache = CompressedCache(model, method=method, key_bits=3, value_bits=2, residual=4, block_size=_block(method, 4), **kw)
    _logits(model, prompt(1, 40), cache)
    for t in range(5):
        _logits(model, prompt(1, 1, seed=t), cache)
    held = {}
    for layer in cache.layers:
        st = layer.store
        for t in (st.sink_k, st.sink_v, st.win_k, st.win_v):
            if t is not None:
                held[t.data_ptr()] = t.numel() * t.element_size()
        for b in st.blocks:
            for part in (b.key, b.value):
                for t in part.tensors().values():
                    held[t.data_ptr()] = t.numel() * t.element_size()
    assert cache.nbytes() == sum(held.values())
    rep = cache.memory_report()
    comp_bits = sum(r["compressed_keys"] + r["compressed_values"] for r in rep) * 8
    comp_values = sum(2 * 2 * l.store.compressed_len * 64 for l in cache.layers)
    assert comp_values and comp_bits / comp_values < 4.5  # 3/2-bit codes + per-token/group scales


@pytest.mark.parametrize("method,kw", METHODS, ids=IDS)
def test_quantized_cache_save_load_continues_identically(method, kw):
    model = tiny_model("llama", 4, 2, 64)
    cache = CompressedCache(model, method=method, key_bits=4, value_bits=3, residual=4, block_size=_block(method, 4), **kw)
    _logits(model, prompt(2, 37), cache)
    loaded = cache_from_bytes(CompressedCache, cache_to_bytes(cache), model)
    assert loaded.nbytes() == cache.nbytes()
    nxt = prompt(2, 2, seed=5)
    torch.testing.assert_close(_logits(model, nxt, loaded), _logits(model, nxt, cache), atol=0, rtol=0)


def test_prod_keys_need_two_bits():
    with pytest.raises(ValueError, match="bits"):
        CompressedCache(tiny_model().config, method="turboquant", key_mode="prod", key_bits=1)


@pytest.mark.parametrize("key_mode,kpre,vpre,sink,tq,q_chunk", [
    ("mse", "scale", "none", 3, 2, 128), ("prod", "scale", "scale", 3, 2, 128), ("mse", "none", "center", 0, 1, 128),
    ("mse", "center", "scale", 1, 7, 3)])
def test_fused_kernel_wiring_matches_torch_path(key_mode, kpre, vpre, sink, tq, q_chunk):
    """The kvcodec.quant.cuda launcher (run here through its CPU float64 reference) plus the one-softmax
    merge with the exact sink and window give the same attention as the torch path on the same packed
    blocks (queries laid out as HF passes them: [B, Tq, H, D] transposed; chunked queries too)."""
    import kvcodec.hf.attention as attn

    chunked = attn.AttentionOptions(q_chunk=q_chunk)
    on_cpu = attn.AttentionOptions(q_chunk=q_chunk, fused="cpu-reference")
    model = tiny_model("llama", 8, 2, 64)
    cache = CompressedCache(model.config, method="turboquant", key_bits=4, value_bits=3, key_mode=key_mode,
                            residual=8, block_size=16, key_precondition=kpre, value_precondition=vpre, sink=sink)
    layer = cache.layers[0]
    torch.manual_seed(3)
    k, v = torch.randn(2, 2, 60, 64) + torch.linspace(-2, 2, 64), torch.randn(2, 2, 60, 64) + 0.5
    layer.lazy_initialization(k, v)
    layer.store.append(k, v)
    layer.store.compact()
    q = torch.randn(2, tq, 8, 64).transpose(1, 2)
    torch_path = attend_store(layer.store, q, None, 0.125, 2, options=chunked)
    assert attn.fused_compressed(layer, q, None, 0.125, chunked) is None  # CPU: no fused kernel
    fused = attn.fused_compressed(layer, q, None, 0.125, on_cpu)
    assert fused is not None
    out = attend_store(layer.store, q, None, 0.125, 2, compressed=fused, options=on_cpu)
    torch.testing.assert_close(out, torch_path, atol=2e-5, rtol=2e-5)


def test_fused_decode_step_stays_lean(monkeypatch):
    """Host-overhead guard: a one-token decode step through the fused wiring makes ~30 torch calls
    per layer besides the kernel launcher (views and attribute reads included; ~10 of them launch
    work), and the per-block constants are built once per block, not per step."""
    import kvcodec.quant.cuda.attention as kernel_launcher
    import kvcodec.hf.attention as attn
    from torch.overrides import TorchFunctionMode
    from transformers import AttentionInterface

    model = tiny_model("llama", 6, 2, 64)
    cache = CompressedCache(model, method="turboquant", residual=16, block_size=64,
                            attention=attn.AttentionOptions(fused="cpu-reference"))
    _logits(model, prompt(1, 100), cache)  # 1 sink + 64 compressed + 35 exact: no compaction for 2 steps
    calls, in_kernel = [], []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not in_kernel:
                calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    real_kernel, real_attention = kernel_launcher.decode_attention, attn.compressed_attention

    def kernel(*a, **kw):
        in_kernel.append(1)
        try:
            return real_kernel(*a, **kw)
        finally:
            in_kernel.pop()

    def counted_attention(*a, **kw):
        with Count():
            return real_attention(*a, **kw)

    monkeypatch.setattr(kernel_launcher, "decode_attention", kernel)
    AttentionInterface.register(attn.NAME, counted_attention)
    try:
        _logits(model, prompt(1, 1, seed=9), cache)
        consts = [layer.fused_consts for layer in cache.layers]
        calls.clear()
        _logits(model, prompt(1, 1, seed=10), cache)
    finally:
        AttentionInterface.register(attn.NAME, real_attention)
    assert all(c is not None for c in consts)
    assert all(layer.fused_consts is c for layer, c in zip(cache.layers, consts))  # reused, not rebuilt
    assert "repeat_interleave" not in calls and "full" not in calls
    assert len(calls) / len(cache.layers) <= 40, calls


def _cuda_ready():
    try:
        import kvcodec.device as kc

        return kc.is_available()
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("key_mode,sink", [("mse", 1), ("prod", 0)])
def test_fused_kernel_on_gpu_matches_torch_path(monkeypatch, key_mode, sink):
    import kvcodec.hf.attention as attn

    model = tiny_model("llama", 8, 2, 128).cuda()
    ids = prompt(1, 300).cuda()
    logits = {}
    for fused in (True, False):
        used = []
        real = attn.fused_compressed

        def spy(*a, real=real, used=used):
            r = real(*a)
            used.append(r is not None)
            return r

        monkeypatch.setattr(attn, "fused_compressed", spy)
        cache = CompressedCache(model, method="turboquant", key_bits=4, value_bits=3, key_mode=key_mode,
                                residual=32, block_size=32, sink=sink,
                                attention=attn.AttentionOptions(fused="auto" if fused else "off"))
        out = [_logits(model, ids, cache)[:, -1]]
        for t in range(4):
            out.append(_logits(model, ids[:, t : t + 1], cache)[:, -1])
        logits[fused] = torch.stack(out)
        assert cache.layers[0].store.compressed_len > 0
        assert any(used) == fused  # the kernel ran exactly when enabled
    torch.testing.assert_close(logits[True], logits[False], atol=3e-2, rtol=3e-2)
