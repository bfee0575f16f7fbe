"""The kvctx / predictive GPU decode's plan on the device (kvcodec/lossless/cuda/kvctx_plan.{cu,py},
kvctx_device.device_inputs) and the model layouts it reads (format2 ``mfields``, and ``mparts`` as
written before it).

CPU checks (always): an ``mparts`` stream (an older model layout) still decodes on the CPU and through
the device path's host plan; forged field values are refused by the CPU decoder; the plan kernels
compile for sm_90 and sm_100. GPU checks (marked gpu): the decode tables built on the device equal
``tables.decode_tables``, the field checks flag exactly what ``format2.check_field_values`` refuses, the
field parts decoded on the device equal the host decode (outputs poisoned first), and streams with
forged field values or damaged field parts raise CorruptStreamError through ``decompress`` on the GPU
exactly where the CPU decoder raises.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import container
from kvcodec.device import build
from kvcodec.device.transfer import Staging
from kvcodec.entropy import rans_fast
from kvcodec.entropy.freq import count_symbols, quantize_frequencies
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.cuda import kvctx_plan
from kvcodec.lossless.predictive import format2, params, tables
from kvcodec.lossless.predictive.codec import kv_layout
from test_kvctx_device import GPU, emulated_decode, emulator, kv_like, same_bits, with_specials  # noqa: F401

N_STORED = len(params.stored_fields("none"))  # a kvctx stream's fields: level, mq, a


def model_parts(blob: bytes):
    """(kind, meta, sections, field header, field bytes, table bytes) of a kvctx blob's model."""
    kind, meta, sections = container.loads(blob)
    secs = {k: np.array(v) for k, v in sections.items()}
    model = secs["model"]
    k = int(model[:4].view("<u4")[0])
    head = model[4:4 + 5 * N_STORED]
    cm = meta["codec_meta"]
    if "mfields" in cm:
        parts, tabs = format2.read_field_parts(cm, model, 4 + head.size, 4 + k, 1 << 40)
        fields = parts.decode(model)
    else:
        raw = format2.decode_model(cm, model[4 + head.size:4 + k].tobytes(), 1 << 40)
        size = format2.field_layout(head.tobytes(), "none", *field_shape(cm))[1]
        fields, tabs = raw[:size], raw[size:]
    return kind, meta, secs, head, fields, tabs


def field_shape(cm) -> tuple[int, int]:
    """(Gp, D): the stored fields' shape of a kvctx codec meta."""
    g, _, d = kv_layout(cm["shape"])
    return (1 if cm["shared"] else g), d


def rebuilt(kind, meta, secs, head, body: bytes, model_meta: dict) -> bytes:
    """The blob with its model's coded bytes replaced (checksums recomputed)."""
    model = secs["model"]
    k = int(model[:4].view("<u4")[0])
    h = head.tobytes() + body
    secs = {**secs, "model": np.concatenate([np.frombuffer(len(h).to_bytes(4, "little") + h, np.uint8), model[4 + k:]])}
    cm = {key: v for key, v in meta["codec_meta"].items() if key not in ("mfields", "mparts")} | model_meta
    return container.dumps(kind, {**meta, "codec_meta": cm}, secs)


def legacy_mparts(raw: np.ndarray, parts: int) -> bytes:
    """The ``mparts`` model body (the older code_model): u32 n | 256 x u16 freq | parts x u32 length |
    8-state payloads of np.array_split(raw, parts), one shared 14-bit table."""
    freqs = quantize_frequencies(count_symbols(raw), format2.MODEL_PRECISION).astype("<u2")
    payloads = [rans_fast.encode_table(x, freqs, format2.MODEL_PRECISION, format2.MODEL_STREAMS)
                for x in np.array_split(raw, parts)]
    head = np.concatenate([np.array([raw.size], "<u4").view(np.uint8), freqs.view(np.uint8),
                           np.array([p.size for p in payloads], "<u4").view(np.uint8)])
    return b"".join([head.tobytes(), *(p.tobytes() for p in payloads)])


