"""The host side of decoding planes blobs on a GPU (kvcodec.lossless.planes_device), run on the CPU:
the plan's stream headers and offsets are decoded by the CPU rANS fast path, the planes merged with
the same torch code the GPU runs."""

import pytest
import torch

from kvcodec import container
from kvcodec.lossless import api, planes_device
from kvcodec.lossless.api import compress, decompress

from test_lossless_planes import assert_bit_exact, random_bits, weights_like


def _plan(blob):
    _, meta, sections = container.loads(blob)
    return planes_device.plan(meta["codec_meta"], sections)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.int16, torch.float64, torch.bool])
@pytest.mark.parametrize("kind", ["weights", "random_bits", "constant"])
def test_plan_run_on_cpu_is_bit_exact(dtype, kind):
    shape = (33, 70)
    if kind == "constant":
        t = torch.full(shape, 3, dtype=torch.float32).to(dtype)
    elif kind == "weights" and dtype.is_floating_point:
        t = weights_like(dtype, shape)
    else:
        t = random_bits(dtype, shape, 2)
    blob = compress(t, max_classes=1, chunk_bytes=512)
    p = _plan(blob)
    assert p is not None
    assert_bit_exact(planes_device.run(p, "cpu"), t)


def test_blobs_the_gpu_kernel_cannot_take_have_no_plan():
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(256, 64, generator=g) * torch.logspace(-4, 0, 256)[:, None]).to(torch.bfloat16)
    with_ctx = compress(t)  # row-context tables
    _, meta, _ = container.loads(with_ctx)
    assert len(meta["codec_meta"]["planes"][0]["tables"]) > 1
    assert _plan(with_ctx) is None
    from pathlib import Path

    v1 = (Path(__file__).parent / "data" / "planes_v1_bf16.kvt").read_bytes()  # 8 lanes
    assert _plan(v1) is None
    assert _plan(compress(t, max_classes=1)) is not None


def test_plans_validate_like_the_cpu_decoder():
    t = weights_like(torch.bfloat16, (40, 64))
    kind, meta, sections = container.loads(compress(t, max_classes=1, chunk_bytes=1024))
    meta["codec_meta"]["planes"][0]["offsets"][-1] += 1  # past the stream: refused by the plan
    with pytest.raises(api.CorruptStreamError):
        planes_device.plan(meta["codec_meta"], sections)
    meta["codec_meta"]["planes"][0]["offsets"][-1] -= 1
    meta["codec_meta"]["planes"][0]["offsets"][1] += 1  # a chunk boundary moved: the streams fail
    with pytest.raises(api.CorruptStreamError):
        planes_device.run(planes_device.plan(meta["codec_meta"], sections), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decompress_to_cuda_decodes_on_the_gpu():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        t = weights_like(dtype, (512, 1024)) if dtype.itemsize > 1 else random_bits(dtype, (512, 1024), 1)
        blob = compress(t, max_classes=1, chunk_bytes=1 << 16)
        assert _plan(blob) is not None
        out = decompress(blob, device="cuda")
        assert out.is_cuda
        assert_bit_exact(out.cpu(), t)
        assert_bit_exact(planes_device.run(_plan(blob), "cuda").cpu(), t)


def test_plan_through_the_emulated_gpu_kernel_is_bit_exact():
    """The plan's buffer, offsets and headers exactly as RansBatch.from_device would take them,
    decoded by the lane-by-lane CPU emulation of rans_decode.cu (tests/test_cuda_rans.py)."""
    import numpy as np

    from kvcodec.cuda import rans as gr
    from test_cuda_rans import emulate_launch

    def emulated_streams(coded, device):
        batch = gr.RansBatch.__new__(gr.RansBatch)  # from_device's setup, on a CPU tensor
        batch.device, batch._fallback = torch.device("cpu"), {}
        batch._setup(coded.headers, torch.from_numpy(coded.data), coded.offsets)
        out, status = emulate_launch(batch)
        assert np.all(status[: batch.n_payloads] == 0)
        return torch.from_numpy(out[: sum(h.n for h in coded.headers)].copy())

    for dtype, shape in ((torch.bfloat16, (21, 50)), (torch.float32, (21, 50)), (torch.float8_e4m3fn, (60, 64))):
        t = weights_like(dtype, shape)
        p = _plan(compress(t, max_classes=1, chunk_bytes=256 if dtype.itemsize > 1 else 1024))
        assert p is not None and any(mode == "rans" for mode, _ in p.planes)
        assert_bit_exact(planes_device.run(p, "cpu", decode_streams=emulated_streams), t)
