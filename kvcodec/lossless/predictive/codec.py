"""The predictive codec: tensor layout, chunking, encode/decode of whole tensors, the codec object.

Format (``meta`` + sections ``model``, ``payload`` and, for float32, ``lo16``): see the package
docstring. Every field read from a stream is validated before it sizes an allocation or a loop.
Encoders write format 2 (:mod:`format2`: bins and table lookups, fast); format 1 (a continuous
CDF per value, :mod:`kernels`) is still read, and written on request (``version=1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from kvcodec import checksum, container
from kvcodec.errors import CorruptStreamError
from kvcodec.kernel_inputs import readonly
from kvcodec.lossless.predictive import format2
from kvcodec.lossless.predictive.bins import bin_grid
from kvcodec.lossless.predictive.grid import FloatGrid, grid_for, inverse_shape_index, value_table
from kvcodec.lossless.predictive.kernels import decode_chunks, encode_chunks
from kvcodec.lossless.predictive.params import ChannelParams, estimated_bits, fit_params
from kvcodec.lossless.tensor_meta import checked_shape, dtype_from_name
from kvcodec.threads import resolve_threads

FORMAT_VERSION = 2  # what encoders write
READ_VERSIONS = (1, 2)  # what decoders read
PREDICTORS = ("external", "previous_token", "neighbour_layer", "none")

_CHUNK_SYMBOLS = 1 << 16  # about this many symbols per independently decodable chunk
_SHARED_PARAMS_BELOW = 64  # fewer tokens: one parameter set per channel, shared over g
_PER_CHANNEL_FROM = 1024  # between the two: whichever of shared / per-(g, d) costs less
_MAX_NUMEL = 1 << 48  # a decoded stream larger than this is taken as forged
_NONE = np.zeros(0, np.int64)
_GAIN_BITS = 8.0  # a fitted neighbour-layer gain's cost per channel in format 2 (its int8 field, entropy-coded)
_CRC_BLOCK = 1 << 16  # values widened per checksum step of a bf16 prediction (256 KB, stays in cache)


def kv_layout(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(G, T, D): leading axes flattened, tokens (axis -2), channels (axis -1); 0-/1-d handled."""
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return 1, int(shape[0]), 1
    return math.prod(int(n) for n in shape[:-2]), int(shape[-2]), int(shape[-1])


