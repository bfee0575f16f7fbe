"""The fitted transform of one model: a PCA basis per (group of layers, K/V[, head]), stored in a safe file.

``fit`` runs once per model on a few thousand tokens of real calibration text. Keys are taken
back to position-free form first (``RoPE.undo``), so one basis serves every position. Vectors of
several consecutive layers are concatenated before the PCA (``layers_per_group``, KVTC's
cross-layer basis): neighbouring layers read the same residual stream, and on SmolLM2 held-out
text a 5-layer basis codes the same relative error with ~0.3 fewer bits per value than a
per-layer one (docs/transform.md). The distortion metric (per-channel ``scales`` times the
per-(layer, K/V) ``weights``) is applied *before* the PCA, so one quantizer step everywhere is the
rate-distortion optimum in that metric. The file is a kvcodec container (``kvcodec.container``:
JSON header, raw little-endian arrays, CRC-32 per section, no pickle), versioned and fully
validated on load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kvcodec import container, safe_write
from kvcodec.errors import CorruptStreamError
from kvcodec.transform.rope import RoPE

KIND = "kvcodec.transform.calibration"
VERSION = 2  # 2: layer groups, weights folded into the metric before the PCA
MAX_FILE_BYTES = 4 << 30
WEIGHTINGS = ("relative", "mse", "custom")
_META_KEYS = {"version", "n_layers", "n_kv_heads", "head_dim", "per_head", "layers_per_group", "joint_kv", "rank",
              "rope", "n_tokens",
              "weighting", "key_weight"}
_SECTIONS = {"mean": np.float32, "basis": np.float32, "eigenvalues": np.float64, "weights": np.float64,
             "scales": np.float32}


@dataclass(frozen=True, eq=False)
class Calibration:
    """A per-model transform.

    Layers are split into ``n_layer_groups`` = L / g consecutive groups of g = ``layers_per_group``.
    mean [LG, P, G, n] float32, basis [LG, P, G, n, r] float32 (column j = component j, by falling
    variance; r = ``rank`` <= n: the components past it are never coded, KVTC's target rank),
    eigenvalues [LG, P, G, r] float64 (calibration variance per component, in the metric). With ``joint_kv`` P = 1 and a vector holds keys then values, else P = 2 (axis 1: 0 =
    keys, 1 = values). G = n_kv_heads with ``per_head``, else 1; n = (2 if joint_kv else 1) * g *
    (head_dim with per_head, else n_kv_heads * head_dim).
    The metric: x * metric_scales() is what is projected and quantized with one step, so squared
    error is measured with channel ``scales`` [L, 2, H, D] float32 (1 = plain MSE; key scales from
    queries make it the attention-score error; RoPE pairs share one scale, so scaling commutes
    with the rotation) times sqrt(``weights``) [L, 2] float64 (distortion weight per layer and K/V:
    relative, measured sensitivity, ...).
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
    layers_per_group: int = 1
    joint_kv: bool = False
    _fp: list = field(default_factory=list, init=False, repr=False)
    _device_cache: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def groups(self) -> int:
        return self.n_kv_heads if self.per_head else 1

    @property
    def n_layer_groups(self) -> int:
        return self.n_layers // self.layers_per_group

    @property
    def parts(self) -> int:
        return 1 if self.joint_kv else 2

    @property
    def dim(self) -> int:
        d = self.head_dim if self.per_head else self.n_kv_heads * self.head_dim
        return self.layers_per_group * d * (2 if self.joint_kv else 1)

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    def truncated(self, rank: int) -> "Calibration":
        """The same calibration keeping only the first ``rank`` components of every basis (a smaller
        file; components past it are never coded). Needs no refit: the components are sorted."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.rank:
            raise ValueError(f"rank must be an int in [1, {self.rank}], got {rank!r}")
        return replace(self, basis=np.ascontiguousarray(self.basis[..., :rank]),
                       eigenvalues=np.ascontiguousarray(self.eigenvalues[..., :rank]))

    def coef_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the coefficients of ``tokens`` tokens: [L / g, P, G, n, tokens]."""
        return (self.n_layer_groups, self.parts, self.groups, self.dim, tokens)

    def metric_scales(self) -> np.ndarray:
        """[L, 2, H, D] float64: the factor each channel is multiplied by before the projection."""
        return self.scales.astype(np.float64) * np.sqrt(self.weights)[:, :, None, None]

    def meta(self) -> dict:
        return {
            "version": VERSION, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "per_head": self.per_head, "layers_per_group": self.layers_per_group,
            "joint_kv": self.joint_kv, "rank": self.rank,
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

    def save(self, path, *, overwrite: bool = False) -> None:
        """Write the calibration file through :func:`kvcodec.safe_write.atomic_write` (never a
        half-written file); WriteRefusedError for an existing file unless ``overwrite``."""
        safe_write.write_bytes(path, self.to_bytes(), overwrite=overwrite)

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
    if type(meta["per_head"]) is not bool or type(meta["joint_kv"]) is not bool or meta["weighting"] not in WEIGHTINGS:
        raise CorruptStreamError("calibration per_head/weighting invalid")
    g = meta["layers_per_group"]
    if type(g) is not int or g < 1 or ints[0] % g:
        raise CorruptStreamError("calibration layers_per_group must divide n_layers")
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
    P = 1 if meta["joint_kv"] else 2
    G, n = (H, g * D) if meta["per_head"] else (1, g * H * D)
    n *= 3 - P
    LG = L // g
    r = meta["rank"]
    if type(r) is not int or not 1 <= r <= n:
        raise CorruptStreamError("calibration rank must be an int in [1, basis dimension]")
    if LG * P * G * n * r > MAX_FILE_BYTES // 4:
        raise CorruptStreamError("calibration basis is too large")
    shapes = {"mean": (LG, P, G, n), "basis": (LG, P, G, n, r), "eigenvalues": (LG, P, G, r), "weights": (L, 2),
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
    b = out["basis"].astype(np.float64).reshape(-1, n, r)
    gram = b.transpose(0, 2, 1) @ b
    if np.max(np.abs(gram - np.eye(r))) > 1e-3:
        raise CorruptStreamError("calibration basis is not orthonormal")
    return Calibration(L, H, D, meta["per_head"], rope, out["mean"], out["basis"], out["eigenvalues"],
                       out["weights"], out["scales"], meta["n_tokens"], meta["weighting"], float(kw), g,
                       meta["joint_kv"])


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


def group_vectors(x: torch.Tensor, per_head: bool, layers_per_group: int = 1) -> torch.Tensor:
    """[L, H, T, D] -> [L / g, G, T, n]: one row per token and group (g consecutive layers of one
    head, or of all heads concatenated); within a row, layer-major, then head, then channel."""
    L, H, T, D = x.shape
    g = layers_per_group
    y = x.reshape(L // g, g, H, T, D)
    if per_head:
        return y.permute(0, 2, 3, 1, 4).reshape(L // g, H, T, g * D)
    return y.permute(0, 3, 1, 2, 4).reshape(L // g, 1, T, g * H * D)


def ungroup_vectors(x: torch.Tensor, n_kv_heads: int, per_head: bool, layers_per_group: int = 1) -> torch.Tensor:
    """Inverse of ``group_vectors``: [L / g, G, T, n] -> [L, H, T, D]."""
    LG, _, T, n = x.shape
    g, H = layers_per_group, n_kv_heads
    if per_head:
        D = n // g
        return x.reshape(LG, H, T, g, D).permute(0, 3, 1, 2, 4).reshape(LG * g, H, T, D)
    D = n // (g * H)
    return x.reshape(LG, T, g, H, D).permute(0, 2, 3, 1, 4).reshape(LG * g, H, T, D)


def stack_parts(keys: torch.Tensor, values: torch.Tensor, per_head: bool, layers_per_group: int,
                joint_kv: bool) -> torch.Tensor:
    """keys, values [L, H, T, D] -> the vectors one basis sees, [L / g, P, G, T, n] (``Calibration``)."""
    gk, gv = (group_vectors(x, per_head, layers_per_group) for x in (keys, values))
    return torch.cat([gk, gv], dim=-1)[:, None] if joint_kv else torch.stack([gk, gv], dim=1)


def unstack_parts(x: torch.Tensor, n_kv_heads: int, per_head: bool, layers_per_group: int,
                  joint_kv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``stack_parts``: [L / g, P, G, T, n] -> keys, values [L, H, T, D]."""
    if joint_kv:
        h = x.shape[-1] // 2
        gk, gv = x[:, 0, ..., :h], x[:, 0, ..., h:]
    else:
        gk, gv = x[:, 0], x[:, 1]
    return tuple(ungroup_vectors(t, n_kv_heads, per_head, layers_per_group) for t in (gk, gv))


MAX_AUTO_DIM = 2048  # the automatic layer grouping keeps every basis at most this wide


def auto_layers_per_group(n_layers: int, n_kv_heads: int, head_dim: int, joint_kv: bool, per_head: bool = False,
                          tokens: int | None = None, max_layers: int = 5) -> int:
    """The default ``layers_per_group``: the largest divisor of ``n_layers`` up to ``max_layers``
    whose basis stays within MAX_AUTO_DIM dimensions and, given the calibration ``tokens``, within
    tokens / 4 (a covariance fitted on fewer tokens than dimensions codes held-out text badly)
    (SmolLM2-135M with 8k tokens: 5 layers x K+V x 192 = 1920; 8 x 128-dim kv heads: 1 layer)."""
    width = (2 if joint_kv else 1) * head_dim * (1 if per_head else n_kv_heads)
    limit = MAX_AUTO_DIM if tokens is None else min(MAX_AUTO_DIM, tokens // 4)
    best = 1
    for g in range(1, max_layers + 1):
        if n_layers % g == 0 and g * width <= limit:
            best = g
    return best


def fit(keys, values, rope: RoPE | None, *, per_head: bool = False, layers_per_group: int | None = None,
        joint_kv: bool = True, rank: int | None = None, positions_start=0, skip_sinks: int = 4, weighting: str = "relative", key_weight: float = 1.0, weights=None, key_scales=None,
        value_scales=None) -> Calibration:
    """Fit the transform on calibration K/V: post-RoPE keys and values [L, H, T, D] (a tensor, or a
    list of tensors from several sequences; ``positions_start`` an int or one per sequence).

    rope: the model's RoPE (``RoPE.default(head_dim, theta)``, ``RoPE.from_model(model)``) or None
    for keys stored without rotation. ``layers_per_group``: consecutive layers sharing one basis
    (must divide L; a g-layer basis has (g * H * D)^2 entries and wants several times g * H * D
    calibration tokens; None: ``auto_layers_per_group``). ``rank``: components kept per basis (the
    file and the projection shrink; the rest is never coded; None: all). ``joint_kv``: keys and values of a group share one basis (they are
    projections of the same hidden states). The first ``skip_sinks`` tokens of each sequence are left out (codecs store
    them exactly; their outliers would bend the basis). ``weighting``: "relative" (every layer and
    K/V gets the same relative error) or "mse" (minimum total squared error); ``weights`` [L, 2]
    instead gives the distortion weight of every (layer, K/V) directly (weighting "custom", e.g.
    ``kvcodec.transform.sensitivity``'s KL per unit error). ``key_weight`` multiplies the keys'
    weights (> 1: keys finer). key_scales / value_scales: channel metric weights [L, H, D]
    (``query_key_scales``); None = plain squared error.
    """
    ks, vs = _as_float_list(keys, "keys"), _as_float_list(values, "values")
    if len(ks) != len(vs) or any(k.shape != v.shape for k, v in zip(ks, vs)):
        raise ValueError("keys and values must have the same shapes")
    starts = list(positions_start) if isinstance(positions_start, (list, tuple)) else [positions_start] * len(ks)
    if len(starts) != len(ks) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in starts):
        raise ValueError("positions_start must be a non-negative int or one per sequence")
    if weights is None and weighting not in ("relative", "mse"):
        raise ValueError(f"weighting must be 'relative' or 'mse' (or pass weights=), got {weighting!r}")
    if not (isinstance(key_weight, (int, float)) and 0 < key_weight < 1e6):
        raise ValueError("key_weight must be a positive number")
    if not isinstance(skip_sinks, int) or skip_sinks < 0:
        raise ValueError("skip_sinks must be a non-negative int")
    L, H, _, D = ks[0].shape
    if not isinstance(joint_kv, bool) or not isinstance(per_head, bool):
        raise ValueError("per_head and joint_kv must be bools")
    n_fit = sum(max(0, k.shape[2] - skip_sinks) for k in ks) if isinstance(skip_sinks, int) else None
    g = auto_layers_per_group(L, H, D, joint_kv, per_head, n_fit) if layers_per_group is None else layers_per_group
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or L % g:
        raise ValueError(f"layers_per_group must be a positive divisor of the {L} layers, got {g!r}")
    if rope is not None and rope.head_dim != D:
        raise ValueError(f"rope has head_dim {rope.head_dim}, keys have {D}")
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=torch.float64).cpu()
        if tuple(weights.shape) != (L, 2) or not bool(torch.isfinite(weights).all()) or bool((weights <= 0).any()):
            raise ValueError(f"weights must be finite, positive and shaped [{L}, 2]")
        weighting = "custom"
    layout = (per_head, g, joint_kv)
    scales = torch.stack([_channel_scales(key_scales, (L, H, D), "key_scales"),
                          _channel_scales(value_scales, (L, H, D), "value_scales")], dim=1)  # [L, 2, H, D]
    sums = grams = None
    count = 0
    for k, v, s in zip(ks, vs, starts):
        k, v = k[:, :, skip_sinks:], v[:, :, skip_sinks:]
        T = k.shape[2]
        if T == 0:
            continue
        if rope is not None:
            k = rope.undo(k, torch.arange(s + skip_sinks, s + skip_sinks + T))
        y = stack_parts(k * scales[:, 0, :, None, :], v * scales[:, 1, :, None, :], *layout).double()
        ys, yg = y.sum(dim=3), y.transpose(-1, -2) @ y  # [LG, P, G, n], [LG, P, G, n, n]
        sums, grams = (ys, yg) if sums is None else (sums + ys, grams + yg)
        count += T
    if count < 2:
        raise ValueError("calibration needs at least 2 tokens after the sinks")
    mean = sums / count
    cov = grams / count - mean[..., :, None] * mean[..., None, :]
    # per-(layer, K/V) mean variance per scalar, read off the covariance's diagonal
    index = torch.arange(2 * L, dtype=torch.float64).view(L, 2, 1, 1, 1).expand(L, 2, H, 1, D)
    part_of = stack_parts(index[:, 0], index[:, 1], *layout)[..., 0, :].long()  # [LG, P, G, n]: 2 * layer + kind
    var = torch.zeros(2 * L, dtype=torch.float64)
    var.index_add_(0, part_of.flatten(), torch.diagonal(cov, dim1=-2, dim2=-1).flatten())
    var = var.view(L, 2) / (H * D)
    if weights is None:
        weights = 1.0 / var.clamp_min(1e-12) if weighting == "relative" else torch.ones(L, 2, dtype=torch.float64)
    weights = weights.clone()
    weights[:, 0] *= key_weight
    weights = weights / weights.mean()
    # fold the weights into the metric: scale rows/columns of every covariance by sqrt(weight) of their layer
    f = weights.sqrt().flatten()[part_of]  # [LG, P, G, n]
    cov *= f[..., :, None] * f[..., None, :]
    mean *= f
    # numpy's LAPACK call: torch.linalg.eigh's threaded path took 2-18 s for 16 small matrices on a loaded
    # 2-core machine (0.05 s single-threaded); the results are the same
    n = cov.shape[-1]
    r = n if rank is None else rank
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= n:
        raise ValueError(f"rank must be an int in [1, {n}], got {rank!r}")
    ev, vec = np.linalg.eigh(cov.numpy())  # ascending
    evals = torch.from_numpy(ev[..., ::-1][..., :r].copy()).clamp_min(0)
    evecs = torch.from_numpy(vec[..., ::-1][..., :r].copy())
    return Calibration(L, H, D, per_head, rope, mean.float().numpy(), evecs.float().contiguous().numpy(),
                       evals.numpy(), weights.numpy(), scales.numpy(), count, weighting, float(key_weight), g,
                       joint_kv)


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

