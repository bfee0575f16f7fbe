"""kvcodec.weights on the CPU: the blob format keeps every bit, a compressed tiny Llama computes the same
logits and tokens as the dense one, checkpoints round-trip, damage raises CorruptStreamError."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig

from kvcodec import container
from kvcodec.errors import CorruptStreamError, WriteRefusedError
from kvcodec.weights import (HostWeight, compress_model, decompress_model, encode, load_model, model_report,
                             save_model)
from kvcodec.weights.blob import CHUNK_BYTES

FP8 = torch.float8_e4m3fn


def _config(tied: bool = True) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _model(dtype=torch.bfloat16, tied: bool = True):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(tied), dtype=dtype).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _greedy(model, ids):
    return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --------------------------------------------------------------------------- the format
def _weightlike(rng, shape, dtype, random_share: float) -> torch.Tensor:
    """N(0, 0.02) values with a share of uniformly random bit patterns (NaN payloads, -0.0, Inf,
    subnormals among them): a skewed exponent plane the codec codes, and every kind of value."""
    n = int(np.prod(shape))
    t = torch.from_numpy(rng.normal(0, 0.02, n).astype(np.float32)).to(dtype)
    raw = t.view(torch.uint8 if dtype == FP8 else torch.int16).clone()
    k = int(n * random_share)
    pos = torch.from_numpy(rng.choice(n, k, replace=False))
    if dtype == FP8:
        raw[pos] = torch.from_numpy(rng.integers(0, 256, k, dtype=np.uint8))
    else:
        raw[pos] = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, k, dtype=np.int16))
    return raw.view(dtype).reshape(shape)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, FP8]),
       shape=st.lists(st.integers(1, 300), min_size=1, max_size=3).filter(lambda s: np.prod(s) <= 120_000),
       random_share=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_every_bit_pattern_survives(dtype, shape, random_share, seed):
    t = _weightlike(np.random.default_rng(seed), shape, dtype, random_share)
    w = HostWeight(encode(t))  # checks the blob by a full decode against its crc32
    assert w.dtype == dtype and w.shape == tuple(shape)
    out = np.full(w.nbytes_decoded, 0xA5, np.uint8)  # poisoned: every byte must be written
    w.decode_into(out)
    assert np.array_equal(out, _bits(t).reshape(-1).numpy())
    assert torch.equal(_bits(w.decode()), _bits(t))


def test_special_values_and_fast_paths():
    specials = [0x7FC0, 0x7F81, 0xFFFF, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x807F]  # NaNs, -0, Inf, subnormals
    t = (torch.randn(64, 1000) * 0.02).to(torch.bfloat16)
    t.view(torch.int16).view(-1)[: len(specials)] = torch.tensor(specials, dtype=torch.int32).to(torch.int16)
    w = HostWeight(encode(t))
    assert w._fast[0] == "merged" and w.n_chunks == -(-t.numel() * 2 // CHUNK_BYTES)
    assert torch.equal(_bits(w.decode()), _bits(t))
    assert w.nbytes < 0.7 * t.numel() * 2  # the exponent is coded (~2.6 of its 8 bits)
    f8 = (torch.randn(256, 300) * 0.05).to(FP8)
    assert HostWeight(encode(f8))._fast[0] == "plain"


def test_chunks_of_rows_decode_those_rows():
    t = (torch.randn(2000, 96) * 0.02).to(torch.bfloat16)
    w = HostWeight(encode(t))
    rows = np.array([0, 7, 341, 499, 7, 1999])  # row 341 spans chunks 0 and 1
    out = np.zeros(w.nbytes_decoded, np.uint8)
    chunks = w.chunks_of_rows(rows, 96)
    assert 0 < chunks.size < w.n_chunks
    w.decode_into(out, chunks)
    got = torch.from_numpy(out).view(torch.bfloat16).reshape(2000, 96)
    assert torch.equal(_bits(got[rows]), _bits(t[rows]))


def _restream(blob: bytes, fn) -> bytes:
    """The blob with its exponent stream changed by ``fn`` and the container checksums made again,
    so only the codec's own checks (stream end states, the tensor's crc32) can see the damage."""
    kind, meta, secs = container.loads(blob)
    secs = {k: np.array(v) for k, v in secs.items()}
    fn(secs["p0"])
    return container.dumps(kind, meta, secs)


def _flip_word(words):
    words[words.size // 2] ^= 0x0100


@pytest.mark.parametrize("damage", ["header", "payload", "last", "truncated", "stream", "stream_end"])
def test_damaged_blob_raises(damage):
    t = (torch.randn(128, 600) * 0.02).to(torch.bfloat16)
    blob = bytearray(encode(t))
    if damage == "header":
        blob[20] ^= 0x10
    elif damage == "payload":
        blob[len(blob) // 2] ^= 0x01
    elif damage == "last":
        blob[-1] ^= 0x80
    elif damage == "truncated":
        blob = blob[:-100]
    elif damage == "stream":
        blob = _restream(bytes(blob), _flip_word)
    else:
        blob = _restream(bytes(blob), lambda w: w.__setitem__(-1, w[-1] ^ 1))
    with pytest.raises(CorruptStreamError):
        HostWeight(bytes(blob))


def test_damaged_stream_raises_on_later_decode_without_verify():
    t = (torch.randn(128, 600) * 0.02).to(torch.bfloat16)
    w = HostWeight(_restream(encode(t), _flip_word), verify=False)
    with pytest.raises(CorruptStreamError):
        w.decode_into(np.empty(w.nbytes_decoded, np.uint8))


# --------------------------------------------------------------------------- models
@pytest.mark.parametrize("dtype,tied", [(torch.bfloat16, True), (torch.float16, False)])
def test_compressed_model_same_logits_and_tokens(ids, dtype, tied):
    model = _model(dtype, tied)
    ref, ref_tokens = _logits(model, ids), _greedy(model, ids)
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = compress_model(model)
    assert torch.equal(_logits(model, ids), ref)
    assert torch.equal(model(ids).logits, ref)  # grad mode on: decoded into a fresh tensor
    assert torch.equal(_greedy(model, ids), ref_tokens)
    # report: one row per distinct Linear / Embedding weight, tied ones once
    assert len(report.rows) == 2 * 7 + (1 if tied else 2)
    assert report.nbytes == sum(r.nbytes for r in report.rows) < report.original_nbytes
    big = [n for n in dense if not n.endswith("norm.weight")]
    assert report.original_nbytes == sum(dense[n].numel() * dense[n].element_size() for n in big if n in dense)
    assert (1.4 if dtype == torch.bfloat16 else 1.1) < report.ratio < 2.0 and report.scratch_nbytes == max(r.original_nbytes for r in report.rows)
    first = report.rows[0]
    assert first.name == "model.embed_tokens.weight" and first.aliases == (("lm_head.weight",) if tied else ())
    assert first.shape == (512, 128) and first.dtype == str(dtype).removeprefix("torch.")
    assert model_report(model).to_dict() == report.to_dict()
    assert not any(n.endswith("proj.weight") for n, _ in model.named_parameters())  # held compressed
    with pytest.raises(ValueError):
        compress_model(model)
    decompress_model(model)
    restored = dict(model.named_parameters())
    assert set(restored) == set(dense) and all(torch.equal(_bits(restored[n]), _bits(dense[n])) for n in dense)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert torch.equal(_logits(model, ids), ref)


def test_save_load_round_trip(tmp_path, ids):
    model = _model()
    ref, ref_tokens = _logits(model, ids), _greedy(model, ids)
    dense_file = tmp_path / "dense.kvw"
    save_model(model, dense_file)  # a dense model: encoded while writing, left as it was
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)
    compress_model(model)
    path = tmp_path / "m.kvw"
    size = save_model(model, path)
    assert size == os.path.getsize(path) == os.path.getsize(dense_file)
    with pytest.raises(WriteRefusedError):
        save_model(model, path)
    save_model(model, path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["dense.kvw", "m.kvw"]  # no temporaries left
    loaded = load_model(path, _config())  # built on the meta device: no dense weight is made
    assert model_report(loaded).nbytes == model_report(model).nbytes
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # the tie: one placeholder
    assert torch.equal(_logits(loaded, ids), ref) and torch.equal(_greedy(loaded, ids), ref_tokens)
    into = load_model(dense_file, _model())  # into an existing model
    assert torch.equal(_logits(into, ids), ref)
    decompress_model(loaded)
    assert torch.equal(_logits(loaded, ids), ref)


@pytest.mark.parametrize("where", [0.3, 0.6, 0.95])
def test_damaged_checkpoint_raises(tmp_path, where):
    model = _model()
    path = tmp_path / "m.kvw"
    save_model(model, path)
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStreamError):
        load_model(path, _config())


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    path = tmp_path / "m.kvw"
    save_model(_model(), path)
    other = _config()
    other.intermediate_size = 192
    with pytest.raises(ValueError):
        load_model(path, other)


# --------------------------------------------------------------------------- compress on load
@pytest.mark.parametrize("tied,shards", [(True, False), (False, True)])
def test_safetensors_checkpoint_loads_compressed(tmp_path, ids, tied, shards):
    """A Hugging Face checkpoint folder (one file, or shards with an index) loads straight into the
    compressed form, built on the meta device: the dense model's logits and greedy tokens, the tie kept,
    the rotary frequencies (not in the checkpoint) made by the model itself."""
    model = _model(tied=tied)
    ref, ref_tokens = _logits(model, ids), _greedy(model, ids)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder, max_shard_size="100KB" if shards else "10GB")
    assert (folder / "model.safetensors.index.json").exists() == shards
    loaded = load_model(folder)  # the config from config.json
    report = model_report(loaded)
    dense = compress_model(_model(tied=tied))
    assert report.nbytes == dense.nbytes and report.original_nbytes == dense.original_nbytes
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert torch.equal(_logits(loaded, ids), ref) and torch.equal(_greedy(loaded, ids), ref_tokens)
    single = next(folder.glob("*.safetensors")) if not shards else None
    if single is not None:  # a file alone, with the config given
        assert torch.equal(_logits(load_model(single, _config(tied)), ids), ref)
    with pytest.raises(ValueError):
        load_model(folder, _model(tied=tied))  # a safetensors checkpoint builds its own model


def test_safetensors_checkpoint_of_another_shape_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    _model().save_pretrained(folder)
    other = _config()
    other.intermediate_size = 192
    with pytest.raises(ValueError):
        load_model(folder, other)
