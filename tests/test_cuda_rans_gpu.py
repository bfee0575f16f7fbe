"""GPU checks of the batched rANS decoder against the CPU decoder (skipped without CUDA + CuPy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcodec.device as kc
from kvcodec import entropy
from kvcodec.entropy import stream
from kvcodec.entropy.cuda import rans as gr
from kvcodec.errors import CorruptStreamError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kc.is_available(), reason="needs a CUDA GPU and CuPy")]


def _to_np(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.uint16 else t.numpy()


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    xs = []
    for i, n in enumerate([0, 1, 31, 32, 33, 1000, 4097, 65536, 100_003]):
        c = int(rng.integers(0, 256))
        xs.append(((c + np.round(rng.laplace(0, 1 + i, n))) % 256).astype(np.uint8))
        xs.append(((c * 200 + np.round(rng.laplace(0, 50 * (i + 1), n))) % 65536).astype(np.uint16))
    xs.append(rng.integers(0, 256, 5000).astype(np.uint8))
    xs.append(np.full(3000, 7, np.uint8))
    return xs


def _prec(x, p):
    if p is None or not x.size:
        return None
    return max(p, int(np.unique(x).size - 1).bit_length())


@pytest.mark.parametrize("mode", [None, 1, 2])
def test_decode_batch_matches_cpu(mode):
    torch.cuda.empty_cache()
    xs = _inputs()
    precs = [None, 12, 13, 14, 16]
    blobs = [entropy.encode(x, coder="rans", streams=32, precision=_prec(x, precs[i % 5])) for i, x in enumerate(xs)]
    if mode is not None:  # force a layout where it fits, compare against the default
        ok = []
        for b in blobs:
            h = entropy.inspect(b)
            try:
                if h.n:
                    gr.build_table(h.freqs, h.param, h.dtype, mode)
                ok.append(b)
            except ValueError:
                pass
        blobs = ok
    ref = [entropy.decode(b) for b in blobs]
    batch = gr.RansBatch(blobs, "cuda", table_mode=mode)
    out = torch.full((max(batch.out_bytes, 1),), 0xA5, dtype=torch.uint8, device="cuda")
    out, status = batch.launch(out)
    batch.check(status)
    ys = batch.split(out)
    for r, y in zip(ref, ys):
        assert y.is_cuda and np.array_equal(_to_np(y), r)
    if mode is None:
        for r, y in zip(ref, gr.decode_batch(blobs)):
            assert np.array_equal(_to_np(y), r)


def test_decode_concat_of_chunks_many_payloads():
    rng = np.random.default_rng(3)
    x = ((np.round(rng.laplace(0, 3, 3_000_000)) + 120) % 256).astype(np.uint8)
    for chunk in (1 << 14, 1 << 16):
        blobs = gr.encode_chunks(x, chunk)
        y = gr.decode_concat(blobs)
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.from_numpy(x))


def test_corrupt_payloads_raise():
    rng = np.random.default_rng(4)
    x = ((np.round(rng.laplace(0, 4, 20_000)) + 60) % 256).astype(np.uint8)
    blob = entropy.encode(x, coder="rans", streams=32)
    h, p = stream.parse(blob)
    p = bytes(p)
    bads = [p[:-2], p + b"\x01\x00", p[:8] + (3).to_bytes(4, "little") + p[12:], p[: 128 + 2 * ((len(p) - 128) // 4)],
            p[:1000] + bytes([p[1000] ^ 0x20]) + p[1001:]]
    for bp in bads:
        bad = stream.pack(h.coder, h.dtype, h.n, h.param, h.streams, h.freqs, bp)
        try:
            stream.parse(bad)
        except CorruptStreamError:
            continue  # rejected on the host (symbol bound): not the kernel's case
        try:
            entropy.decode(bad)
        except CorruptStreamError:
            pass
        else:
            continue
        with pytest.raises(CorruptStreamError, match="stream 1"):
            gr.decode_batch([blob, bad, blob])
    with pytest.raises(CorruptStreamError):
        gr.decode_batch([blob[:-1]])  # host-side: length / CRC
    with pytest.raises(ValueError):
        gr.decode_batch([entropy.encode(x, coder="rans", streams=8)])
    y = gr.decode_batch([entropy.encode(x, coder="tans"), blob], cpu_fallback=True)
    assert all(np.array_equal(_to_np(t), x) for t in y)


def test_from_device_payloads():
    rng = np.random.default_rng(6)
    xs = [rng.integers(0, 50, n).astype(np.uint8) for n in (10_000, 777, 64)]
    blobs = [entropy.encode(x, coder="rans", streams=32) for x in xs]
    parsed = [stream.parse(b) for b in blobs]
    offs, buf = [], bytearray()
    for _, p in parsed:
        offs.append(len(buf))
        buf += bytes(p) + b"\0" * (-len(p) % 8)
    data = torch.frombuffer(bytearray(buf), dtype=torch.uint8).cuda()
    batch = gr.RansBatch.from_device(data, offs, [h for h, _ in parsed])
    out, status = batch.launch()
    batch.check(status)
    for x, y in zip(xs, batch.split(out)):
        assert np.array_equal(_to_np(y), x)
