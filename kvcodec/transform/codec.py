"""encode / decode: K/V tensors <-> a transform-coded blob (see docs/transform.md).

Pipeline: exact sinks + recent window (lossless, ``kvcodec.compress``) | the tokens in between:
undo RoPE -> PCA coefficients -> one global quantizer step chosen for the rate or distortion
target -> integer symbols -> per-class chunked rANS streams. Decoding reverses it on the CPU or,
for a CUDA ``device``, with the rANS kernel and torch ops on the GPU; both read the same bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcodec import container, entropy
from kvcodec.errors import CorruptStreamError
from kvcodec.transform import blob as fmt
from kvcodec.transform import coding
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES
from kvcodec.transform import quantize as qz
from kvcodec.transform.allocation import StepModel, solve_step
from kvcodec.transform.calibration import Calibration
from kvcodec.transform.projection import from_coefficients, to_coefficients

DEFAULT_CHUNK = 1 << 18  # symbols per rANS stream: ~0.3% overhead at 1 bit, thousands of streams per large cache
DEFAULT_ROUNDING = 0.15
RATE_TOLERANCE = 0.01  # encode aims within 1% of the byte target (the promise is 2%)
_RATE_ITERATIONS = 8


def _check_inputs(keys, values, calib: Calibration) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.as_tensor(keys) if not isinstance(keys, torch.Tensor) else keys
    values = torch.as_tensor(values) if not isinstance(values, torch.Tensor) else values
    if keys.shape != values.shape or keys.ndim != 4:
        raise ValueError(f"keys and values must share one shape [layers, kv_heads, tokens, head_dim], got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    if keys.dtype != values.dtype or str(keys.dtype).removeprefix("torch.") not in fmt.DTYPES:
        raise ValueError(f"keys/values must both be one of {fmt.DTYPES}, got {keys.dtype} and {values.dtype}")
    if keys.device != values.device:
        raise ValueError("keys and values must be on the same device")
    L, H, _, D = keys.shape
    if (L, H, D) != (calib.n_layers, calib.n_kv_heads, calib.head_dim):
        raise ValueError(f"K/V shape {tuple(keys.shape)} does not match the calibration "
                         f"({calib.n_layers} layers, {calib.n_kv_heads} kv heads, head_dim {calib.head_dim})")
    return keys, values


def encode(keys, values, calib: Calibration, bits: float | None = None, *, distortion: float | None = None,
           sinks: int = 4, window: int = 128, positions_start: int = 0, rounding: float = DEFAULT_ROUNDING,
           chunk: int = DEFAULT_CHUNK) -> bytes:
    """Transform-code post-RoPE keys and values [L, H, T, D] (bf16/fp16/fp32, CPU or CUDA).

    bits: target *true* bits per value: len(blob) * 8 / (2 * L * H * T * D), everything counted
    (exact tokens, tables, headers); the result lands within 2% of it (or below it, when even
    the finest useful step, every coefficient kept to 1/32766 of the largest, needs fewer bits). distortion: instead, a
    target relative squared error ||m(x_hat - x)||^2 / ||m(x)||^2 over the coded tokens, m = the
    calibration's metric (channel scales x sqrt(layer weights); with scales and weights all 1, the
    plain relative error). Default: bits=2.
    sinks / window: the first ``sinks`` and last ``window`` tokens are kept bit-exact.
    positions_start: position of token 0 (for RoPE). rounding in [0, 0.5): dead-zone widening.
    Raises ValueError for bad arguments or an unreachable rate.
    """
    keys, values = _check_inputs(keys, values, calib)
    if bits is not None and distortion is not None:
        raise ValueError("pass bits or distortion, not both")
    if bits is None and distortion is None:
        bits = 2.0
    if bits is not None and not (isinstance(bits, (int, float)) and not isinstance(bits, bool) and 0 < bits <= 16):
        raise ValueError(f"bits must be a number in (0, 16], got {bits!r}")
    if distortion is not None and not (isinstance(distortion, (int, float)) and 0 < distortion < 1):
        raise ValueError(f"distortion must be a number in (0, 1), got {distortion!r}")
    for name, v, hi in (("sinks", sinks, fmt.MAX_TOKENS), ("window", window, fmt.MAX_TOKENS),
                        ("positions_start", positions_start, 1 << 40), ("chunk", chunk, fmt.MAX_CHUNK)):
        if isinstance(v, bool) or not isinstance(v, int) or not (0 <= v <= hi) or (name == "chunk" and v < 1024):
            raise ValueError(f"{name} must be an int in range, got {v!r}")
    if not (isinstance(rounding, (int, float)) and 0 <= rounding < 0.5):
        raise ValueError("rounding must be in [0, 0.5)")
    L, H, T, D = keys.shape
    if T > fmt.MAX_TOKENS:
        raise ValueError(f"at most {fmt.MAX_TOKENS} tokens per blob")
    head = min(T, sinks)
    tail = min(T - head, window)
    M = T - head - tail
    dtype = str(keys.dtype).removeprefix("torch.")
    exact = None
    if head + tail:
        idx = torch.cat([torch.arange(head), torch.arange(T - tail, T)]).to(keys.device)
        ex = torch.stack([keys.index_select(2, idx), values.index_select(2, idx)]).cpu()
        from kvcodec.lossless.api import compress

        exact = compress(ex, layout="kv")
    builder = _Builder(calib, dtype, (L, H, T, D), positions_start, sinks, window, chunk, exact)
    if M == 0:  # every token exact: nothing to allocate; refuse only a target the exact tokens exceed
        blob = builder.build(None, 1.0, rounding)
        if bits is not None and len(blob) > (1 + 2 * RATE_TOLERANCE) * bits * builder.n_values / 8:
            raise ValueError(f"the target ({bits} bits/value) does not cover the exact tokens alone "
                             f"({len(blob) * 8 / builder.n_values:.3f} bits/value)")
        return blob
    pos = torch.arange(positions_start + head, positions_start + head + M)
    coef = to_coefficients(keys[:, :, head: head + M], values[:, :, head: head + M], calib, pos)
    rows = coef.reshape(-1, M)
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("keys/values hold NaN or Inf in the coded tokens (only the exact tokens may)")
    unit = qz.row_steps(calib, 1.0, rows.device)
    model = StepModel(rows, unit, chunk, rounding)
    start = float(rows.float().pow(2).mean().sqrt()) or 1.0
    if distortion is not None:
        # relative to the coded tokens' energy in the calibration's metric (channel scales x sqrt(weights);
        # RoPE pairs share a scale, so the rotation does not change it)
        s = torch.from_numpy(calib.metric_scales()).to(rows.device, torch.float64)  # [L, 2, H, D]
        energy = sum(float((x[:, :, head: head + M].double() * s[:, kind, :, None, :]).pow(2).sum())
                     for kind, x in enumerate((keys, values)))
        ceiling = 4 * float(rows.abs().max()) + 1e-30  # every symbol is 0 from here on: the error cannot grow
        step = min(solve_step(model.squared_error, distortion * energy, start, increasing=True), ceiling)
        return builder.build(rows, max(step, _step_floor(rows)), rounding)
    return _encode_at_rate(builder, model, rows, bits * 2 * L * H * T * D / 8, start, rounding)


def _step_floor(rows: torch.Tensor) -> float:
    """The finest useful step: below it the largest coefficient's symbol would pass QMAX (clamped).
    A step this fine already keeps every coefficient to ~1/QMAX of the largest one."""
    return float(rows.abs().max()) / (qz.QMAX - 1) or 1e-30


def _encode_at_rate(builder, model: StepModel, rows, target: float, start: float, rounding: float) -> bytes:
    """Find the step whose blob is within RATE_TOLERANCE of ``target`` bytes (true size)."""
    fixed = builder.fixed_bytes(rows.shape[0])
    if target <= fixed:
        raise ValueError(f"the target ({target * 8 / builder.n_values:.3f} bits/value) does not cover the exact "
                         f"tokens and headers alone ({fixed * 8 / builder.n_values:.3f} bits/value)")
    want = target - fixed
    best = None
    floor = _step_floor(rows)
    for _ in range(_RATE_ITERATIONS):
        step = solve_step(model.stream_bytes, max(want, 1.0), start, increasing=False)
        blob = builder.build(rows, max(step, floor), rounding)
        err = len(blob) - target
        if best is None or abs(err) < abs(len(best) - target):
            best = blob
        if abs(err) <= RATE_TOLERANCE * target:
            break
        if step <= floor and err < 0:  # finer steps buy nothing: return the smaller blob
            return blob
        want -= err
        start = step
    if abs(len(best) - target) > 2 * RATE_TOLERANCE * target:
        raise ValueError(f"could not reach {target * 8 / builder.n_values:.3f} bits/value (closest: "
                         f"{len(best) * 8 / builder.n_values:.3f}); use distortion= or another rate")
    return best


class _Builder:
    """Assembles blobs for one input at different steps."""

    def __init__(self, calib, dtype, shape, positions_start, sinks, window, chunk, exact):
        self.calib, self.dtype, self.shape = calib, dtype, shape
        self.positions_start, self.sinks, self.window, self.chunk, self.exact = positions_start, sinks, window, chunk, exact
        self.n_values = 2 * math.prod(shape)

    def fixed_bytes(self, n_rows: int) -> int:
        """Bytes spent whatever the step: exact tokens, container header and the class stream (about)."""
        return (len(self.exact) if self.exact else 0) + 1024 + n_rows // 4

    def build(self, rows, step: float, rounding: float) -> bytes:
        c = self.calib
        n_rows = 2 * c.n_layers * c.n_kv_heads * c.head_dim
        if rows is None:
            cls = np.zeros(n_rows, dtype=np.uint8)
            infos, streams = [], []
        else:
            q = qz.quantize(rows, qz.row_steps(c, step, rows.device), rounding)
            cls_t = qz.classes(q)
            cls = cls_t.cpu().numpy()
            infos, streams = coding.encode_classes(q.cpu().numpy(), cls, self.chunk)
        header = fmt.Header(c.fingerprint, self.shape, self.dtype, self.positions_start, self.sinks, self.window,
                            float(step), self.chunk, tuple(infos))
        return fmt.pack(header, self.exact, entropy.encode(cls), streams)


def decode(blob, calib: Calibration, *, device="cpu", threads: int = 1,
           max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [L, H, T, D] in the stored dtype on ``device`` ("cpu" or a CUDA device: rANS and
    the inverse transform then run on the GPU). Raises CorruptStreamError for a damaged blob and
    ValueError for a blob made with another calibration."""
    return Decoder(blob, calib, device=device, threads=threads, max_output_bytes=max_output_bytes).run()


