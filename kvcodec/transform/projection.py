"""K/V tokens <-> PCA coefficients with the calibration's basis (torch, on any device).

Coefficients are laid out [L / g, P, G, n, M] (``Calibration.coef_shape``): one row of M token values per
principal component, so every component's values are contiguous for the quantizer and the entropy
coder. The basis is orthonormal and RoPE is a rotation, so squared errors are the same in both
domains (in the calibration's metric: channel scales times sqrt of the layer weights). Scales and mean are folded into one affine map each way:
coefficients = A x - b with A = B^T diag(s), b = B^T mu; x = S c + m with S = diag(1/s) B, m = mu / s.
"""

from __future__ import annotations

import torch

from kvcodec.transform.calibration import Calibration, stack_parts, unstack_parts


def _layout(calib: Calibration) -> tuple:
    return calib.per_head, calib.layers_per_group, calib.joint_kv


def _maps(calib: Calibration, device) -> dict:
    key = str(device)
    if key not in calib._device_cache:
        basis = torch.from_numpy(calib.basis).double()  # [LG, P, G, n, r]
        n, r = basis.shape[-2:]
        if r < n:  # components past the rank: zero coefficients in, nothing out (class 0, never stored)
            basis = torch.nn.functional.pad(basis, (0, n - r))
        mean = torch.from_numpy(calib.mean).double()  # [LG, P, G, n]
        s = torch.from_numpy(calib.metric_scales())  # [L, 2, H, D]
        s = stack_parts(s[:, 0, :, None, :], s[:, 1, :, None, :], *_layout(calib))[..., 0, :]  # [LG, P, G, n]
        calib._device_cache[key] = {
            "A": (basis.transpose(-1, -2) * s[..., None, :]).float().to(device),
            "b": (basis.transpose(-1, -2) @ mean[..., None]).float().to(device),  # [L, 2, G, n, 1]
            "S": (basis / s[..., :, None]).float().to(device),
            "m": (mean / s)[..., None].float().to(device),  # [L, 2, G, n, 1]
        }
    return calib._device_cache[key]


def to_coefficients(keys: torch.Tensor, values: torch.Tensor, calib: Calibration, positions: torch.Tensor) -> torch.Tensor:
    """keys/values [L, H, M, D] (post-RoPE, any float dtype) at ``positions`` [M] -> coefficients
    ``calib.coef_shape(M)`` float32 on the same device."""
    k = keys.float()
    if calib.rope is not None:
        k = calib.rope.undo(k, positions)
    mp = _maps(calib, k.device)
    x = stack_parts(k, values.float(), *_layout(calib))
    return torch.matmul(mp["A"], x.transpose(-1, -2)).sub_(mp["b"])  # [LG, P, G, n, M]


def from_coefficients(coef: torch.Tensor, calib: Calibration, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``to_coefficients``: ``calib.coef_shape(M)`` -> keys, values [L, H, M, D] float32."""
    mp = _maps(calib, coef.device)
    x = torch.matmul(mp["S"], coef).add_(mp["m"]).transpose(-1, -2)  # [LG, P, G, M, n]
    k, v = unstack_parts(x, calib.n_kv_heads, *_layout(calib))
    if calib.rope is not None:
        k = calib.rope.apply(k, positions)
    return k, v
