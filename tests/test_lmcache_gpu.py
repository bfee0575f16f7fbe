"""GPU-staged kvcodec LMCache serdes (``cuda_device``): chunks go to a GPU through a pinned buffer,
kvcodec's GPU codecs (or torch's CUDA kernels for TurboQuant) run there, results come back; a device
failure is a failed store or a miss. The CUDA tests skip on a machine without CUDA; the config and
failure-mapping tests run everywhere."""

import pytest
import torch

try:
    import lmcache.v1.distributed.serde  # noqa: F401
except ImportError as exc:
    pytest.skip(f"lmcache is not usable here (pip install 'kvcodec[lmcache]'): {exc}", allow_module_level=True)

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402

from kvcodec.data import load_kv_sample  # noqa: E402
from kvcodec.errors import CorruptStreamError  # noqa: E402
from kvcodec.integrations import lmcache as kvlm  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")
KEY = ObjectKey(chunk_hash=b"\x07" * 16, model_name="m", kv_rank=0)


@pytest.fixture(scope="module")
def chunk():
    s = load_kv_sample()
    return kvlm.kv_chunk(s.keys, s.values)


def buffers(ser, c):
    dst = torch.zeros(ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[c.shape], dtypes=[c.dtype])), dtype=torch.uint8)
    return kvlm.host_memory_obj(c), dst


@pytest.mark.skipif(CUDA, reason="checks the CPU-only refusal")
@pytest.mark.parametrize("type_", ["kvcodec_lossless", "kvcodec_turboquant"])
def test_cuda_device_without_cuda_is_a_config_error(type_):
    with pytest.raises(ValueError, match="CUDA is not available"):
        create_serde_processor(SerdeConfig(type=type_, kwargs={"cuda_device": "auto"}))


@pytest.mark.parametrize("bad", [True, 1.5, ["cuda:0"]])
def test_bad_cuda_device_option(bad):
    with pytest.raises(ValueError):
        create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs={"cuda_device": bad}))


class FailingStage(kvlm.CudaStage):
    """A stage whose device fails the way a GPU does (CUDA errors are RuntimeErrors)."""

    def __init__(self):
        super().__init__(torch.device("cpu"))

    def upload(self, t):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def download(self, d, out):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")


def test_device_failure_is_a_failed_store_or_a_miss(chunk):
    stage = FailingStage()
    for ser, de in ((kvlm.LosslessSerializer("planes", 1.2, 1, stage=stage), kvlm.LosslessDeserializer(1, "", stage)),
                    (kvlm.TurboQuantSerializer(kvlm.TurboQuantOptions(head_dim=64), 1, stage),
                     kvlm.TurboQuantDeserializer("", 1, stage))):
        src, dst = buffers(ser, chunk)
        with pytest.raises(kvlm.DeviceStagingError):
            ser.serialize(src, kvlm.host_memory_obj(dst), KEY)
        ser.stage = None  # store on the CPU, then load through the failing device
        ser.config = de.config
        ser.serialize(src, kvlm.host_memory_obj(dst), KEY)
        with pytest.raises(CorruptStreamError):  # LMCache counts it as a miss
            de.deserialize(kvlm.host_memory_obj(dst), kvlm.host_memory_obj(torch.empty_like(chunk)), KEY)


@needs_cuda
@pytest.mark.parametrize("codec", ["planes", "kvctx"])
def test_gpu_lossless_bit_exact_and_cpu_readable(chunk, codec):
    gpu = create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs={"codec": codec, "slot_ratio": 1.3,
                                                                              "cuda_device": "auto"}))
    cpu = create_serde_processor(SerdeConfig(type="kvcodec_lossless", kwargs={"codec": codec, "slot_ratio": 1.3}))
    try:
        src, dst = buffers(gpu._serializer, chunk)
        gpu._serializer.serialize(src, kvlm.host_memory_obj(dst), KEY)
        for proc in (gpu, cpu):  # the GPU's objects load on a CPU-only server and the other way round
            out = torch.empty_like(chunk)
            proc._deserializer.deserialize(kvlm.host_memory_obj(dst), kvlm.host_memory_obj(out), KEY)
            assert torch.equal(out.view(torch.int16), chunk.view(torch.int16))
    finally:
        gpu.close()
        cpu.close()


@needs_cuda
def test_gpu_turboquant_round_trip(chunk):
    kw = {"head_dim": 64, "key_bits": 4, "value_bits": 4}
    gpu = create_serde_processor(SerdeConfig(type="kvcodec_turboquant", kwargs={**kw, "cuda_device": 0}))
    cpu = create_serde_processor(SerdeConfig(type="kvcodec_turboquant", kwargs=kw))
    try:
        for writer, reader in ((gpu, cpu), (cpu, gpu), (gpu, gpu)):
            src, dst = buffers(writer._serializer, chunk)
            writer._serializer.serialize(src, kvlm.host_memory_obj(dst), KEY)
            out = torch.empty_like(chunk)
            reader._deserializer.deserialize(kvlm.host_memory_obj(dst), kvlm.host_memory_obj(out), KEY)
            err = float((out.float() - chunk.float())[:, :, 1:].norm() / chunk[:, :, 1:].float().norm())
            assert err < 0.12, err
    finally:
        gpu.close()
        cpu.close()
