"""The fitted transform of one model: a PCA basis per (layer, K/V[, head]), stored in a safe file.

``fit`` runs once per model on a few thousand tokens of real calibration text. Keys are taken
back to position-free form first (``RoPE.undo``), so one basis serves every position. The file is
a kvcodec container (``kvcodec.container``: JSON header, raw little-endian arrays, CRC-32 per
section, no pickle), versioned and fully validated on load.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvcodec import container
from kvcodec.errors import CorruptStreamError
from kvcodec.transform.rope import RoPE

KIND = "kvcodec.transform.calibration"
VERSION = 1
MAX_FILE_BYTES = 4 << 30
WEIGHTINGS = ("relative", "mse")
_META_KEYS = {"version", "n_layers", "n_kv_heads", "head_dim", "per_head", "rope", "n_tokens", "weighting", "key_weight"}
_SECTIONS = {"mean": np.float32, "basis": np.float32, "eigenvalues": np.float64, "weights": np.float64,
             "scales": np.float32}


@dataclass(frozen=True, eq=False)
class Calibration:
    """A per-model transform.

    mean [L, 2, G, n] float32, basis [L, 2, G, n, n] float32 (column j = component j, by falling
    variance), eigenvalues [L, 2, G, n] float64 (calibration variance per component), weights
    [L, 2] float64 (distortion weight per layer and K/V: the quantizer step of (l, k) is the
    global step / sqrt(weight)). Axis 1 is 0 = keys, 1 = values. G = n_kv_heads and n = head_dim
    with ``per_head``, else G = 1 and n = n_kv_heads * head_dim (heads concatenated).
    scales [L, 2, H, D] float32: channel metric weights applied before the basis (x * scale is what
    is projected and quantized, so squared error is measured in that metric; 1 = plain MSE). Key
    scales from queries make the quantizer minimise the attention-score error; RoPE pairs share
    one scale, so scaling commutes with the rotation.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    per_head: bool
    rope: RoPE | None
    mean: np.ndarray
    basis: np.ndarray
    eigenvalues: np.ndarray
    weights: np.ndarray
    scales: np.ndarray
    n_tokens: int
    weighting: str = "relative"
    key_weight: float = 1.0
    _fp: list = field(default_factory=list, init=False, repr=False)
    _device_cache: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def groups(self) -> int:
        return self.n_kv_heads if self.per_head else 1

    @property
    def dim(self) -> int:
        return self.head_dim if self.per_head else self.n_kv_heads * self.head_dim

    def meta(self) -> dict:
        return {
            "version": VERSION, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "per_head": self.per_head,
            "rope": None if self.rope is None else self.rope.to_json(), "n_tokens": self.n_tokens,
            "weighting": self.weighting, "key_weight": self.key_weight,
        }

    def arrays(self) -> dict[str, np.ndarray]:
        return {"mean": self.mean, "basis": self.basis, "eigenvalues": self.eigenvalues, "weights": self.weights,
                "scales": self.scales}

    @property
    def fingerprint(self) -> str:
        """sha256 (first 16 hex digits) of the header and arrays: a blob names the calibration it needs."""
        if not self._fp:
            h = hashlib.sha256(json.dumps(self.meta(), sort_keys=True).encode())
            for name, arr in self.arrays().items():
                h.update(name.encode())
                h.update(np.ascontiguousarray(arr).tobytes())
            self._fp.append(h.hexdigest()[:16])
        return self._fp[0]

    def to_bytes(self) -> bytes:
        return container.dumps(KIND, self.meta(), self.arrays())

    def save(self, path) -> None:
        """Write the calibration file (a temporary file renamed over ``path``: no half-written file)."""
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)

    @classmethod
    def from_bytes(cls, blob) -> "Calibration":
        """Parse and validate a calibration file's bytes; CorruptStreamError for anything wrong."""
        _, meta, arrays = container.loads(blob, expect_kind=KIND)
        return _validated(meta, arrays)

    @classmethod
    def load(cls, path) -> "Calibration":
        path = Path(path)
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CorruptStreamError(f"{path}: {size} bytes is too large for a calibration file")
        return cls.from_bytes(path.read_bytes())


