"""Format 2 of kvctx / predictive (bins + per-class tables + 32-lane rANS) against independent references."""

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcodec import CorruptStreamError, entropy
from kvcodec.entropy import rans, rans_lanes
from kvcodec.lossless import predictive
from kvcodec.lossless.api import compress, decompress
from kvcodec.lossless.predictive import binned, bins, format2, tables
from kvcodec.lossless.predictive.cdf import location
from kvcodec.lossless.predictive.codec import kv_layout

DTYPES = [d for d in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
                      torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) if d in bins._LAYOUTS]


def patterns(t: torch.Tensor) -> np.ndarray:
    view = torch.uint8 if t.element_size() == 1 else torch.int16
    return t.contiguous().view(view).numpy().view(np.uint8 if t.element_size() == 1 else np.uint16)


def _magnitude_values(dtype):
    """|value| of every positive magnitude pattern, from torch (not from the bins' V formula)."""
    bg = bins.bin_grid(dtype)
    mags = np.arange(1 << (bg.width - (1 if bg.sign else 0)))
    signed = np.int8 if bg.width == 8 else np.int16
    mags = mags.astype(np.uint16 if bg.width == 16 else np.uint8).view(signed)
    return torch.from_numpy(mags).view(dtype).double().numpy()


MAG_VALUES = {d: _magnitude_values(d) for d in DTYPES}


def reference_bin(dtype, pat: int, ep: int, centre: int):
    """What the bins of width 2**ep steps must give a pattern, from its real value: None for an
    escape, else (symbol, bin index u, patterns in the bin, rank of the pattern in the bin)."""
    bg = bins.bin_grid(dtype)
    signed = np.int8 if bg.width == 8 else np.int16
    val = torch.from_numpy(np.array([pat]).astype(np.uint8 if bg.width == 8 else np.uint16).view(signed)).view(dtype)
    v = float(val.double())
    if not math.isfinite(v) or bg.escape[pat]:
        return None
    q = 2.0 ** (ep + bg.eoff)
    mag = pat & ~bg.sign & ((1 << bg.width) - 1)
    mags = MAG_VALUES[dtype]
    if abs(v) >= q * 2 ** bg.mb:  # grid steps >= a bin: one bin per pattern, counted on from 2**mb
        u = (1 << bg.mb) + int(mag - np.searchsorted(mags, q * 2 ** bg.mb, "left"))
        lo, hi = mag, mag + 1
    else:
        u = math.floor(abs(v) / q)
        lo, hi = np.searchsorted(mags, u * q, "left"), np.searchsorted(mags, (u + 1) * q, "left")
    j = -1 - u if pat & bg.sign else u
    if abs(j - centre) > bins.CENTRE:
        return None
    return j - centre + bins.CENTRE, u, int(hi - lo), int(mag - lo)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), pat=st.integers(0, 65535), ep=st.integers(0, 300), shift=st.integers(-130, 130))
