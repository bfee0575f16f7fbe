"""Save / load of the static compressed cache: its file is the eager cache's file (the same bytes for
the same K/V), so either cache loads the other's and continues as the saved one would have (CPU)."""

import pytest
import torch

from kvcodec.cache_argument import cache_kwargs
from kvcodec.errors import CorruptStreamError
from kvcodec.hf import CompressedCache, enable
from kvcodec.hf.static_cache import StaticCompressedCache, enable_static

from test_hf_cache import tiny_model
from test_hf_static import KW, _tokens, model  # noqa: F401  (model: the 2-layer module fixture)


def _feed(model, cache, toks, static):
    """Teacher-forced one-token steps (the model switched to the cache's attention); their logits."""
    (enable_static if static else enable)(model)
    with torch.no_grad():
        return torch.stack([model(toks[:, i:i + 1], **cache_kwargs(model, cache)).logits[:, -1].float()
                            for i in range(toks.shape[1])])


def _prefilled(model, ids, static, max_len=64):
    cache = CompressedCache(model, **KW, max_cache_len=max_len) if static else CompressedCache(model, **KW)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    return cache


@pytest.mark.parametrize("length", [5, 11])  # 5: the preconditioner is fitted on the device
def test_static_file_is_the_eager_file_for_the_same_kv(tmp_path, length):
    """One layer: both caches see the same K/V (no attention output feeds them), so the files are equal
    byte for byte: sink, window, compressed codes and norms, preconditioners, options."""
    model = tiny_model(heads=4, kv_heads=2, head_dim=32, layers=1)
    ids, feed = _tokens(2, length, length), _tokens(2, 9, length + 1)
    for static in (False, True):
        cache = _prefilled(model, ids, static)
        _feed(model, cache, feed, static)
        cache.save(tmp_path / f"{static}.kvc")
    assert (tmp_path / "True.kvc").read_bytes() == (tmp_path / "False.kvc").read_bytes()


def test_saved_caches_load_as_either_and_continue(model, tmp_path):
    ids, feed, more = _tokens(2, 11, 1), _tokens(2, 7, 2), _tokens(2, 6, 3)
    eager, static = _prefilled(model, ids, False), _prefilled(model, ids, True)
    _feed(model, eager, feed, False)
    _feed(model, static, feed, True)
    eager.save(tmp_path / "eager.kvc")
    static.save(tmp_path / "static.kvc")
    again = CompressedCache.load(tmp_path / "static.kvc", model, max_cache_len=64)
    as_eager = CompressedCache.load(tmp_path / "static.kvc", model)
    as_static = StaticCompressedCache.load(tmp_path / "eager.kvc", model, max_cache_len=40)
    assert type(as_eager) is CompressedCache and isinstance(as_static, StaticCompressedCache)
    assert int(as_static.get_seq_length()) == int(again.get_seq_length()) == as_eager.get_seq_length() == 18
    ref_s, ref_e = _feed(model, static, more, True), _feed(model, eager, more, False)
    assert torch.equal(_feed(model, again, more, True), ref_s)  # the very state it saved
    torch.testing.assert_close(_feed(model, as_eager, more, False), ref_s, rtol=0, atol=1e-5)
    torch.testing.assert_close(_feed(model, as_static, more, True), ref_e, rtol=0, atol=1e-5)


def test_bad_static_loads_raise(model, tmp_path):
    static = _prefilled(model, _tokens(1, 11, 3), True)
    path = tmp_path / "c.kvc"
    static.save(path)
    data = path.read_bytes()
    bad = tmp_path / "bad.kvc"
    for broken in (data[: len(data) // 2], data[:40] + bytes([data[40] ^ 0xFF]) + data[41:], b""):
        bad.write_bytes(broken)
        with pytest.raises(CorruptStreamError):
            CompressedCache.load(bad, model, max_cache_len=64)
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):
        StaticCompressedCache.load(path, model, max_cache_len=64, max_output_bytes=1000)
    with pytest.raises(ValueError, match="max_cache_len"):
        CompressedCache.load(path, model, max_cache_len=8)  # it holds 11 tokens
    with pytest.raises(ValueError, match="needs the model"):
        CompressedCache.load(path, model.config, max_cache_len=64)