def _validated(meta: dict, arrays: dict) -> Calibration:
    if set(meta) != _META_KEYS:
        raise CorruptStreamError(f"calibration header keys {sorted(meta)} != {sorted(_META_KEYS)}")
    if meta["version"] != VERSION:
        raise CorruptStreamError(f"calibration version {meta['version']!r} (this build reads {VERSION})")
    ints = [meta[k] for k in ("n_layers", "n_kv_heads", "head_dim", "n_tokens")]
    if any(type(v) is not int or v < 1 for v in ints) or ints[0] > 4096 or ints[1] > 1024 or ints[2] > 4096:
        raise CorruptStreamError("calibration dimensions must be positive integers in range")
    if type(meta["per_head"]) is not bool or meta["weighting"] not in WEIGHTINGS:
        raise CorruptStreamError("calibration per_head/weighting invalid")
    kw = meta["key_weight"]
    if isinstance(kw, bool) or not isinstance(kw, (int, float)) or not 0 < kw < 1e6:
        raise CorruptStreamError("calibration key_weight invalid")
    try:
        rope = None if meta["rope"] is None else RoPE.from_json(meta["rope"])
    except ValueError as exc:
        raise CorruptStreamError(f"calibration rope: {exc}") from None
    L, H, D = ints[:3]
    if rope is not None and rope.head_dim != D:
        raise CorruptStreamError("calibration rope frequencies do not match head_dim")
    G, n = (H, D) if meta["per_head"] else (1, H * D)
    shapes = {"mean": (L, 2, G, n), "basis": (L, 2, G, n, n), "eigenvalues": (L, 2, G, n), "weights": (L, 2),
              "scales": (L, 2, H, D)}
    if set(arrays) != set(_SECTIONS):
        raise CorruptStreamError(f"calibration sections {sorted(arrays)} != {sorted(_SECTIONS)}")
    out = {}
    for name, dt in _SECTIONS.items():
        a = arrays[name]
        if not isinstance(a, np.ndarray) or a.dtype != dt or a.shape != shapes[name]:
            raise CorruptStreamError(f"calibration {name}: expected {np.dtype(dt).name} {shapes[name]}")
        if not np.all(np.isfinite(a)):
            raise CorruptStreamError(f"calibration {name} holds non-finite values")
        out[name] = np.array(a)  # own, writable copy
    if np.any(out["weights"] <= 0) or np.any(out["eigenvalues"] < 0) or np.any(out["scales"] <= 1e-6):
        raise CorruptStreamError("calibration weights and scales must be > 0 and eigenvalues >= 0")
    b = out["basis"].astype(np.float64).reshape(-1, n, n)
    gram = np.einsum("gij,gik->gjk", b, b)
    if np.max(np.abs(gram - np.eye(n))) > 1e-3:
        raise CorruptStreamError("calibration basis is not orthonormal")
    return Calibration(L, H, D, meta["per_head"], rope, out["mean"], out["basis"], out["eigenvalues"],
                       out["weights"], out["scales"], meta["n_tokens"], meta["weighting"], float(kw))


def _as_float_list(x, what: str) -> list[torch.Tensor]:
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    out = []
    for t in items:
        t = torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t
        if t.ndim != 4 or not t.is_floating_point():
            raise ValueError(f"{what} must be float tensors shaped [layers, kv_heads, tokens, head_dim]")
        out.append(t.detach().to("cpu", torch.float32))
    if any(t.shape[:2] != out[0].shape[:2] or t.shape[3] != out[0].shape[3] for t in out):
        raise ValueError(f"all {what} must share layers, kv_heads and head_dim")
    return out


