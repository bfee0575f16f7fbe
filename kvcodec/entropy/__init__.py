"""kvcodec.entropy: exact static entropy coders behind one front door.

>>> from kvcodec import entropy
>>> blob = entropy.encode(symbols, coder="rans")     # "rans" | "tans" | "arith"
>>> entropy.decode(blob)                              # same values, dtype and length

``encode`` counts the symbols, quantizes the counts to a power-of-two total (``freq``), codes
them with the chosen coder and wraps the payload in a self-describing, checksummed stream
(``stream``; layout in docs/format.md). ``impl="reference"`` runs the pure-Python coders (the
specification); ``impl="fast"`` (default) the numba ones; both give identical bytes.

Low-level, header-free coders for other codecs (each a pure-Python reference + a numba fast path
producing the same bytes): ``rans`` / ``rans_fast`` (static interleaved and context-switched rANS),
``rans_lanes`` (the byte-plane coder: N lanes, per-row context tables, fused 16-bit output),
``rans64`` / ``rans64_fast`` (64-bit rANS driven by a per-symbol probability model), ``tans`` /
``tans_fast``, and ``freq`` (frequency quantization); see docs/entropy.md.
"""

from __future__ import annotations

from kvcodec import _numba_cache

_numba_cache.lock_saves()  # before this package's kernels can compile: see kvcodec._numba_cache

import importlib

import numpy as np

from kvcodec import validate
from kvcodec.entropy import freq, stream
from kvcodec.entropy.freq import choose_precision, count_symbols, entropy_bits, quantize_frequencies
from kvcodec.entropy.stream import MAX_SYMBOLS, StreamHeader
from kvcodec.errors import CorruptStreamError

CODERS = ("rans", "tans", "arith")
IMPLS = ("fast", "reference")
#: rANS states used when ``streams`` is not given: interleaving pays off once the input is long
#: enough that 4 bytes per extra state do not matter.
AUTO_STREAMS_MIN_SYMBOLS = 1 << 14
AUTO_STREAMS = 8
#: Default cap on the bytes :func:`decode` may produce: the library-wide 4 GiB of
#: ``kvcodec.validate``. A legal stream can declare up to ``MAX_SYMBOLS`` symbols in a few dozen
#: bytes (one near-certain symbol costs almost no bits), so decode time is bounded by the cap the
#: caller allows: pass a smaller ``max_output_bytes`` for untrusted input of known size.
DEFAULT_MAX_OUTPUT_BYTES = validate.DEFAULT_MAX_OUTPUT_BYTES

__all__ = [
    "CODERS",
    "CorruptStreamError",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "MAX_SYMBOLS",
    "StreamHeader",
    "choose_precision",
    "choose_table_log",
    "count_symbols",
    "decode",
    "encode",
    "entropy_bits",
    "inspect",
    "quantize_frequencies",
]


def choose_table_log(n_distinct: int) -> int:
    """Default tANS table log: 12 for byte alphabets, more for big ones (max 16)."""
    if n_distinct < 1:
        raise ValueError("n_distinct must be >= 1")
    need = max(1, (n_distinct - 1).bit_length())
    return min(16, max(12, need + 4)) if (1 << 16) >= n_distinct else 16


