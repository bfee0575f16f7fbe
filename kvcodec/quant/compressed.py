"""QuantizedTensor: the packed, compressed form of a [..., T, D] K or V tensor.

It holds only real tensors (bit-packed codes, fp16/bf16 norms and scales, small per-head side
data) and a JSON-able config that rebuilds its quantizer. Its fields come in three kinds:
- ``token`` fields have the token axis at position ``lead_ndim`` ([..., T] or [..., T, W]):
  concatenated, sliced and selected along with the tokens;
- ``grouped`` fields hold one row per ``group_size`` tokens ([..., G, W]; KIVI keys);
- ``side`` fields are per-(leading index) constants ([..., 1, W], leading dims equal or 1):
  preconditioners, channel permutations. They must match for concatenation.
``nbytes`` is the sum of the bytes of every tensor held: what a kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcodec import container, validate
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES as CAP
from kvcodec.errors import CorruptStreamError
from kvcodec.quant.registry import quantizer_from_config

_DTYPES = {
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
CONTAINER_KIND = "kvcodec.quant.v1"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors; shared ones (the HF cache's side data) without the host sync of torch.equal."""
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device)))


@dataclass
class QuantizedTensor:
    """A compressed [*lead, T, D] tensor. See the module docstring for the field kinds."""

    config: dict
    lead_shape: tuple
    num_tokens: int
    dim: int
    token: dict = field(default_factory=dict)
    side: dict = field(default_factory=dict)
    grouped: dict = field(default_factory=dict)
    group_size: int = 0

    # ----------------------------------------------------------------- basic facts
    @property
    def method(self) -> str:
        return self.config["method"]

    @property
    def lead_ndim(self) -> int:
        return len(self.lead_shape)

    @property
    def shape(self) -> torch.Size:
        """The logical shape of the tensor this compresses."""
        return torch.Size((*self.lead_shape, self.num_tokens, self.dim))

    @property
    def device(self) -> torch.device:
        return next(iter(self.token.values())).device

    def tensors(self) -> dict:
        """Every tensor held, with a kind prefix ("token.codes", "side.center", ...)."""
        out = {}
        for kind in ("token", "side", "grouped"):
            for k, v in getattr(self, kind).items():
                out[f"{kind}.{k}"] = v
        return out

    @property
    def nbytes(self) -> int:
        """True bytes held: the sum over every tensor (codes, norms, scales, side data)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def bits_per_value(self) -> float:
        """nbytes * 8 / (number of values compressed)."""
        n = self.shape.numel()
        return self.nbytes * 8 / n if n else 0.0

    def __getattr__(self, name):
        # codes, norms, qjl, rnorms, center, scale, ... read as attributes (the shared layout)
        for kind in ("token", "side", "grouped"):
            d = self.__dict__.get(kind)
            if d is not None and name in d:
                return d[name]
        raise AttributeError(name)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"QuantizedTensor({self.method}, shape={tuple(self.shape)}, "
                f"nbytes={self.nbytes}, bits/value={self.bits_per_value():.3f})")

    # ----------------------------------------------------------------- quantizer
    @property
    def quantizer(self):
        return quantizer_from_config(self.config)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.quantizer.dequantize(self, dtype=dtype)

    # ----------------------------------------------------------------- movement
    def _map(self, fn) -> "QuantizedTensor":
        return QuantizedTensor(
            config=self.config, lead_shape=self.lead_shape, num_tokens=self.num_tokens, dim=self.dim,
            token={k: fn(v) for k, v in self.token.items()},
            side={k: fn(v) for k, v in self.side.items()},
            grouped={k: fn(v) for k, v in self.grouped.items()},
            group_size=self.group_size,
        )

    def to(self, device) -> "QuantizedTensor":
        """The same compressed tensor on another device (dtypes unchanged)."""
        return self._map(lambda t: t.to(device))

    def clone(self) -> "QuantizedTensor":
        return self._map(lambda t: t.clone())

    # ----------------------------------------------------------------- token ops
    def slice_tokens(self, start: int, stop: int | None = None) -> "QuantizedTensor":
        """Tokens [start, stop) on the packed form (negative indices as in Python)."""
        start, stop, _ = slice(start, stop).indices(self.num_tokens)
        stop = max(stop, start)
        ax = self.lead_ndim
        grouped = {}
        if self.grouped:
            if start % self.group_size:
                raise ValueError(f"{self.method}: a slice must start on a group boundary (group_size={self.group_size})")
            g0, g1 = start // self.group_size, -(-stop // self.group_size)
            grouped = {k: v.narrow(ax, g0, g1 - g0) for k, v in self.grouped.items()}
        return QuantizedTensor(
            config=self.config, lead_shape=self.lead_shape, num_tokens=stop - start, dim=self.dim,
            token={k: v.narrow(ax, start, stop - start) for k, v in self.token.items()},
            side=dict(self.side), grouped=grouped, group_size=self.group_size,
        )

    def crop(self, max_length: int) -> "QuantizedTensor":
        """Keep the first ``max_length`` tokens (a negative value removes that many from the end)."""
        n = max_length if max_length >= 0 else max(self.num_tokens + max_length, 0)
        return self.slice_tokens(0, min(n, self.num_tokens))

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Concatenate along tokens on the packed form (same quantizer, same side data)."""
        parts = [p for p in parts]
        if not parts:
            raise ValueError("cat needs at least one QuantizedTensor")
        first = parts[0]
        for p in parts[1:]:
            if p.config != first.config or p.lead_shape != first.lead_shape or p.dim != first.dim:
                raise ValueError("cat: parts differ in quantizer config or leading shape")
            if p.side.keys() != first.side.keys() or not all(_same(first.side[k], p.side[k]) for k in first.side):
                raise ValueError("cat: parts were quantized with different side data (preconditioner); "
                                 "quantize later blocks with precond=<the first compressed tensor>")
        if first.grouped:
            for p in parts[:-1]:
                if p.num_tokens % first.group_size:
                    raise ValueError(f"{first.method}: only the last part may end in a partial group")
        parts = [p for p in parts if p.num_tokens > 0] or [first]
        ax = first.lead_ndim
        token = {}
        for k in first.token:
            ts = [p.token[k].to(first.device) for p in parts]
            dts = {t.dtype for t in ts}
            if len(dts) > 1:  # fp16 and bf16 norms: widen to bf16 range (the layout allows either)
                ts = [t.to(torch.bfloat16) for t in ts]
            token[k] = torch.cat(ts, dim=ax)
        grouped = {k: torch.cat([p.grouped[k].to(first.device) for p in parts], dim=ax) for k in first.grouped}
        return QuantizedTensor(
            config=first.config, lead_shape=first.lead_shape, num_tokens=sum(p.num_tokens for p in parts),
            dim=first.dim, token=token, side=dict(first.side), grouped=grouped, group_size=first.group_size,
        )

    def index_select(self, dim: int, index: torch.Tensor) -> "QuantizedTensor":
        """Select along a leading dim (e.g. batch, for beam search) on the packed form."""
        if dim < 0:
            dim += self.lead_ndim
        if not 0 <= dim < self.lead_ndim:
            raise ValueError(f"index_select works on leading dims 0..{self.lead_ndim - 1}, got {dim}")
        index = torch.as_tensor(index, dtype=torch.int64)

        def sel(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[dim] == 1 and self.lead_shape[dim] != 1 else t.index_select(dim, index.to(t.device))

        lead = list(self.lead_shape)
        lead[dim] = int(index.numel())
        return QuantizedTensor(
            config=self.config, lead_shape=tuple(lead), num_tokens=self.num_tokens, dim=self.dim,
            token={k: v.index_select(dim, index.to(v.device)) for k, v in self.token.items()},
            side={k: sel(v) for k, v in self.side.items()},
            grouped={k: v.index_select(dim, index.to(v.device)) for k, v in self.grouped.items()},
            group_size=self.group_size,
        )

    def repeat_interleave(self, repeats: int, dim: int = 0) -> "QuantizedTensor":
        """Repeat each entry of a leading dim ``repeats`` times (batch expansion for beam search)."""
        n = self.lead_shape[dim]
        return self.index_select(dim, torch.arange(n).repeat_interleave(repeats))

    # ----------------------------------------------------------------- serialization
    def meta(self) -> dict:
        return {
            "config": self.config, "lead_shape": list(self.lead_shape), "num_tokens": self.num_tokens,
            "dim": self.dim, "group_size": self.group_size,
        }

    def to_dict(self) -> dict:
        """Plain CPU tensors plus JSON-able metadata: {"meta": {...}, "tensors": {name: tensor}}."""
        return {"meta": self.meta(), "tensors": {k: v.detach().cpu().contiguous() for k, v in self.tensors().items()}}

    @classmethod
    def from_dict(cls, d: dict, max_output_bytes: int | None = CAP) -> "QuantizedTensor":
        """Rebuild from to_dict's output; any inconsistency raises CorruptStreamError.

        Every meta field is checked (types, ranges, the quantizer's cost) before the quantizer is
        built or a tensor is touched; ``max_output_bytes`` (default 4 GiB,
        ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES``; ``None``: no cap) caps the float32 tensor
        it dequantizes to.
        """
        if type(d) is not dict or set(d) != {"meta", "tensors"} or type(d["tensors"]) is not dict:
            raise CorruptStreamError("malformed quantized tensor: expected {'meta', 'tensors'}")
        meta, tensors = _checked_meta(d["meta"], max_output_bytes), d["tensors"]
        qt = cls(config=dict(meta["config"]), lead_shape=tuple(meta["lead_shape"]), num_tokens=meta["num_tokens"],
                 dim=meta["dim"], group_size=meta["group_size"])
        for name, t in tensors.items():
            kind, _, key = name.partition(".") if type(name) is str else ("", "", "")
            if kind not in ("token", "side", "grouped") or not key or not isinstance(t, torch.Tensor):
                raise CorruptStreamError(f"unexpected tensor entry {str(name)[:80]!r}")
            getattr(qt, kind)[key] = t
        try:
            qt.quantizer.validate(qt)
        except CorruptStreamError:
            raise
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError, OverflowError) as e:
            raise CorruptStreamError(f"quantized tensor does not match its config: {str(e)[:200]}") from e
        return qt

    def to_bytes(self) -> bytes:
        """Serialize through kvcodec.container (the library's one container format)."""
        d = self.to_dict()
        return container.dumps(CONTAINER_KIND, d["meta"], d["tensors"])

    @classmethod
    def from_bytes(cls, blob: bytes, max_output_bytes: int | None = CAP) -> "QuantizedTensor":
        """Parse :meth:`to_bytes` output (untrusted input: see :meth:`from_dict`)."""
        kind, meta, tensors = container.loads(blob)
        if kind != CONTAINER_KIND:
            raise CorruptStreamError(f"not a quantized tensor (container kind {kind!r})")
        return cls.from_dict({"meta": meta, "tensors": tensors}, max_output_bytes)


