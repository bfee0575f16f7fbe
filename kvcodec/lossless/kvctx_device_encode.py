"""The kvctx and predictive codecs' format 2 streams encoded on a CUDA device.

Why: a KV cache lives on the GPU; the CPU encoder needs the tensor on the host and codes ~0.06 GB/s on
the GPU box, so offloading or moving KV through it costs seconds per GB.

The stream is the CPU encoder's (``predictive.format2.encode``), so either side decodes it:

1. fit the per-channel model (``params.fit_params``' sums per column of tb tokens,
   ``kvctx_encode.fit_*``, reduced by torch; its formulas and the bin parameters on the device,
   ``kvctx_device_fit``; shared or per-(g, d) parameters chosen by the CPU encoder's estimate);
2. ``kvctx_encode.symbolise`` computes every value's class, symbol and raw
   code with the GPU decoder's own model arithmetic and counts the per-class histogram;
3. the tables on the host (``tables.fit_tables``: the same integer tables as the CPU for the same
   counts), the ``model`` section as ``format2`` writes it;
4. ``kvctx_encode.encode_chunks``: one warp per chunk writes its 32-lane rANS stream and its raw bits;
   the streams are packed into the ``payload`` section (``planes_codec.gather``).

Only the stored parameter fields (~6 bytes a channel), the histogram, per-chunk sizes and the model
section cross to the host.
Calls the GPU cannot take (:func:`unsupported`: format 1, e.g. fp8 by default; 8-lane streams of small
tensors; other dtypes) are coded on the CPU by the caller: the format is
never changed silently.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kvcodec import container
from kvcodec.cuda.transfer import upload
from kvcodec.entropy import rans_lanes
from kvcodec.lossless import kvctx_device_fit as kfit
from kvcodec.lossless.kvctx_device import _prediction_f32, grid_constants
from kvcodec.lossless.predictive import codec as pcodec
from kvcodec.lossless.predictive.bins import N_CLASSES, bin_grid
from kvcodec.lossless.predictive.format2 import CHUNK_VALUES, WIDE_LANES_FROM, chunk_layout, code_model
from kvcodec.lossless.predictive.grid import grid_for, value_table
from kvcodec.lossless.predictive.tables import fit_tables, table_bytes

SOURCES = ("none", "external", "previous_token", "neighbour_layer")
N_KEYS = N_CLASSES * 256
_CODED = {torch.bfloat16, torch.float16, torch.float32}
_CODED_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}  # format 2 only with version=2 (tested ones)


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
    if (pcodec.default_version(t.dtype) if version is None else version) != 2:
        return "only format 2 is encoded on the GPU (fp8 defaults to format 1: pass version=2)"
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
        from kvcodec.cuda import kvctx_encode as ke

        self.ke, self.pats, self.pred, self.val, self.shape, self.tb, self.runner = ke, pats, pred, val, shape, tb, runner

    def moments(self, lw) -> torch.Tensor:
        """[G, D, 7]: params._fit_moments' fields."""
        return self.ke.fit_moments(self.pats, self.pred, self.val, lw, self.shape, self.tb, self.runner).sum(dim=1)

    def residuals(self, m, c, a, shared: bool) -> torch.Tensor:
        """[Gp, D, 3] residual sums under the location (m, c, a: float64 [Gp, D] device tensors)."""
        res = self.ke.fit_residuals(self.pats, self.pred, self.val, m.reshape(-1).contiguous(),
                                    c.reshape(-1).contiguous(), a.reshape(-1).contiguous(), shared, self.shape,
                                    self.tb, self.runner).sum(dim=1)
        return res.sum(dim=0, keepdim=True) if shared else res


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


