"""Shared machinery for the KV quantizers: argument checks, norms, token chunking."""

from __future__ import annotations

import math

import torch

from kvcodec.errors import CorruptStreamError
from kvcodec.quant.compressed import QuantizedTensor
from kvcodec.quant.packed import PackedKV

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CHUNK_ELEMENTS = 1 << 22  # floats materialized per chunk of tokens (16 MiB of float32)
CHUNK_ELEMENTS_CUDA = 1 << 26  # on a GPU (256 MiB): ~15 launches a chunk, so a 32k-token prefill takes a few chunks


def chunk_elements(device) -> int:
    """Floats an encode materializes per chunk on ``device``: bounded host memory on the CPU; on a GPU,
    chunks large enough that a long prefill is not bound by kernel launches."""
    return CHUNK_ELEMENTS_CUDA if torch.device(device).type == "cuda" else CHUNK_ELEMENTS
_FP16_MAX, _FP16_MIN_NORMAL = 65504.0, 2.0 ** -14


def check_input(x, dim: int, what: str = "x", finite: bool = True) -> torch.Tensor:
    """A floating tensor [..., N, dim] with finite values, or a clear ValueError. ``finite=False``
    leaves the values to the caller (an encode checks them with its norms: ``settle_norms``)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} must be float16/bfloat16/float32/float64, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{what} must have shape [..., N, {dim}], got {tuple(x.shape)}")
    if x.shape[-1] != dim:
        raise ValueError(f"{what} has last dim {x.shape[-1]}, this quantizer was built for dim={dim}")
    if finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contains NaN or Inf")
    return x


def check_bits(bits, lo: int = 1, hi: int = 8) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not lo <= bits <= hi:
        raise ValueError(f"bits must be an integer in {lo}..{hi}, got {bits!r}")
    return bits


def check_dim(dim, minimum: int = 4) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < minimum:
        raise ValueError(f"dim must be an integer >= {minimum}, got {dim!r}")
    return dim


def row_norms(x: torch.Tensor, check: bool = True) -> torch.Tensor:
    """L2 norm of each row, without overflow or underflow for huge or tiny float32 values.
    ``check=False``: no host read here (``settle_norms`` checks a whole encode's norms at once)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    n = torch.linalg.vector_norm(x / safe, dim=-1, keepdim=True) * amax
    if check and not bool(torch.isfinite(n).all()):
        raise ValueError(ROW_NORM_OVERFLOW)
    return n.squeeze(-1)


ROW_NORM_OVERFLOW = "a row norm overflows float32; scale the input down"


def settle_norms(x: torch.Tensor, *norms: torch.Tensor, what: str = "x") -> torch.dtype:
    """The end of an encode, in one host read instead of one per check and chunk (each read waits for
    a GPU): every norm is finite, else ``x`` held NaN or Inf (check_input's error) or a row norm
    overflowed (row_norms's); and the dtype the norms are stored in (``storage_dtype``'s choice).
    Non-finite input always gives a non-finite norm (an Inf row's norm is NaN, a NaN row's NaN)."""
    stats = _norm_stats(*norms)
    if stats is None:
        return torch.float16
    finite, top, low = stats.tolist()
    if not finite:
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{what} contains NaN or Inf")
        raise ValueError(ROW_NORM_OVERFLOW)
    return _dtype_for(top, low)


def storage_dtype(*norms: torch.Tensor) -> torch.dtype:
    """float16 when every nonzero norm fits its normal range, else bfloat16 (same range as float32)."""
    stats = _norm_stats(*norms)
    return torch.float16 if stats is None else _dtype_for(*stats[1:].tolist())


def _norm_stats(*norms: torch.Tensor) -> torch.Tensor | None:
    """[all finite, largest positive value, smallest positive value] of ``norms`` as one tensor, for one
    host read (0 and inf where none is positive; NaN is not positive), or None when they are empty.
    float64 norms stay float64, so the range tests are exact."""
    parts = [n.reshape(-1) for n in norms if n.numel()]
    if not parts:
        return None
    dt = torch.float64 if any(n.dtype == torch.float64 for n in parts) else torch.float32
    n = torch.cat([p.to(dt) for p in parts])
    positive = n > 0
    return torch.stack([torch.isfinite(n).all().to(dt), torch.where(positive, n, 0.0).amax(),
                        torch.where(positive, n, math.inf).amin()])


def _dtype_for(top: float, low: float) -> torch.dtype:
    return torch.bfloat16 if top > _FP16_MAX or low < _FP16_MIN_NORMAL else torch.float16


def token_chunk(q: QuantizedTensor, width: int, multiple: int = 1) -> int:
    """Tokens per chunk so a chunk materializes at most CHUNK_ELEMENTS floats."""
    lead = 1
    for s in q.lead_shape:
        lead *= max(int(s), 1)
    n = max(CHUNK_ELEMENTS // max(lead * width, 1), 1)
    n = max((n // multiple) * multiple, multiple)
    return n


def check_queries(q: QuantizedTensor, queries: torch.Tensor, dim: int) -> torch.Tensor:
    check_input(queries, dim, "queries")
    return queries.to(device=q.device, dtype=torch.float32)


def cat_scores(parts: list, q: torch.Tensor, c: QuantizedTensor) -> torch.Tensor:
    """Score chunks [..., Q, n] joined along tokens; [..., Q, 0] when c holds no token."""
    if not parts:
        lead = torch.broadcast_shapes(q.shape[:-2], c.lead_shape)
        return q.new_zeros((*lead, q.shape[-2], 0))
    return torch.cat(parts, dim=-1)


def check_weights(q: QuantizedTensor, w: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_DTYPES:
        raise ValueError("weights must be a floating torch.Tensor [..., Q, N]")
    if w.ndim < 2 or w.shape[-1] != q.num_tokens:
        raise ValueError(f"weights must have shape [..., Q, {q.num_tokens}], got {tuple(w.shape)}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("weights contain NaN or Inf")
    return w.to(device=q.device, dtype=torch.float32)


def expect(qt: QuantizedTensor, kind: str, name: str, dtype, tail: tuple) -> torch.Tensor:
    """Check one field of a compressed tensor: present, right dtype, shape [*lead, *tail]."""
    store = getattr(qt, kind)
    if name not in store:
        raise CorruptStreamError(f"{qt.method}: missing field {kind}.{name}")
    t = store[name]
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise CorruptStreamError(f"{qt.method}: field {name} has dtype {t.dtype}, expected {dtypes}")
    if kind == "side":
        ok = t.ndim == qt.lead_ndim + len(tail) and all(
            s in (1, l) for s, l in zip(t.shape[: qt.lead_ndim], qt.lead_shape)) and tuple(t.shape[qt.lead_ndim:]) == tail
    else:
        ok = tuple(t.shape) == (*qt.lead_shape, *tail)
    if not ok:
        raise CorruptStreamError(f"{qt.method}: field {name} has shape {tuple(t.shape)}, expected [*{qt.lead_shape}, *{tail}]")
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise CorruptStreamError(f"{qt.method}: field {name} holds NaN or Inf")
    return t


class KVQuantizer:
    """Interface every quantizer implements (TurboQuantMSE, TurboQuantProd, QJL, KIVI, outliers)."""

    dim: int

    def config(self) -> dict:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor, precond=None) -> QuantizedTensor:
        raise NotImplementedError

    def dequantize(self, c: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_scores(self, c: QuantizedTensor, queries: torch.Tensor) -> torch.Tensor:
        """``scores`` for a caller that made ``c`` itself (the HF cache); quantizers with a cheaper
        unchecked path override it."""
        return self.scores(c, queries)

    def attention_weighted_sum(self, c: QuantizedTensor, weights: torch.Tensor) -> torch.Tensor:
        """``weighted_sum`` for a caller that made ``c`` itself (see attention_scores)."""
        return self.weighted_sum(c, weights)

    def validate(self, c: QuantizedTensor) -> None:
        raise NotImplementedError

    def packed(self, c: QuantizedTensor) -> PackedKV | None:
        """c in the layout attention kernels read (kvcodec.quant.packed), or None: this quantizer has none."""
        return None

    def append(self, c: QuantizedTensor, x: torch.Tensor) -> QuantizedTensor:
        """Quantize new tokens with c's side data (preconditioner) and concatenate them to c."""
        return QuantizedTensor.cat([c, self.quantize(x, precond=c)])

    def _own(self, c: QuantizedTensor) -> None:
        if not isinstance(c, QuantizedTensor):
            raise ValueError(f"expected a QuantizedTensor, got {type(c).__name__}")
        if c.config != self.config():
            raise ValueError(f"this QuantizedTensor was made by {c.config}, not by {self.config()}")
