"""The names transformers gives a model's cache, which changed in 5.24: a forward takes it as ``cache``
(``past_key_values`` before; the old keyword warns from 5.24 and is removed in 5.40), and outputs hold
it in ``cache``. kvcodec's own forwards (calibration, sensitivity) pass it by the name the model's
forward declares, so they work on every transformers the package allows without deprecation warnings."""

from __future__ import annotations

import inspect
import weakref

NEW, OLD = "cache", "past_key_values"
_KEYWORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward function -> its keyword


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` or ``past_key_values`` (a forward that
    declares neither, e.g. one taking ``**kwargs`` only: ``cache`` where transformers' decoders do)."""
    forward = model.forward
    fn = getattr(forward, "__func__", forward)  # a bound method: its class's function, the same every call
    try:
        return _KEYWORDS[fn]  # inspect.signature costs ~36 us: too much for a decode loop to pay each step
    except (KeyError, TypeError):
        pass
    keyword = _keyword_of(forward)
    try:
        _KEYWORDS[fn] = keyword
    except TypeError:  # not weakly referenceable: looked up each call
        pass
    return keyword


def _keyword_of(forward) -> str:
    try:
        params = inspect.signature(forward).parameters  # follows transformers' deprecation wrappers
    except (TypeError, ValueError):
        params = {}
    if NEW in params:
        return NEW
    if OLD in params:
        return OLD
    return NEW if _decoders_take_cache() else OLD


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model(**inputs, **cache_kwargs(model, cache))``."""
    return {cache_keyword(model): cache}


def output_cache(out):
    """The cache a forward or ``generate`` returned (``out.cache``; ``out.past_key_values`` before 5.24): by
    the output class's own field, so a missing cache is None and the deprecated alias is never read."""
    return getattr(out, NEW if NEW in getattr(type(out), "__dataclass_fields__", ()) else OLD)


def _decoders_take_cache() -> bool:
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    return NEW in inspect.signature(LlamaForCausalLM.forward).parameters
