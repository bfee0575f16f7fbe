"""K/V tokens <-> PCA coefficients with the calibration's basis (torch, on any device).

Coefficients are laid out [L, 2, G, n, M]: one row of M token values per principal component, so
every component's values are contiguous for the quantizer and the entropy coder. The basis is
orthonormal and RoPE is a rotation, so squared errors are the same in both domains (in the metric
of the calibration's channel scales). Scales and mean are folded into one affine map each way:
coefficients = A x - b with A = B^T diag(s), b = B^T mu; x = S c + m with S = diag(1/s) B, m = mu / s.
"""

from __future__ import annotations

import torch

from kvcodec.transform.calibration import Calibration, group_vectors, ungroup_vectors


def _maps(calib: Calibration, device) -> dict:
    key = str(device)
    if key not in calib._device_cache:
        basis = torch.from_numpy(calib.basis).double()  # [L, 2, G, n, n]
        mean = torch.from_numpy(calib.mean).double()  # [L, 2, G, n]
        L, _, G, n, _ = basis.shape
        s = torch.from_numpy(calib.scales).double()  # [L, 2, H, D]
        s = s.reshape(L, 2, G, n)  # per_head: [L, 2, H, D]; joint: heads concatenated, as group_vectors
        calib._device_cache[key] = {
            "A": (basis.transpose(-1, -2) * s[..., None, :]).float().to(device),
            "b": (basis.transpose(-1, -2) @ mean[..., None]).float().to(device),  # [L, 2, G, n, 1]
            "S": (basis / s[..., :, None]).float().to(device),
            "m": (mean / s)[..., None].float().to(device),  # [L, 2, G, n, 1]
        }
    return calib._device_cache[key]


def to_coefficients(keys: torch.Tensor, values: torch.Tensor, calib: Calibration, positions: torch.Tensor) -> torch.Tensor:
    """keys/values [L, H, M, D] (post-RoPE, any float dtype) at ``positions`` [M] -> coefficients
    [L, 2, G, n, M] float32 on the same device."""
    k = keys.float()
    if calib.rope is not None:
        k = calib.rope.undo(k, positions)
    mp = _maps(calib, k.device)
    x = torch.stack([group_vectors(k, calib.per_head), group_vectors(values.float(), calib.per_head)], dim=1)
    return torch.matmul(mp["A"], x.transpose(-1, -2)).sub_(mp["b"])  # [L, 2, G, n, M]


def from_coefficients(coef: torch.Tensor, calib: Calibration, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``to_coefficients``: [L, 2, G, n, M] -> keys, values [L, H, M, D] float32 (views)."""
    mp = _maps(calib, coef.device)
    x = torch.matmul(mp["S"], coef).add_(mp["m"]).transpose(-1, -2)  # [L, 2, G, M, n]
    k = ungroup_vectors(x[:, 0], calib.n_kv_heads, calib.per_head)
    v = ungroup_vectors(x[:, 1], calib.n_kv_heads, calib.per_head)
    if calib.rope is not None:
        k = calib.rope.apply(k, positions)
    return k, v
