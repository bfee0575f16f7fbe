"""``compress(codec="auto")`` never expands a tensor by more than the raw codec's header: a tensor
its codec (kvctx with ``layout="kv"``, predictive with a prediction, planes) would make bigger than
its raw bytes is stored with the "raw" codec, and decodes bit for bit (with or without the
prediction it was given)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec.lossless import api

HEADER_BYTES = 512  # the raw codec's container: prefix, JSON header (meta, one section), alignment
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=4), dtype=st.sampled_from(DTYPES),
       mode=st.sampled_from(["kv", "prediction", "plain"]), seed=st.integers(0, 2**16))
def test_auto_never_expands_beyond_a_fixed_header(shape, dtype, mode, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 3).to(dtype)
    pred = (t.float() + 0.1 * torch.randn(shape, generator=g)).to(dtype) if mode == "prediction" else None
    blob = kvcodec.compress(t, prediction=pred, **({"layout": "kv"} if mode == "kv" else {}))
    assert len(blob) <= t.numel() * t.element_size() + HEADER_BYTES
    back = kvcodec.decompress(blob, prediction=pred)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(_bits(back), _bits(t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_one_token_kv_tensor_is_stored_raw(dtype):
    t = torch.randn(1, 1, 1, 1 << 16).to(dtype)  # one token: the per-channel model outweighs any gain
    blob = kvcodec.compress(t, layout="kv")
    assert api.describe(blob)["codec"] == "raw"
    assert len(blob) <= t.numel() * t.element_size() + HEADER_BYTES
    assert torch.equal(kvcodec.decompress(blob).view(torch.uint8), t.view(torch.uint8))
    # an explicit codec is kept (the caller asked for that stream)
    assert api.describe(kvcodec.compress(t, codec="kvctx"))["codec"] == "kvctx"


def test_a_compressible_kv_tensor_keeps_its_codec():
    t = torch.randn(2, 4, 128, 64).cumsum(2).to(torch.bfloat16)
    blob = kvcodec.compress(t, layout="kv")
    assert api.describe(blob)["codec"] == "kvctx" and len(blob) < t.numel() * 2
