"""kvcodec.transform: RoPE undo/redo, calibration fit + safe files, rate/distortion control,
round trips on random and real KV, corrupt blobs, HF cache save/load."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec import container
from kvcodec import transform as T
from kvcodec.errors import CorruptStreamError, WriteRefusedError
from kvcodec.transform import blob as fmt

L, H, D = 2, 2, 16


def synthetic_kv(tokens: int, seed: int, rope: T.RoPE | None = None, start: int = 0):
    """K/V with a decaying spectrum in a fixed random basis (what PCA should find), keys post-RoPE."""
    g = torch.Generator().manual_seed(1234)  # the same "model" for every seed
    basis = torch.linalg.qr(torch.randn(L, 2, H * D, H * D, generator=g))[0]
    scale = 3.0 * 0.8 ** torch.arange(H * D, dtype=torch.float32)
    mean = torch.randn(L, 2, H * D, generator=g)
    z = torch.randn(L, 2, tokens, H * D, generator=torch.Generator().manual_seed(seed)) * scale
    x = z @ basis.transpose(-1, -2) + mean[:, :, None]
    x = x.reshape(L, 2, tokens, H, D).permute(0, 1, 3, 2, 4)
    k, v = x[:, 0].contiguous(), x[:, 1].contiguous()
    if rope is not None:
        k = rope.apply(k, torch.arange(start, start + tokens))
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


@pytest.fixture(scope="module")
def rope():
    return T.RoPE.default(D, 10000.0)


@pytest.fixture(scope="module")
def calib(rope):
    k, v = synthetic_kv(600, seed=1, rope=rope)
    return T.fit(k, v, rope)


def true_bits(blob, k) -> float:
    return len(blob) * 8 / (2 * k.numel())


def rel_sq_error(a, b) -> float:
    return float((a.double() - b.double()).pow(2).sum() / b.double().pow(2).sum())


# ------------------------------------------------------------------------------------ RoPE
def test_rope_matches_transformers_and_inverts():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = T.RoPE.default(64, 1e5)
    x = torch.randn(3, 50, 64)
    pos = torch.arange(7, 57)
    f = torch.tensor(rope.inv_freq, dtype=torch.float64)
    ang = torch.cat([pos[:, None] * f, pos[:, None] * f], dim=-1)
    ref, _ = apply_rotary_pos_emb(x, x, ang.cos().float(), ang.sin().float(), unsqueeze_dim=0)
    torch.testing.assert_close(rope.apply(x, pos), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.undo(rope.apply(x, pos), pos), x, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        T.RoPE.default(63, 1e5)


# ----------------------------------------------------------------------------- calibration
def test_fit_finds_an_orthonormal_basis_by_falling_variance(calib):
    b = calib.basis.astype(np.float64)
    assert calib.layers_per_group == 2 and calib.joint_kv and b.shape == (1, 1, 1, 4 * H * D, 4 * H * D)  # defaults
    assert np.allclose(np.einsum("lcgij,lcgik->lcgjk", b, b), np.eye(calib.dim), atol=1e-4)
    ev = calib.eigenvalues
    assert np.all(np.diff(ev, axis=-1) <= 1e-9)
    assert ev[..., 0].min() > 5 * ev[..., -1].max()  # the decaying spectrum was found
    per_head = T.fit(*synthetic_kv(300, 2), None, per_head=True, layers_per_group=1, joint_kv=False)
    assert per_head.basis.shape == (L, 2, H, D, D)


@pytest.mark.parametrize("per_head,g,joint", [(False, 1, False), (True, 2, True), (False, 2, False), (True, 1, True)])
def test_vector_layouts_invert(per_head, g, joint):
    from kvcodec.transform.calibration import stack_parts, unstack_parts

    k, v = torch.randn(4, 3, 5, 8), torch.randn(4, 3, 5, 8)
    x = stack_parts(k, v, per_head, g, joint)
    assert x.shape == (4 // g, 1 if joint else 2, 3 if per_head else 1, 5, (2 if joint else 1) * g * (8 if per_head else 24))
    kb, vb = unstack_parts(x, 3, per_head, g, joint)
    assert torch.equal(kb, k) and torch.equal(vb, v)
    with pytest.raises(ValueError):
        T.fit(k, v, None, layers_per_group=3)


def test_truncated_rank_codes_only_the_kept_components(rope):
    k, v = synthetic_kv(600, seed=1, rope=rope)
    full, cut = T.fit(k, v, rope), T.fit(k, v, rope, rank=40)
    assert cut.basis.shape[-1] == 40 and cut.eigenvalues.shape[-1] == 40
    assert T.Calibration.from_bytes(cut.to_bytes()).rank == 40
    same = full.truncated(40)
    assert np.array_equal(same.basis, cut.basis) and same.fingerprint == cut.fingerprint
    k2, v2 = synthetic_kv(700, seed=3, rope=rope)
    errs = [rel_sq_error(T.decode(T.encode(k2, v2, c, bits=4.0, window=16), c)[1], v2) for c in (full, cut)]
    assert errs[0] < errs[1] < 0.05  # the dropped tail costs a little at a high rate, nothing breaks


def test_calibration_file_round_trip_and_validation(calib, tmp_path):
    path = tmp_path / "model.kvtc"
    calib.save(path)
    with pytest.raises(WriteRefusedError, match="already exists"):  # kvcodec.safe_write's rules
        calib.save(path)
    calib.save(path, overwrite=True)
    back = T.Calibration.load(path)
    assert back.fingerprint == calib.fingerprint and back.rope == calib.rope
    raw = path.read_bytes()
    # any flipped byte is detected (container CRCs)
    for pos in (0, 5, 20, len(raw) // 2, len(raw) - 1):
        bad = bytearray(raw)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptStreamError):
            T.Calibration.from_bytes(bytes(bad))
    # a well-formed file with the wrong version, a non-orthonormal basis, or extra arrays is refused
    meta, arrays = calib.meta(), calib.arrays()
    cases = [({**meta, "version": 99}, arrays),
             (meta, {**arrays, "basis": arrays["basis"] * 1.5}),
             (meta, {**arrays, "extra": np.zeros(3, np.float32)}),
             (meta, {**arrays, "scales": np.zeros_like(arrays["scales"])}),
             ({**meta, "n_layers": 3}, arrays)]
    for m, a in cases:
        with pytest.raises(CorruptStreamError):
            T.Calibration.from_bytes(container.dumps("kvcodec.transform.calibration", m, a))
    # not a container (e.g. a pickle or an npz) is refused, never unpickled
    import pickle

    with pytest.raises(CorruptStreamError):
        T.Calibration.from_bytes(pickle.dumps({"basis": 1}))


def test_query_weighted_keys(rope):
    from kvcodec.transform.calibration import query_key_scales

    q = torch.randn(L, 2 * H, 50, D) * torch.linspace(0.1, 3, D)
    s = query_key_scales(q, H)
    assert s.shape == (L, H, D) and torch.allclose(s[..., : D // 2], s[..., D // 2:])  # RoPE pairs share a scale
    torch.testing.assert_close(s.pow(2).mean(-1), torch.ones(L, H), atol=0.05, rtol=0)
    k, v = synthetic_kv(400, seed=2, rope=rope)
    cal = T.fit(k, v, rope, key_scales=s)
    kh, _ = T.decode(T.encode(k, v, cal, distortion=0.001, window=16), cal)
    assert rel_sq_error(kh, k) < 0.01  # scaling is undone on decode
    with pytest.raises(ValueError):
        T.fit(k, v, rope, key_scales=-s)


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("bits", [4.0, 2.0, 1.0])
def test_rate_is_honoured_on_random_kv(calib, rope, bits):
    k, v = synthetic_kv(1500, seed=7, rope=rope)
    blob = T.encode(k, v, calib, bits=bits, window=32)
    assert abs(true_bits(blob, k) / bits - 1) <= 0.02
    info = T.inspect(blob)
    assert info["bytes"] == len(blob) and abs(info["bits_per_value"] - true_bits(blob, k)) < 1e-12


def test_distortion_target_and_exact_tokens(calib, rope):
    k, v = synthetic_kv(800, seed=8, rope=rope, start=5)
    blob = T.encode(k, v, calib, distortion=0.01, sinks=4, window=20, positions_start=5)
    kh, vh = T.decode(blob, calib)
    assert kh.dtype == torch.bfloat16 and kh.shape == k.shape
    # exact tokens are bit-exact
    for a, b in ((kh, k), (vh, v)):
        assert torch.equal(a[:, :, :4].view(torch.int16), b[:, :, :4].view(torch.int16))
        assert torch.equal(a[:, :, -20:].view(torch.int16), b[:, :, -20:].view(torch.int16))
    mid = slice(4, 800 - 20)
    err = (rel_sq_error(kh[:, :, mid], k[:, :, mid]) * k[:, :, mid].float().pow(2).sum()
           + rel_sq_error(vh[:, :, mid], v[:, :, mid]) * v[:, :, mid].float().pow(2).sum())
    err = float(err / (k[:, :, mid].float().pow(2).sum() + v[:, :, mid].float().pow(2).sum()))
    assert 0.003 < err < 0.013  # within the stated distortion (bf16 output rounding included)
    # more bits, less error: the rate parameter is monotone in quality
    errs = [rel_sq_error(T.decode(T.encode(k, v, calib, bits=b, window=20), calib)[0], k) for b in (1.0, 2.0, 4.0)]
    assert errs[0] > errs[1] > errs[2]


def test_short_sequences_are_all_exact(calib, rope):
    k, v = synthetic_kv(30, seed=3, rope=rope)
    blob = T.encode(k, v, calib, distortion=0.1, sinks=4, window=128)
    kh, vh = T.decode(blob, calib)
    assert torch.equal(kh.view(torch.int16), k.view(torch.int16)) and torch.equal(vh.view(torch.int16), v.view(torch.int16))
    with pytest.raises(ValueError, match="does not cover"):
        T.encode(k, v, calib, bits=2.0)  # 30 exact tokens cost more than 2 bits/value


def test_bad_arguments(calib, rope):
    k, v = synthetic_kv(200, seed=4, rope=rope)
    for kw in ({"bits": 0}, {"bits": 20}, {"distortion": 1.5}, {"bits": 2, "distortion": 0.1}, {"window": -1},
               {"rounding": 0.5}):
        with pytest.raises(ValueError):
            T.encode(k, v, calib, **kw)
    with pytest.raises(ValueError):
        T.encode(k[:1], v[:1], calib)
    with pytest.raises(ValueError):
        T.encode(k.int(), v.int(), calib)
    other = T.fit(*synthetic_kv(300, 9), None)
    blob = T.encode(k, v, calib, distortion=0.05, window=16)
    with pytest.raises(ValueError, match="calibration"):
        T.decode(blob, other)


def test_real_smollm2_kv():
    from kvcodec.data import attention_reference, load_kv_sample

    s = load_kv_sample()
    layers = slice(0, 3)  # layers 0, 4 and 8 of the model: enough for a real-data check, 3x cheaper
    keys, values = s.keys[layers], s.values[layers]
    cal = T.fit(keys[:, :, :128], values[:, :, :128], T.RoPE.default(64, s.meta["rope_theta"]))
    blob = T.encode(keys, values, cal, bits=3.0, window=16)
    assert abs(true_bits(blob, keys) / 3.0 - 1) <= 0.02
    k, v = T.decode(blob, cal)
    num = den = 0.0
    for i in range(3):
        ref = attention_reference(s, i)
        num += float((attention_reference(s, i, k[i], v[i]) - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    assert math.sqrt(num / den) < 0.35  # measured 0.23 (calibration on 128 tokens of the same text, 20 exact tokens)


def test_undoing_rope_matters(calib, rope):
    k, v = synthetic_kv(900, seed=12, rope=rope)
    blind = T.fit(*synthetic_kv(600, seed=1, rope=rope), None)  # the same data, RoPE left on the keys
    errs = [rel_sq_error(T.decode(T.encode(k, v, c, bits=2.0, window=16), c)[0], k) for c in (calib, blind)]
    assert errs[0] * 3 < errs[1]


def test_hf_dynamic_cache_round_trip(calib, rope):
    from transformers import DynamicCache

    k, v = synthetic_kv(300, seed=5, rope=rope)
    cache = DynamicCache()
    for i in range(L):
        cache.update(k[i][None], v[i][None], i)
    blob = T.encode_cache(cache, calib, distortion=0.01, window=16)
    back = T.decode_cache(blob, calib)
    assert back.get_seq_length() == 300 and len(back.layers) == L
    kh, _ = T.decode(blob, calib)
    assert torch.equal(back.layers[1].keys[0], kh[1])
    with pytest.raises(ValueError):
        T.encode_cache(DynamicCache(), calib)


def test_hf_decode_into_a_static_compressed_cache(calib, rope):
    """decode_cache into kvcodec's static cache (the default CompressedCache on CUDA; growable here):
    filled through its eager form, the same compressed bytes as decoding into an eager cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcodec.hf import CompressedCache
    from kvcodec.hf.static_cache import StaticCompressedCache

    k, v = synthetic_kv(300, seed=5, rope=rope)
    blob = T.encode(k, v, calib, distortion=0.01, window=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=2 * H * D, intermediate_size=32,
                                         num_hidden_layers=L, num_attention_heads=2 * H, num_key_value_heads=H,
                                         head_dim=D)).eval()
    kw = dict(method="turboquant", key_bits=4, value_bits=4, residual=16, block_size=16)
    static = T.decode_cache(blob, calib, cache=StaticCompressedCache(model, **kw, max_cache_len=None))
    eager = T.decode_cache(blob, calib, cache=CompressedCache(model.config, **kw))
    assert int(static.lengths.seen) == 300 and static.first_layer.max_cache_len >= 300
    back = static.to_eager()
    for a, b in zip(back.layers, eager.layers):
        (ka, va), (kb, vb) = a.store.materialize(), b.store.materialize()
        assert torch.equal(ka, kb) and torch.equal(va, vb)