def test_bins_match_a_reference_from_real_values(dtype, pat, ep, shift):
    bg = bins.bin_grid(dtype)
    pat &= (1 << bg.width) - 1
    mag = pat & ~bg.sign & ((1 << bg.width) - 1)
    u_true = int(bins.bin_of(mag, ep, bg.mb))
    centre = min(max((-1 - u_true if pat & bg.sign else u_true) + shift, -(1 << 20)), 1 << 20)
    sym, code, nb = bins.encode_value(pat, ep, centre, bg.width, bg.sign, bg.mb, bg.escape[pat])
    ref = reference_bin(dtype, pat, ep, centre)
    if sym == bins.ESC:
        assert code == pat and nb == bg.width
        if ref is not None:  # a codable value escapes only deep in bin 0
            assert ref[1] == 0
        return
    assert ref is not None and sym == ref[0]
    _, u, count, rank = ref
    if u > 0 or ep <= bg.mb + 1:  # a bin inside one binade: every pattern equally likely (or one)
        assert count == 1 << nb and code == rank
    else:  # bin 0 below several binades: the binade's depth in unary (each level down is half as
        # likely under a flat density), then the mantissa; the lowest level holds the subnormals too
        steps = abs(float(MAG_VALUES[dtype][mag])) / 2.0 ** bg.eoff
        last = ep - bg.mb - 1
        depth = last if steps < 2 ** (bg.mb + 1) else ep - 1 - math.floor(math.log2(steps))
        assert depth < bins.DEPTH_MAX and 0 <= rank < count
        assert nb == (depth + bg.mb + 1 if depth == last else depth + 1 + bg.mb)
        assert (code & ((1 << (depth + 1)) - 1)) == (0 if depth == last else 1 << depth) or depth == last
    # the decoder's two paths give the pattern back from the symbol and the raw bits
    j = centre + sym - bins.CENTRE
    if j in (0, -1):  # bin 0: unary depth and mantissa, decoded with the raw bits in order
        back, used, kind = binned.decode_escape_or_bin0(sym, j, ep, code, bg.width, bg.sign, bg.mb, bg.maxmag)
        assert kind == 0 and used == nb and back == pat
    else:  # the raw bit count and the pattern less its raw bits come from the symbol alone
        used, hi = binned.raw_layout(sym, centre - bins.CENTRE, ep, bg.mb)
        assert used == nb and hi + (code & ((1 << nb) - 1)) == mag and (j < 0) == bool(pat & bg.sign)