def forged(blob: bytes, edit) -> bytes:
    """The blob with ``edit(fields, layout, n, head)`` applied to its decoded field bytes and field
    header, re-coded in parts."""
    kind, meta, secs, head, fields, tabs = model_parts(blob)
    gp, d = field_shape(meta["codec_meta"])
    layout, _ = format2.field_layout(head.tobytes(), "none", gp, d)
    fields, head = fields.copy(), head.copy()
    edit(fields, layout, gp * d, head)
    body, mmeta = format2.code_model(fields, tabs)
    return rebuilt(kind, meta, secs, head, body, mmeta)


def cpu_result(blob: bytes, x: torch.Tensor) -> bool:
    try:
        return same_bits(kvcodec.decompress(blob), x)
    except CorruptStreamError:
        return False


def level_over(fields, layout, n, head):
    """A stored level minimum just below the largest level, and one level above it."""
    k = params.stored_fields("none").index("s")
    head[5 * k:5 * k + 4] = np.array([format2.level_limit(np.zeros((4, 3), np.int64)) - 2], "<i4").view(np.uint8)
    fields[int(layout[format2.FIELD_ORDER.index("level"), 0]) + n // 3] = 3


def mq_65535(fields, layout, n, head):
    off, width, _ = (int(v) for v in layout[format2.FIELD_ORDER.index("mq")])
    assert width == 2
    fields[off + n // 2] = fields[off + n + n // 2] = 0xFF


def offset_kv(shape, seed=0) -> torch.Tensor:
    """Channels far from zero relative to their spread: 2-byte zigzag locations (mq)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.01 + torch.linspace(-50, 50, shape[-1])).to(torch.bfloat16)


@pytest.fixture
def small_parts(monkeypatch):
    """Model bytes in ``mfields`` parts of 256 bytes from 256 bytes on (small tensors, many parts)."""
    monkeypatch.setattr(format2, "MODEL_PART_BYTES", 256)
    monkeypatch.setattr(format2, "FIELD_PART_BYTES", 256)


# ------------------------------------------------------------------------------------ CPU
def test_mparts_streams_still_decode(emulator, small_parts):
    """A stream whose model is in the older ``mparts`` layout decodes on the CPU and through the
    device path's host plan (emulated kernel), as its ``mfields`` twin does."""
    x = with_specials(kv_like((2, 2, 128, 64), seed=3))
    blob = kvcodec.compress(x, layout="kv")
    kind, meta, secs, head, fields, tabs = model_parts(blob)
    assert "mfields" in meta["codec_meta"]
    old = rebuilt(kind, meta, secs, head, legacy_mparts(np.concatenate([fields, tabs]), 7), {"mparts": 7})
    for b in (blob, old):
        assert same_bits(kvcodec.decompress(b), x)
        out, status, _ = emulated_decode(emulator, b)
        assert not status.any() and same_bits(out, x)


@pytest.mark.parametrize("n,part", [(70_001, 1 << 14), (5000, 700), (1, 1)])
def test_field_parts_are_rans_fast_payloads(n, part, monkeypatch):
    """code_model's batched encoder writes, part by part, exactly ``rans_fast.encode_table``'s payload
    (32 states, the shared 12-bit table), and the parts decode back to the fields."""
    monkeypatch.setattr(format2, "MODEL_PART_BYTES", 0)
    monkeypatch.setattr(format2, "FIELD_PART_BYTES", part)
    rng = np.random.default_rng(n)
    fields = np.minimum(rng.geometric(0.03, n), 255).astype(np.uint8)
    tabs = rng.integers(0, 9, 77).astype(np.uint8)
    body, meta = format2.code_model(fields, tabs)
    buf = np.frombuffer(body, np.uint8)
    parts, got_tabs = format2.read_field_parts(meta, buf, 0, buf.size, 1 << 30)
    assert meta["mfields"] == len(parts.start) == min(format2.MAX_FIELD_PARTS, -(-n // part))
    freqs = buf[8:520].view("<u2")
    for k, piece in enumerate(np.array_split(fields, meta["mfields"])):
        want = rans_fast.encode_table(piece, freqs, format2.FIELD_PRECISION, format2.FIELD_STATES)
        assert np.array_equal(buf[parts.start[k]:parts.start[k] + parts.length[k]], want), k
    assert np.array_equal(parts.decode(buf), fields) and np.array_equal(got_tabs, tabs)
    # the GPU decode's launch of the parts, staged straight, is LaunchPlan.build's for one table
    from kvcodec.device.transfer import Staging
    from kvcodec.entropy.cuda import rans as cuda_rans

    st = Staging(kvctx_plan.parts_pieces(parts), pin=False)
    n_blocks = kvctx_plan.stage_parts(st, parts)
    table = cuda_rans.Table(np.zeros(16, np.uint8), mode=0, precision=format2.FIELD_PRECISION, lo=0,
                            smem_words=kvctx_plan.TABLE_SLOTS, aux=0, symbytes=1)
    pdesc = st.view("pdesc", np.int64, (-1, 4))
    ref = cuda_rans.LaunchPlan.build(pdesc.copy(), np.zeros(len(parts.start), np.int32), [table], "cpu")
    for name, dtype in (("pdesc", np.int64), ("order", np.int32), ("blocks", np.int32), ("tdesc", np.int64)):
        assert np.array_equal(st.view(name, dtype), getattr(ref, name).numpy().reshape(-1)), name
    smem = cuda_rans.WARPS * cuda_rans.RING_BYTES + 4 * kvctx_plan.TABLE_SLOTS  # decode_field_parts' launch
    assert (n_blocks, smem) == (ref.n_blocks, ref.smem_bytes)
    assert np.array_equal(st.view("ptable", np.uint32), tables.decode_tables(parts.freqs[None]))


@pytest.mark.parametrize("edit,make", [(level_over, kv_like), (mq_65535, offset_kv)])
def test_forged_field_values_are_refused_on_the_cpu(edit, make, small_parts):
    x = make((2, 4, 256, 64))
    blob = kvcodec.compress(x, layout="kv")
    assert cpu_result(blob, x)
    with pytest.raises(CorruptStreamError, match="out of range"):
        kvcodec.decompress(forged(blob, edit))


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_plan_kernels_compile_with_nvcc(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    proc = build.nvcc_compile(kvctx_plan.SOURCE, [], arch, tmp_path, extra=("-Xptxas", "-v"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " 0 bytes spill stores" in proc.stderr and "kp_plan" in proc.stderr


# ------------------------------------------------------------------------------------ GPU
def poisoned_allocator(nbytes: int) -> None:
    """Leave a freed block of ``nbytes`` filled with 0xAB in torch's caching allocator, so the next
    allocation of that size (a kernel's output) starts as garbage, not zeros."""
    torch.full((nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("seed", range(3))
def test_gpu_tables_equal_the_host_tables(seed):
    from kvcodec.lossless.cuda import kvctx_plan

    rng = np.random.default_rng(seed)
    counts = rng.geometric(0.05, (68, 256)) * (rng.random((68, 256)) < [[0.02], [0.5], [1.0], [0.1]] * 17)
    counts[rng.random(68) < 0.3] = 0  # unused classes
    counts[5, :] = 0
    counts[5, 17] = 9  # one symbol only
    freq = tables.fit_tables(counts)
    poisoned_allocator(68 * 4096 * 4)
    tabs = kvctx_plan.build_tables(torch.from_numpy(freq.astype(np.int16)).cuda())
    assert np.array_equal(tabs.cpu().numpy().view(np.uint32), tables.decode_tables(freq))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_field_checks_flag_what_the_host_refuses():
    from kvcodec.lossless.cuda import kvctx_plan

    rng = np.random.default_rng(1)
    for trial in range(40):
        n = int(rng.integers(1, 5000))
        lv_w, mq_w = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        layout = np.zeros((4, 3), np.int64)
        layout[0] = (0, lv_w, int(rng.integers(-64, 100)))
        layout[1] = (lv_w * n, mq_w, 0)
        raw = rng.integers(0, 256, (lv_w + mq_w) * n).astype(np.uint8)
        if trial % 2:  # mostly in range: levels small, few 0xFF pairs
            raw[:lv_w * n] = rng.integers(0, 40, lv_w * n)
            raw[lv_w * n:] = rng.integers(0, 255, mq_w * n)
            if trial % 4 == 1:
                raw[lv_w * n + int(rng.integers(0, n))] = 255
                raw[-1] = 255
        try:
            format2.check_field_values(raw, layout, n)
            host_bad = 0
        except CorruptStreamError:
            host_bad = 1
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        kvctx_plan.check_fields(torch.from_numpy(raw).cuda(), n, (0, lv_w), format2.level_limit(layout),
                                (lv_w * n, mq_w), flag)
        assert int(flag.item()) == host_bad, trial


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_field_parts_equal_the_host_decode(offset, monkeypatch):
    """The field parts decoded on the device (at an even and an odd address: then from an aligned copy)
    equal the host decode."""
    from kvcodec.lossless.cuda import kvctx_plan

    monkeypatch.setattr(format2, "FIELD_PART_BYTES", 3000)
    rng = np.random.default_rng(offset)
    fields = np.minimum(rng.geometric(0.05, 100_001), 255).astype(np.uint8)
    tabs = rng.integers(0, 30, 900).astype(np.uint8)
    body, meta = format2.code_model(fields, tabs)
    buf = np.frombuffer(bytes(offset) + body, np.uint8)
    parts, got_tabs = format2.read_field_parts(meta, buf, offset, buf.size, 1 << 30)
    assert meta["mfields"] == 34 and np.array_equal(got_tabs, tabs)
    status = torch.full((34,), 7, dtype=torch.int32, device="cuda")
    st = Staging(kvctx_plan.parts_pieces(parts), pin=True)
    n_blocks = kvctx_plan.stage_parts(st, parts)
    up = st.to("cuda")
    model = torch.from_numpy(buf.copy()).cuda()
    copy = torch.empty(buf.size, dtype=torch.uint8, device="cuda")
    poisoned_allocator(fields.size)
    out = torch.empty(fields.size, dtype=torch.uint8, device="cuda")
    kvctx_plan.decode_field_parts(up.data_ptr(), st.offsets, n_blocks, parts, model.data_ptr(), copy.data_ptr(),
                                  out.data_ptr(), status.data_ptr(), model.device)
    assert not status.any() and np.array_equal(out.cpu().numpy(), parts.decode(buf))
    assert np.array_equal(out.cpu().numpy(), fields)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU and CuPy")
def test_gpu_forged_fields_raise_where_the_cpu_raises(small_parts):
    """Forged field values (checksums valid) and damaged field-part payloads: decompress on the GPU
    refuses exactly the streams the CPU decoder refuses, and decodes the others identically."""
    for edit, make in ((level_over, kv_like), (mq_65535, offset_kv)):
        x = make((2, 4, 256, 64))
        bad = forged(kvcodec.compress(x, layout="kv"), edit)
        assert not cpu_result(bad, x)
        with pytest.raises(CorruptStreamError):
            kvcodec.decompress(torch.frombuffer(bytearray(bad), dtype=torch.uint8).cuda())
    x = kv_like((2, 4, 256, 64), seed=5)
    blob = kvcodec.compress(x, layout="kv")
    kind, meta, secs, head, fields, tabs = model_parts(blob)
    model = secs["model"]
    parts, _ = format2.read_field_parts(meta["codec_meta"], model, 4 + head.size, int(model[:4].view("<u4")[0]) + 4,
                                        1 << 40)
    rng = np.random.default_rng(4)
    for trial in range(24):
        m = model.copy()
        p = int(rng.integers(0, len(parts.start)))
        m[int(parts.start[p] + rng.integers(0, parts.length[p]))] ^= np.uint8(1 << int(rng.integers(0, 8)))
        bad = container.dumps(kind, meta, {**secs, "model": m})
        try:
            gpu_ok = same_bits(kvcodec.decompress(torch.frombuffer(bytearray(bad), dtype=torch.uint8).cuda()), x)
        except CorruptStreamError:
            gpu_ok = False
        assert gpu_ok == cpu_result(bad, x), trial
    torch.cuda.synchronize()