# ------------------------------------------------------------------------------ corruption
@pytest.fixture(scope="module")
def small_blob(calib, rope):
    k, v = synthetic_kv(260, seed=6, rope=rope)
    return T.encode(k, v, calib, distortion=0.02, window=16, chunk=1024)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_blobs_raise(small_blob, calib, data):
    blob = bytearray(small_blob)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if kind == "flip":
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        blob += bytes(data.draw(st.integers(1, 64)))
    with pytest.raises(CorruptStreamError):
        T.decode(bytes(blob), calib)


def test_inspect_and_verify_need_no_calibration(small_blob):
    info = T.inspect(small_blob)
    assert info["shape"] == [L, H, 260, D] and info["exact_tokens"] == 20 and info["coded_tokens"] == 240
    assert T.verify(small_blob) >= info["coded_components"] * 240
    bad = bytearray(small_blob)
    bad[-3] ^= 1
    with pytest.raises(CorruptStreamError):
        T.verify(bytes(bad))


def test_cli_inspect_names_and_verifies_transform_files(small_blob, calib, tmp_path):
    from kvcodec import inspection

    blob_path, calib_path = tmp_path / "prefix.kvt", tmp_path / "model.kvtc"
    blob_path.write_bytes(small_blob)
    calib.save(calib_path)
    for path, kind in ((blob_path, "kvcodec.transform"), (calib_path, "kvcodec.transform.calibration")):
        fmt_ = inspection.identify(path)
        assert fmt_.key == kind
        inspection.describe(path, fmt_.key, verify=True)
    assert "bits/value" in inspection.describe(blob_path, "kvcodec.transform").table
    bad = bytearray(small_blob)
    bad[len(bad) // 2] ^= 4
    blob_path.write_bytes(bytes(bad))
    with pytest.raises(CorruptStreamError):
        inspection.describe(blob_path, "kvcodec.transform", verify=True)


def _remeta(blob, **changes) -> bytes:
    """A well-formed container (valid CRCs) whose transform meta is edited: the semantic checks must catch it."""
    _, meta, sections = container.loads(blob)
    return container.dumps(fmt.KIND, {**meta, **changes}, {k: bytes(v) if isinstance(v, memoryview) else v
                                                           for k, v in sections.items()})


def test_forged_headers_are_refused_before_allocation(small_blob, calib):
    meta = container.loads(small_blob)[1]
    L_, H_, T_, D_ = meta["shape"]
    forged = [
        {"shape": [L_, H_, 1 << 24, D_]},  # would allocate gigabytes
        {"shape": [L_, H_, T_ + 1, D_]},
        {"version": 1}, {"dtype": "int8"}, {"step": -1.0}, {"chunk": 0},
        {"classes": meta["classes"][:-1]}, {"classes": [[300, 0, 1, 1, 1]]}, {"sinks": 3},
    ]
    for change in forged:
        with pytest.raises(CorruptStreamError):
            T.decode(_remeta(small_blob, **change), calib, max_output_bytes=1 << 26)
    with pytest.raises(CorruptStreamError):
        T.decode(_remeta(small_blob, shape=[L_ + 1, H_, T_, D_]), calib)
    huge = _remeta(small_blob, shape=[L_, H_, 1 << 24, D_])  # a working set of gigabytes (the most tokens a header may say)
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):  # the library's default cap
        T.decode(huge, calib)
    with pytest.raises(CorruptStreamError) as exc:  # no cap: refused further on (the streams do not fit)
        T.decode(huge, calib, max_output_bytes=None)
    assert "max_output_bytes" not in str(exc.value)


