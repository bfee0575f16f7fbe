"""The lossless codec registry: codecs by name, so a stored name finds its decoder.

A codec is any object with

- ``name: str``: stored in every blob it writes (keep it stable: renaming breaks old files);
- ``encode(t, prediction, threads, **opts) -> (meta: dict, sections: dict[str, np.ndarray | bytes])``
  where ``t`` is a CPU, contiguous tensor, ``prediction`` a CPU tensor of the same shape or None,
  ``threads`` the worker count (0 = all cores); ``meta`` must be plain JSON;
- ``decode(meta, sections, prediction, threads) -> torch.Tensor`` (same dtype and shape as encoded).
  It must raise :class:`kvcodec.CorruptStreamError` for malformed ``meta``/``sections``;
- optionally ``validate(meta, sections)``: the same checks without decoding (CorruptStreamError),
  run by ``kvcodec.lossless.validate``; every built-in codec has one.

Codecs register themselves when their module is imported (``register(MyCodec())``); the built-in
ones (``planes``, ``raw``, ``kvctx``, ``predictive``) are imported by ``kvcodec.lossless``'s
``__init__``, which runs before any of its submodules, so decoding never depends on import order.
The registry imports no codec: codecs depend on it, never the reverse.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvcodec.errors import CorruptStreamError
from kvcodec.threads import resolve_threads  # noqa: F401  (kept importable from here)


class Codec(Protocol):
    name: str

    def encode(self, t, prediction, threads: int, **opts) -> tuple[dict, dict[str, Any]]: ...

    def decode(self, meta: dict, sections: dict[str, Any], prediction, threads: int): ...


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
    """The codec registered as ``name``; KeyError if none."""
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
    """Whether a codec is registered as ``name``."""
    return name in _codecs


def available() -> list[str]:
    """Names of the registered codecs."""
    return sorted(_codecs)
