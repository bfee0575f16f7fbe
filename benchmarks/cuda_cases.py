"""Inputs for checking and timing kvcodec's fused CUDA kernels: random packed K/V cases, the rotations
and codebooks they use, and a NaN-poisoned CUDA allocator.

Laboratory code, not part of the kvcodec package: the GPU benchmarks (``gpu_kernels.py``,
``gpu_generate.py``) and the tests (``tests/test_cuda_*.py``, ``tests/test_hf_static.py``; through
``tests/conftest.py``, which puts ``benchmarks/`` on ``sys.path``) build their cases here and compare
the kernels against ``kvcodec.quant.cuda.fallback``, the torch path kvcodec itself runs without them.
"""

from __future__ import annotations

import torch

from kvcodec.quant.codebooks import lloyd_max_codebook
from kvcodec.quant.rotations import rotation_matrix


def hadamard_rotation(dim: int, seed: int = 0, rounds: int = 1) -> torch.Tensor:
    """The randomized Hadamard rotation kvcodec.quant builds for ``seed`` (float32 [dim, dim]):
    H diag(s) / sqrt(dim) for one round ("hadamard"), H diag(s2) H diag(s1) / dim for two
    ("hadamard2"); the same matrix as ``kvcodec.quant.rotations.rotation_matrix``."""
    if rounds not in (1, 2):
        raise ValueError(f"rounds must be 1 or 2, got {rounds}")
    return rotation_matrix(dim, seed, "hadamard" if rounds == 1 else "hadamard2").to(torch.float32)


def poison_allocator(nbytes: int = 256 << 20) -> None:
    """Fill free blocks of torch's CUDA caching allocator with NaN, so outputs a kernel leaves
    unwritten show up as NaN in the checks instead of stale plausible values."""
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


def codebook_tensor(bits: int, dim: int) -> torch.Tensor:
    """The Lloyd-Max codebook of ``kvcodec.quant`` as a float32 tensor (what the kernels read)."""
    return torch.tensor(lloyd_max_codebook(dim, bits), dtype=torch.float32)


def random_decode_case(b, hq, hkv, ql, tcap, d, kb, vb, lens, *, norm_dtype=torch.float16, qjl=False,
                       seed=0, device="cuda"):
    """Random packed K/V for ``decode_attention`` checks and timings: (tensors, keyword arguments).

    Cache slots past each sequence's length hold NaN norms, so a kernel that reads them fails.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    case = dict(
        query=torch.randn(b, hq, ql, d, device=device, generator=g).to(torch.bfloat16),
        k_codes=torch.randint(0, 256, (b, hkv, tcap, d * kb // 8), device=device, generator=g, dtype=torch.uint8),
        v_codes=torch.randint(0, 256, (b, hkv, tcap, d * vb // 8), device=device, generator=g, dtype=torch.uint8),
        k_norms=(torch.rand(b, hkv, tcap, device=device, generator=g) * 20 + 1).to(norm_dtype),
        v_norms=(torch.rand(b, hkv, tcap, device=device, generator=g) * 4 + 0.1).to(norm_dtype),
        seq_lens=torch.tensor(lens, device=device, dtype=torch.int32),
    )
    for i, n in enumerate(lens):
        case["k_norms"][i, :, n:] = float("nan")
        case["v_norms"][i, :, n:] = float("nan")
    kw = dict(k_rotation=hadamard_rotation(d, seed + 1).to(device),
              v_rotation=hadamard_rotation(d, seed + 2).to(device),
              k_codebook=codebook_tensor(kb, d).to(device), v_codebook=codebook_tensor(vb, d).to(device),
              k_bits=kb, v_bits=vb)
    if qjl:
        case["k_qjl"] = torch.randint(0, 256, (b, hkv, tcap, d // 8), device=device, generator=g, dtype=torch.uint8)
        case["k_rnorms"] = (torch.rand(b, hkv, tcap, device=device, generator=g) * 3).to(norm_dtype)
        kw["qjl_matrix"] = torch.randn(d, d, device=device, generator=g)
    return case, kw