def group_vectors(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """[L, H, T, D] -> [L, G, T, n]: one row per token and group (a head, or all heads concatenated)."""
    L, H, T, D = x.shape
    return x if per_head else x.permute(0, 2, 1, 3).reshape(L, 1, T, H * D)


def ungroup_vectors(x: torch.Tensor, n_kv_heads: int, per_head: bool) -> torch.Tensor:
    """Inverse of ``group_vectors``: [L, G, T, n] -> [L, H, T, D]."""
    if per_head:
        return x
    L, _, T, n = x.shape
    return x.reshape(L, T, n_kv_heads, n // n_kv_heads).permute(0, 2, 1, 3)


def fit(keys, values, rope: RoPE | None, *, per_head: bool = False, positions_start=0, skip_sinks: int = 4,
        weighting: str = "relative", key_weight: float = 1.0, key_scales=None, value_scales=None) -> Calibration:
    """Fit the transform on calibration K/V: post-RoPE keys and values [L, H, T, D] (a tensor, or a
    list of tensors from several sequences; ``positions_start`` an int or one per sequence).

    rope: the model's RoPE (``RoPE.default(head_dim, theta)``, ``RoPE.from_model(model)``) or None
    for keys stored without rotation. The first ``skip_sinks`` tokens of each sequence are left out
    (codecs store them exactly; their outliers would bend the basis). ``weighting``: "relative"
    (every layer and K/V gets a quantizer step proportional to its RMS: equal relative error) or
    "mse" (one step everywhere: minimum total squared error). ``key_weight`` multiplies the keys'
    distortion weight (> 1: keys finer). key_scales / value_scales: channel metric weights
    [L, H, D] (``query_key_scales``, ``output_value_scales``); None = plain squared error.
    """
    ks, vs = _as_float_list(keys, "keys"), _as_float_list(values, "values")
    if len(ks) != len(vs) or any(k.shape != v.shape for k, v in zip(ks, vs)):
        raise ValueError("keys and values must have the same shapes")
    starts = list(positions_start) if isinstance(positions_start, (list, tuple)) else [positions_start] * len(ks)
    if len(starts) != len(ks) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in starts):
        raise ValueError("positions_start must be a non-negative int or one per sequence")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if not (isinstance(key_weight, (int, float)) and 0 < key_weight < 1e6):
        raise ValueError("key_weight must be a positive number")
    if not isinstance(skip_sinks, int) or skip_sinks < 0:
        raise ValueError("skip_sinks must be a non-negative int")
    L, H, _, D = ks[0].shape
    if rope is not None and rope.head_dim != D:
        raise ValueError(f"rope has head_dim {rope.head_dim}, keys have {D}")
    G, n = (H, D) if per_head else (1, H * D)
    scales = torch.stack([_channel_scales(key_scales, (L, H, D), "key_scales"),
                          _channel_scales(value_scales, (L, H, D), "value_scales")], dim=1)  # [L, 2, H, D]
    sums = torch.zeros(L, 2, G, n, dtype=torch.float64)
    grams = torch.zeros(L, 2, G, n, n, dtype=torch.float64)
    count = 0
    for k, v, s in zip(ks, vs, starts):
        k, v = k[:, :, skip_sinks:], v[:, :, skip_sinks:]
        T = k.shape[2]
        if T == 0:
            continue
        if rope is not None:
            k = rope.undo(k, torch.arange(s + skip_sinks, s + skip_sinks + T))
        for kind, x in enumerate((k, v)):
            g = group_vectors(x * scales[:, kind, :, None, :], per_head).double()  # [L, G, T, n]
            sums[:, kind] += g.sum(dim=2)
            grams[:, kind] += g.transpose(-1, -2) @ g
        count += T
    if count < 2:
        raise ValueError("calibration needs at least 2 tokens after the sinks")
    mean = sums / count
    cov = grams / count - mean[..., :, None] * mean[..., None, :]
    # numpy's LAPACK call: torch.linalg.eigh's threaded path took 2-18 s for 16 small matrices on a loaded
    # 2-core machine (0.05 s single-threaded); the results are the same
    ev, vec = np.linalg.eigh(cov.numpy())  # ascending
    evals, evecs = torch.from_numpy(ev[..., ::-1].copy()).clamp_min(0), torch.from_numpy(vec[..., ::-1].copy())
    var = evals.sum(dim=-1).mean(dim=-1) / n  # [L, 2] mean variance per scalar
    if weighting == "relative":
        weights = 1.0 / var.clamp_min(1e-12)
    else:
        weights = torch.ones(L, 2, dtype=torch.float64)
    weights[:, 0] *= key_weight
    weights = weights / weights.mean()
    return Calibration(L, H, D, per_head, rope, mean.float().numpy(), evecs.float().contiguous().numpy(),
                       evals.numpy(), weights.numpy(), scales.numpy(), count, weighting, float(key_weight))


def _channel_scales(s, shape, what: str) -> torch.Tensor:
    if s is None:
        return torch.ones(shape, dtype=torch.float32)
    s = torch.as_tensor(s, dtype=torch.float32).cpu()
    if tuple(s.shape) != shape or not bool(torch.isfinite(s).all()) or bool((s <= 1e-6).any()):
        raise ValueError(f"{what} must be finite, positive and shaped {list(shape)}")
    return s


def query_key_scales(queries, n_kv_heads: int, floor: float = 0.05) -> torch.Tensor:
    """Key channel scales [L, H, D] from calibration queries [L, Hq, T, D] (any RoPE state): the
    score error of a key error e is q.e, so channel c is weighted by sqrt(E[q_c^2]) over the query
    heads that read its kv head, averaged over each RoPE pair (c, c + D/2) (the rotation mixes a
    pair, so only the pair's energy is position-independent). Normalised to mean square 1 per
    (layer, head); ``floor`` (relative) keeps every channel codable."""
    q = torch.as_tensor(queries).float()
    L, Hq, T, D = q.shape
    if Hq % n_kv_heads:
        raise ValueError("query heads must be a multiple of kv heads")
    e = q.pow(2).mean(dim=2).reshape(L, n_kv_heads, Hq // n_kv_heads, D).mean(dim=2)  # [L, H, D]
    h = D // 2
    pair = (e[..., :h] + e[..., h:]) / 2
    e = torch.cat([pair, pair], dim=-1)
    e = e / e.mean(dim=-1, keepdim=True)
    return e.clamp_min(floor).sqrt()

