"""kvcodec.weights on a CUDA device (skipped without CUDA and CuPy): the GPU decode of a weight blob equals
the CPU reference decoder bit for bit (output memory poisoned first), and a tiny Llama compressed on the
device (decode ahead on a side stream) gives the dense model's logits and greedy tokens."""

import numpy as np
import pytest
import torch

from test_weights import _weightlike as weightlike

import kvcodec.device
from kvcodec.errors import CorruptStreamError
from kvcodec.weights import HostWeight, compress_model, decompress_model, encode, load_model, model_report, save_model

pytestmark = pytest.mark.skipif(not kvcodec.device.is_available(), reason="needs a CUDA device and CuPy")

FP8 = torch.float8_e4m3fn


def _bits(t):
    return t.contiguous().view(torch.uint8).cpu()


def _weightlike(seed, shape, dtype, random_share):
    return weightlike(np.random.default_rng(seed), shape, dtype, random_share)


def _poison(nbytes: int, device) -> None:
    """Fill memory the caching allocator will hand out next with 0xA5 and give it back."""
    junk = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=device)
    del junk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, FP8])
@pytest.mark.parametrize("shape,share", [((1000, 700), 0.0), ((333, 257), 0.3), ((17,), 1.0), ((4096, 512), 0.01)])
def test_device_decode_equals_cpu_reference(dtype, shape, share):
    from kvcodec.device.transfer import bytes_to_device, device_to_bytes
    from kvcodec.weights.device import DeviceWeight

    dev = torch.device("cuda")
    t = _weightlike(7, shape, dtype, share)
    host_blob = encode(t)
    # the GPU encoder's blob (its header differs from the CPU encoder's on an H100, from byte 8 on)
    # decodes on the CPU to the same bits
    assert torch.equal(_bits(HostWeight(device_to_bytes(encode(t.to(dev)))).decode()), _bits(t))
    ref = HostWeight(host_blob).decode()
    dw = DeviceWeight(bytes_to_device(host_blob, dev))
    for _ in range(2):  # the second decode reuses the launch plan
        _poison(t.numel() * t.element_size(), dev)
        out = dw.decode()
        torch.cuda.synchronize()
        assert out.dtype == dtype and tuple(out.shape) == tuple(shape)
        assert torch.equal(_bits(out), _bits(ref)) and torch.equal(_bits(ref), _bits(t))
        dw.check()


def test_damaged_device_blob_raises():
    from kvcodec.device.transfer import bytes_to_device
    from kvcodec.weights.device import DeviceWeight

    blob = bytearray(encode((torch.randn(256, 512) * 0.02).to(torch.bfloat16)))
    blob[len(blob) // 2] ^= 0x01
    with pytest.raises(CorruptStreamError):
        DeviceWeight(bytes_to_device(bytes(blob), torch.device("cuda")))


def _tiny():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval(), config


def test_cuda_model_same_logits_and_tokens(tmp_path):
    model, config = _tiny()
    model = model.cuda()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        ref = model(ids).logits
    ref_tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    report = compress_model(model)
    assert report.device.startswith("cuda") and report.nbytes < report.original_nbytes
    for _ in range(3):  # the first pass learns the order; later ones decode ahead on the side stream
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), ref_tokens)
    rt = model._kvcodec_weights
    assert rt.successor  # the module order the ahead decode follows was learned
    path = tmp_path / "m.kvw"
    save_model(model, path)
    loaded = load_model(path, config, device="cuda")
    assert model_report(loaded).nbytes == report.nbytes
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    decompress_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