class Decoder:
    """A parsed, validated blob ready to decode; ``run()`` does the decoding work. On a CUDA device
    the rANS streams are uploaded once (``kvcodec.entropy.cuda.rans.RansBatch``), so repeated ``run()`` calls
    time the device work alone (benchmarks)."""

    def __init__(self, blob, calib: Calibration, *, device="cpu", threads: int = 1,
                 max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES):
        h, exact, cls_stream, self.streams = fmt.unpack(blob, calib, max_output_bytes)
        self.h, self.calib, self.threads = h, calib, threads
        self.device = torch.device(device)
        L, H, T, D = h.shape
        n_rows = 2 * L * H * D
        cls = entropy.decode(cls_stream, max_symbols=n_rows)
        if cls.dtype != np.uint8 or cls.shape != (n_rows,):
            raise CorruptStreamError("transform blob: component classes have the wrong length or type")
        counts = np.bincount(cls, minlength=256)
        want = np.zeros(256, dtype=np.int64)
        for c in h.classes:
            want[c.cls] = c.n_components
        if np.any(counts[1:] != want[1:]):
            raise CorruptStreamError("transform blob: component classes disagree with the class table")
        self.dtype = container.torch_dtypes()[h.dtype]
        self.exact = None
        if h.n_exact:
            from kvcodec.lossless.api import decompress

            ex = decompress(exact)
            if tuple(ex.shape) != (2, L, H, h.n_exact, D) or ex.dtype != self.dtype:
                raise CorruptStreamError("transform blob: exact tokens have the wrong shape or dtype")
            self.exact = ex.to(self.device)
        self.rows = [np.flatnonzero(cls == c.cls) for c in h.classes]
        self.steps = qz.row_steps(calib, h.step, self.device)
        self.batch = None
        if self.device.type == "cuda" and h.n_coded:
            from kvcodec.entropy.cuda.rans import RansBatch

            self.batch = RansBatch(self.streams, self.device)
            self.rows_dev = [torch.from_numpy(r).to(self.device) for r in self.rows]

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        h, calib, device = self.h, self.calib, self.device
        L, H, T, D = h.shape
        M, head = h.n_coded, h.n_head
        keys = torch.empty((L, H, T, D), dtype=self.dtype, device=device)
        values = torch.empty_like(keys)
        if self.exact is not None:
            ex = self.exact
            keys[:, :, :head], values[:, :, :head] = ex[0, :, :, :head], ex[1, :, :, :head]
            keys[:, :, head + M:], values[:, :, head + M:] = ex[0, :, :, head:], ex[1, :, :, head:]
        if M:
            coef = torch.zeros((2 * L * H * D, M), dtype=torch.float32, device=device)
            if self.batch is not None:
                parts = coding.decode_classes_gpu(h.classes, self.batch, M, h.chunk)
                for idx, q in zip(self.rows_dev, parts):
                    coef[idx] = qz.dequantize(q, self.steps[idx])
            else:
                coding.decode_coefficients_cpu(h.classes, self.streams, M, h.chunk, self.rows,
                                               self.steps.numpy(), coef.numpy(), self.threads)
            pos = torch.arange(h.positions_start + head, h.positions_start + head + M)
            k, v = from_coefficients(coef.view(calib.coef_shape(M)), calib, pos)
            keys[:, :, head: head + M], values[:, :, head: head + M] = k, v
        return keys, values


