"""The lossless codec registry: codecs by name, so a stored name finds its decoder.

A codec is any object with

- ``name: str``: stored in every blob it writes (keep it stable: renaming breaks old files);
- ``encode(t, prediction, threads, **opts) -> (meta: dict, sections: dict[str, np.ndarray | bytes])``
  where ``t`` is a CPU, contiguous tensor, ``prediction`` a CPU tensor of the same shape or None,
  ``threads`` the worker count (0 = all cores); ``meta`` must be plain JSON;
- ``decode(meta, sections, prediction, threads) -> torch.Tensor`` (same dtype and shape as encoded).
  It must raise :class:`kvcodec.CorruptStreamError` for malformed ``meta``/``sections``.

Codecs of other modules register themselves on import (``register(MyCodec())``); ``get`` imports
the module of a known built-in name on first use, so decoding never depends on import order.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from kvcodec.errors import CorruptStreamError


class Codec(Protocol):
    name: str

    def encode(self, t, prediction, threads: int, **opts) -> tuple[dict, dict[str, Any]]: ...

    def decode(self, meta: dict, sections: dict[str, Any], prediction, threads: int): ...


# Built-in codec name -> module that registers it when imported.
_BUILTIN_MODULES = {
    "planes": "kvcodec.lossless.planes",
    "raw": "kvcodec.lossless.planes",
    "kvctx": "kvcodec.lossless.kv_context",
    "predictive": "kvcodec.lossless.predictive",
}

_codecs: dict[str, Codec] = {}


def register(codec: Codec, *, replace: bool = False) -> Codec:
    """Add ``codec`` under ``codec.name``; ValueError if the name is taken (unless ``replace``)."""
    name = getattr(codec, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError("a codec needs a non-empty string attribute 'name'")
    for method in ("encode", "decode"):
        if not callable(getattr(codec, method, None)):
            raise ValueError(f"codec {name!r} has no {method}() method")
    if name in _codecs and _codecs[name] is not codec and not replace:
        raise ValueError(f"a codec named {name!r} is already registered")
    _codecs[name] = codec
    return codec


def get(name: str) -> Codec:
    """The codec registered as ``name`` (importing its built-in module if needed); KeyError if none."""
    if name not in _codecs and name in _BUILTIN_MODULES:
        try:
            importlib.import_module(_BUILTIN_MODULES[name])
        except ModuleNotFoundError as exc:
            if exc.name != _BUILTIN_MODULES[name]:
                raise
    if name not in _codecs:
        raise KeyError(f"no lossless codec named {name!r} (registered: {', '.join(sorted(_codecs)) or 'none'})")
    return _codecs[name]


def get_for_decoding(name: Any) -> Codec:
    """Like :func:`get` for a name read from a stream: an unknown name is a CorruptStreamError."""
    if not isinstance(name, str):
        raise CorruptStreamError("codec name in stream is not a string")
    try:
        return get(name)
    except KeyError as exc:
        raise CorruptStreamError(str(exc.args[0])) from None


def has(name: str) -> bool:
    """Whether ``get(name)`` would succeed. A built-in module that fails to import counts as absent
    (with a warning), so one broken optional codec never stops the others."""
    try:
        get(name)
    except KeyError:
        return False
    except ImportError as exc:
        import warnings

        warnings.warn(f"lossless codec {name!r} is unavailable: {exc}", RuntimeWarning, stacklevel=2)
        return False
    return True


def available() -> list[str]:
    """Names of the usable codecs (importing the built-in modules)."""
    return sorted(set(_codecs) | {n for n in _BUILTIN_MODULES if has(n)})


def resolve_threads(threads: int) -> int:
    """Worker count for a ``threads`` argument: 0 means every core this process may use."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError(f"threads must be a non-negative integer, got {threads!r}")
    if threads:
        return threads
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
