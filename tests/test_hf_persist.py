"""Saving and reloading a CompressedCache (prefix reuse across processes)."""

import pytest
import torch
from test_hf_cache import _cache, _logits, prompt, tiny_model

from kvcodec import CorruptStreamError
from kvcodec.hf import CompressedCache
from kvcodec.hf.persist import cache_from_bytes, cache_to_bytes


def _filled(model, **kw):
    cache = _cache(model, sink=2, **kw)
    _logits(model, prompt(2, 21), cache)
    return cache


def test_saved_cache_continues_exactly(tmp_path):
    model = tiny_model("llama", 9, 3, 64)
    cache = _filled(model)
    path = tmp_path / "prefix.kvc"
    cache.save(path)
    loaded = CompressedCache.load(path, model)
    assert loaded.get_seq_length() == 21 and loaded.nbytes() == cache.nbytes()
    assert [len(l.store.blocks) for l in loaded.layers] == [len(l.store.blocks) for l in cache.layers]
    nxt = prompt(2, 3, seed=7)
    torch.testing.assert_close(_logits(model, nxt, loaded), _logits(model, nxt, cache), atol=0, rtol=0)


def test_empty_cache_round_trips():
    model = tiny_model()
    loaded = cache_from_bytes(CompressedCache, cache_to_bytes(_cache(model)), model)
    assert loaded.get_seq_length() == 0


def test_corrupted_or_truncated_file_raises():
    model = tiny_model()
    blob = cache_to_bytes(_filled(model))
    for bad in (blob[: len(blob) // 2], blob[:-1], b"", b"KVCC" + bytes(40)):
        with pytest.raises(CorruptStreamError):
            cache_from_bytes(CompressedCache, bad, model)
    flipped = bytearray(blob)
    flipped[len(blob) - 100] ^= 0x10
    with pytest.raises(CorruptStreamError):
        cache_from_bytes(CompressedCache, bytes(flipped), model)


def test_other_model_shape_is_refused():
    blob = cache_to_bytes(_filled(tiny_model("llama", 4, 2, 64)))
    with pytest.raises(ValueError, match="shaped"):
        cache_from_bytes(CompressedCache, blob, tiny_model("llama", 4, 1, 64))