def inspect(blob) -> dict:
    """Header and sizes of a blob without decoding it (no calibration needed)."""
    h, exact, cls_stream, streams = fmt.unpack(blob, None, check_output=False)
    n_values = 2 * math.prod(h.shape)
    return {
        **h.meta(), "bytes": len(blob), "exact_bytes": len(exact) if exact is not None else 0,
        "stream_bytes": sum(s.nbytes for s in streams), "n_streams": len(streams),
        "bits_per_value": len(blob) * 8 / n_values if n_values else float("nan"),
        "ratio_vs_bf16": 2 * n_values / len(blob) if n_values else float("nan"),
        "exact_tokens": h.n_exact, "coded_tokens": h.n_coded,
        "coded_components": sum(c.n_components for c in h.classes),
    }


def verify(blob, max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> int:
    """Decode every entropy stream and the exact tokens of a blob without its calibration (what
    ``kvcodec inspect --verify`` can check); returns the number of symbols decoded. Raises
    CorruptStreamError on damage."""
    h, exact, cls_stream, streams = fmt.unpack(blob, None, max_output_bytes)
    L, H, T, D = h.shape
    cls = entropy.decode(cls_stream, max_symbols=2 * L * H * D)
    if cls.shape != (2 * L * H * D,):
        raise CorruptStreamError("transform blob: component classes have the wrong length")
    n = cls.size
    k = 0
    for info in h.classes:
        for m in coding.chunk_lengths(info.n_components * h.n_coded, h.chunk, info.n_streams):
            sym = entropy.decode(streams[k], max_symbols=m)
            coding.check_decoded(sym, info, m, k)
            n += sym.size
            k += 1
    if exact is not None:
        from kvcodec.lossless.api import decompress

        decompress(exact, max_output_bytes=max_output_bytes)
    return n
