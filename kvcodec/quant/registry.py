"""Rebuild a quantizer from the JSON-able config a QuantizedTensor carries (cached)."""

from __future__ import annotations

import json
from functools import lru_cache

from kvcodec.errors import CorruptStreamError


def _classes() -> dict:
    from kvcodec.quant.kivi import KIVI
    from kvcodec.quant.outliers import TurboQuantOutlier
    from kvcodec.quant.qjl import QJL
    from kvcodec.quant.turboquant import TurboQuantMSE, TurboQuantProd

    return {c.method: c for c in (TurboQuantMSE, TurboQuantProd, QJL, KIVI, TurboQuantOutlier)}


@lru_cache(maxsize=128)
def _build(cfg_json: str):
    cfg = json.loads(cfg_json)
    cls = _classes().get(cfg.pop("method", None))
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
