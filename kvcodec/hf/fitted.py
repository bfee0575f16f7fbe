"""Quantizer statistics fitted on a model's own K/V and queries, stored by name with the cache spec.

Two things a calibration pass (``kvcodec.hf.calibrate.fit_statistics``) can learn that the data of one
prefill cannot tell the cache:

* ``query_rms`` [layers][kv heads][head_dim]: the RMS of each post-RoPE query channel (the query
  heads of a GQA group pooled). With it the key preconditioner uses the query-aware scale
  ``sqrt(sigma_k / rms(q))`` (``kvcodec.quant.precondition.calibrate(keys, queries=...)``) instead of
  ``sqrt(sigma_k)``: channels the queries read strongly get finer steps.
* ``codebooks`` {"key"|"value": {bits: centroids}}: Lloyd-Max codebooks fitted to the preconditioned,
  rotated coordinates of real keys / values (``kvcodec.quant.codebooks.fit_codebook``) instead of
  the uniform-sphere law.

A cache refers to a fit by name (``CompressedCache(..., calibration=name)``; ``name:qscale`` /
``name:codebooks`` take one of the two parts of a shipped fit), so the name is what ``save`` writes and ``load`` finds again; fits
ship as JSON under ``kvcodec/data`` and :func:`register` adds one for this process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources

import torch

_SHIPPED = {"smollm2-135m": "smollm2_kv_fit.json"}  # name -> file in kvcodec/data
_REGISTRY: dict[str, "Fit"] = {}


@dataclass
class Fit:
    query_rms: torch.Tensor | None = None  # float32 [layers, kv heads, head_dim]
    codebooks: dict = field(default_factory=dict)  # "key"/"value" -> {bits: float32 tensor [2^bits]}

    def codebook(self, part: str, bits: int) -> torch.Tensor | None:
        return self.codebooks.get(part, {}).get(int(bits))

    def to_json(self) -> dict:
        """JSON-ready dict (6 significant digits: the statistics end up as fp16 scales / fp32 centroids)."""
        def r(t):
            return [float(f"{x:.6g}") for x in t.reshape(-1).tolist()]

        q = self.query_rms
        return {"query_rms": None if q is None else torch.tensor(r(q)).reshape(q.shape).tolist(),
                "codebooks": {p: {str(b): r(c) for b, c in cbs.items()} for p, cbs in self.codebooks.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Fit":
        q = data.get("query_rms")
        cbs = {p: {int(b): torch.tensor(c, dtype=torch.float32) for b, c in v.items()}
               for p, v in (data.get("codebooks") or {}).items()}
        return cls(None if q is None else torch.tensor(q, dtype=torch.float32), cbs)

    def subset(self, query_scales: bool = True, codebooks: bool = True) -> "Fit":
        return Fit(self.query_rms if query_scales else None, dict(self.codebooks) if codebooks else {})


def register(name: str, fit: Fit) -> None:
    """Make ``fit`` available to caches built with ``calibration=name`` in this process."""
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise ValueError("a calibration name is a string of 1..64 characters")
    _check(fit)
    _REGISTRY[name] = fit


_PARTS = {"qscale": {"codebooks": False}, "codebooks": {"query_scales": False}}


def lookup(name: str) -> Fit:
    """The fit called ``name`` (ValueError if there is none); ``"<shipped>:qscale"`` and
    ``"<shipped>:codebooks"`` name a shipped fit's query scales or codebooks alone."""
    base, _, part = name.partition(":")
    if name not in _REGISTRY and base in _SHIPPED and (not part or part in _PARTS):
        if base not in _REGISTRY:
            text = resources.files("kvcodec.data").joinpath(_SHIPPED[base]).read_text(encoding="utf-8")
            _REGISTRY[base] = _check(Fit.from_json(json.loads(text)))
        if part:
            _REGISTRY[name] = _REGISTRY[base].subset(**_PARTS[part])
    if name not in _REGISTRY:
        raise ValueError(f"unknown calibration {name!r}; shipped: {sorted(_SHIPPED)}; "
                         "others must be registered with kvcodec.hf.fitted.register first")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(set(_SHIPPED) | set(_REGISTRY))


def _check(fit: Fit) -> Fit:
    q = fit.query_rms
    if q is not None and (q.ndim != 3 or not torch.isfinite(q).all() or (q < 0).any()):
        raise ValueError("query_rms must be a finite non-negative [layers, kv heads, head_dim] tensor")
    for part, cbs in fit.codebooks.items():
        if part not in ("key", "value"):
            raise ValueError(f"codebooks are for 'key' or 'value', got {part!r}")
        for bits, c in cbs.items():
            if c.shape != (1 << bits,) or not torch.isfinite(c).all() or not (c[1:] > c[:-1]).all():
                raise ValueError(f"{part} codebook for {bits} bits must be 2^bits ascending finite centroids")
    return fit


def check_shape(fit: Fit, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    if fit.query_rms is not None and tuple(fit.query_rms.shape) != (num_layers, num_kv_heads, head_dim):
        raise ValueError(f"calibration query_rms is {tuple(fit.query_rms.shape)}, this model needs "
                         f"{(num_layers, num_kv_heads, head_dim)}")


def apply_codebook(quantizer, codebook: torch.Tensor | None) -> None:
    """Give a TurboQuantMSE its fitted codebook (before its first use; same length as its own)."""
    if codebook is None:
        return
    if quantizer.codebook.shape != codebook.shape:
        raise ValueError(f"fitted codebook has {codebook.numel()} centroids, the quantizer {quantizer.codebook.numel()}")
    quantizer.codebook = codebook.to(torch.float32).clone()
    quantizer._dev = {}  # device constants (thresholds, lookup tables) follow the new codebook