@pytest.mark.gpu
def test_gpu_decode_matches_cpu(calib, rope):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    k, v = synthetic_kv(3000, seed=11, rope=rope)
    blob = T.encode(k, v, calib, bits=2.0, chunk=4096)
    kc, vc = T.decode(blob, calib)
    kg, vg = T.decode(blob, calib, device="cuda")
    for a, b in ((kc, kg), (vc, vg)):
        assert (a.float() - b.float().cpu()).abs().max() <= 0.02 * a.float().abs().max()
    # the same blob encoded from CUDA tensors honours the rate
    blob_g = T.encode(k.cuda(), v.cuda(), calib, bits=2.0)
    assert abs(true_bits(blob_g, k) / 2.0 - 1) <= 0.02


# ------------------------------------------------------------------- measured distortion weights
@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def test_sensitivity_weights_follow_the_models_kl(tiny_llama, monkeypatch):
    from kvcodec.transform import sensitivity

    ids = torch.randint(0, 96, (1, 160), generator=torch.Generator().manual_seed(1))
    found = []
    monkeypatch.setattr(sensitivity, "weights_from", lambda ms: found.extend(ms) or np.ones((4, 2)))
    calib = sensitivity.fit_model(tiny_llama, [ids], layers_per_group=2, joint_kv=True, scored=24, window=16)
    assert calib.weighting == "custom" and calib.layers_per_group == 2 and calib.joint_kv
    (m,) = found
    assert m["kl"].shape == (4, 2) and np.all(m["kl"] > 0) and np.all(m["sq_error"] > 0) and m["tokens"] == 24
    w = sensitivity.weights_from([m, m])
    assert w.shape == (4, 2) and abs(w.mean() - 1) < 1e-9 and w.min() >= sensitivity.WEIGHT_FLOOR * np.median(w) * 0.999
    # a part whose weight is raised gets less error at the same total distortion
    k, v = sensitivity._prefix_kv(tiny_llama, ids[:, :136])
    heavy = np.ones((4, 2))
    heavy[1, 0] = 30.0
    cals = [T.fit(k, v, calib.rope, weights=w_, layers_per_group=2, joint_kv=True) for w_ in (heavy, np.ones((4, 2)))]
    errs = [rel_sq_error(T.decode(T.encode(k, v, c, distortion=0.05, window=16), c)[0][1], k[1]) for c in cals]
    assert errs[0] < errs[1] / 2  # measured 0.019 vs 0.045


