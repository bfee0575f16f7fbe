"""Format 2's "mag" flag: symbols and classes counted by magnitude (``bins.magnitude_symbol``), set by
the encoder for fp8 with a prediction tensor (``codec.magnitude_symbols``). Flagged streams round-trip
bit-exactly (special values too), streams without the flag decode as before, a forged flag is refused,
and the GPU paths, which do not know the flag, leave flagged streams to the CPU."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import kvcodec
from kvcodec import container
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import kvctx_device
from kvcodec.lossless import kvctx_device_encode as kde
from kvcodec.lossless.predictive import codec as pc
from test_kvctx_device import same_bits

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]  # e4m3: a specialised decoder; e5m2: the generic one


def _with_specials(x: torch.Tensor, gen: torch.Generator, share: float) -> torch.Tensor:
    """``x`` (fp8) with a share of its bytes replaced by random bit patterns (NaN, Inf, -0.0, subnormals)."""
    bits = x.clone().view(torch.uint8).reshape(-1)
    hit = torch.rand(bits.numel(), generator=gen) < share
    bits[hit] = torch.randint(0, 256, (int(hit.sum()),), generator=gen, dtype=torch.uint8)
    return bits.view(x.dtype).reshape(x.shape)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(FP8), source=st.sampled_from(["external", "none", "previous_token"]),
       g=st.integers(1, 2), t=st.integers(1, 260), d=st.sampled_from([1, 16, 64]),
       scale=st.floats(0.01, 300.0), noise=st.floats(0.0, 1.0), special=st.sampled_from([0.0, 0.02, 0.5]),
       seed=st.integers(0, 2**31 - 1))
@example(dtype=torch.float8_e4m3fn, source="external", g=2, t=200, d=64, scale=3.0, noise=0.3, special=0.02,
         seed=1)  # 25600-value chunks: 32 lanes (the others mostly 8)
def test_flagged_streams_round_trip(dtype, source, g, t, d, scale, noise, special, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(g, t, d, generator=gen) * scale
    x = _with_specials((base + noise * scale * torch.randn(g, t, d, generator=gen)).to(dtype), gen, special)
    pred = _with_specials(base.to(dtype), gen, special / 2) if source == "external" else None
    # the default sets the flag for fp8 with a prediction; the others are forced (not their default)
    meta, sections = pc.encode_tensor(x, pred, source, 1, version=2, mag=None if source == "external" else True)
    assert meta.get("mag") == 1
    assert same_bits(pc.decode_tensor(meta, sections, pred, 1), x)
    if t > 2:
        assert same_bits(pc.decode_tensor(meta, sections, pred, 1, tokens=(1, t - 1)), x[:, 1:t - 1])


def test_flag_set_where_it_pays_and_in_the_blob():
    x = torch.randn(2, 96, 64).to(torch.float8_e4m3fn)
    p = (x.float() + 0.1).to(torch.float8_e4m3fn)
    assert pc.magnitude_symbols(torch.float8_e4m3fn, "external")
    assert not any(pc.magnitude_symbols(dt, s) for dt in (torch.bfloat16, torch.float16, torch.float32)
                   for s in pc.PREDICTORS)
    assert not pc.magnitude_symbols(torch.float8_e4m3fn, "none")
    blob = kvcodec.compress(x, prediction=p, version=2)
    assert container.loads(blob)[1]["codec_meta"]["mag"] == 1
    assert same_bits(kvcodec.decompress(blob, prediction=p), x)
    assert "mag" not in container.loads(kvcodec.compress(x, layout="kv"))[1]["codec_meta"]


# an fp8 e4m3 stream with a prediction written before the flag existed (kvcodec.compress(x, prediction=p,
# version=2) at commit 8e84873), of _old_inputs()
OLD_BLOB = base64.b64decode(
    "S1ZDQwEAAACHAgAAnmDlM3sia2luZCI6Imt2Y29kZWMudGVuc29yIiwibWV0YSI6eyJjb2RlYyI6InByZWRpY3RpdmUiLCJkdHlwZSI6ImZsb2F0"
    "OF9lNG0zZm4iLCJzaGFwZSI6WzIsMjQsMTZdLCJkZXZpY2UiOiJjcHUiLCJjcmMzMiI6MTMwNjk2NzY2MSwidXNlc19wcmVkaWN0aW9uIjp0cnVl"
    "LCJjb2RlY19tZXRhIjp7InYiOjIsInNvdXJjZSI6ImV4dGVybmFsIiwiZHR5cGUiOiJmbG9hdDhfZTRtM2ZuIiwic2hhcGUiOlsyLDI0LDE2XSwi"
    "bW9kZSI6ImdyaWQiLCJwcmVkX2NyYyI6NDg4MDA3MDQ1LCJ0YiI6MjQsInNoYXJlZCI6dHJ1ZSwibGFuZXMiOjgsIm1sYW5lcyI6OH19LCJzZWN0"
    "aW9ucyI6W3sibmFtZSI6Im1vZGVsIiwidHlwZSI6Im51bXB5IiwiZHR5cGUiOiJ1aW50OCIsInNoYXBlIjpbNzMwXSwibmJ5dGVzIjo3MzAsImNy"
    "YzMyIjo3MjYzNDMyOTYsIm9mZnNldCI6NzA0fSx7Im5hbWUiOiJwYXlsb2FkIiwidHlwZSI6Im51bXB5IiwiZHR5cGUiOiJ1aW50MTYiLCJzaGFw"
    "ZSI6WzEwMl0sIm5ieXRlcyI6MjA0LCJjcmMzMiI6Mzk3MzgwMjc1OSwib2Zmc2V0IjoxNDcyfSx7Im5hbWUiOiJiaXRzIiwidHlwZSI6Im51bXB5"
    "IiwiZHR5cGUiOiJ1aW50MzIiLCJzaGFwZSI6WzJdLCJuYnl0ZXMiOjgsImNyYzMyIjoxMjUxMjYwMCwib2Zmc2V0IjoxNzI4fV19AAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAADOAgAAAAAAAAEbAAAAAQAAAAABDgMAAP0A9gD/LgTcuJ2Og2QqXhAqAAUABQA0FQAAAAAL"
    "BQsFAAAABQUAAAAFAAAFAAAAAAAAAAUAAAAFAE8FBQAAAAALJSoVAAsAAAAFAAUFAAAqAAAAAAALAAAAAABUCwAAAAAAAAAAAAAABQUAACUVAAAA"
    "AAAAAAAAAAAAAAULBQUKBRoqPzQQEAAAAAUAAAAABQAAAAAFAAAAFQoAAAAAAAAQAAAABQAAAAAFAAAABQAAAEQAAAAAAAoFAAAAAAAAABAAAAUA"
    "AAAAAAUAAAAABQAAAAAaAAAFAAAAAAAAAAAFAAAFAAAAAAAAAAAAAAAAAAAABQoAAAAAAAAABf8jA3o4CQmb+A4AROgMABb4IQGcFxIAyhd8BwHY"
    "AQDHB8kAcxgZ+M0Hz7e3xOtkbDXE1N4ZpVnj6cAJgQnQ+dqp4gq2Cow0Hoy5FJDPywS3qoPCV7GwfN+iYxGUYvFqMMkZlvz6Qia2ULdu1ILyctoB"
    "KmNhIdT93CJFQsxthjEpfxyUS2uBsuFwrYOY9LsIucFs2S75SEsFrCba8Wu3AxiqbkUiLrS1Zt6TMF/P+8cv7GklTqJYOtLTpRiRc27bax5kDFr+"
    "PWdVQJbeG2ScgSDT8K9eUpUIOTvYGN3eaEkBChT5Xs9ER11Odbx7HEUP7cryJ2h9DU2W8Ae4FnuYGRhOwIakHqn9R/NGLWGB7SODrXkCT9ogF9Du"
    "jgpTU48L8E7w72I3ZK5nVTS8fxHJPh4jBXNVEbhHNYqUbhDe6Gtuf6AtwlxsoS47Xq3z0TsPngcznluno94U52jvxxbTnxBtRS3zEA2GJ+bKkGyL"
    "ig7aLhii4BwxFIsOT7PYwGXdpzWUwx2pIP3tqJ0TswDzXsNiQJWy2026PTDJGobVK4Qv186ZO2/yGe/PJontvhrJgOMxJpWrIiaeUqTbZP67PGYA"
    "AAACAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAD2H0HtR18FANAvewEnT/AA4v+eIfuvbgc4724AYR4DAIdu70u3eVpo"
    "Ytko8qdK+sp5CEz+UjUOrN0AW/k+KXhwzQqPYtrAb/NRCVr5O6dUe2PIqCEiFMEwpAMjiLv5Djo8E1oos9m/VQgyeZsaR8NXZZemUhTwj+C3AAgk"
    "YuQ5SWsOVkF36bvPX5XXW5Mbsb74Gx+8D1vKLgfZTSMZ6czrpuuTRefJO77aKXkPQiYmbsPdvZrKEDn6nGwha8+jAoMsj7jKnUPDxdWsZQUAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAnuTGa8guAAA="
)


def _old_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(2 * 24 * 16, dtype=torch.float64).reshape(2, 24, 16)
    x = ((i * 0.37).sin() * 6 + (i * 0.011).cos()).to(torch.float8_e4m3fn)
    return x, ((i * 0.37).sin() * 6).to(torch.float8_e4m3fn)


def test_streams_without_the_flag_decode_as_before():
    x, p = _old_inputs()
    assert same_bits(kvcodec.decompress(OLD_BLOB, prediction=p), x)
    kind, meta, sections = container.loads(OLD_BLOB)
    assert "mag" not in meta["codec_meta"]
    # the flag forced off writes those bytes again; set, the stream differs and decodes too
    meta0, sec0 = pc.encode_tensor(x, p, "external", 1, version=2, mag=False)
    assert meta0 == meta["codec_meta"]
    assert all(np.array_equal(np.asarray(sections[k]), sec0[k]) for k in sec0)
    meta1, sec1 = pc.encode_tensor(x, p, "external", 1, version=2)
    assert meta1["mag"] == 1 and same_bits(pc.decode_tensor(meta1, sec1, p, 1), x)


@pytest.mark.parametrize("forged", [2, -1, True, False, 1.0, "1", None, [1]])
def test_forged_flag_raises(forged):
    x, p = _old_inputs()
    meta, sections = pc.encode_tensor(x, p, "external", 1, version=2)
    with pytest.raises(CorruptStreamError, match="mag"):
        pc.decode_tensor({**meta, "mag": forged}, sections, p, 1)
    kind, head, secs = container.loads(kvcodec.compress(x, prediction=p, version=2))
    head["codec_meta"]["mag"] = forged
    with pytest.raises(CorruptStreamError):
        kvcodec.decompress(container.dumps(kind, head, dict(secs)), prediction=p)
    with pytest.raises(CorruptStreamError, match="mag"):
        pc.parse_stream({**meta, "mag": forged}, sections)


def test_gpu_decoder_takes_valid_flags_and_leaves_forged_ones_to_the_cpu():
    meta = {"v": 2, "lanes": 32, "mode": "grid", "source": "external"}
    for flag in ({}, {"mag": 0}, {"mag": 1}):
        assert kvctx_device.gpu_decodable({**meta, **flag})
    for flag in (2, -1, True, False, "0", 0.0, 1.0, None):  # the CPU parser raises CorruptStreamError on these
        assert not kvctx_device.gpu_decodable({**meta, "mag": flag})


class _OnCuda(torch.Tensor):
    """A meta tensor that reports a CUDA device: :func:`kvctx_device_encode.unsupported`'s checks run
    on its dtype and shape without a GPU."""

    @property
    def device(self):
        return torch.device("cuda")


def test_gpu_encoder_takes_what_the_cpu_counts_by_magnitude():
    """The GPU encoder writes the flag where the CPU encoder does (fp8 with a prediction), so it takes those
    calls too (its streams: tests/test_kvctx_encode_device.py)."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        t = torch.Tensor._make_subclass(_OnCuda, torch.empty((2, 128, 64), dtype=dtype, device="meta"))
        for source in ("none", "external", "previous_token"):
            assert kde.unsupported(t, source, 2) is None, (dtype, source)
            assert kde.unsupported(t, source, None) is None, (dtype, source)