def encode(
    symbols,
    coder: str = "rans",
    *,
    impl: str = "fast",
    streams: int | None = None,
    precision: int | None = None,
    table_log: int | None = None,
) -> bytes:
    """Entropy-code a 1-D uint8/uint16 array into a self-describing stream.

    coder: "rans" (static rANS, ``streams`` interleaved states, 1..32), "tans" (FSE-style,
    ``table_log`` 5..16) or "arith" (the static range coder of ``range_coder``).
    precision: probability precision in bits for rans/arith (1..16; default from the alphabet).
    streams: rANS only; default 1 for short inputs, ``AUTO_STREAMS`` from
    ``AUTO_STREAMS_MIN_SYMBOLS`` symbols on.
    Raises ValueError for bad arguments.
    """
    x = _as_symbols(symbols)
    if coder not in CODERS:
        raise ValueError(f"coder must be one of {CODERS}, got {coder!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if coder != "rans" and streams not in (None, 1):
        raise ValueError("streams applies to coder='rans' only")
    if coder == "tans" and precision is not None:
        raise ValueError("coder='tans' takes table_log, not precision")
    if coder != "tans" and table_log is not None:
        raise ValueError("table_log applies to coder='tans' only")
    n = x.size
    if n > MAX_SYMBOLS:
        raise ValueError(f"at most {MAX_SYMBOLS} symbols per stream; split the input")
    if n == 0:
        return stream.pack(coder, x.dtype, 0, 0, 0, None, b"")
    counts = freq.count_symbols(x)
    distinct = int(np.count_nonzero(counts))
    if coder == "tans":
        param = choose_table_log(distinct) if table_log is None else _int_in(table_log, "table_log", 5, 16)
    else:
        param = choose_precision(distinct) if precision is None else _int_in(precision, "precision", 1, 16)
    if distinct > 1 << param:
        raise ValueError(f"{distinct} distinct symbols do not fit in 2**{param} frequency slots")
    if coder == "rans":
        n_streams = (AUTO_STREAMS if n >= AUTO_STREAMS_MIN_SYMBOLS else 1) if streams is None else streams
        n_streams = _int_in(n_streams, "streams", 1, 32)
    else:
        n_streams = 1
    freqs = quantize_frequencies(counts, param)
    payload = _encode_payload(x, coder, impl, freqs, param, n_streams)
    return stream.pack(coder, x.dtype, n, param, n_streams, freqs, payload)


def decode(blob, *, impl: str = "fast", max_symbols: int | None = None,
           max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> np.ndarray:
    """Decode a stream from :func:`encode`; returns the original array (same dtype and length).

    Raises CorruptStreamError (a ValueError) for malformed, truncated or corrupted streams, for
    streams declaring more than ``max_symbols`` (default ``MAX_SYMBOLS``) symbols, and for streams
    whose output would exceed ``max_output_bytes`` (default ``DEFAULT_MAX_OUTPUT_BYTES``, 4 GiB;
    ``None``: no cap beyond ``MAX_SYMBOLS``). Every header field is validated (and the declared
    count checked against what the payload can hold, and against the cap) before anything is
    allocated, so decode time is bounded by the input and the allowed output size.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    validate.resolve_max_output(max_output_bytes)
    if max_symbols is not None and (isinstance(max_symbols, bool) or not isinstance(max_symbols, int)):
        raise ValueError(f"max_symbols must be an int or None, got {max_symbols!r}")
    h, payload = stream.parse(blob, max_symbols)
    validate.check_output(h.n * h.dtype.itemsize, max_output_bytes, "entropy stream")
    if h.n == 0:
        return np.zeros(0, dtype=h.dtype)
    p = np.frombuffer(payload, dtype=np.uint8)
    if h.coder == "rans":
        if impl == "fast":
            from kvcodec.entropy import rans_fast

            return rans_fast.decode_table(p, h.freqs, h.param, h.n, h.streams, h.dtype)
        from kvcodec.entropy import rans

        return np.asarray(rans.decode(p.tobytes(), h.freqs, h.param, h.n, h.streams), dtype=h.dtype)
    if h.coder == "tans":
        if impl == "fast":
            from kvcodec.entropy import tans_fast

            return tans_fast.decode_table(p, h.freqs, h.param, h.n, h.dtype)
        from kvcodec.entropy import tans

        return np.asarray(tans.decode(p.tobytes(), h.freqs, h.param, h.n), dtype=h.dtype)
    rc = _range_coder(impl)
    out = np.asarray(rc.decode_static(p.tobytes() if impl == "reference" else p, h.freqs, h.param, h.n))
    if out.shape != (h.n,):
        raise CorruptStreamError("range coder returned the wrong number of symbols")
    out = out.astype(h.dtype, copy=False)
    # The range coder's decoder has no end-state check (rANS and tANS have one), so a forged payload
    # with a recomputed CRC could decode to other symbols: accept only the payload these symbols
    # encode to (one extra encode, the price of never returning silent garbage).
    if bytes(memoryview(rc.encode_static(out, h.freqs, h.param)).cast("B")) != bytes(payload):
        raise CorruptStreamError("range-coded payload is not the encoding of the symbols it decodes to")
    return out


def inspect(blob) -> StreamHeader:
    """Parse and verify a stream's header and checksums without decoding it."""
    return stream.parse(blob)[0]


def _encode_payload(x, coder, impl, freqs, param, n_streams):
    """The coder's payload (bytes or a uint8 array)."""
    if coder == "rans":
        if impl == "fast":
            from kvcodec.entropy import rans_fast

            return rans_fast.encode_table(x, freqs, param, n_streams)
        from kvcodec.entropy import rans

        return rans.encode(x, freqs, param, n_streams)
    if coder == "tans":
        if impl == "fast":
            from kvcodec.entropy import tans_fast

            return tans_fast.encode_table(x, freqs, param)
        from kvcodec.entropy import tans

        return tans.encode(x, freqs, param)
    return _range_coder(impl).encode_static(x, freqs, param)


def _range_coder(impl: str):
    """The static range coder module for ``impl``: ``range_coder`` (reference) or ``range_coder_fast``."""
    name = "kvcodec.entropy.range_coder" if impl == "reference" else "kvcodec.entropy.range_coder_fast"
    return importlib.import_module(name)


def _as_symbols(symbols) -> np.ndarray:
    if not isinstance(symbols, np.ndarray):
        raise ValueError("symbols must be a numpy array (1-D, uint8 or uint16)")
    if symbols.ndim != 1 or symbols.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError(f"symbols must be a 1-D uint8 or uint16 array, got {symbols.dtype} with shape {symbols.shape}")
    return np.ascontiguousarray(symbols)


def _int_in(v, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    return int(v)


_MODEL_NAMES = ("Categorical", "Gaussian", "Laplace", "Mixture")
__all__ += list(_MODEL_NAMES)


def __getattr__(name: str):
    """Probability models for the model-driven range coder, imported on first use."""
    if name in _MODEL_NAMES:
        from kvcodec.entropy import models

        return getattr(models, name)
    raise AttributeError(f"module 'kvcodec.entropy' has no attribute {name!r}")
