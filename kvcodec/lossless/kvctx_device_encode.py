"""The kvctx and predictive codecs' format 2 streams encoded on a CUDA device.

Why: a KV cache lives on the GPU; the CPU encoder needs the tensor on the host and codes ~0.06 GB/s on
the GPU box, so offloading or moving KV through it costs seconds per GB.

The stream is the CPU encoder's (``predictive.format2.encode``), so either side decodes it:

1. fit the per-channel model (``params.fit_params``' sums per column of tb tokens,
   ``kvctx_encode.fit_*``, reduced by torch; its formulas and the bin parameters on the device,
   ``kvctx_device_fit``; shared or per-(g, d) parameters chosen by the CPU encoder's estimate);
2. ``kvctx_encode.symbolise`` computes every value's class, symbol and raw
   code with the GPU decoder's own model arithmetic and counts the per-class histogram (symbols counted by
   magnitude, meta ``"mag": 1``, where the CPU encoder counts them so: ``pcodec.magnitude_symbols``);
3. ``kvctx_encode.raw_bits``: one warp per chunk writes its raw bits (no table needed: it runs on a side
   stream, with the checksums, right after symbolise: beside the first wait, the host's table work and
   the rANS kernel);
4. the tables on the host (``tables.fit_tables``: the CPU's tables for the same counts), the ``model``
   section as ``format2.code_model`` writes it: its field bytes' parts (``mfields``) coded on the device
   with the payload (:class:`_FieldParts`), a small model on the host;
5. ``kvctx_encode.encode_chunks``: one warp per chunk writes its 32-lane rANS stream; the streams are
   packed into the ``payload`` section (``planes_codec.gather``).

Only the stored fields' statistics and byte histograms, the symbol histogram, per-chunk sizes and
small headers cross to the host.
Calls the GPU cannot take (:func:`unsupported`: format 1, requested by ``version=1``; 8-lane streams of
small tensors; other dtypes) are coded on the CPU by the caller: the format is never changed silently.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch
from numba import njit

from kvcodec import container
from kvcodec.device.transfer import download, upload
from kvcodec.entropy import rans_lanes
from kvcodec.lossless import kvctx_device_fit as kfit
from kvcodec.lossless.device_container import side_stream
from kvcodec.lossless.kvctx_device import _prediction_f32, grid_constants
from kvcodec.lossless.predictive import codec as pcodec
from kvcodec.lossless.predictive import format2
from kvcodec.lossless.predictive.bins import DEPTH_MAX, N_CLASSES, bin_grid
from kvcodec.lossless.predictive.format2 import CHUNK_VALUES, WIDE_LANES_FROM, chunk_layout, code_model
from kvcodec.lossless.predictive.grid import grid_for, value_table
from kvcodec.lossless.predictive.params import stored_fields
from kvcodec.lossless.predictive.tables import fit_tables, table_bytes
from kvcodec.lossless.tensor_meta import KIND, blob_meta

SOURCES = ("none", "external", "previous_token", "neighbour_layer")
MODEL_CLASS = N_CLASSES  # the payload kernel's table of the model's field parts (:class:`_FieldParts`)
assert format2.FIELD_PRECISION == rans_lanes.PRECISION  # the parts' table is one more row of the classes'
N_KEYS = N_CLASSES * 256
_CODED = {torch.bfloat16, torch.float16, torch.float32}
_CODED_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}  # format 2 only (tested ones)


def unsupported(t: torch.Tensor, source: str, version) -> str | None:
    """Why the GPU encoder does not take this call (None: it does)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.layout != torch.strided:
        return "the tensor is not a dense CUDA tensor"
    if source not in SOURCES:
        return f"the {source!r} predictor is encoded on the CPU"
    if source == "neighbour_layer" and t.dim() < 3:
        return "the neighbour-layer predictor needs a [layers, ..., tokens, channels] tensor"
    if t.dtype not in _CODED and t.dtype not in _CODED_FP8:
        return f"{t.dtype} is coded on the CPU"
    if (pcodec.default_version(t.dtype, source) if version is None else version) != 2:
        return "only format 2 is encoded on the GPU"
    g, tt, d = pcodec.kv_layout(tuple(t.shape))
    if t.numel() == 0:
        return "empty tensor"
    tb = pcodec.token_block(tt, d)
    unit = _unit(tuple(t.shape), source)
    gb = max(1, min(unit, CHUNK_VALUES // max(tb * d, 1)))  # format2.chunk_layout's first (largest) chunk
    if gb * tb * d < WIDE_LANES_FROM:
        return "chunks under 16384 values are 8-lane streams, coded on the CPU"
    return None


def _unit(shape: tuple, source: str) -> int:
    """Leading indices per layer for the neighbour-layer predictor (chunks never cross a layer), else G."""
    g = pcodec.kv_layout(shape)[0]
    return g // shape[0] if source == "neighbour_layer" else g


@lru_cache(maxsize=16)
def _pattern_tables(bdtype: torch.dtype, device: torch.device):
    """float64 per bit pattern: the value (NaN where not finite) and log2 of its rank's bin width (NaN
    where none), as params.fit_params reads them through the rank."""
    grid = grid_for(bdtype)
    with np.errstate(all="ignore"):
        width = np.diff(grid.edges)
        log_width = np.where(np.isfinite(width) & (width > 0), np.log2(width), np.nan)
    k = grid.k_of_bits
    val = np.where(grid.finite[k], grid.valf[k], np.nan)
    return torch.from_numpy(val).to(device), torch.from_numpy(log_width[k]).to(device)


class _Sums:
    """The per-column fit kernels, summed over token blocks (and leading indices when shared) by torch."""

    def __init__(self, pats, pred, val, shape, tb, runner):
        from kvcodec.lossless.cuda import kvctx_encode as ke

        self.ke, self.pats, self.pred, self.val, self.shape, self.tb, self.runner = ke, pats, pred, val, shape, tb, runner

    def _blocks_summed(self, sums: torch.Tensor) -> torch.Tensor:
        return sums[:, 0] if sums.shape[1] == 1 else sums.sum(dim=1)

    def moments(self, lw) -> torch.Tensor:
        """[G, D, 7]: params._fit_moments' fields."""
        return self._blocks_summed(self.ke.fit_moments(self.pats, self.pred, self.val, lw, self.shape, self.tb,
                                                       self.runner))

    def residuals(self, locations: list) -> list[torch.Tensor]:
        """[Gp, D, 3] residual sums under each location (m, c, a: float64 [Gp, D] device tensors, shared)."""
        flat = [(m.reshape(-1).contiguous(), c.reshape(-1).contiguous(), a.reshape(-1).contiguous(), sh)
                for m, c, a, sh in locations]
        res = self._blocks_summed(self.ke.fit_residuals(self.pats, self.pred, self.val, flat, self.shape, self.tb,
                                                        self.runner))
        return [res[:, :, j].sum(dim=0, keepdim=True) if sh else res[:, :, j] for j, (*_, sh) in enumerate(locations)]


def _layer_prediction(pats: torch.Tensor, bdtype: torch.dtype, shape: tuple, unit: int) -> torch.Tensor:
    """float32 [G, T, D]: the previous layer's values (``grid.value_table`` by pattern; non-finite as 0),
    0 for the first layer, as the CPU encoder predicts a neighbour-layer stream."""
    grid = grid_for(bdtype)
    values = torch.from_numpy(value_table(grid)[grid.k_of_bits]).to(pats.device)
    idx = pats.to(torch.int32) & (values.numel() - 1)  # the unsigned pattern
    pred = torch.zeros(shape, dtype=torch.float32, device=pats.device)
    pred[unit:] = values[idx.reshape(shape)[:-unit]] if unit < shape[0] else 0.0
    return pred


def _symbol_bits(t: torch.Tensor, sections: dict) -> torch.Tensor:
    """The coded bit patterns (a float32's upper, bf16 half; its lower half to ``sections['lo16']``)."""
    flat = t.reshape(-1)
    if t.dtype == torch.float32:
        w = flat.view(torch.int32)
        sections["lo16"] = w.to(torch.int16)  # the low half (a C cast keeps the low 16 bits)
        return (w >> 16).to(torch.int16)
    return flat.view(torch.uint8 if t.element_size() == 1 else torch.int16)


class _Clock:
    """Host wall time per step of one encode call into ``steps`` (ms, summed by name; None: off). The
    benchmark's per-step breakdown: where the host part of a call goes, waits for the device included."""

    def __init__(self, steps: dict | None):
        self.steps, self.t = steps, time.perf_counter()

    def mark(self, name: str) -> None:
        if self.steps is not None:
            now = time.perf_counter()
            self.steps[name] = self.steps.get(name, 0.0) + (now - self.t) * 1e3
            self.t = now


_NP_OF = {torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}


def _read_back(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The tensors on the host (numpy, same dtypes and shapes) through one pinned buffer and one copy:
    the call's wait for the model (the fields, the histogram) before its tables can be built."""
    hv, out, pos = download(torch.cat([x.reshape(-1).view(torch.uint8) for x in tensors])), [], 0
    for x in tensors:
        n = x.numel() * x.element_size()
        out.append(hv[pos:pos + n].view(_NP_OF[x.dtype]).reshape(x.shape))
        pos += n
    return out


def _chunk_descriptors(layout: tuple, tt: int, d: int) -> tuple[np.ndarray, int]:
    """(int64 [n, 4]: per chunk of ``format2.chunk_layout``'s arrays its first value, g count, values per g
    and stride between g's, as ``kvctx_encode.raw_bits`` / ``encode_chunks`` take them; the most values a
    chunk holds)."""
    cg0, cng, ct0, cnt = (np.asarray(a, np.int64) for a in layout)
    desc = np.stack([(cg0 * tt + ct0) * d, cng, cnt * d, np.full_like(cng, tt * d)], 1)
    return desc, int((cng * cnt).max()) * d


def _launch_tables(freq: np.ndarray, parts: np.ndarray, dev):
    """(the model parts' chunk descriptors ``parts`` [n, 4], rANS table words, reciprocals: ``kvctx_encode.
    encode_chunks``' ``parts``, ``ftab``, ``rcp``, on ``dev``) of the tables ``freq`` [rows, 256]: one
    compiled pass into one buffer, one upload. Why: ~15 numpy steps and three arrays took ~0.4 ms of the
    host between the first wait and the payload launch."""
    n, rows = parts.shape[0], freq.shape[0]
    buf = np.empty(4 * n + rows * 256, np.int64)
    buf[:4 * n] = parts.reshape(-1)
    words = buf[4 * n:].view(np.uint32)
    _fill_tables(np.ascontiguousarray(freq, np.int64), words[:rows * 256], words[rows * 256:])
    (buf_d,) = upload([buf], dev)
    tabs = buf_d[4 * n:].view(torch.int32)
    return buf_d[:4 * n].view(n, 4), tabs[:rows * 256], tabs[rows * 256:]


@njit(cache=True, nogil=True)
def _fill_tables(freq, ftab, rcp):
    """Per table entry its word (frequency | exclusive cumulative frequency << 16) and reciprocal
    (2**32 // f, 0xFFFFFFFF where f < 2). Not ``rans_fast.table_args``: that gives the CPU table coder
    three int64 / float64 arrays of one table (frequencies, cumulative sums, 1 / f in float64 for its
    float division); ``ke_encode`` reads one packed uint32 word and an integer reciprocal for
    ``__umulhi`` per (class, symbol) of all rows at once, into the launch's one upload buffer. The only
    shared step is the exclusive cumulative sum, one line in this loop."""
    for r in range(freq.shape[0]):
        cum = 0
        for s in range(freq.shape[1]):
            f = freq[r, s]
            ftab[r * freq.shape[1] + s] = f | (cum << 16)
            rcp[r * freq.shape[1] + s] = (1 << 32) // f if f >= 2 else 0xFFFFFFFF
            cum += f


class _Side:
    """A side stream of a CUDA device for work that needs no table (the checksums, the raw bits): it runs
    beside the main stream's kernels, the host's table work and the rANS kernel. On CPU tensors (the tests'
    emulation) everything runs in order."""

    def __init__(self, dev: torch.device):
        self.on = dev.type == "cuda"
        if self.on:
            self.main = torch.cuda.current_stream(dev)
            self.stream = side_stream(dev)

    def mark(self):
        """An event after the main stream's work so far (None off a GPU)."""
        return self.main.record_event() if self.on else None

    @contextmanager
    def after(self, event=None):
        """Launches inside run on the side stream after ``event`` (:meth:`mark`; None: after the main
        stream's work so far)."""
        if not self.on:
            yield
            return
        if event is None:
            self.stream.wait_stream(self.main)
        else:
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            yield

    @contextmanager
    def then(self):
        """Launches inside run on the side stream after its own work so far only."""
        if not self.on:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """The main stream waits for the side stream's work so far."""
        if self.on:
            self.main.wait_stream(self.stream)


@lru_cache(maxsize=16)
def _escape_table(bdtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """uint8 per bit pattern: 1 where bins.BinGrid.escape says the pattern is always escaped."""
    return torch.from_numpy(bin_grid(bdtype).escape.astype(np.uint8)).to(device)


def encode(t: torch.Tensor, prediction, source: str, runner=None, gather=None, overlap=None,
           steps: dict | None = None) -> tuple[dict, dict]:
    """(codec meta, sections {name: 1-D tensor on t's device}) of the contiguous tensor ``t``, a format 2
    stream of ``source`` (``SOURCES``; ``prediction``: a tensor of t's shape for "external"). The caller
    checked :func:`unsupported`. ``runner`` / ``gather``: the kernels' launcher and the stream packer
    (default: the GPU's; the tests pass the CPU emulation's). ``overlap(buffers)``: checksums to queue of
    buffers finished by then (0-d int64 device tensors by name, all queued so far); called on a side stream
    before the first wait (the tensor's, ``lo16``, ``"prediction"``: its bytes, read back at the second wait)
    and after the payload launch (``bits``); ``steps``: a dict that receives the host time of each step
    (:class:`_Clock`).

    The host waits for the device twice: once for the fitted fields' statistics, the histograms and the
    chunks' raw-bit totals (one read-back), once for the stream lengths of the chunks and the model's field
    parts (both coded by the payload kernel) and the raw-bit check. (Reading the fields back on the side
    stream while symbolise ran cost more than it saved: its kernels queued behind symbolise's blocks.)"""
    from kvcodec.device import crc32 as gcrc
    from kvcodec.lossless.cuda import kvctx_encode as ke

    clock = _Clock(steps)
    runner = runner or ke.gpu_runner
    if gather is None:
        from kvcodec.lossless.cuda.planes_codec import gather
    dev = t.device
    shape = tuple(t.shape)
    g, tt, d = pcodec.kv_layout(shape)
    tb = pcodec.token_block(tt, d)
    f32 = t.dtype == torch.float32
    bdtype = torch.bfloat16 if f32 else t.dtype
    mag = pcodec.magnitude_symbols(t.dtype, source)  # the CPU encoder's default (codec.encode_tensor)
    meta = {"v": 2, "source": source, "dtype": container.torch_dtype_name(t.dtype), "shape": list(shape),
            "mode": "f32split" if f32 else "grid"}
    sections: dict = {}
    pats = _symbol_bits(t, sections)
    unit = _unit(shape, source)
    pred = None
    if source == "external":  # its checksum is queued beside the fit, with the tensor's
        pred = _prediction_f32(prediction.to(dev), g, tt, d).contiguous()
    elif source == "neighbour_layer":  # each layer predicted by the one before (the first by 0)
        pred = _layer_prediction(pats, bdtype, (g, tt, d), unit)
    side = _Side(dev)
    inputs_ready = side.mark()
    clock.mark("prepare (prediction)")

    # 1. the model, its stored fields (shared or per-(g, d) chosen on the device)
    val, lw = _pattern_tables(bdtype, dev)
    sums = _Sums(pats, pred, val, (g, tt, d), tb, runner)
    mom = sums.moments(lw)
    clock.mark("fit: moments (launch)")
    gain = {"external": "one", "neighbour_layer": "fit"}.get(source, "zero")
    prev_coef = "one" if source == "previous_token" else "fit"
    choices = (True,) if tt < pcodec._SHARED_PARAMS_BELOW else (False, True) if tt < pcodec._PER_CHANNEL_FROM else (False,)
    cands = kfit.fit(mom, sums.residuals, gain, prev_coef, choices, runner)
    clock.mark("fit: formulas + residual passes (launches)")
    shared_won = kfit.choose(cands)
    values, margs = kfit.bin_params(cands, shared_won, bin_grid(bdtype), runner)
    clock.mark("fit: choice, bin parameters (launches)")

    # 2. symbols, histogram, raw-bit counts (room after the values for the model's field bytes)
    layout = chunk_layout(g, tt, d, tb, unit)
    n_chunks = layout[0].size
    gb = int(layout[1][0])
    n_values = g * tt * d
    n_plane_bytes = 2 * len(stored_fields(source)) * values.shape[1]  # kfit.field_planes' bytes
    spare = n_plane_bytes if n_plane_bytes > format2.MODEL_PART_BYTES else 0
    desc, cap = _chunk_descriptors(layout, tt, d)
    chunks_d = upload([desc], dev)[0].view(-1, 4)
    grid = grid_constants(bdtype)  # (width, sign, mb, maxmag, eoff)
    keys, raw, hist, chunk_bits = ke.symbolise(pats, pred, margs, choices == (True,), _escape_table(bdtype, dev),
                                               grid, (g, tt, d), tb, gb, unit, n_chunks, N_KEYS,
                                               spare, runner, mag)
    planes, stats = kfit.field_planes(values, source)  # after the symbolise launch: off its critical path
    phist = kfit.plane_histograms(planes, d, runner)
    pending = {k: sections[k] for k in ("lo16",) if k in sections}
    if source == "external":  # read back with the stream lengths (the second wait)
        pending["prediction"] = pred.reshape(-1).view(torch.uint8)
    with side.after(inputs_ready):  # the checksums beside the fit and symbolise kernels
        crcs = overlap(pending) if overlap is not None else {}
        pred_crc = [crcs["prediction"] if "prediction" in crcs else gcrc.crc32_many([pending["prediction"]])[0]
                    ] if source == "external" else []
    # 3. the raw bits on the side stream right after symbolise, beside the first wait, the host's table work
    # and the rANS kernel; into room for the most raw bits a value can have (bins: a raw code is at most the
    # pattern or mb + DEPTH_MAX bits): their total is known on the host only after the wait
    most = max(grid[0], grid[2] + DEPTH_MAX)
    with side.after():
        chunk_words = (chunk_bits + 31) >> 5
        n_bad = torch.zeros(1, dtype=torch.int64, device=dev)
        bits = ke.raw_bits(raw, chunks_d, chunk_bits, torch.cumsum(chunk_words, 0) - chunk_words, n_bad,
                           -(-n_values * most // 32) + n_chunks, runner)
    clock.mark("symbolise, field planes, checksums, raw bits (launches)")
    won = [] if shared_won is None else [shared_won.view(1)]
    stats, phist, counts, cbits, *won = _read_back([stats, phist, hist.sum(dim=0), chunk_bits, *won])
    clock.mark("wait: fit + symbolise (sync 1)")
    bit_words = (cbits + 31) // 32
    bits = bits[:int(bit_words.sum())]
    shared = bool(won[0][0]) if won else choices == (True,)

    # 4. tables (the classes' and the model's field parts'), the parts
    fields_head, fields, widths = kfit.field_bytes(planes, stats, d if shared else planes.shape[-1])
    in_parts = fields.numel() > format2.MODEL_PART_BYTES
    rows = counts.reshape(N_CLASSES, 256)
    if in_parts:  # the model's field parts: one more row (MODEL_CLASS)
        rows = np.concatenate([rows, kfit.field_counts(phist[0 if shared else 1], widths)[None]])
    freq = fit_tables(rows, format2._pool())
    clock.mark("tables: frequencies")
    parts = _FieldParts(fields, freq[MODEL_CLASS], keys, n_values) if in_parts else None
    clock.mark("tables: model parts (launches)")
    parts_rows = parts.chunks if parts is not None else np.zeros((0, 4), np.int64)
    parts_d, ftab_d, rcp_d = _launch_tables(freq, parts_rows, dev)
    cap = max(cap, int(parts_rows[:, 2].max(initial=0))) + 2 * ke.LANES
    clock.mark("tables: layout")

    # 5. the chunks' streams (and the model's parts); the host writes the model meanwhile
    scratch, lens = ke.encode_chunks(keys, chunks_d, parts_d, ftab_d, rcp_d, cap, runner)
    if overlap is not None:
        with side.then():  # after the raw bits
            overlap({"bits": bits})
    side.join()  # what follows on the main stream (and the freeing of raw, keys) after the raw bits
    del keys, raw
    clock.mark("payload (launch)")
    tables = table_bytes(freq[:N_CLASSES])
    if parts is None:
        body, mparts = code_model(fields.cpu().numpy(), tables)
    clock.mark("model bytes (host)")
    wlen, bad, *pred_crc = _read_back([lens, n_bad, *(c.view(1) for c in pred_crc)])
    if pred_crc:
        meta["pred_crc"] = int(pred_crc[0][0])
    clock.mark("wait: payload (sync 2)")
    if (wlen < 0).any() or bad[0]:
        raise RuntimeError("GPU kvctx encoder: a symbol without frequency or a raw-bit miscount (internal error)")
    woff = np.concatenate([[0], np.cumsum(wlen)]).astype(np.int64)
    words = torch.empty(int(woff[-1]), dtype=torch.int16, device=dev)
    gather(scratch, cap, lens, woff[:-1], words)
    payload = words[:woff[n_chunks]]
    counts_b = np.concatenate([wlen[:n_chunks], bit_words]).astype("<u4").view(np.uint8)
    if parts is None:
        head = np.frombuffer(b"".join([(len(fields_head) + len(body)).to_bytes(4, "little"), fields_head, body]),
                             np.uint8)
        (model_d,) = upload([np.concatenate([head, counts_b])], dev)
    else:
        mparts = {"mfields": parts.count}
        head = parts.head(fields_head, wlen[n_chunks:], tables.size)
        head_d, tail_d = upload([head, np.concatenate([tables, counts_b])], dev)
        model_d = torch.cat([head_d, words[woff[n_chunks]:].view(torch.uint8), tail_d])
    flag = {"mag": 1} if mag else {}  # last, as format2.encode writes it (the same meta bytes)
    meta.update(tb=tb, shared=shared, lanes=ke.LANES, **mparts, **flag)
    sections.update(model=model_d, payload=payload, bits=bits)
    clock.mark("sections")
    return meta, sections


class _FieldParts:
    """``format2.code_model``'s "mfields" parts of the model's field bytes (more than MODEL_PART_BYTES),
    coded on the device by the payload kernel: the bytes go after the tensor's values in ``keys`` as
    symbols of one more class (``MODEL_CLASS``, its table the parts' shared one) and each part is one more
    chunk of 32 lanes: the same words and states as ``rans_fast``'s 32-state table kernel (value i on lane
    i % 32, groups of 32 from the last, 2**12 probabilities). Why: coding ~1.5 MB of fields on the host
    took 2.5-4.5 ms of each call's critical path; on the device they ride along with the payload's chunks."""

    def __init__(self, fields: torch.Tensor, freqs: np.ndarray, keys: torch.Tensor, at: int):
        n = fields.numel()
        self.count = max(1, min(format2.MAX_FIELD_PARTS, -(-n // format2.FIELD_PART_BYTES)))
        sizes = format2._part_sizes(n, self.count)
        self.freqs = freqs  # quantize_frequencies of the bytes' counts, as code_model's
        self.size = n
        keys[at:at + n] = fields.to(torch.int16) | (MODEL_CLASS << 8)
        first = at + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.chunks = np.stack([first, np.ones_like(sizes), sizes, sizes], 1).astype(np.int64)  # one g each

    def head(self, fields_head: bytes, lens: np.ndarray, n_tables: int) -> np.ndarray:
        """The model section's bytes before the parts' payloads (``lens``: their lengths in words)."""
        parts_head = format2.field_parts_head(self.size, n_tables, self.freqs, 2 * lens)
        body = parts_head.size + 2 * int(lens.sum()) + n_tables
        return np.concatenate([np.frombuffer((len(fields_head) + body).to_bytes(4, "little") + fields_head, np.uint8),
                               parts_head])


def compress(tensor: torch.Tensor, prediction, codec: str, source: str, steps: dict | None = None) -> torch.Tensor:
    """The tensor blob (``kvcodec.compress``'s container, a uint8 tensor on the device) of a CUDA tensor
    coded with codec ``codec`` ("kvctx" / "predictive") and predictor ``source``; ``steps``: as
    :func:`encode`'s, with the container's steps."""
    from kvcodec.device.crc32 import crc32_many
    from kvcodec.lossless import device_container

    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    early = {}  # the tensor's and the finished sections' checksums, queued beside the encoder's kernels

    def checksums(done: dict) -> dict:
        """Queue the checksums of the buffers ``done`` (and of the tensor, the first time)."""
        names = [*(() if "tensor" in early else ("tensor",)), *done]
        bufs = [t.reshape(-1) if k == "tensor" else done[k] for k in names]
        early.update(zip(names, crc32_many([b.view(torch.uint8) for b in bufs])))
        return early

    codec_meta, sections = encode(t, prediction, source, steps=steps, overlap=checksums)
    clock = _Clock(steps)
    late = [k for k in sections if k not in early]
    if late:
        early.update(zip(late, crc32_many([sections[k].view(torch.uint8) for k in late])))
    crcs = torch.stack([early[k] for k in ("tensor", *sections)]).cpu().tolist()
    clock.mark("wait: checksums (sync 3)")
    meta = blob_meta(codec, t.dtype, t.shape, tensor.device, crcs[0], source == "external", codec_meta)
    out = device_container.assemble(KIND, meta, sections, crcs[1:], t.device)
    clock.mark("container")
    return out


def route(tensor, prediction, name: str, opts: dict, gpu) -> tuple[str, str] | None:
    """(codec, predictor) when ``kvcodec.compress(tensor, prediction, codec, gpu=gpu, **opts)`` is a
    kvctx / predictive call the GPU encoder takes, else None (the CPU encodes it, or raises for bad
    arguments). ``name``: the codec ``codec`` resolves to (``api.choose_codec``, resolved by the
    caller so that this module does not import the API). ``gpu=True`` and a kvctx / predictive call
    it cannot take: ValueError saying why."""
    if gpu is False or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
        return None
    opts = dict(opts)
    layout = opts.pop("layout", None)
    version = opts.pop("version", None)
    predictor = opts.pop("predictor", None)
    if opts or layout not in (None, "kv") or version not in (None, 2) or type(version) not in (int, type(None)):
        return None
    if prediction is not None and (not isinstance(prediction, torch.Tensor) or prediction.device != tensor.device
                                   or tuple(prediction.shape) != tuple(tensor.shape) or prediction.dtype.is_complex
                                   or prediction.dtype == torch.bool):
        return None
    if name == "kvctx" and prediction is None and predictor is None:
        source = "none"
    elif name == "predictive" and prediction is not None and predictor in (None, "external"):
        source = "external"
    elif name == "predictive" and prediction is None and predictor in ("previous_token", "neighbour_layer"):
        source = predictor
    else:
        return None
    import kvcodec.device

    why = unsupported(tensor, source, version) or (None if kvcodec.device.is_available() else "CuPy is not available")
    if why is not None:
        if gpu:
            raise ValueError(f"gpu=True: {why}")
        return None
    return name, source
