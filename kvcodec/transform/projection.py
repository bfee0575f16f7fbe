"""K/V tokens <-> PCA coefficients with the calibration's basis (torch, on any device).

Coefficients are laid out [L, 2, G, n, M]: one row of M token values per principal component, so
every component's values are contiguous for the quantizer and the entropy coder. The basis is
orthonormal and RoPE is a rotation, so squared errors are the same in both domains.
"""

from __future__ import annotations

import torch

from kvcodec.transform.calibration import Calibration, group_vectors, ungroup_vectors


def _basis(calib: Calibration, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(calib.basis).to(device), torch.from_numpy(calib.mean).to(device))


def to_coefficients(keys: torch.Tensor, values: torch.Tensor, calib: Calibration, positions: torch.Tensor) -> torch.Tensor:
    """keys/values [L, H, M, D] (post-RoPE, any float dtype) at ``positions`` [M] -> coefficients
    [L, 2, G, n, M] float32 on the same device."""
    k = keys.float()
    if calib.rope is not None:
        k = calib.rope.undo(k, positions)
    basis, mean = _basis(calib, k.device)
    x = torch.stack([group_vectors(k, calib.per_head), group_vectors(values.float(), calib.per_head)], dim=1)
    x = x - mean[..., None, :]  # [L, 2, G, M, n]
    return basis.transpose(-1, -2) @ x.transpose(-1, -2)  # [L, 2, G, n, M]


def from_coefficients(coef: torch.Tensor, calib: Calibration, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``to_coefficients``: [L, 2, G, n, M] -> keys, values [L, H, M, D] float32."""
    basis, mean = _basis(calib, coef.device)
    x = (basis @ coef).transpose(-1, -2) + mean[..., None, :]  # [L, 2, G, M, n]
    k = ungroup_vectors(x[:, 0], calib.n_kv_heads, calib.per_head)
    v = ungroup_vectors(x[:, 1], calib.n_kv_heads, calib.per_head)
    if calib.rope is not None:
        k = calib.rope.apply(k.contiguous(), positions)
    return k.contiguous(), v.contiguous()