def reference_stream(t: torch.Tensor, meta, sections, prediction=None):
    """Chunk 0 of a format 2 stream rebuilt value by value in Python: the model from the stored
    parameters, each value's bins and class, the symbols through the pure-Python rANS reference
    (``rans.encode_ctx``) and the raw bits packed by hand."""
    dtype = t.dtype
    bg = bins.bin_grid(dtype)
    g_n, t_n, d_n = kv_layout(tuple(t.shape))
    p2 = predictive.codec.parse_stream(meta, sections).v2
    m, c, a, es, level = p2.margs
    cg0, cng, ct0, cnt = (int(x[0]) for x in p2.chunks)
    pats = patterns(t).reshape(g_n, t_n, d_n)
    pred = None if prediction is None else prediction.float().numpy().reshape(g_n, t_n, d_n)
    syms, ctxs, raw = [], [], []
    for g in range(cg0, cg0 + cng):
        gp = 0 if p2.shared else g
        dev = np.zeros(d_n)
        for tok in range(ct0, ct0 + cnt):
            for d in range(d_n):
                p = 0.0 if pred is None or not np.isfinite(pred[g, tok, d]) else float(pred[g, tok, d])
                base, mu = location(m[gp, d], c[gp, d], p, a[gp, d], dev[d])
                mv = mu * 2.0 ** -bg.eoff
                ep, centre, k = bins.locate(mv if abs(mv) < bins.MU_MAX else 0.0, es[gp, d], level[gp, d], bg.mb,
                                            p2.mag)
                pat = int(pats[g, tok, d])
                s, code, nb = bins.encode_value(pat, ep, centre, bg.width, bg.sign, bg.mb, bg.escape[pat])
                s = bins.magnitude_symbol(s, centre, p2.mag)  # the stream's "mag" flag
                syms.append(s)
                ctxs.append(k)
                raw.append((int(code), int(nb)))
                val = float(t.reshape(g_n, t_n, d_n)[g, tok, d].double())
                dev[d] = val - base if s != bins.ESC else 0.0  # an escaped value leaves no residual
    k = int.from_bytes(sections["model"][:4].tobytes(), "little")
    head = sections["model"][4:4 + k].tobytes()
    n_head = 5 * len(predictive.params.stored_fields(meta["source"]))
    _, rest = format2.StoredFields.read(head[:n_head], format2.decode_model(meta, head[n_head:], 1 << 30),
                                        meta["source"], m.shape[0], d_n)
    freq = tables.tables_from_bytes(rest)
    counts = np.zeros((bins.N_CLASSES, 256), np.int64)
    np.add.at(counts, (np.array(ctxs), np.array(syms)), 1)
    assert np.array_equal(freq, tables.fit_tables(counts))  # the tables are fitted on exactly these symbols
    full = freq.copy()
    full[~full.any(axis=1), bins.ESC] = rans_lanes.M  # unused classes (the reference wants full tables)
    words = rans.encode_ctx(np.array(syms, np.uint8), np.array(ctxs), list(full), rans_lanes.PRECISION, meta["lanes"])
    acc, n_bits = 0, 0
    for code, nb in raw:
        acc |= code << n_bits
        n_bits += nb
    bit_words = np.array([(acc >> (32 * i)) & 0xFFFFFFFF for i in range((n_bits + 31) // 32)], np.uint32)
    return np.frombuffer(words, np.uint16), bit_words


@pytest.mark.parametrize("dtype,source", [(torch.bfloat16, "none"), (torch.bfloat16, "external"),
                                          (torch.bfloat16, "previous_token"), (torch.float16, "external"),
                                          (torch.float8_e4m3fn, "none"), (torch.float8_e4m3fn, "external")])
def test_chunk_streams_are_the_reference_coder_driven_by_the_model(dtype, source):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 2, 24, 8, generator=g) * torch.rand(8, generator=g) * 4 + torch.randn(8, generator=g)
    x = (x + 0.7 * torch.roll(x, 1, dims=-2)).to(dtype)
    x.view(torch.uint8 if x.element_size() == 1 else torch.int16).reshape(-1)[::37] ^= 0x7F  # NaN/Inf/outliers
    pred = x.float() + 0.1 * torch.randn(x.shape, generator=g) if source == "external" else None
    meta, sections = predictive.encode_tensor(x, pred, source, 1, version=2)
    words, bit_words = reference_stream(x, meta, sections, pred)  # the tensor is one chunk
    assert np.array_equal(sections["payload"], words)
    assert np.array_equal(sections["bits"], bit_words)
    assert torch.equal(predictive.decode_tensor(meta, sections, pred, 1).view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("source", ["external", "previous_token", "neighbour_layer"])
def test_thread_count_never_changes_the_bytes(source):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 2, 1500, 64, generator=g) * torch.rand(64, generator=g)).to(torch.bfloat16)
    pred = x.float() + 0.01 * torch.randn(x.shape, generator=g) if source == "external" else None
    opts = {} if pred is not None else {"predictor": source}
    b1 = compress(x, prediction=pred, codec="predictive", threads=1, **opts)
    b2 = compress(x, prediction=pred, codec="predictive", threads=2, **opts)
    assert b1 == b2
    assert torch.equal(decompress(b1, prediction=pred, threads=2).view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("source", ["none", "external", "previous_token", "neighbour_layer"])
def test_format_1_streams_still_decode(source):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 2, 70, 16, generator=g) * 3).to(torch.bfloat16)
    pred = x.float() + 0.05 * torch.randn(x.shape, generator=g) if source == "external" else None
    meta, sections = predictive.encode_tensor(x, pred, source, 1, version=1)
    assert meta["v"] == 1 and sections["payload"].dtype == np.uint32
    out = predictive.decode_tensor(meta, sections, pred, 1)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    with pytest.raises(ValueError):
        predictive.encode_tensor(x, pred, source, 1, version=3)