def token_block(t: int, d: int) -> int:
    """Tokens per chunk: about ``_CHUNK_SYMBOLS`` symbols, at least one token."""
    return max(1, min(max(t, 1), _CHUNK_SYMBOLS // max(d, 1)))


class _Threads:
    """Run numba kernels on ``threads`` workers (0 = all), restoring the previous count after."""

    def __init__(self, threads: int):
        self.n = min(resolve_threads(threads), numba.config.NUMBA_NUM_THREADS)

    def __enter__(self):
        self.old = numba.get_num_threads()
        if self.old != self.n:  # (each set costs a few microseconds: a small tensor's decode notices)
            numba.set_num_threads(self.n)

    def __exit__(self, *exc):
        if self.old != self.n:
            numba.set_num_threads(self.old)


@numba.njit(nogil=True, cache=True)
def _widen_bf16(hi, out):
    """float32 bits of bf16 bits (one pass: 5x numpy's astype-and-shift)."""
    for i in range(hi.size):
        out[i] = np.uint32(hi[i]) << 16


def _prediction_f32(prediction: torch.Tensor, g: int, t: int, d: int) -> np.ndarray:
    """The prediction as float32 [G, T, D]: what the kernels use and the checksum covers."""
    if not isinstance(prediction, torch.Tensor):
        raise ValueError("a prediction must be a torch.Tensor")
    if prediction.dtype.is_complex:
        raise ValueError("a prediction must be real-valued")
    p = prediction.detach().to("cpu").contiguous()
    if p.dtype == torch.bfloat16:  # exact and single-threaded: the bf16 bits are a float32's top half
        out = np.empty(p.numel(), np.uint32)
        _widen_bf16(p.reshape(-1).view(torch.int16).numpy().view(np.uint16), out)
        return out.view(np.float32).reshape(g, t, d)
    return p.to(torch.float32).numpy().reshape(g, t, d)


def _decode_prediction(prediction: torch.Tensor, g: int, t: int, d: int, bf16_bits: bool) -> tuple[np.ndarray, int]:
    """(the prediction as the decoder reads it, the checksum of its float32 form). With
    ``bf16_bits`` a bf16 prediction stays bf16 (its uint16 bit patterns: format 2's kernel widens
    each value itself) and the checksum is taken a block at a time: no float32 copy (~7 ms of
    page faults and writes per 12 M values)."""
    if not (bf16_bits and isinstance(prediction, torch.Tensor) and prediction.dtype == torch.bfloat16):
        with np.errstate(invalid="ignore"):
            pred = _prediction_f32(prediction, g, t, d)
        return pred, checksum.crc32(pred.reshape(-1).view(np.uint8))
    bits = prediction.detach().to("cpu").contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    return bits.reshape(g, t, d), bf16_as_f32_crc32(bits)


def bf16_as_f32_crc32(bits: np.ndarray) -> int:
    """crc32 of the float32 form of bf16 bit patterns ``bits`` (uint16), without that form: widened a
    block at a time. With ISA-L's crc32 (the C function ``crc32_gzip_refl`` that python-isal's module
    exports) in one compiled loop of L1-sized blocks (42 us instead of 69 for the sample's 393K values:
    the per-block Python calls and the 256 KB blocks' L2 writes were as much as the crc itself)."""
    fn = checksum.isal_crc32_fn()
    if fn is not None:
        return int(_widened_crc32(fn, readonly(bits), np.empty(min(max(bits.size, 1), _CRC_L1_BLOCK), np.uint32)))
    block = np.empty(min(max(bits.size, 1), _CRC_BLOCK), np.uint32)
    crc = 0
    for a in range(0, bits.size, block.size):
        n = min(block.size, bits.size - a)
        _widen_bf16(bits[a:a + n], block[:n])
        crc = checksum.crc32(block[:n].view(np.uint8), crc)
    return crc


_CRC_L1_BLOCK = 1 << 12  # values widened per ISA-L call (16 KB: stays in L1)


@numba.njit(nogil=True, cache=True)
def _widened_crc32(fn, bits, block):
    """crc32 (by ``fn``, ISA-L's) of ``bits`` widened to float32 bits, ``block.size`` values at a time."""
    crc = np.uint32(0)
    s = 0
    while s < bits.size:
        n = min(block.size, bits.size - s)
        _widen_bf16(bits[s:s + n], block[:n])
        crc = fn(crc, block.ctypes.data, 4 * n)
        s += n
    return crc


def default_version(dtype: torch.dtype, source: str | None = None) -> int:
    """Format 2 (fast) for every dtype and source. fp8 against an external prediction took format 1
    until its format 2 streams counted symbols by magnitude (:func:`magnitude_symbols`): by value,
    format 2's ratio there was 7.5-8% lower (fp8 e4m3 SmolLM2 KV, fp8-weight prediction, keys and
    values: sample 2.847x vs format 1's 3.079x, bench_lossless_kv's held-out 2.943x vs 3.197x); by
    magnitude 3.106x and 3.206x (+0.9%, +0.3%) at ~150 MB/s per core instead of 23 (on longer
    caches, layers 0-7 / 16-23 of the 2048-token cache: -0.6% / -1.4%). Format 1 is written on
    request (``version=1``) and read always."""
    del dtype, source
    return FORMAT_VERSION


def magnitude_symbols(dtype: torch.dtype, source: str | None) -> bool:
    """Whether format 2 streams of this dtype and predictor count their symbols by magnitude (meta
    ``"mag": 1``, ``bins.magnitude_symbol``): where it pays. The GPU encoder asks this too
    (``kvctx_device_encode``), so both write the same stream. Other dtypes and predictors gain 0-2.6%
    with it but stay by value by default (measured in docs/lossless_kv.md)."""
    return dtype.is_floating_point and dtype.itemsize == 1 and source == "external"


def encode_tensor(t: torch.Tensor, prediction, source: str, threads: int = 0,
                  version: int | None = None, mag: bool | None = None) -> tuple[dict, dict]:
    """Encode ``t`` (any dtype and shape); ``source`` is one of PREDICTORS; ``version``: 2 (fast),
    1 (the original continuous-CDF format) or None (:func:`default_version` of the dtype and source);
    ``mag``: format 2's symbols by magnitude (None: :func:`magnitude_symbols`; a bool: forced, for
    measurements and tests)."""
    if version is None:
        version = default_version(t.dtype, source)
    if version not in READ_VERSIONS or type(version) is not int:
        raise ValueError(f"version must be one of {READ_VERSIONS}, got {version!r}")
    if source not in PREDICTORS:
        raise ValueError(f"predictor must be one of {PREDICTORS}, got {source!r}")
    if (source == "external") != (prediction is not None):
        raise ValueError("a prediction tensor goes with source 'external' and only with it")
    t = t.detach().to("cpu").contiguous()
    shape = tuple(t.shape)
    g, tt, d = kv_layout(shape)
    meta = {"v": version, "source": source, "dtype": container.torch_dtype_name(t.dtype),
            "shape": list(shape)}
    if prediction is not None and tuple(prediction.shape) != shape:
        raise ValueError("prediction must have the same shape as the tensor")
    if source == "neighbour_layer" and len(shape) < 3:
        raise ValueError("predictor='neighbour_layer' needs a [layers, ..., tokens, channels] tensor")
    grid = grid_for(t.dtype)
    if t.numel() == 0 or (grid is None and t.dtype != torch.float32):
        meta["mode"] = "raw"
        raw = t.reshape(-1).view(torch.uint8).numpy().copy() if t.numel() else np.zeros(0, np.uint8)
        return meta, {"raw": raw}
    sections: dict = {}
    bgrid = bin_grid(t.dtype)
    if grid is None:  # float32: the upper half is a bf16 pattern; keep the lower half verbatim
        grid, bgrid = grid_for(torch.bfloat16), bin_grid(torch.bfloat16)
        b32 = t.reshape(-1).view(torch.int32).numpy().view(np.uint32)
        sym_bits = (b32 >> 16).astype(np.uint16)
        sections["lo16"] = (b32 & 0xFFFF).astype(np.uint16)
        meta["mode"] = "f32split"
    else:
        sym_bits = t.reshape(-1).view(grid.bits_torch).numpy().view(grid.bits_np)
        meta["mode"] = "grid"
    kx = grid.k_of_bits[sym_bits].reshape(g, tt, d)
    tb = token_block(tt, d)
    if source == "external":
        with np.errstate(invalid="ignore"):
            pred = _prediction_f32(prediction, g, tt, d)
        meta["pred_crc"] = checksum.crc32(pred.reshape(-1).view(np.uint8))
    elif source == "neighbour_layer":
        per_layer = g // shape[0]
        pred = np.zeros((g, tt, d), np.float32)
        pred[per_layer:] = value_table(grid)[kx[:-per_layer]] if per_layer < g else 0.0
    else:
        pred = None

    gain = {"external": "one", "neighbour_layer": "fit"}.get(source, "zero")
    prev_coef = "one" if source == "previous_token" else "fit"
    if tt < _SHARED_PARAMS_BELOW:
        choices = (True,)
    elif tt < _PER_CHANNEL_FROM:
        choices = (False, True)
    else:
        choices = (False,)
    # the neighbour layer's fitted gains against none: on SmolLM2 KV they do not pay (the stream is
    # 0.1-0.4% smaller without them), and a stream without gains decodes as fast as kvctx
    gains = (gain, "zero") if source == "neighbour_layer" and version == 2 else (gain,)
    models = [fit_params(kx, pred, grid, tb, gn, prev_coef, sh, shape=version == 1) for gn in gains for sh in choices]

    def cost(mdl):  # format 2 codes a channel's parameters in about 2 bytes, and a fitted gain ~1 more
        if version == 1:
            return estimated_bits(mdl, source)
        return estimated_bits(mdl, source, 16.0 * mdl.s.size + (_GAIN_BITS * mdl.c.size if gain == "fit" and mdl.c.any()
                                                                else 0.0))

    model = min(models, key=cost)
    if version == 2:
        unit = g // shape[0] if source == "neighbour_layer" else g
        with _Threads(threads):
            by_mag = magnitude_symbols(t.dtype, source) if mag is None else bool(mag)
            meta2, sec2 = format2.encode(sym_bits.reshape(g, tt, d), pred, model, bgrid, tb, unit, source, by_mag)
        meta.update(tb=tb, **meta2)
        sections.update(sec2)
        return meta, sections
    shared = model.shared
    n_tb = -(-tt // tb)
    sizes = np.full(g * n_tb, tb * d + 2, np.int64)
    sizes[n_tb - 1::n_tb] = (tt - (n_tb - 1) * tb) * d + 2
    caps = np.concatenate([[0], np.cumsum(sizes)])
    out = np.empty(int(caps[-1]), np.uint32)
    out_start = np.empty(g * n_tb, np.int64)
    with _Threads(threads):
        encode_chunks(kx, pred if pred is not None else np.zeros((1, 1, 1), np.float32), pred is not None,
                       *model.kernel_args(), grid.edges, grid.valf, grid.finite, tb, caps, out, out_start)
    lengths = caps[1:] - out_start
    payload = np.concatenate([out[s0:s1] for s0, s1 in zip(out_start, caps[1:])])
    meta.update(tb=tb, shared=shared)
    sections.update(model=np.concatenate([model.pack(source), lengths.astype("<u4").view(np.uint8)]),
                    payload=payload)
    return meta, sections


def _section(sections, name, dtype, n=None) -> np.ndarray:
    if not isinstance(sections, dict) or name not in sections:
        raise CorruptStreamError(f"predictive stream lacks section {name!r}")
    v = sections[name]
    if isinstance(v, (bytes, bytearray, memoryview)):
        v = np.frombuffer(v, np.uint8)
    elif isinstance(v, torch.Tensor):
        v = v.numpy()
    if not isinstance(v, np.ndarray) or v.dtype != np.dtype(dtype) or v.ndim != 1 or (n is not None and v.size != n):
        raise CorruptStreamError(f"predictive stream section {name!r} has the wrong type or size")
    return v


def _meta_dtype_shape(meta) -> tuple[torch.dtype, tuple[int, ...]]:
    if not isinstance(meta, dict) or meta.get("v") not in READ_VERSIONS or type(meta.get("v")) is not int:
        raise CorruptStreamError("predictive stream has an unknown format version")
    dtype = dtype_from_name(meta.get("dtype"), "predictive stream")
    shape = checked_shape(meta.get("shape"), "predictive stream")
    if math.prod(shape) > _MAX_NUMEL:
        raise CorruptStreamError("predictive stream claims an implausibly large tensor")
    return dtype, tuple(shape)


def _token_range(tokens, tt: int) -> tuple[int, int]:
    if tokens is None:
        return 0, tt
    try:
        start, stop = (int(v) for v in tokens)
    except (TypeError, ValueError):
        raise ValueError("tokens must be a (start, stop) pair of ints") from None
    if not 0 <= start <= stop <= tt:
        raise ValueError(f"tokens ({start}, {stop}) out of range for {tt} tokens")
    return start, stop


def _out_shape(shape: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return shape
    if len(shape) == 1:
        return (stop - start,)
    return (*shape[:-2], stop - start, shape[-1])


@dataclass(frozen=True)
class ParsedStream:
    """A stream whose every field was checked against the others and the sections present."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    source: str
    mode: str
    raw: np.ndarray | None  # mode "raw": the verbatim bytes
    grid: FloatGrid | None
    tb: int
    n_tb: int
    margs: tuple  # ChannelParams.kernel_args()
    lengths: np.ndarray  # words per chunk
    words: np.ndarray
    wstart: np.ndarray
    lo16: np.ndarray | None  # mode "f32split": the low halves
    v2: format2.Parsed2 | None = None  # format 2: everything its decoder needs


def parse_stream(meta: dict, sections: dict) -> ParsedStream:
    """Check every metadata field and section size of a stream (CorruptStreamError) before
    anything is sized by them; nothing is decoded."""
    dtype, shape = _meta_dtype_shape(meta)
    source = meta.get("source")
    if source not in PREDICTORS:
        raise CorruptStreamError("predictive stream names an unknown predictor")
    g, tt, d = kv_layout(shape)
    numel = math.prod(shape)
    mode = meta.get("mode")
    if mode == "raw":
        raw = _section(sections, "raw", np.uint8, numel * dtype.itemsize)
        return ParsedStream(dtype, shape, source, mode, raw, None, 0, 0, (), _NONE, _NONE, _NONE, None)
    grid = grid_for(dtype) if mode == "grid" else None
    if mode == "f32split" and dtype == torch.float32:
        grid = grid_for(torch.bfloat16)
    if grid is None or numel == 0:
        raise CorruptStreamError("predictive stream has a mode that does not fit its dtype")
    if source == "neighbour_layer" and len(shape) < 3:
        raise CorruptStreamError("neighbour-layer stream needs a [layers, ..., tokens, channels] shape")
    if source == "external" and type(meta.get("pred_crc")) is not int:
        raise CorruptStreamError("predictive stream lacks the checksum of its prediction")
    tb, shared = meta.get("tb"), meta.get("shared")
    if tb != token_block(tt, d) or not isinstance(shared, bool):
        raise CorruptStreamError("predictive stream has a bad chunking or sharing field")
    lo16 = _section(sections, "lo16", np.uint16, numel) if mode == "f32split" else None
    if meta["v"] == 2:
        bgrid = bin_grid(torch.bfloat16 if mode == "f32split" else dtype)
        unit = g // shape[0] if source == "neighbour_layer" else g
        p2 = format2.parse(meta, sections, _section, bgrid, g, tt, d, tb, unit, source)
        return ParsedStream(dtype, shape, source, mode, None, grid, tb, -(-tt // tb), (), _NONE, _NONE, _NONE,
                            lo16, p2)
    gp = 1 if shared else g
    n_tb = -(-tt // tb)
    n_model = ChannelParams.packed_size(source, gp, d)
    blob = _section(sections, "model", np.uint8, n_model + 4 * g * n_tb)
    margs = ChannelParams.unpack(blob[:n_model], source, gp, d, shared).kernel_args()
    lengths = blob[n_model:].copy().view("<u4").astype(np.int64)
    words = _section(sections, "payload", np.uint32)
    if int(lengths.sum()) != words.size or lengths.min() < 2:
        raise CorruptStreamError("predictive stream chunk sizes do not add up to its payload")
    wstart = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return ParsedStream(dtype, shape, source, mode, None, grid, tb, n_tb, margs, lengths, words, wstart, lo16)


def decode_tensor(meta: dict, sections: dict, prediction=None, threads: int = 0,
                  tokens: tuple[int, int] | None = None) -> torch.Tensor:
    """Invert :func:`encode_tensor`; every inconsistency raises CorruptStreamError.

    ``tokens=(start, stop)`` decodes only that range of axis -2 (axis 0 of a 1-d tensor): only the
    chunks holding it are decoded, since every chunk decodes alone.
    """
    ps = parse_stream(meta, sections)
    dtype, shape, source, mode, grid = ps.dtype, ps.shape, ps.source, ps.mode, ps.grid
    g, tt, d = kv_layout(shape)
    start, stop = _token_range(tokens, tt)
    out_shape = _out_shape(shape, start, stop)
    numel = math.prod(shape)
    if mode == "raw":
        out = torch.from_numpy(ps.raw.copy()) if numel else torch.empty(0, dtype=torch.uint8)
        out = out.view(dtype).reshape(shape)
        if (start, stop) == (0, tt) or not numel:
            return out if (start, stop) == (0, tt) else torch.empty(out_shape, dtype=dtype)
        return out.reshape(g, tt, d)[:, start:stop].reshape(out_shape).clone()

    pred = None
    if source == "external":
        if prediction is None:
            raise CorruptStreamError("this stream was coded with a prediction: pass the same prediction to decode")
        if tuple(prediction.shape) != shape:
            raise CorruptStreamError(f"prediction must have shape {shape}, the stream's")
        pred, crc = _decode_prediction(prediction, g, tt, d, meta["v"] == 2)
        if crc != meta.get("pred_crc"):
            raise CorruptStreamError("the prediction differs from the one this stream was coded with")
    elif prediction is not None:
        raise CorruptStreamError("this stream was coded without a prediction tensor")
    if start == stop:
        return torch.empty(out_shape, dtype=dtype)
    if ps.v2 is not None:
        sym_bits = _decode_v2(ps, pred, threads, start, stop).reshape(-1)
    else:
        sym_bits = _decode_v1(ps, pred, threads, start, stop)
    if mode == "f32split":
        lo = ps.lo16.reshape(g, tt, d)[:, start:stop].reshape(-1)
        out = (sym_bits.astype(np.uint32) << 16) | lo.astype(np.uint32)
        return torch.from_numpy(out.view(np.int32)).view(torch.float32).reshape(out_shape)
    return torch.from_numpy(sym_bits.view(grid.bits_np_signed)).view(dtype).reshape(out_shape)


def _decode_v2(ps: ParsedStream, pred, threads: int, start: int, stop: int) -> np.ndarray:
    """Bit patterns [G, stop - start, D] of a format 2 stream's tokens [start, stop)."""
    g, tt, d = kv_layout(ps.shape)
    grid, p2 = ps.grid, ps.v2
    bgrid = bin_grid(torch.bfloat16 if ps.mode == "f32split" else ps.dtype)
    cg0, _, ct0, cnt = p2.chunks
    every = (start, stop) == (0, tt)
    if every:  # every chunk (the common case: no mask of them to build)
        hit, t0, t1 = None, 0, tt
    else:
        hit = (ct0 < stop) & (ct0 + cnt > start)
        t0, t1 = int(ct0[hit].min()), int((ct0 + cnt)[hit].max())
    out = np.empty((g, t1 - t0, d), grid.bits_np)
    # no gain anywhere: base = m + 0 * p = m whatever the previous layer (m is never -0.0), so the layers
    # decode as one round without a prediction, all chunks in parallel
    chained = ps.source == "neighbour_layer" and bool(p2.margs[1].any())
    if chained and (cg0.size if every else int(hit.sum())) <= ps.shape[0]:
        threads = 1  # one chunk per layer: waking the other workers per layer only costs time
    with _Threads(threads):
        if chained:
            per_layer = g // ps.shape[0]
            # bf16 patterns are their own prediction (the kernel widens them, a non-finite one
            # predicts 0 as in the value table): no float32 copy of each layer
            as_bits = bgrid is bin_grid(torch.bfloat16)
            if as_bits:  # one call: each layer reads the one before from ``out``
                sel = range(cg0.size) if every else np.flatnonzero(hit)
                if format2.decode(p2, bgrid, sel, out, t0, None, 0, 0, layer_g=per_layer).any():
                    raise CorruptStreamError("predictive stream payload is corrupted (rANS state check failed)")
                return out[:, start - t0:stop - t0]
            values = value_table(grid)
            bits = values.view(np.uint32)
            if not (bits & 0xFFFF).any():  # every value a bfloat16 (fp8): the layer's prediction as bf16 bit
                # patterns (the same values), the type of every other fp8 decode's prediction, so one
                # compiled kernel serves them all
                values = (bits >> 16).astype(np.uint16)
            p_layer = np.zeros((per_layer, out.shape[1], d), values.dtype)
            bounds = np.searchsorted(cg0, np.arange(ps.shape[0] + 1) * per_layer)  # chunks are layer-major
            for layer in range(ps.shape[0]):
                lo, hi = int(bounds[layer]), int(bounds[layer + 1])
                sel = range(lo, hi) if every else lo + np.flatnonzero(hit[lo:hi])
                if format2.decode(p2, bgrid, sel, out, t0, p_layer, layer * per_layer, t0).any():
                    raise CorruptStreamError("predictive stream payload is corrupted (rANS state check failed)")
                p_layer = values[grid.k_of_bits[out[layer * per_layer:(layer + 1) * per_layer]]]
        elif format2.decode(p2, bgrid, range(cg0.size) if every else np.flatnonzero(hit), out, t0, pred, 0, 0).any():
            raise CorruptStreamError("predictive stream payload is corrupted (rANS state check failed)")
    return out[:, start - t0:stop - t0]


def _decode_v1(ps: ParsedStream, pred, threads: int, start: int, stop: int) -> np.ndarray:
    """Bit patterns (flat) of a format 1 stream's tokens [start, stop)."""
    grid, source, shape = ps.grid, ps.source, ps.shape
    tb, n_tb, margs, lengths, words, wstart = ps.tb, ps.n_tb, ps.margs, ps.lengths, ps.words, ps.wstart
    g, tt, d = kv_layout(shape)
    b0, b1 = start // tb, -(-stop // tb)
    out_t0 = b0 * tb
    kx = np.empty((g, min(tt, b1 * tb) - out_t0, d), np.uint16)  # ranks < 65536: 2 bytes per value
    err = np.zeros(g * (b1 - b0), np.int32)
    tail = (grid.edges, grid.valf, grid.finite, grid.rank_of_bf16, 1.0 / margs[3],
            inverse_shape_index(margs[5]), 1.0 / np.diff(margs[5]).astype(np.float64), tb, tt)
    blocks = np.arange(b0, b1, dtype=np.int64)

    def run(g_first: int, n_groups: int, p, has_p: bool, p_t0: int, e):
        cg = np.repeat(np.arange(n_groups, dtype=np.int64), b1 - b0)
        cb = np.tile(blocks, n_groups)
        ci = (g_first + cg) * n_tb + cb
        decode_chunks(words, wstart[ci], lengths[ci], cg, cb, p, has_p, p_t0, *margs, *tail, g_first, out_t0,
                       kx[g_first:g_first + n_groups], e)

    with _Threads(threads):
        if source == "neighbour_layer":
            per_layer = g // shape[0]
            values = value_table(grid)
            p_layer = np.zeros((per_layer, kx.shape[1], d), np.float32)
            for layer in range(shape[0]):
                e = err[layer * per_layer * (b1 - b0):(layer + 1) * per_layer * (b1 - b0)]
                run(layer * per_layer, per_layer, p_layer, True, out_t0, e)
                if e.any():
                    break
                p_layer = values[kx[layer * per_layer:(layer + 1) * per_layer]]
        else:
            run(0, g, pred if pred is not None else np.zeros((1, 1, 1), np.float32), pred is not None, 0, err)
    if err.any():
        raise CorruptStreamError("predictive stream payload is corrupted (rANS state check failed)")
    kx = kx[:, start - out_t0:stop - out_t0]
    return grid.bits_of_k[kx.reshape(-1)]


class PredictiveCodec:
    """Codec ``"predictive"``: code a tensor given a prediction both sides have.

    ``encode(t, prediction, threads, predictor=None, version=None)``: with a prediction tensor the
    model is centred on it; without one, ``predictor`` names a built-in source,
    ``"previous_token"`` or ``"neighbour_layer"``, and decoding needs no prediction either.
    ``version``: the stream format (None: :func:`default_version`).
    """

    name = "predictive"

    def encode(self, t, prediction, threads: int = 0, predictor: str | None = None, version: int | None = None,
               **opts):
        if opts:
            raise ValueError(f"unknown option(s) for the predictive codec: {', '.join(sorted(opts))}")
        if prediction is not None:
            if predictor not in (None, "external"):
                raise ValueError("pass a prediction tensor or a built-in predictor name, not both")
            return encode_tensor(t, prediction, "external", threads, version)
        if predictor not in ("previous_token", "neighbour_layer"):
            raise ValueError("the predictive codec needs a prediction tensor or "
                             "predictor='previous_token' / 'neighbour_layer'")
        return encode_tensor(t, None, predictor, threads, version)

    def decode(self, meta, sections, prediction, threads: int = 0):
        return decode_tensor(meta, sections, prediction, threads)

    def validate(self, meta, sections) -> None:
        """Check meta and sections against each other (CorruptStreamError) without decoding."""
        parse_stream(meta, sections)

