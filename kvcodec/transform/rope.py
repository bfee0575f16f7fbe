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
        """cos, sin [T, D/2] in float32 (angles computed in float64)."""
        f = torch.tensor(self.inv_freq, dtype=torch.float64, device=device)
        ang = positions.to(device=device, dtype=torch.float64)[:, None] * f[None, :]
        return ang.cos().float(), ang.sin().float()

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, sign: float, scale: float) -> torch.Tensor:
        cos, sin = self._cos_sin(positions, x.device)
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        torch.addcmul(x1 * cos, x2, sin, value=-sign, out=out[..., :h])
        torch.addcmul(x2 * cos, x1, sin, value=sign, out=out[..., h:])
        return out.mul_(scale) if scale != 1.0 else out

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., T, D] forward (float32 result): what the model did to its keys
        (``x * cos + rotate_half(x) * sin``, cos/sin times ``attention_scaling``)."""
        return self._rotate(x, positions, 1.0, self.attention_scaling)

    def undo(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of ``apply`` (exact up to float rounding)."""
        return self._rotate(x, positions, -1.0, 1.0 / self.attention_scaling)