def test_mutated_streams_raise_or_decode_never_crash():
    """Random byte changes in every section (no container checksum at this level): each decode
    raises CorruptStreamError or returns a tensor of the right shape, never crashes or hangs."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 3, 90, 16, generator=g) * torch.logspace(-3, 1, 16)).to(torch.bfloat16)
    meta, sections = predictive.encode_tensor(x, None, "previous_token", 1)
    rng = np.random.default_rng(0)
    outcomes = {"raised": 0, "decoded": 0}
    for _ in range(150):
        name = rng.choice(sorted(sections))
        arr = sections[name].copy()
        raw = arr.view(np.uint8)
        for _ in range(rng.integers(1, 4)):
            raw[rng.integers(raw.size)] ^= np.uint8(1 << rng.integers(8))
        try:
            out = predictive.decode_tensor(meta, dict(sections, **{name: arr}), None, 1)
            assert out.shape == x.shape
            outcomes["decoded"] += 1
        except CorruptStreamError:
            outcomes["raised"] += 1
    assert outcomes["raised"] > 50


def test_container_checksums_catch_raw_bit_flips():
    x = (torch.randn(2, 2, 300, 32) * 2).to(torch.bfloat16)
    blob = bytearray(compress(x, layout="kv"))
    for pos in (len(blob) // 2, len(blob) - 9):
        bad = bytearray(blob)
        bad[pos] ^= 0x04
        with pytest.raises(CorruptStreamError):
            decompress(bytes(bad))


def test_chunks_group_short_heads_and_respect_layers():
    cg0, cng, ct0, cnt = format2.chunk_layout(g=12, tt=40, d=64, tb=40, unit=4)  # 2560 values a head
    assert list(cg0) == [0, 4, 8] and list(cng) == [4, 4, 4] and set(cnt) == {40}
    cg0, cng, ct0, cnt = format2.chunk_layout(g=3, tt=2500, d=32, tb=2048, unit=3)
    assert list(zip(cg0, ct0, cnt)) == [(0, 0, 2048), (0, 2048, 452), (1, 0, 2048), (1, 2048, 452),
                                        (2, 0, 2048), (2, 2048, 452)]
    assert int((cng * cnt).sum()) * 32 == 3 * 2500 * 32
    for shape in ((12, 40, 64, 40, 4), (3, 2500, 32, 2048, 3), (7, 5, 3, 5, 7), (8, 1, 1, 1, 1), (6, 300, 512, 128, 2)):
        assert format2.chunk_count(*shape) == format2.chunk_layout(*shape)[0].size


def test_a_forged_shape_is_refused_before_anything_is_sized_by_it():
    x = torch.randn(4, 1, 1, 1).to(torch.bfloat16)  # one chunk per layer with the neighbour-layer predictor
    meta, sections = predictive.encode_tensor(x, None, "neighbour_layer", 1)
    with pytest.raises(CorruptStreamError):  # 2**31 chunks claimed: 16 GiB of chunk sizes missing
        predictive.decode_tensor(dict(meta, shape=[1 << 31, 1, 1, 1]), sections, None, 1)


def test_scale_levels_are_exact_quarter_octaves():
    s = np.array([1.0, 1.1892071150027210, 1.18920711500272, 1.5, 2.0, 3.0, 0.75, 1e-30, 2.0 ** 200])
    want = np.floor(4 * np.log2(s) + 1e-12).astype(np.int64)
    got = bins.scale_levels(s)
    assert np.array_equal(got[[0, 3, 4, 5, 6, 7, 8]], want[[0, 3, 4, 5, 6, 7, 8]]) and got[1] == 1


def test_default_format_per_dtype_and_the_version_option():
    """Format 2 by default (fp8 against a prediction tensor too: its symbols counted by magnitude)."""
    x = (torch.randn(2, 3, 80, 16) * 3).to(torch.bfloat16)
    q = x.float().to(torch.float8_e4m3fn)
    qp = q.float() + 0.1
    for t, pred, default in ((x, None, 2), (x.float(), None, 2), (q, None, 2), (x, x.float(), 2), (q, qp, 2)):
        for version in (None, 1, 2):
            blob = compress(t, prediction=pred, layout="kv" if pred is None else None, version=version)
            meta = __import__("kvcodec").container.loads(blob)[1]["codec_meta"]
            assert meta["v"] == (default if version is None else version)
            assert torch.equal(decompress(blob, prediction=pred).view(torch.uint8), t.view(torch.uint8))
    assert predictive.codec.default_version(torch.float8_e5m2, "previous_token") == 2
    with pytest.raises(ValueError):
        compress(x, layout="kv", version=3)


@pytest.mark.parametrize("dtype", [d for d in bins._LAYOUTS if d.itemsize == 1])
@pytest.mark.parametrize("source", ["none", "external", "neighbour_layer"])
def test_format_2_round_trips_every_8_bit_float(dtype, source):
    """Format 2 is exact on every fp8 pattern (e8m0 has no sign bit and no mantissa; the fnuz formats
    have no -0.0)."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(3, 2, 70, 8, generator=g) * 4).to(dtype)
    flat = x.view(torch.uint8).reshape(-1)  # every 7th value: any pattern (NaN, Inf, subnormals)
    flat[::7] = torch.randint(0, 256, (flat[::7].numel(),), generator=g, dtype=torch.uint8)
    pred = x.float() + 0.3 * torch.randn(x.shape, generator=g) if source == "external" else None
    meta, sections = predictive.encode_tensor(x, pred, source, 1, version=2)
    assert meta["v"] == 2
    assert torch.equal(predictive.decode_tensor(meta, sections, pred, 1).view(torch.uint8), x.view(torch.uint8))