def encode(t: torch.Tensor, prediction, source: str, runner=None, gather=None) -> tuple[dict, dict]:
    """(codec meta, sections {name: 1-D tensor on t's device}) of the contiguous tensor ``t``, a format 2
    stream of ``source`` (``SOURCES``; ``prediction``: a tensor of t's shape for "external"). The caller
    checked :func:`unsupported`. ``runner`` / ``gather``: the kernels' launcher and the stream packer
    (default: the GPU's; the tests pass the CPU emulation's)."""
    from kvcodec.cuda import crc32 as gcrc
    from kvcodec.cuda import kvctx_encode as ke

    runner = runner or ke.gpu_runner
    if gather is None:
        from kvcodec.cuda.planes_codec import gather
    dev = t.device
    shape = tuple(t.shape)
    g, tt, d = pcodec.kv_layout(shape)
    tb = pcodec.token_block(tt, d)
    f32 = t.dtype == torch.float32
    bdtype = torch.bfloat16 if f32 else t.dtype
    meta = {"v": 2, "source": source, "dtype": container.torch_dtype_name(t.dtype), "shape": list(shape),
            "mode": "f32split" if f32 else "grid"}
    sections: dict = {}
    pats = _symbol_bits(t, sections)
    unit = _unit(shape, source)
    pred = None
    if source == "external":
        pred = _prediction_f32(prediction.to(dev), g, tt, d).contiguous()
        meta["pred_crc"] = int(gcrc.crc32_many([pred.reshape(-1).view(torch.uint8)]).cpu()[0])
    elif source == "neighbour_layer":  # each layer predicted by the one before (the first by 0)
        pred = _layer_prediction(pats, bdtype, (g, tt, d), unit)

    # 1. the model
    val, lw = _pattern_tables(bdtype, dev)
    sums = _Sums(pats, pred, val, (g, tt, d), tb, runner)
    mom = sums.moments(lw)
    gain = {"external": "one", "neighbour_layer": "fit"}.get(source, "zero")
    prev_coef = "one" if source == "previous_token" else "fit"
    choices = (True,) if tt < pcodec._SHARED_PARAMS_BELOW else (False, True) if tt < pcodec._PER_CHANNEL_FROM else (False,)
    model = min((kfit.fit(mom, sums.residuals, gain, prev_coef, sh) for sh in choices), key=kfit.cost)
    bgrid = bin_grid(bdtype)
    bp, margs = kfit.bin_params(model, bgrid)

    # 2. symbols, histogram, raw-bit counts (the host writes the parameter fields meanwhile)
    cg0, cng, ct0, cnt = chunk_layout(g, tt, d, tb, unit)
    gb = int(cng[0])
    (esc_d,) = upload([bgrid.escape.astype(np.uint8)], dev)
    packed, hist, chunk_bits = ke.symbolise(pats, pred, margs, bp.shared, esc_d, grid_constants(bdtype),
                                            (g, tt, d), tb, gb, unit, cg0.size, N_KEYS, runner)
    fields_head, fields = bp.field_bytes(source)
    counts = hist.sum(dim=0).cpu().numpy().reshape(N_CLASSES, 256)
    cbits = chunk_bits.cpu().numpy()

    # 3. tables and the chunk layout of the sections
    freq = fit_tables(counts)
    cum = rans_lanes.cumulative(freq)
    f = freq.reshape(-1).astype(np.uint64)
    ftab = (f | (cum.reshape(-1).astype(np.uint64) << 16)).astype(np.uint32)
    rcp = np.where(f >= 2, (1 << 32) // np.maximum(f, 1), 0xFFFFFFFF).astype(np.uint32)
    bwords = (cbits + 31) // 32
    bstart = np.concatenate([[0], np.cumsum(bwords)[:-1]]).astype(np.int64)
    chunks = np.stack([cg0, cng, ct0, cnt, bstart, cbits], 1).astype(np.int64)
    cap = int((cng * cnt).max()) * d + 2 * ke.LANES

    # 4. the chunks' streams (the host entropy-codes the model meanwhile)
    chunks_d, ftab_d, rcp_d = upload([chunks, ftab, rcp], dev)
    scratch, lens, bits = ke.encode_chunks(packed, chunks_d.view(-1, 6), ftab_d, rcp_d, (g, tt, d), cap,
                                           int(bwords.sum()), runner)
    del packed
    body, mparts = code_model(fields, table_bytes(freq))
    head = fields_head + body
    wlen = lens.cpu().numpy()
    if (wlen < 0).any():
        raise RuntimeError("GPU kvctx encoder: a symbol without frequency or a raw-bit miscount (internal error)")
    woff = np.concatenate([[0], np.cumsum(wlen)]).astype(np.int64)
    payload = torch.empty(int(woff[-1]), dtype=torch.int16, device=dev)
    gather(scratch, cap, lens, woff[:-1], payload)
    counts_b = np.concatenate([wlen, bwords]).astype("<u4").view(np.uint8)
    model_blob = np.concatenate([np.frombuffer(len(head).to_bytes(4, "little") + head, np.uint8), counts_b])
    meta.update(tb=tb, shared=bp.shared, lanes=ke.LANES, **mparts)
    sections.update(model=torch.from_numpy(model_blob).to(dev), payload=payload, bits=bits)
    return meta, sections


def compress(tensor: torch.Tensor, prediction, codec: str, source: str, kind: str) -> torch.Tensor:
    """The tensor blob (``kvcodec.compress``'s container, a uint8 tensor on the device) of a CUDA tensor
    coded with codec ``codec`` ("kvctx" / "predictive") and predictor ``source``."""
    from kvcodec.cuda.crc32 import crc32_many
    from kvcodec.lossless import device_container

    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    codec_meta, sections = encode(t, prediction, source)
    crcs = crc32_many([t.reshape(-1).view(torch.uint8), *(s.view(torch.uint8) for s in sections.values())])
    crcs = crcs.cpu().tolist()
    meta = {"codec": codec, "dtype": container.torch_dtype_name(t.dtype), "shape": list(t.shape),
            "device": str(tensor.device), "crc32": crcs[0], "uses_prediction": source == "external",
            "codec_meta": codec_meta}
    return device_container.assemble(kind, meta, sections, crcs[1:], t.device)


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
    import kvcodec.cuda

    why = unsupported(tensor, source, version) or (None if kvcodec.cuda.is_available() else "CuPy is not available")
    if why is not None:
        if gpu:
            raise ValueError(f"gpu=True: {why}")
        return None
    return name, source
