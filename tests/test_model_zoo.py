"""The model zoo itself: every entry builds, generates the same greedy tokens with an explicit
``DynamicCache(config=...)`` and with no cache argument, and its sliding window (where it has one) is
shorter than the prompt and changes the logits."""

import warnings

import pytest
import torch
import transformers

import model_zoo
from kvcodec.cache_argument import cache_kwargs

PROMPT = 40
NEW = 24
NAMES = [name for name, _ in model_zoo.zoo()]


def _entry_or_skip(name):
    e = model_zoo.entry(name)
    if not e.available():
        pytest.skip(f"transformers {transformers.__version__} has no {e.config_class}")
    if e.skip:
        pytest.skip(e.skip)
    return e


def _prompt(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model_zoo.VOCAB, (1, PROMPT), generator=g)


def _generate(model, ids, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, **kw)


def _window(config):
    """The shortest local attention span the config sets (sliding window, local window, attention chunk)."""
    spans = [getattr(config, a, None) for a in ("sliding_window", "window_size", "attention_chunk_size")]
    spans = [s for s in spans if isinstance(s, int) and s > 0]
    return min(spans) if spans else None


def test_zoo_size_and_metadata():
    entries = [e for _, e in model_zoo.zoo()]
    assert len(NAMES) == len(set(NAMES))
    archs = {e.config_class for e in entries if e.available()}
    assert len(archs) >= 25
    for e in entries:
        assert isinstance(e.features, frozenset)
        assert isinstance(e.attention_kv, bool)
    feats = set().union(*(e.features for e in entries if e.available() and not e.skip))
    for f in ("sliding", "softcap", "mla", "hybrid", "fused_qkv", "mqa", "nope", "bias", "multiplier"):
        assert f in feats, f


@pytest.mark.parametrize("name", NAMES)
def test_generate_dynamic_cache_matches_default(name):
    e = _entry_or_skip(name)
    model, config = model_zoo.build(name)
    if not model_zoo.supports_dynamic_cache(model):
        pytest.skip(f"transformers {transformers.__version__}: {type(model).__name__} keeps its state in its own "
                    f"cache class ({', '.join(model_zoo.own_cache_classes(model))}); generate takes no DynamicCache")
    assert next(model.parameters()).dtype == torch.float32
    assert not model.training
    ids = _prompt()
    if not e.attention_kv:  # state-space models keep their own cache class (transformers 5.17: Mamba's)
        assert _generate(model, ids).shape == (1, PROMPT + NEW)
        return
    cache = transformers.DynamicCache(config=model.config)
    with_cache = _generate(model, ids, **cache_kwargs(model, cache))
    default = _generate(model, ids)
    assert with_cache.shape == (1, PROMPT + NEW)
    assert torch.equal(with_cache, default), (with_cache[0, PROMPT:].tolist(), default[0, PROMPT:].tolist())
    if e.attention_kv:
        # the cache passed in is the one generate filled
        assert cache.get_seq_length() > 0


@pytest.mark.parametrize("name", [n for n, e in model_zoo.zoo() if "sliding" in e.features or "chunked" in e.features])
def test_sliding_window_is_exercised(name):
    _entry_or_skip(name)
    model, config = model_zoo.build(name)
    window = _window(config)
    assert window is not None and window < PROMPT, window
    ids = _prompt()
    with torch.no_grad():
        local = model(ids).logits[0, -1]
    attr = next(a for a in ("sliding_window", "window_size", "attention_chunk_size")
                if getattr(config, a, None) == window)
    wide, _ = model_zoo.build(name, **{attr: 4 * PROMPT})
    with torch.no_grad():
        full = wide(ids).logits[0, -1]
    assert not torch.allclose(local, full, atol=1e-5), "the window does not change the last logits"


@pytest.mark.parametrize("name", NAMES)
def test_attention_modules_take_a_cache_argument(name):
    e = _entry_or_skip(name)
    model, _ = model_zoo.build(name)
    attn = model_zoo.attention_modules(model)
    if not e.attention_kv:
        assert not attn
        return
    assert attn
    for qn, m in attn:
        assert model_zoo.cache_arg(m) is not None, (qn, type(m).__name__)
    projs = {p: getattr(m, p) for _, m in attn for p in model_zoo.projections(m)}
    qkv = {p: mod for p, mod in projs.items() if p not in ("o_proj", "out_proj", "dense", "c_proj")}
    if "bias" in e.features:
        assert any(getattr(mod, "bias", None) is not None for mod in qkv.values()), sorted(qkv)
    if "fused_qkv" in e.features:
        assert not {"q_proj", "k_proj", "v_proj"} <= set(projs), sorted(projs)
