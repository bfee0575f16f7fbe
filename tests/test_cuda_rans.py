"""CPU checks of the GPU rANS decoder (kvcodec/entropy/cuda/rans_decode.cu + rans.py): nvcc builds it for
Hopper and Blackwell without spills, and a lane-by-lane numpy emulation of the kernel (the launcher's
descriptors, shared-memory/global tables, shared-memory word ring, ballot/popcount reads, masked
loads, final checks) decodes real ``entropy.encode(..., streams=32)`` streams bit-exactly and gives
the error status on inconsistent payloads, without ever reading outside a payload."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec import entropy
from kvcodec.device import build
from kvcodec.entropy import rans_fast, stream
from kvcodec.entropy.cuda import rans as gr
from kvcodec.errors import CorruptStreamError

L = 1 << 16
LANES = np.arange(32, dtype=np.int64)
BELOW = (np.int64(1) << LANES) - 1


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_rans_kernel_compiles_without_spills(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: CUDA compile check skipped")
    proc = build.nvcc_compile(gr.SOURCE, gr.instance_declarations((gr.WARPS, 8)), arch, tmp_path,
                              extra=("-Xptxas", "-v,-warn-spills"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    spills = [line for line in proc.stderr.splitlines() if "spill" in line and " 0 bytes spill stores" not in line]
    assert not spills, "\n".join(spills)
    assert (tmp_path / f"rans_decode_{arch}.cubin").stat().st_size > 1000


# ------------------------------------------------------------------------------- emulation
def _popc(v):
    return np.array([bin(int(a)).count("1") for a in np.atleast_1d(v)], dtype=np.int64)


class _Mem:
    """Byte memory whose reads are confined to a window: the 16-byte aligned pieces that overlap the
    payload being decoded (the kernel's word loads), or the payload itself (its states)."""

    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.lo = self.hi = 0

    def read(self, off: int, size: int) -> int:
        lo, hi = (self.lo & ~15, -(-self.hi // 16) * 16) if size == 16 else (self.lo, self.hi)
        assert lo <= off and off + size <= hi, f"read [{off}, {off + size}) outside [{lo}, {hi})"
        assert off % size == 0, "misaligned load"
        return int.from_bytes(self.buf[off: off + size].tobytes(), "little")


SEG_WORDS, RING_SEGS = 256, 4  # rans_decode.cu: RD_SEG_WORDS, RD_RING_SEGS


def _emulate_warp(mem, pd, smem, gtab, mode, prec, lo, aux, symbytes, out):
    """One warp of rans32_decode: the word ring in shared memory (segments of 16-byte pieces,
    stored two segments ahead of the read position, loads masked past the payload), ballot reads."""
    in_off, in_len, out_off, n = (int(v) for v in pd)
    if in_len < 128 or (in_len - 128) & 1:
        return 1
    mem.lo, mem.hi = in_off, in_off + in_len
    odd = in_off % 4 != 0  # a 2-byte aligned payload: the kernel reads its states as 16-bit halves

    def read32(off):
        return mem.read(off, 2) | (mem.read(off + 2, 2) << 16) if odd else mem.read(off, 4)

    x = np.array([read32(in_off + 4 * k) for k in range(32)], dtype=np.int64)
    if (x < L).any():
        return 2
    nw = (in_len - 128) >> 1
    wa = in_off + 128
    a0 = wa & ~15
    end = wa - a0 + 2 * nw  # the payload's end, from a0
    skew = (wa - a0) >> 1
    ring = np.zeros(SEG_WORDS * RING_SEGS, dtype=np.int64)
    held = np.full(RING_SEGS, -1)  # the segment each ring slot holds

    def load_seg(s):  # the lanes' 16-byte pieces (a piece past the end: the one before a0)
        return [mem.read(a0 + 16 * (32 * s + lane) if 16 * (32 * s + lane) < end else a0 - 16, 16)
                for lane in range(32)]

    def store_seg(s, pieces):  # zeroed at and past the payload's end, as 8 words each
        words = np.zeros((32, 8), dtype=np.int64)
        for lane, v in enumerate(pieces):
            keep = min(16, max(0, end - 16 * (32 * s + lane)))
            v &= (1 << (8 * keep)) - 1
            words[lane] = [(v >> (16 * j)) & 0xFFFF for j in range(8)]
        ring[SEG_WORDS * (s % RING_SEGS): SEG_WORDS * (s % RING_SEGS + 1)] = words.reshape(-1)
        held[s % RING_SEGS] = s

    for s in range(3):
        store_seg(s, load_seg(s))
    pending = load_seg(3)
    seg, inseg = 0, skew
    mask = (1 << prec) - 1
    sym_dt = np.uint8 if symbytes == 1 else np.uint16
    s32 = smem.view("<u4").astype(np.int64) if smem.size else None
    symv = smem.view(sym_dt).astype(np.int64) if smem.size else None
    if mode == 2:
        g32 = gtab[: 4 << prec].view("<u4").astype(np.int64)
        gsym = gtab[aux: aux + (symbytes << prec)].view(sym_dt).astype(np.int64)
    outv = out[out_off: out_off + n * symbytes].view(sym_dt)
    groups, tail = n >> 5, n & 31
    for g in range(groups + (1 if tail else 0)):
        active = np.ones(32, bool) if g < groups else LANES < tail
        slot = x & mask
        if mode == 0:
            e = s32[slot]
            sym, f, bias = lo + (e >> 24), ((e >> 12) & 0xFFF) + 1, e & 0xFFF
        elif mode == 1:
            idx = symv[slot]
            e = s32[(aux >> 2) + idx]
            sym, f, bias = lo + idx, (e >> 16) + 1, slot - (e & 0xFFFF)
        else:
            e = g32[slot]
            sym, f, bias = gsym[slot], (e >> 16) + 1, e & 0xFFFF
        assert (bias >= 0).all() and (bias < f).all()
        xn = f * (x >> prec) + bias
        assert (xn < 1 << 32).all()  # the kernel's u32 arithmetic never wraps
        x = np.where(active, xn, x)
        need = active & (x < L)
        m = int(np.sum(need.astype(np.int64) << LANES))
        cnt = bin(m).count("1")
        at = SEG_WORDS * seg + inseg + _popc(m & BELOW)  # skew + the word's index
        assert (held[(at[need] // SEG_WORDS) % RING_SEGS] == at[need] // SEG_WORDS).all()  # stored, not overwritten
        word = ring[at % (SEG_WORDS * RING_SEGS)]
        x = np.where(need, ((x << 16) | word) & 0xFFFFFFFF, x)
        i = 32 * g + LANES
        outv[i[active]] = sym[active]
        inseg += cnt
        if inseg >= SEG_WORDS:
            inseg -= SEG_WORDS
            seg += 1
            store_seg(seg + 2, pending)
            pending = load_seg(seg + 3)
    pos = SEG_WORDS * seg + inseg - skew
    if pos > nw:
        return 3
    return 4 if pos != nw or (x != L).any() else 0


def emulate_launch(batch: gr.RansBatch):
    """Run the kernel's grid in numpy on a RansBatch built on the CPU: (out bytes, status)."""
    mem = _Mem(batch.data.numpy())
    pdesc, order = batch.pdesc.numpy(), batch.order.numpy()
    blocks, tdesc, tabs = batch.blocks.numpy(), batch.tdesc.numpy(), batch.table_data.numpy()
    out = np.full(max(batch.out_bytes, 1), 0xA5, dtype=np.uint8)  # poison: unwritten bytes show
    status = np.full(max(batch.n_payloads, 1), -1, dtype=np.int32)
    assert batch.smem_bytes <= gr.SMEM_MAX and batch.smem_bytes - gr.WARPS * gr.RING_BYTES <= gr.TABLE_SMEM_MAX
    for t, first, count, _ in blocks:
        assert 1 <= count <= gr.WARPS
        toff, mode, prec, lo, words, aux, symbytes, _ = (int(v) for v in tdesc[t])
        assert toff % 16 == 0
        smem = np.zeros(batch.smem_bytes, dtype=np.uint8)
        if mode != 2:
            smem[: 4 * words] = tabs[toff: toff + 4 * words]
        for wi in range(count):
            p = int(order[first + wi])
            assert pdesc[p][0] % 2 == 0
            status[p] = _emulate_warp(mem, pdesc[p], smem, tabs[toff:], mode, prec, lo, aux, symbytes, out)
    return out, status


def emulate_decode(blobs, table_mode=None):
    """decode_batch with the emulated kernel (CPU tensors): list of numpy arrays, or raises."""
    batch = gr.RansBatch(blobs, device="cpu", table_mode=table_mode)
    out, status = emulate_launch(batch)
    batch.check(torch.from_numpy(status))
    views = batch.split(torch.from_numpy(out))
    return [v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.uint16 else v.numpy() for v in views]


# ------------------------------------------------------------------------------- bit-exactness
def _symbols(rng, dtype, n, kind):
    hi = 256 if dtype == np.uint8 else 65536
    if kind == "single":
        return np.full(n, rng.integers(0, hi), dtype=dtype)
    if kind == "uniform":
        return rng.integers(0, hi, n).astype(dtype)
    if kind == "small":  # a few symbols somewhere in the alphabet
        base = int(rng.integers(0, hi - 40))
        return (base + rng.geometric(0.4, n).clip(1, 40) - 1).astype(dtype)
    # skewed around a random centre (bf16 exponent-like)
    c = int(rng.integers(0, hi))
    return ((c + np.round(rng.laplace(0, 6 if dtype == np.uint8 else 300, n))) % hi).astype(dtype)


LENGTHS = [0, 1, 2, 31, 32, 33, 63, 64, 65, 95, 97, 200, 1000, 2049]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from([np.uint8, np.uint16]), n=st.one_of(st.sampled_from(LENGTHS), st.integers(0, 3000)),
       kind=st.sampled_from(["single", "uniform", "small", "skewed"]), prec_extra=st.integers(0, 8),
       default_prec=st.booleans(), mode=st.sampled_from([None, 0, 1, 2]), seed=st.integers(0, 2**31))
def test_emulated_kernel_decodes_encoder_output(dtype, n, kind, prec_extra, default_prec, mode, seed):
    rng = np.random.default_rng(seed)
    x = _symbols(rng, dtype, n, kind)
    distinct = int(np.unique(x).size) if n else 1
    prec = None if default_prec else min(16, max(1, (distinct - 1).bit_length()) + prec_extra)
    blob = entropy.encode(x, coder="rans", streams=32, precision=prec)
    h = entropy.inspect(blob)
    if n and mode is not None:
        try:
            gr.build_table(h.freqs, h.param, h.dtype, mode)
        except ValueError:
            mode = None  # this table cannot take the forced layout
    (y,) = emulate_decode([blob], table_mode=mode)
    assert y.dtype == x.dtype and np.array_equal(y, x)


def test_emulated_batch_mixed_dtypes_lengths_and_shared_tables():
    rng = np.random.default_rng(1)
    xs = [_symbols(rng, dt, n, k) for dt, n, k in [(np.uint8, 5000, "skewed"), (np.uint16, 333, "skewed"),
                                                   (np.uint8, 0, "uniform"), (np.uint8, 31, "small"),
                                                   (np.uint16, 4097, "small"), (np.uint8, 1, "single"),
                                                   (np.uint16, 2000, "uniform")]]
    blobs = [entropy.encode(x, coder="rans", streams=32) for x in xs]
    blobs += [blobs[0], blobs[3]]  # repeated tables: uploaded once
    xs += [xs[0], xs[3]]
    batch = gr.RansBatch(blobs, device="cpu")
    assert len(batch.tables) == 6 and {t.mode for t in batch.tables} == {0, 1, 2}
    ys = emulate_decode(blobs)
    for x, y in zip(xs, ys):
        assert y.dtype == x.dtype and np.array_equal(x, y)


def test_encode_chunks_roundtrip_and_concat_layout():
    rng = np.random.default_rng(2)
    x = _symbols(rng, np.uint8, 10_000, "skewed")
    for shared in (False, True):
        blobs = gr.encode_chunks(x, 2048, shared_table=shared, workers=2)
        assert len(blobs) == 5 and all(entropy.inspect(b).streams == 32 for b in blobs)
        assert np.array_equal(np.concatenate([entropy.decode(b) for b in blobs]), x)
        batch = gr.RansBatch(blobs, device="cpu")
        assert len(batch.tables) == (1 if shared else 5)
        out, status = emulate_launch(batch)
        assert not status.any() and batch.out_bytes == x.size
        assert np.array_equal(out[: x.size], x)  # chunks back to back: decode_concat's buffer
    x16 = _symbols(rng, np.uint16, 3000, "skewed")
    ys = emulate_decode(gr.encode_chunks(x16, 1000, precision=16))
    assert np.array_equal(np.concatenate(ys), x16)
    assert gr.encode_chunks(np.zeros(0, np.uint8)) and entropy.decode(gr.encode_chunks(np.zeros(0, np.uint8))[0]).size == 0


def test_build_table_layouts():
    f = np.zeros(256, np.int64)
    f[[3, 10, 200]] = [2048, 1024, 1024]
    t0 = gr.build_table(f, 12, np.uint8)
    assert t0.mode == 0 and t0.lo == 3 and t0.smem_words == 4096
    e = t0.data.view("<u4")
    assert e[0] == (0 << 24) | (2047 << 12) | 0 and e[2048 + 5] == (7 << 24) | (1023 << 12) | 5
    f14 = np.ones(256, np.int64) * 64
    t1 = gr.build_table(f14, 14, np.uint8)
    assert t1.mode == 1 and t1.aux == 16384 and 4 * t1.smem_words == 16384 + 1024
    t2 = gr.build_table(f14 * 4, 16, np.uint8)
    assert t2.mode == 2 and t2.aux == 4 << 16 and t2.smem_words == 0
    with pytest.raises(ValueError):
        gr.build_table(f14 * 4, 16, np.uint8, mode=1)
    with pytest.raises(ValueError):
        gr.build_table(f14, 14, np.uint8, mode=0)


# ------------------------------------------------------------------------------- corruption
def _repack(blob, payload: bytes) -> bytes:
    """The same header with another payload (valid CRCs): only the kernel can catch it."""
    h, _ = stream.parse(blob)
    return stream.pack(h.coder, h.dtype, h.n, h.param, h.streams, h.freqs, payload)


def _corrupt_variants(blob):
    h, p = stream.parse(blob)
    p = bytes(p)
    yield "drop last word", p[:-2], 3 if len(p) > 128 else 1
    yield "extra word", p + b"\x01\x02", 4
    yield "odd length", p + b"\x00", 1
    yield "short head", p[:100], 1
    yield "state < L", p[:8] + (5).to_bytes(4, "little") + p[12:], 2
    yield "state flipped", p[:4] + bytes([p[4] ^ 0x40]) + p[5:], None
    if len(p) > 140:
        mid = 128 + 2 * ((len(p) - 128) // 4)
        yield "word flipped", p[:mid] + bytes([p[mid] ^ 0x10]) + p[mid + 1:], None
        yield "truncated half", p[:128 + 2 * ((len(p) - 128) // 4)], None


@pytest.mark.parametrize("dtype,kind,n", [(np.uint8, "skewed", 3000), (np.uint16, "skewed", 1500),
                                          (np.uint8, "uniform", 777), (np.uint8, "small", 40)])
def test_emulated_kernel_flags_corrupt_payloads(dtype, kind, n):
    rng = np.random.default_rng(n)
    x = _symbols(rng, dtype, n, kind)
    blob = entropy.encode(x, coder="rans", streams=32)
    for what, payload, code in _corrupt_variants(blob):
        try:
            bad = _repack(blob, payload)
            stream.parse(bad)
        except CorruptStreamError:
            continue  # the host-side header checks (symbol bound) already reject it
        batch = gr.RansBatch([blob, bad, blob], device="cpu")
        out, status = emulate_launch(batch)  # asserts that no read leaves its payload
        assert status[0] == 0 and status[2] == 0, what
        cpu_ok = True
        try:
            cpu = entropy.decode(bad)
        except CorruptStreamError:
            cpu_ok = False
        if cpu_ok:  # a flip the format cannot see: GPU must agree with the CPU decoder exactly
            assert status[1] == 0, what
            assert np.array_equal(emulate_decode([bad])[0], cpu), what
        else:
            assert status[1] != 0, what
            if code is not None:
                assert status[1] == code, (what, status[1])
            with pytest.raises(CorruptStreamError, match="stream 1"):
                emulate_decode([blob, bad, blob])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), seed=st.integers(0, 2**31), cut=st.integers(0, 1 << 20), flip=st.integers(0, 1 << 20))
def test_emulated_kernel_random_corruption_never_reads_outside(n, seed, cut, flip):
    rng = np.random.default_rng(seed)
    x = _symbols(rng, np.uint8, n, "skewed")
    blob = entropy.encode(x, coder="rans", streams=32)
    p = bytearray(stream.parse(blob)[1])
    p[flip % len(p)] ^= 1 << (flip % 8)
    p = bytes(p[: len(p) - (cut % 9)])
    try:
        bad = _repack(blob, p)
        stream.parse(bad)
    except CorruptStreamError:
        return
    out, status = emulate_launch(gr.RansBatch([bad], device="cpu"))
    try:
        ref = entropy.decode(bad)
    except CorruptStreamError:
        assert status[0] != 0
    else:
        assert status[0] == 0 and np.array_equal(out[:n], ref)


def test_non_rans_streams_are_refused_or_fall_back():
    x = np.arange(500, dtype=np.uint8) % 7
    for blob in (entropy.encode(x, coder="tans"), entropy.encode(x, coder="rans", streams=8)):
        with pytest.raises(ValueError, match="32"):
            gr.RansBatch([blob], device="cpu")
        batch = gr.RansBatch([blob, entropy.encode(x, coder="rans", streams=32)], device="cpu", cpu_fallback=True)
        out, status = emulate_launch(batch)
        ys = batch.split(torch.from_numpy(out))
        assert np.array_equal(ys[0].numpy(), x) and np.array_equal(ys[1].numpy(), x)


def test_rans_fast_decoder_is_the_reference_for_32_states():
    """The CPU decoder used as the oracle agrees with the spec on 32-state payloads."""
    from kvcodec.entropy import rans

    rng = np.random.default_rng(5)
    x = _symbols(rng, np.uint8, 700, "skewed")
    freqs = entropy.quantize_frequencies(entropy.count_symbols(x), 12)
    p = rans_fast.encode_table(x, freqs, 12, 32)
    assert bytes(p) == rans.encode(x, freqs, 12, 32)
    assert rans.decode(bytes(p), freqs, 12, x.size, 32) == x.tolist()


def test_batches_over_the_output_cap_are_refused_before_allocation():
    from kvcodec import CorruptStreamError, entropy

    blobs = [entropy.encode(np.zeros(5000, np.uint8), coder="rans", streams=32)] * 3
    with pytest.raises(CorruptStreamError, match="max_output_bytes"):
        gr.RansBatch(blobs, device="cpu", max_output_bytes=14_999)
    assert gr.RansBatch(blobs, device="cpu", max_output_bytes=15_000).out_bytes == 15_000


def _placed_batch(payloads, headers, shift: int, device="cpu"):
    """A RansBatch over one buffer holding the payloads at offsets = shift (mod 16), each followed
    by random bytes (what surrounds a chunk stream inside a planes section)."""
    rng = np.random.default_rng(shift)
    offs, buf = [], bytearray(rng.integers(0, 256, shift).astype(np.uint8).tobytes())
    for p in payloads:
        offs.append(len(buf))
        buf += bytes(p) + rng.integers(0, 256, 16 + (-len(p) % 16)).astype(np.uint8).tobytes()
    data = torch.frombuffer(buf, dtype=torch.uint8).to(device)
    batch = gr.RansBatch.__new__(gr.RansBatch)  # from_device's setup, on any device
    batch.device, batch._fallback = data.device, {}
    batch._setup(headers, data, offs)
    return batch


@pytest.mark.parametrize("shift", [0, 2, 4, 6, 8, 10, 12, 14])
def test_emulated_kernel_at_every_even_alignment(shift):
    """Payloads at each 2-byte alignment (word 0 anywhere in a 16-byte piece), ending anywhere in
    one: the word ring's skew, its first and last pieces (neighbour bytes masked), lengths around
    the segment boundaries."""
    rng = np.random.default_rng(100 + shift)
    xs = [_symbols(rng, np.uint8, n, kind) for n, kind in ((1, "small"), (700, "uniform"), (4100, "uniform"),
                                                           (20_000, "skewed"), (9000, "small"))]
    xs.append(_symbols(rng, np.uint16, 1500, "uniform"))  # 32 words a step: a segment every 8 steps
    blobs = [entropy.encode(x, coder="rans", streams=32) for x in xs]
    parsed = [stream.parse(b) for b in blobs]
    batch = _placed_batch([p for _, p in parsed], [h for h, _ in parsed], shift)
    out, status = emulate_launch(batch)
    assert not status[: len(xs)].any()
    for x, y in zip(xs, batch.split(torch.from_numpy(out))):
        got = y.view(torch.int16).numpy().view(np.uint16) if y.dtype == torch.uint16 else y.numpy()
        assert np.array_equal(got, x)


GPU = torch.cuda.is_available()
try:
    import cupy  # noqa: F401
except Exception:
    GPU = False


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("shift", [0, 2, 6, 14])
@pytest.mark.parametrize("warps", [4, 2])
def test_gpu_kernel_at_every_even_alignment_equals_emulation(shift, warps, monkeypatch):
    """The kernel on the device against its emulation: valid payloads at each alignment, and the same
    payloads truncated or bit-flipped (same status, same garbage output: words past the end are 0);
    both block sizes the benchmark compares."""
    monkeypatch.setattr(gr, "WARPS", warps)
    rng = np.random.default_rng(shift)
    xs = [_symbols(rng, np.uint8, n, "uniform") for n in (5000, 33, 12_345)] + [_symbols(rng, np.uint16, 999, "skewed")]
    payloads, headers = [], []
    for x in xs:
        h, p = stream.parse(entropy.encode(x, coder="rans", streams=32))
        cut = bytes(p[: 128 + 2 * ((len(p) - 128) // 3)])
        flip = bytearray(p)
        flip[len(p) // 2] ^= 0x08
        for q in (bytes(p), cut, bytes(flip)):
            payloads.append(q)
            headers.append(dataclasses.replace(h, payload_len=len(q)))
    cpu = _placed_batch(payloads, headers, shift)
    want_out, want_status = emulate_launch(cpu)
    dev = _placed_batch(payloads, headers, shift, "cuda")
    out = torch.full((max(dev.out_bytes, 1),), 0xA5, dtype=torch.uint8, device="cuda")
    out, status = dev.launch(out)
    assert np.array_equal(status.cpu().numpy(), want_status[: len(payloads)])
    assert np.array_equal(out.cpu().numpy()[: dev.out_bytes], want_out[: cpu.out_bytes])
