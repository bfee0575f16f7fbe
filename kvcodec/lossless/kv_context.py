"""Codec ``"kvctx"``: lossless KV cache coding with no second model.

Why: a KV cache ``[..., heads, tokens, head_dim]`` is far from i.i.d. bytes. Each (head,
channel) has its own location and spread (keys carry a few large outlier channels), and many
key channels drift slowly from token to token (low RoPE frequencies). kvctx fits, per leading
index and channel, a location, a previous-token coefficient and a scale, plus one shared
shape CDF for the whole tensor, stores them quantised, and codes every scalar's bit pattern
with the probability that model gives it (the engine of :mod:`kvcodec.lossless.predictive` with
no prediction; format 2: bins and per-class tables, see docs/lossless_kv.md). Every bit pattern
round-trips.
"""

from __future__ import annotations

from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.predictive.codec import decode_tensor, encode_tensor, parse_stream


class KVContextCodec:
    """Codec ``"kvctx"``: per-(head, channel) location/scale + previous-token model, no predictor."""

    name = "kvctx"

    def encode(self, t, prediction=None, threads: int = 0, version: int | None = None, **opts):
        """``version``: the stream format (None: format 2; ``predictive.codec.default_version``)."""
        if opts:
            raise ValueError(f"unknown option(s) for the kvctx codec: {', '.join(sorted(opts))}")
        if prediction is not None:
            raise ValueError("the kvctx codec takes no prediction (use codec='predictive')")
        return encode_tensor(t, None, "none", threads, version)

    def decode(self, meta, sections, prediction=None, threads: int = 0):
        if prediction is not None:
            raise CorruptStreamError("the kvctx codec takes no prediction")
        return decode_tensor(meta, sections, None, threads)

    def validate(self, meta, sections) -> None:
        """Check meta and sections against each other (CorruptStreamError) without decoding."""
        parse_stream(meta, sections)


def _register() -> None:
    from kvcodec.lossless.registry import register

    register(KVContextCodec(), replace=True)


_register()
