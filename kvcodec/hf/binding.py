"""How a kvcodec cache reaches a transformers model's attention without leaving the model changed.

Every decoder in transformers hands its new K/V to ``Cache.update`` and then calls the attention
function named by ``config._attn_implementation`` with the module, but not the cache. :func:`attach`
adds one forward pre-hook and one forward hook to the model object the user calls. When a forward
receives a kvcodec cache (under any argument name: ``past_key_values`` up to transformers 5.23,
``cache`` from 5.24, or positionally), the pre-hook *binds* it for that forward:

* the cache's compressed layers return only the new tokens from ``update`` (the history stays
  compressed) and the attention function reads the rest from the layer;
* every config of the model names kvcodec's attention (with the mask format of the model's own
  implementation: ``"kvcodec"`` builds SDPA's boolean masks, ``"kvcodec_eager"`` eager's additive
  ones) and carries the bound cache, which the attention function finds through ``module.config``.

The forward hook puts every config back when the forward ends, also when it raises, and checks
that each compressed layer's new tokens were attended by kvcodec (a model whose attention bypasses
the attention interface is refused loudly instead of attending only its new tokens). Attention
modules are found by nothing but their ``layer_idx`` and ``config``: no projection names.

A forward without a kvcodec cache sees the model exactly as it was; nothing else is changed.
One forward at a time per model (two threads running one model with two caches would share the
binding).
"""

from __future__ import annotations

import contextlib

import torch

BOUND_ATTR = "_kvcodec_bound"  # on a config, during a bound forward: the Binding
_ATTACH_ATTR = "_kvcodec_attach"  # on the model: its Attachment
NAME = "kvcodec"  # the attention implementations kvcodec.hf.attention registers
EAGER_NAME = NAME + "_eager"  # the same function with eager's additive float masks


class Binding:
    """What the attention function needs during one bound forward: the cache and, per config, the
    implementation the model had (its non-compressed layers keep using it)."""

    __slots__ = ("cache", "original")

    def __init__(self, cache, original: str):
        self.cache = cache
        self.original = original


class Attachment:
    """The hooks :func:`attach` installed on one model, and the configs they switch."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.depth = 0
        self._configs = None
        self.saved: list[tuple[object, object]] = []
        self.cache = None
        # models whose class declares it attends through transformers' attention interface; the others
        # (Falcon, Bloom, GPT-Neo, StableLM, MPT in some releases) branch on the implementation's name
        # themselves: their configs are left alone and their layers return the history decoded
        self.interface = bool(getattr(model, "_supports_attention_backend", False))
        self.handles = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._exit, with_kwargs=True, always_call=True),
        ]

    def configs(self) -> list:
        """Every distinct config object of the model's modules (the text config of a multimodal model
        included): the attention function reads ``module.config``. Found once: the walk of a 32-layer
        Llama's 423 modules took 1.7 ms on the 2-core CPU, too much for every decode step."""
        if self._configs is None:
            self._configs = self._find_configs()
        return self._configs

    def _find_configs(self) -> list:
        seen, out = set(), []
        for module in self.model.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation_internal") and id(cfg) not in seen:
                seen.add(id(cfg))
                out.append(cfg)
        return out

    def _enter(self, module, args, kwargs):
        if self.depth:  # a nested call of the same model inside a bound forward
            self.depth += 1
            return None
        cache = _find_cache(args, kwargs)
        if cache is not None:
            self.bind(cache)
            cache.before_forward(args, kwargs)
        return None

    def bind(self, cache) -> None:
        self.depth, self.cache, self.saved = 1, cache, []
        if not self.interface:
            cache.bind(True, decoded=True)
            return
        for cfg in self.configs():
            original = cfg._attn_implementation_internal
            self.saved.append((cfg, original))
            cfg._attn_implementation_internal = implementation_for(self.model, original, cache)
            setattr(cfg, BOUND_ATTR, Binding(cache, original))
        cache.bind(True)

    def _exit(self, module, args, kwargs, output):
        if not self.depth:
            return None
        self.depth -= 1
        if not self.depth:
            self.unbind(completed=output is not None)
        return None

    def unbind(self, completed: bool = True) -> None:
        cache, self.cache = self.cache, None
        for cfg, original in self.saved:
            cfg._attn_implementation_internal = original
            if BOUND_ATTR in cfg.__dict__:
                delattr(cfg, BOUND_ATTR)
        self.saved = []
        cache.bind(False)
        cache.check_attended(completed)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def implementation_for(model, original, cache) -> str:
    """The attention implementation a bound forward switches ``model`` to: the cache's own (static
    caches), else kvcodec with the mask format of the model's implementation (eager where the model
    runs eager or cannot run SDPA: soft-capping and sink models)."""
    name = getattr(cache, "attention_name", NAME)
    if name != NAME:
        return name
    return EAGER_NAME if original == "eager" or not getattr(model, "_supports_sdpa", True) else NAME


def _find_cache(args, kwargs):
    """The kvcodec cache among a forward's arguments, whatever their names (kvcodec caches, and only
    they, carry ``binds``: True when built with the model)."""
    for value in (*kwargs.values(), *args):
        if getattr(value, "binds", False) is True:
            return value
    return None


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Install the binding hooks on ``model`` (idempotent). They act only in forwards that receive a
    kvcodec cache; the attention functions they switch to are registered by ``kvcodec.hf.attention``."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"expected a transformers model, got {type(model).__name__}")
    if getattr(model, _ATTACH_ATTR, None) is None:
        object.__setattr__(model, _ATTACH_ATTR, Attachment(model))
    return model


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Remove the hooks :func:`attach` installed (nothing else was changed)."""
    attachment = getattr(model, _ATTACH_ATTR, None)
    if attachment is not None:
        attachment.remove()
        object.__setattr__(model, _ATTACH_ATTR, None)
    return model


@contextlib.contextmanager
def bound_to(model: torch.nn.Module, cache):
    """Bind ``cache`` to ``model`` for a block of code, for callers that run ``model.forward`` (or a
    compiled copy of it) directly, which skips the hooks::

        with kvcodec.hf.use(model, cache):
            logits = compiled_forward(input_ids=ids, cache=cache).logits  # past_key_values= before 5.24
    """
    attachment = getattr(attach(model), _ATTACH_ATTR)  # kvcodec.hf.use registers the attention first
    if attachment.depth:
        raise RuntimeError("a kvcodec cache is already bound to this model")
    attachment.depth = 1
    attachment.bind(cache)
    ok = False
    try:
        yield cache
        ok = True
    finally:
        attachment.depth = 0
        attachment.unbind(completed=ok)


def bound(module) -> Binding | None:
    """The binding of the forward ``module`` runs in, or None."""
    return getattr(getattr(module, "config", None), BOUND_ATTR, None)
