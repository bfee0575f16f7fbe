"""The torch implementation of tq layout v1 that kvcodec runs where the CUDA kernels do not.

``kvcodec.quant.cuda.decode_attention`` and ``quantize_pack`` (and through them ``attend`` and the HF
caches' ops) call ``decode_attention_reference`` / ``quantize_reference`` for CPU tensors and for
rotations or head dims the kernels do not take; ``pack.py`` reads the Hadamard signs and decision
thresholds of a quantizer from here to build the kernel's plan. Plain torch on any device, float64
where it matters, so it is also the oracle the kernels are tested against. Layout (shared with
``kvcodec.quant`` and ``kvcodec.hf``): codes are b-bit centroid indices of the rotated unit vector,
packed per row as a little-endian bit stream (coordinate j at bits [j*b, (j+1)*b), row bit i = bit
i % 8 of byte i // 8); norms are ||x|| as float16 (bfloat16 where float16 overflows); the rotation
is a [D, D] float32 matrix with y = x @ rotation.T; the codebook is ascending float32 [2^b].
"""

from __future__ import annotations

import math

import torch

from kvcodec.quant.rotations import sylvester_hadamard


def hadamard_matrix(dim: int) -> torch.Tensor:
    """Sylvester Hadamard matrix H_dim (entries +-1, float64): ``kvcodec.quant.rotations``' one."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"dim must be a power of two, got {dim}")
    return torch.from_numpy(sylvester_hadamard(dim))


def hadamard_signs(rotation: torch.Tensor, atol: float = 1e-6) -> torch.Tensor | None:
    """The sign vector s if ``rotation`` is H diag(s)/sqrt(D), else None (float32 [D] on its device)."""
    d = rotation.shape[-1]
    if rotation.shape != (d, d) or d & (d - 1):
        return None
    rot = rotation.detach().to(torch.float64)
    s = torch.sign(rot[0])
    if bool((s == 0).any()):
        return None
    expect = hadamard_matrix(d).to(rot.device) * s / math.sqrt(d)
    if not torch.allclose(rot, expect, atol=atol, rtol=0):
        return None
    return s.to(torch.float32)


def hadamard2_signs(rotation: torch.Tensor, atol: float = 1e-5) -> torch.Tensor | None:
    """Signs [2, D] (s1, s2) if ``rotation`` is H diag(s2) H diag(s1) / D (kvcodec.quant's
    "hadamard2"), else None. (s1, s2) and (-s1, -s2) give the same matrix: s1[0] = +1 is chosen."""
    d = rotation.shape[-1]
    if rotation.shape != (d, d) or d & (d - 1):
        return None
    rot = rotation.detach().to(torch.float64)
    h = hadamard_matrix(d).to(rot.device)
    s2 = torch.sign(h @ rot[:, 0])  # H R e_0 = s1[0] * s2
    if bool((s2 == 0).any()):
        return None
    m = (h * s2) @ h / d
    s1 = torch.sign(torch.diagonal(m.T @ rot))
    if bool((s1 == 0).any()):
        return None
    if not torch.allclose(rot, m * s1, atol=atol, rtol=0):
        return None
    return torch.stack([s1, s2]).to(torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [..., D] (values < 2^bits) -> uint8 [..., ceil(D*bits/8)] little-endian bit stream."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    d = codes.shape[-1]
    c = codes.to(torch.int64)
    shifts = torch.arange(bits, device=codes.device)
    bitstream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], d * bits)
    nbytes = (d * bits + 7) // 8
    pad = nbytes * 8 - d * bits
    if pad:
        bitstream = torch.nn.functional.pad(bitstream, (0, pad))
    weights = 1 << torch.arange(8, device=codes.device)
    return (bitstream.reshape(*codes.shape[:-1], nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 [..., nbytes] -> int64 codes [..., dim]."""
    if packed.dtype != torch.uint8:
        raise ValueError("packed codes must be uint8")
    if packed.shape[-1] != (dim * bits + 7) // 8:
        raise ValueError(f"expected {(dim * bits + 7) // 8} bytes per row, got {packed.shape[-1]}")
    p = packed.to(torch.int64)
    bitstream = ((p.unsqueeze(-1) >> torch.arange(8, device=p.device)) & 1).reshape(*p.shape[:-1], -1)
    bitstream = bitstream[..., : dim * bits].reshape(*p.shape[:-1], dim, bits)
    return (bitstream << torch.arange(bits, device=p.device)).sum(-1)


def thresholds_of(codebook: torch.Tensor) -> torch.Tensor:
    """Midpoints between neighbouring centroids, computed in float32 exactly as kvcodec.quant does
    ((cb[1:] + cb[:-1]) / 2), so both sides draw the same decision boundaries."""
    cb = codebook.to(torch.float32)
    return (cb[1:] + cb[:-1]) / 2


