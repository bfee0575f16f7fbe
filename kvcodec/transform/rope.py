"""Rotary position embedding (RoPE) undo/redo for cached keys.

A cache stores keys *after* RoPE, so the same head channel of two tokens is rotated by different
angles: a fixed PCA basis cannot follow that. Undoing the rotation (the rotation is orthogonal, so
squared errors are unchanged) gives position-free keys whose covariance one basis captures; the
decoder redoes it. Convention: Hugging Face's ``rotate_half`` (Llama, Mistral, Qwen, SmolLM): pair
channel ``i`` with ``i + D/2``, angle ``position * inv_freq[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RoPE:
    """RoPE parameters: ``inv_freq`` (D/2 frequencies) and the cos/sin ``attention_scaling``."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0

    def __post_init__(self):
        f = np.asarray(self.inv_freq, dtype=np.float64)
        if f.ndim != 1 or f.size < 1 or not np.all(np.isfinite(f)):
            raise ValueError("inv_freq must be a non-empty 1-D sequence of finite floats")
        s = float(self.attention_scaling)
        if not (np.isfinite(s) and s > 0):
            raise ValueError("attention_scaling must be a finite positive float")
        object.__setattr__(self, "inv_freq", tuple(float(v) for v in f))
        object.__setattr__(self, "attention_scaling", s)

    @property
    def head_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @classmethod
    def default(cls, head_dim: int, theta: float) -> "RoPE":
        """Plain RoPE: ``inv_freq[i] = theta ** (-2i / head_dim)``."""
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2, got {head_dim}")
        if not theta > 1:
            raise ValueError(f"rope theta must be > 1, got {theta}")
        i = np.arange(0, head_dim, 2, dtype=np.float64)
        return cls(tuple(float(theta) ** (-i / head_dim)))

    @classmethod
    def from_model(cls, model) -> "RoPE":
        """Read the frequencies a Hugging Face model actually uses (``rotary_emb.inv_freq``), so
        scaled variants (llama3, yarn, ...) are handled exactly as the model handles them."""
        for mod in model.modules():
            if hasattr(mod, "inv_freq") and isinstance(mod.inv_freq, torch.Tensor):
                return cls(tuple(mod.inv_freq.double().cpu().tolist()), float(getattr(mod, "attention_scaling", 1.0)))
        raise ValueError("model has no rotary embedding module with an inv_freq buffer")

    def to_json(self) -> dict:
        return {"inv_freq": list(self.inv_freq), "attention_scaling": self.attention_scaling}

    @classmethod
    def from_json(cls, d) -> "RoPE":
        if not isinstance(d, dict) or set(d) != {"inv_freq", "attention_scaling"}:
            raise ValueError("rope must be an object with inv_freq and attention_scaling")
        if not isinstance(d["inv_freq"], list) or not all(isinstance(v, (int, float)) for v in d["inv_freq"]):
            raise ValueError("rope inv_freq must be a list of numbers")
        return cls(tuple(d["inv_freq"]), d["attention_scaling"])

    def _cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] in float32 (angles computed in float64)."""
        f = torch.tensor(self.inv_freq, dtype=torch.float64, device=device)
        ang = positions.to(device=device, dtype=torch.float64)[:, None] * f[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        s = self.attention_scaling
        return (ang.cos() * s).float(), (ang.sin() * s).float()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., T, D] (float32) forward: what the model did to its keys."""
        cos, sin = self._cos_sin(positions, x.device)
        return x * cos + _rotate_half(x) * sin

    def undo(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse rotation of ``apply`` (exact up to float rounding when scaling is 1)."""
        cos, sin = self._cos_sin(positions, x.device)
        s2 = self.attention_scaling**2
        return (x * cos - _rotate_half(x) * sin) / s2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)
