"""The byte format of a transform-coded KV blob (a kvcodec container of kind ``kvcodec.transform``).

Meta (JSON, every field validated before anything is allocated)::

    {"version": 2, "calibration": fingerprint, "shape": [L, H, T, D], "dtype": "bfloat16",
     "positions_start": p, "sinks": s, "window": w, "step": float, "chunk": symbols per stream,
     "classes": [[class, offset, width, n_components, n_streams], ...]}

Sections: ``exact`` (a ``kvcodec.compress`` blob of the exact tokens, [2, L, H, E, D], when E > 0),
``component_classes`` (an entropy stream of the class id of every coefficient row, uint8),
``stream_ends`` (uint64, the end offset of every rANS stream in ``streams``) and ``streams``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcodec import container, validate
from kvcodec.errors import CorruptStreamError
from kvcodec.transform.calibration import Calibration
from kvcodec.transform.coding import ClassInfo, expected_streams

KIND = "kvcodec.transform"
VERSION = 2  # 2: one step for every row (weights live in the calibration metric)
DTYPES = ("bfloat16", "float16", "float32")
MAX_TOKENS = 1 << 24
MAX_CHUNK = 1 << 24
_META_KEYS = {"version", "calibration", "shape", "dtype", "positions_start", "sinks", "window", "step", "chunk", "classes"}


@dataclass(frozen=True)
class Header:
    """The validated meta of a blob."""

    calibration: str
    shape: tuple[int, int, int, int]
    dtype: str
    positions_start: int
    sinks: int
    window: int
    step: float
    chunk: int
    classes: tuple[ClassInfo, ...]

    @property
    def n_exact(self) -> int:
        """Tokens stored exactly: the first ``sinks`` and the last ``window`` (never more than T)."""
        T = self.shape[2]
        return min(T, self.sinks + self.window)

    @property
    def n_head(self) -> int:
        return min(self.shape[2], self.sinks)

    @property
    def n_coded(self) -> int:
        return self.shape[2] - self.n_exact

    def meta(self) -> dict:
        return {
            "version": VERSION, "calibration": self.calibration, "shape": list(self.shape), "dtype": self.dtype,
            "positions_start": self.positions_start, "sinks": self.sinks, "window": self.window,
            "step": self.step, "chunk": self.chunk, "classes": [c.to_json() for c in self.classes],
        }


def pack(header: Header, exact: bytes | None, class_stream: bytes, streams: list[bytes]) -> bytes:
    ends = np.cumsum([len(s) for s in streams], dtype=np.uint64)
    sections = {} if exact is None else {"exact": exact}
    sections.update({"component_classes": class_stream, "stream_ends": ends, "streams": b"".join(streams)})
    return container.dumps(KIND, header.meta(), sections)


def _int(v, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptStreamError(f"transform blob: {what} {v!r} not an int in [{lo}, {hi}]")
    return v


def parse_header(meta: dict) -> Header:
    """Validate a blob's meta on its own (no calibration needed): types, ranges, class table."""
    if not isinstance(meta, dict) or set(meta) != _META_KEYS:
        raise CorruptStreamError(f"transform blob meta keys {sorted(meta) if isinstance(meta, dict) else meta!r}")
    _int(meta["version"], VERSION, VERSION, "version")
    if not isinstance(meta["calibration"], str) or len(meta["calibration"]) != 16:
        raise CorruptStreamError("transform blob: bad calibration fingerprint")
    shape = meta["shape"]
    if not isinstance(shape, list) or len(shape) != 4:
        raise CorruptStreamError("transform blob: shape must be [layers, kv_heads, tokens, head_dim]")
    L, H, T, D = (_int(shape[0], 1, 4096, "layers"), _int(shape[1], 1, 1024, "kv_heads"),
                  _int(shape[2], 0, MAX_TOKENS, "tokens"), _int(shape[3], 1, 4096, "head_dim"))
    if meta["dtype"] not in DTYPES:
        raise CorruptStreamError(f"transform blob: dtype {meta['dtype']!r} not one of {DTYPES}")
    step = meta["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not (0 < step < 1e30):
        raise CorruptStreamError("transform blob: step must be a positive finite number")
    classes = meta["classes"]
    if not isinstance(classes, list) or len(classes) > 255:
        raise CorruptStreamError("transform blob: classes must be a list of at most 255 entries")
    infos, prev = [], 0
    for c in classes:
        if not isinstance(c, list) or len(c) != 5:
            raise CorruptStreamError("transform blob: malformed class entry")
        info = ClassInfo(_int(c[0], prev + 1, 255, "class id"), _int(c[1], -65535, 32767, "class offset"),
                         _int(c[2], 1, 2, "symbol width"), _int(c[3], 1, 1 << 40, "class size"),
                         _int(c[4], 1, 1 << 40, "class streams"))
        prev = info.cls
        infos.append(info)
    return Header(meta["calibration"], (L, H, T, D), meta["dtype"],
                  _int(meta["positions_start"], 0, 1 << 40, "positions_start"),
                  _int(meta["sinks"], 0, MAX_TOKENS, "sinks"), _int(meta["window"], 0, MAX_TOKENS, "window"),
                  float(step), _int(meta["chunk"], 1, MAX_CHUNK, "chunk"), tuple(infos))


def unpack(blob, calib: Calibration | None, max_output_bytes: int | None = None, check_output: bool = True):
    """Parse and validate a blob against ``calib`` (None: header checks only); returns
    (Header, exact bytes or None, class stream bytes, list of stream byte views).
    ``max_output_bytes`` caps the decoder's working set, 2 * L * H * T * D float32 values (None: no
    cap; the decoding functions default to ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES``); ``check_output=False`` skips that (inspect)."""
    _, meta, sec = container.loads(blob, expect_kind=KIND)
    h = parse_header(meta)
    L, H, T, D = h.shape
    if calib is not None:
        if h.calibration != calib.fingerprint:
            raise ValueError(f"blob was encoded with calibration {h.calibration}, got {calib.fingerprint}")
        if (L, H, D) != (calib.n_layers, calib.n_kv_heads, calib.head_dim):
            raise CorruptStreamError("transform blob shape does not match its calibration")
    if check_output:
        validate.check_output(2 * L * H * T * D * 4, max_output_bytes, "transform blob working set")
    n_rows = L * 2 * H * D
    if sum(c.n_components for c in h.classes) > n_rows:
        raise CorruptStreamError("transform blob: classes hold more components than the cache has")
    if h.classes and h.n_coded == 0:
        raise CorruptStreamError("transform blob: classes without coded tokens")
    for c in h.classes:
        if c.n_streams != expected_streams(c.n_components * h.n_coded, h.chunk):
            raise CorruptStreamError(f"transform blob: class {c.cls} has {c.n_streams} streams")
    want = {"component_classes", "stream_ends", "streams"} | ({"exact"} if h.n_exact else set())
    if set(sec) != want:
        raise CorruptStreamError(f"transform blob sections {sorted(sec)} != {sorted(want)}")
    ends = sec["stream_ends"]
    n_streams = sum(c.n_streams for c in h.classes)
    if not isinstance(ends, np.ndarray) or ends.dtype != np.uint64 or ends.shape != (n_streams,):
        raise CorruptStreamError("transform blob: stream_ends must be uint64, one per stream")
    data = sec["streams"]
    if not isinstance(data, memoryview) or not isinstance(sec["component_classes"], memoryview):
        raise CorruptStreamError("transform blob: streams and component_classes must be byte sections")
    starts = np.concatenate([[0], ends[:-1]]).astype(np.uint64) if n_streams else ends
    if n_streams and (np.any(ends < starts) or int(ends[-1]) != data.nbytes):
        raise CorruptStreamError("transform blob: stream offsets out of order or do not cover the streams")
    if not n_streams and data.nbytes:
        raise CorruptStreamError("transform blob: stream bytes without streams")
    streams = [data[int(a): int(b)] for a, b in zip(starts, ends)]
    exact = sec.get("exact")
    if exact is not None and not isinstance(exact, memoryview):
        raise CorruptStreamError("transform blob: exact must be a byte section")
    return h, exact, sec["component_classes"], streams
