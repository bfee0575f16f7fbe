"""The quantizers on CUDA tensors give the CPU results (skipped without a GPU)."""

import pytest
import torch

from kvcodec.quant import KIVI, QJL, TurboQuantMSE, TurboQuantOutlier, TurboQuantProd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("make", [
    lambda: TurboQuantMSE(128, 3), lambda: TurboQuantMSE(96, 4, precondition="scale"),
    lambda: TurboQuantProd(64, 3), lambda: QJL(64), lambda: KIVI(2, 32, "channel"),
    lambda: KIVI(4, 32, "token"), lambda: TurboQuantOutlier.paper(128, "2.5"),
])
def test_cuda_matches_cpu(make):
    q = make()
    d = getattr(q, "dim", None) or 128
    x = torch.randn(2, 4, 300, d, dtype=torch.bfloat16) * torch.linspace(0.2, 4, d).to(torch.bfloat16)
    c_cpu = q.quantize(x)
    c_gpu = q.quantize(x.cuda())
    assert c_gpu.device.type == "cuda"
    for name, t in c_cpu.tensors().items():  # codes may differ only on exact ties: allow a tiny fraction
        g = c_gpu.tensors()[name].cpu()
        assert t.shape == g.shape and t.dtype == g.dtype
        if t.dtype == torch.uint8:
            assert (t != g).float().mean() < 1e-3, name
    xh = q.dequantize(c_cpu)
    assert torch.allclose(q.dequantize(c_gpu).cpu(), xh, atol=0.05 * float(x.float().abs().max()))
    moved = c_cpu.to("cuda")
    queries = torch.randn(2, 4, 8, d)
    w = torch.softmax(torch.randn(2, 4, 8, 300), -1)
    assert torch.allclose(q.scores(moved, queries.cuda()).cpu(), q.scores(c_cpu, queries), rtol=1e-3, atol=1e-2)
    assert torch.allclose(q.weighted_sum(moved, w.cuda()).cpu(), q.weighted_sum(c_cpu, w), rtol=1e-3, atol=1e-3)
    assert moved.index_select(0, torch.tensor([1])).device.type == "cuda"
