"""Rebuild a quantizer from the JSON-able config a QuantizedTensor carries (cached).

A leaf module: quantizer classes are registered by ``kvcodec.quant`` when the package is imported
(``register``), so this module, and ``QuantizedTensor`` which uses it, import no quantizer.
"""

from __future__ import annotations

import json
from functools import lru_cache

from kvcodec.errors import CorruptStreamError

_classes: dict[str, type] = {}


def register(*classes: type) -> None:
    """Make quantizer classes rebuildable from their config, under their ``method`` name."""
    for cls in classes:
        _classes[cls.method] = cls
    _build.cache_clear()


@lru_cache(maxsize=128)
def _build(cfg_json: str):
    cfg = json.loads(cfg_json)
    cls = _classes.get(cfg.pop("method", None))
    if cls is None:
        raise CorruptStreamError(f"unknown quantizer method in {cfg_json}")
    try:
        return cls.from_config(cfg) if hasattr(cls, "from_config") else cls(**cfg)
    except (TypeError, ValueError) as e:
        raise CorruptStreamError(f"invalid quantizer config {cfg_json}: {e}") from e


def quantizer_from_config(cfg: dict):
    """The quantizer a config describes (same object for equal configs)."""
    try:
        key = json.dumps(cfg, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CorruptStreamError(f"quantizer config is not JSON: {e}") from e
    return _build(key)