# --------------------------------------------------------------------- untrusted metadata
#: Largest vector dimension a saved quantizer may have: building its rotation (a QR of dim x dim)
#: and codebook takes ~0.2 s at 1024 on one core, 1.8 s at 2048; head dims are 64-512.
MAX_QUANT_DIM = 1024
#: Largest QJL sketch (m x dim float32 entries, m/dim QR blocks) a saved quantizer may ask for:
#: 8 bits per coordinate at dim 256, 2 at dim 1024 (a QJL m = 2^30 would take minutes to build).
MAX_SKETCH_ELEMENTS = 1 << 21
_MAX_TOKENS = 1 << 40
_MAX_CONFIG_KEYS = 32


def _checked_config(cfg, dim: int) -> dict:
    """Config fields a quantizer is rebuilt from: JSON scalars, with the sizes that cost memory
    and time (dim, m) bounded before anything is built. The quantizer's own constructor checks
    the rest (bits ranges, rotation names) and raises CorruptStreamError through the registry."""
    if type(cfg) is not dict or len(cfg) > _MAX_CONFIG_KEYS or type(cfg.get("method")) is not str:
        raise CorruptStreamError("quantized tensor config must be an object with a method name")
    for k, v in cfg.items():
        if type(v) not in (str, int, bool, type(None)) or (type(v) is str and len(v) > 64):
            raise CorruptStreamError(f"quantized tensor config field {k!r} is not a short JSON scalar")
        if type(v) is int:
            validate.require_int(v, -(1 << 63), (1 << 63) - 1, f"quantizer config {k!r}")
    cdim = cfg.get("dim")
    if cdim is not None and cdim != dim:
        raise CorruptStreamError(f"quantizer config dim {cdim!r} differs from the tensor's dim {dim}")
    m = cfg.get("m")
    if m is not None and (type(m) is not int or not 1 <= m or m * dim > MAX_SKETCH_ELEMENTS):
        raise CorruptStreamError(f"QJL sketch size m={m!r} at dim {dim} is out of range")
    return cfg


def _checked_meta(meta, max_output_bytes: int | None) -> dict:
    """QuantizedTensor meta with every field type- and range-checked (see to_dict)."""
    validate.require_keys(meta, ("config", "lead_shape", "num_tokens", "dim", "group_size"), "quantized tensor meta")
    dim = validate.require_int(meta["dim"], 1, MAX_QUANT_DIM, "quantized tensor dim")
    num_tokens = validate.require_int(meta["num_tokens"], 0, _MAX_TOKENS, "quantized tensor num_tokens")
    validate.require_int(meta["group_size"], 0, _MAX_TOKENS, "quantized tensor group_size")
    lead = validate.check_shape(meta["lead_shape"], "quantized tensor lead_shape", max_ndim=8)
    validate.checked_nbytes([*lead, num_tokens, dim], 4, "dequantized tensor", max_output_bytes)
    _checked_config(meta["config"], dim)
    return meta