def decode_model_bytes(meta, body, n):
    """(fields, tables) bytes of code_model's output, whatever its layout (n: fields + tables)."""
    buf = np.frombuffer(body, np.uint8)
    if "mfields" in meta:
        parts, tabs = format2.read_field_parts(meta, buf, 0, buf.size, n)
        return parts.decode(buf), tabs
    return format2.decode_model(meta, body, n), None


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=3000), cut=st.integers(0, 3000), part=st.integers(1, 700),
       skew=st.integers(0, 255))
def test_model_parts_round_trip(data, cut, part, skew):
    """code_model: one rans_lanes stream (``mlanes``) up to MODEL_PART_BYTES, else ``mfields`` field
    parts of FIELD_PART_BYTES plus a tables part, one shared table; every byte comes back exactly."""
    raw = np.frombuffer(data, np.uint8) & np.uint8(skew | 1)
    fields, tabs = raw[:max(1, min(cut, raw.size))], raw[max(1, min(cut, raw.size)):]
    old = format2.MODEL_PART_BYTES, format2.FIELD_PART_BYTES
    format2.MODEL_PART_BYTES = format2.FIELD_PART_BYTES = part
    try:
        body, meta = format2.code_model(fields, tabs)
    finally:
        format2.MODEL_PART_BYTES, format2.FIELD_PART_BYTES = old
    assert meta == ({"mlanes": format2.MODEL_LANES} if raw.size <= part
                    else {"mfields": min(format2.MAX_FIELD_PARTS, -(-fields.size // part))})
    got_fields, got_tabs = decode_model_bytes(meta, body, raw.size)
    if "mfields" in meta:
        assert np.array_equal(got_fields, fields) and np.array_equal(got_tabs, tabs)
    else:
        assert np.array_equal(got_fields, raw)


def _entropy_stream_model(meta: dict, sections: dict) -> tuple[dict, dict]:
    """The stream with its model as format 2 first wrote it: one ``entropy.encode`` stream, no meta field."""
    model = sections["model"]
    k = int.from_bytes(model[:4].tobytes(), "little")
    n_head = 5 * len(predictive.params.stored_fields(meta["source"]))
    raw = format2.decode_model(meta, model[4 + n_head:4 + k].tobytes(), 1 << 30)
    head = model[4:4 + n_head].tobytes() + entropy.encode(raw, coder="rans")
    new = np.concatenate([np.frombuffer(len(head).to_bytes(4, "little") + head, np.uint8), model[4 + k:]])
    return {key: v for key, v in meta.items() if key != "mlanes"}, {**sections, "model": new}


def test_model_parts_stream_and_old_single_stream_decode(monkeypatch):
    """The same tensor with the model in parts (meta "mfields"), as one rans_lanes stream ("mlanes")
    and as one entropy stream (format 2 as first written, no meta field): all decode bit-exactly;
    damaged part headers and part counts raise."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 64, 64, generator=g) * torch.logspace(-3, 2, 64) + torch.randn(64, generator=g)).to(torch.bfloat16)
    one_meta, one_secs = predictive.encode_tensor(x, None, "none", 1, version=2)
    old_meta, old_secs = _entropy_stream_model(one_meta, one_secs)
    monkeypatch.setattr(format2, "MODEL_PART_BYTES", 100)
    monkeypatch.setattr(format2, "FIELD_PART_BYTES", 100)
    meta, secs = predictive.encode_tensor(x, None, "none", 1, version=2)
    assert "mfields" not in one_meta and one_meta["mlanes"] == format2.MODEL_LANES and meta["mfields"] >= 2
    assert {k: v for k, v in meta.items() if k != "mfields"} == old_meta
    for m, s in ((one_meta, one_secs), (old_meta, old_secs), (meta, secs)):
        assert torch.equal(predictive.decode_tensor(m, s, None, 1).view(torch.int16), x.view(torch.int16))
    for bad in (0, 16, "8", 8.0, None):
        with pytest.raises(CorruptStreamError):
            predictive.decode_tensor({**one_meta, "mlanes": bad}, one_secs, None, 1)
    for bad in (0, format2.MAX_FIELD_PARTS + 1, "2", meta["mfields"] + 1, meta["mfields"] - 1):
        with pytest.raises(CorruptStreamError):
            predictive.decode_tensor({**meta, "mfields": bad}, secs, None, 1)
    with pytest.raises(CorruptStreamError):
        predictive.decode_tensor(one_meta | {"mfields": 2}, one_secs, None, 1)
    n_head = 5 * len(predictive.params.stored_fields("none"))
    for pos, value in ((4 + n_head, 0xFF), (4 + n_head + 3, 0x7F), (4 + n_head + 9, 0x40), (4 + n_head + 520, 0x33)):
        model = secs["model"].copy()
        model[pos] ^= value
        with pytest.raises(CorruptStreamError):
            predictive.decode_tensor(meta, {**secs, "model": model}, None, 1)


def test_model_parts_damaged_payload_raises_or_decodes(monkeypatch):
    """Byte flips inside the parts' rANS payloads: CorruptStreamError or some bytes of the right size
    (the container's checksums catch the rest), never a crash."""
    rng = np.random.default_rng(3)
    raw = np.minimum(rng.geometric(0.1, 5000), 255).astype(np.uint8)
    monkeypatch.setattr(format2, "MODEL_PART_BYTES", 600)
    monkeypatch.setattr(format2, "FIELD_PART_BYTES", 600)
    body, meta = format2.code_model(raw[:4500], raw[4500:])
    for _ in range(200):
        b = bytearray(body)
        b[int(rng.integers(8 + 512 + 4 * (meta["mfields"] + 1), len(b)))] ^= int(rng.integers(1, 256))
        try:
            fields, tabs = decode_model_bytes(meta, bytes(b), raw.size)
        except CorruptStreamError:
            continue
        assert fields.size == 4500 and tabs.size == 500
    with pytest.raises(CorruptStreamError):
        decode_model_bytes(meta, body[:-1], raw.size)
    with pytest.raises(CorruptStreamError):
        decode_model_bytes(meta, body, raw.size - 1)  # more symbols than the shape allows


def test_lanes_model_damaged_raises_or_decodes():
    """A small model's one rans_lanes stream (``mlanes``): every byte comes back; byte flips, cuts and a
    wrong symbol count give CorruptStreamError or bytes of the right size, never a crash."""
    rng = np.random.default_rng(4)
    raw = np.minimum(rng.geometric(0.05, 3000), 255).astype(np.uint8)
    body, meta = format2.code_model(raw[:2500], raw[2500:])
    assert meta == {"mlanes": format2.MODEL_LANES} and np.array_equal(format2.decode_model(meta, body, 3000), raw)
    for _ in range(200):
        b = bytearray(body)
        b[int(rng.integers(0, len(b)))] ^= int(rng.integers(1, 256))
        try:
            got = format2.decode_model(meta, bytes(b), 1 << 20)
        except CorruptStreamError:
            continue
        assert got.size <= 1 << 20
    for bad in (body[:-1], body[:-2], body[:5], b""):
        with pytest.raises(CorruptStreamError):
            format2.decode_model(meta, bad, 3000)
    with pytest.raises(CorruptStreamError):
        format2.decode_model(meta, body, 2999)  # more symbols than the shape allows


def test_a_bf16_prediction_is_read_as_is_with_the_float32_checksum():
    """The decoder reads a bf16 prediction's bit patterns directly (no float32 copy) and checksums
    its float32 form a block at a time: the same checksum, values and errors as the float32 path,
    special values included, across block boundaries."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 2, 300, 64, generator=g) * torch.logspace(-2, 1, 64)).to(torch.bfloat16)
    pred = (x.float() + 0.05 * torch.randn(x.shape, generator=g)).to(torch.bfloat16)
    bits = pred.view(torch.int16).reshape(-1)
    bits[::97] = 0x7FC0  # NaN
    bits[5::89] = -0x80  # -Inf (0xFF80)
    bits[7::83] = 0x0001  # subnormal
    bits[9::79] = -0x8000  # -0.0
    shape = kv_layout(tuple(x.shape))
    read, crc = predictive.codec._decode_prediction(pred, *shape, True)
    f32, crc32 = predictive.codec._decode_prediction(pred, *shape, False)
    assert read.dtype == np.uint16 and f32.dtype == np.float32 and crc == crc32
    assert np.array_equal(read.astype(np.uint32) << 16, f32.view(np.uint32))
    meta, sections = predictive.encode_tensor(x, pred, "external", 1, version=2)
    assert torch.equal(predictive.decode_tensor(meta, sections, pred, 1).view(torch.int16), x.view(torch.int16))
    assert torch.equal(predictive.decode_tensor(meta, sections, pred.float(), 1).view(torch.int16),
                       x.view(torch.int16))  # the same prediction in float32 decodes the same
    part = predictive.decode_tensor(meta, sections, pred, 1, tokens=(100, 250))
    assert torch.equal(part.view(torch.int16), x[:, :, 100:250].view(torch.int16))
    wrong = pred.clone()
    wrong.view(torch.int16).reshape(-1)[12345] ^= 1
    with pytest.raises(CorruptStreamError):
        predictive.decode_tensor(meta, sections, wrong, 1)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3 * 4096 + 5), seed=st.integers(0, 2**31), isal=st.booleans())
def test_bf16_float32_checksum_equals_zlib_of_the_widened_bits(n, seed, isal):
    """``bf16_as_f32_crc32`` (ISA-L's crc32 over L1 blocks, or the numpy-block fallback without it) is
    zlib's crc32 of the float32 bit patterns, across block boundaries."""
    bits = np.random.default_rng(seed).integers(0, 2**16, n, dtype=np.uint16)
    want = zlib.crc32((bits.astype(np.uint32) << 16).view(np.uint8))
    with pytest.MonkeyPatch.context() as mp:
        if not isal:
            mp.setattr(predictive.codec.checksum, "isal_crc32_fn", lambda: None)
        assert predictive.codec.bf16_as_f32_crc32(bits) == want