def quantize_reference(x: torch.Tensor, rotation: torch.Tensor, codebook: torch.Tensor, bits: int,
                       norm_dtype: torch.dtype = torch.float16,
                       norm_correction: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant-MSE of rows x [..., D] -> (packed codes uint8, norms). Float32 math, ties go low.

    norm_correction: store ||x|| / <y, c> (c = chosen centroids) where positive, as kvcodec.quant does."""
    xf = x.to(torch.float32)
    norms = xf.norm(dim=-1)
    u = xf / torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(-1)
    y = u @ rotation.to(xf.device, torch.float32).T
    thr = thresholds_of(codebook).to(xf.device)
    codes = torch.searchsorted(thr, y.contiguous(), right=False)  # = #{thr < y}
    if norm_correction:
        dot = (y * codebook.to(xf.device, torch.float32)[codes]).sum(-1)
        norms = torch.where(dot > 0, norms / torch.where(dot > 0, dot, torch.ones_like(dot)), norms)
    return pack_codes(codes, bits), norms.to(norm_dtype)


def dequantize_rotated(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, bits: int,
                       dim: int) -> torch.Tensor:
    """Rows in rotated space, float64: norms * codebook[codes]."""
    codes = unpack_codes(packed, bits, dim)
    return codebook.to(packed.device, torch.float64)[codes] * norms.to(torch.float64).unsqueeze(-1)


def decode_attention_reference(query, k_codes, k_norms, v_codes, v_norms, seq_lens, *, k_rotation,
                               v_rotation, k_codebook, v_codebook, k_bits, v_bits, scale=None,
                               k_qjl=None, k_rnorms=None, qjl_matrix=None, window_k=None, window_v=None,
                               window_lens=None, causal=True):
    """Dequantize-then-attend in float64. Returns (out [B, Hq, q_len, D] float64, lse [B, Hq, q_len]).

    Same arguments as ``kvcodec.quant.cuda.decode_attention``; the lse is over every attended token
    (compressed and window) of exp(scale * score).
    """
    b, hq, ql, d = query.shape
    hkv = k_codes.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dev = query.device
    kr = k_rotation.to(dev, torch.float64)
    vr = v_rotation.to(dev, torch.float64)
    q = query.to(torch.float64)
    q_rot = q @ kr.T
    k_hat = dequantize_rotated(k_codes, k_norms, k_codebook, k_bits, d)  # [B, Hkv, T, D] rotated
    v_hat = dequantize_rotated(v_codes, v_norms, v_codebook, v_bits, d)
    k_hat = k_hat.repeat_interleave(g, dim=1)
    v_hat = v_hat.repeat_interleave(g, dim=1)
    scores = q_rot @ k_hat.transpose(-1, -2)  # [B, Hq, ql, T]
    if k_qjl is not None:
        m = qjl_matrix.shape[0]
        s = qjl_matrix.to(dev, torch.float64)
        signs = unpack_codes(k_qjl, 1, m).to(torch.float64) * 2 - 1  # [B, Hkv, T, m]
        signs = signs.repeat_interleave(g, dim=1)
        rn = k_rnorms.to(torch.float64).repeat_interleave(g, dim=1)
        scores = scores + math.sqrt(math.pi / 2) / m * (q_rot @ s.T) @ signs.transpose(-1, -2) * rn.unsqueeze(-2)
    scores = scores * scale
    t = k_codes.shape[2]
    lens = seq_lens.to(dev).view(b, 1, 1, 1)
    scores = scores.masked_fill(torch.arange(t, device=dev).view(1, 1, 1, t) >= lens, float("-inf"))
    values = v_hat @ vr  # back to the original space
    dead = torch.arange(t, device=dev).view(1, 1, t, 1) >= seq_lens.to(dev).view(b, 1, 1, 1)
    values = values.masked_fill(dead, 0.0)  # slots past seq_lens may hold anything (even NaN norms)
    if window_k is not None:
        wk = window_k.to(torch.float64).repeat_interleave(g, dim=1)
        wv = window_v.to(torch.float64).repeat_interleave(g, dim=1)
        w = wk.shape[2]
        ws = (q @ wk.transpose(-1, -2)) * scale
        wl = (torch.full((b,), w, device=dev) if window_lens is None else window_lens.to(dev)).view(b, 1, 1, 1)
        pos = torch.arange(w, device=dev).view(1, 1, 1, w)
        limit = wl.expand(b, 1, ql, 1)
        if causal and ql > 1:
            limit = limit - (ql - 1) + torch.arange(ql, device=dev).view(1, 1, ql, 1)
        ws = ws.masked_fill(pos >= limit, float("-inf"))
        scores = torch.cat([scores, ws], -1)
        values = torch.cat([values, wv], -2)
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return p @ values, lse