def test_hf_compressed_cache_saved_and_loaded_as_a_file(tiny_llama, tmp_path):
    """A kvcodec CompressedCache prefix goes to a transform-coded file and back into a new cache."""
    from kvcodec.hf import CompressedCache
    from kvcodec.transform import hf as thf

    cfg = tiny_llama.config
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, 2, 300, 16, generator=g), torch.randn(4, 2, 300, 16, generator=g)
    cache = CompressedCache(cfg, key_bits=4)
    for i in range(4):
        cache.update(k[i][None], v[i][None], i)
    held_k, held_v = thf.cache_tensors(cache)  # what the cache holds: its own 4-bit error included
    cal = T.fit(k, v, None)
    path = tmp_path / "prefix.kvt"
    n = thf.save_cache(cache, path, cal, distortion=0.01, window=16)
    assert path.stat().st_size == n and not list(tmp_path.glob(".*.kvcodec-tmp.*"))  # no temporary left
    back = thf.load_cache(path, cal, cache=CompressedCache(cfg, key_bits=4))
    assert isinstance(back, CompressedCache) and back.get_seq_length() == 300
    dense = thf.load_cache(path, cal)
    assert rel_sq_error(dense.layers[2].keys[0], held_k[2]) < 0.03
    with pytest.raises(ValueError, match="empty cache"):
        thf.load_cache(path, cal, cache=back)
    # the same through CompressedCache's own save/load (a delegating hook)
    cache.save(tmp_path / "hook.kvt", transform=cal, distortion=0.01, window=16)
    assert (tmp_path / "hook.kvt").read_bytes() == path.read_bytes()
    again = CompressedCache.load(tmp_path / "hook.kvt", cfg, transform=cal)
    assert isinstance(again, CompressedCache) and again.get_seq_length() == 300
