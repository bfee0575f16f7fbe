"""The kvctx and predictive codecs' format 2 streams decoded on a CUDA device.

Why: a KV cache lives on the GPU; decoding its blob on the CPU and copying the tensor back costs
more than decoding it where it is. The stream's chunks are 32-lane rANS streams (the warp layout of
``kvcodec.entropy.rans_lanes``) plus a raw bit stream per chunk, so one warp decodes one chunk
(``kvcodec/lossless/cuda/kvctx_decode.cu``, the CPU kernel ``predictive.binned.decode_chunks`` computed bit
for bit).

Host work (:func:`plan`): the stream is checked by the CPU decoder's own parser
(``predictive.codec.parse_stream``): only the small ``model`` section is copied to the host; the
payload, raw-bit and ``lo16`` sections stay on the device and the parser sees size-only stand-ins
for them (zero-stride arrays of their dtype and length). The stored parameter fields of an
``mfields`` stream are not decoded there: :func:`device_inputs` decodes them on the device from the
blob's model section, checks their values and builds the decode tables there (``kvcodec.lossless.cuda.kvctx_plan``),
all on the stream without a sync. Decoding (:func:`decode`): one launch for every chunk (a ``"neighbour_layer"`` stream: one per layer, each predicted from the layer decoded
before it); every chunk's status, the plan's status words and the prediction's checksum are checked once,
with the container's checks, by the caller (``kvcodec.lossless.api``).

Blobs the kernel does not take return None (the caller decodes on the CPU): format 1, 8-lane
streams (tensors under 16384 values), the ``raw`` mode, a prediction that is not a real CUDA tensor
of the blob's shape on the blob's device.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kvcodec.device.transfer import Staging, download
from kvcodec.lossless.predictive import codec as pcodec
from kvcodec.lossless.predictive.bins import bin_grid
from kvcodec.lossless.predictive.grid import value_table

SOURCES = ("none", "previous_token", "external", "neighbour_layer")


def gpu_decodable(meta) -> bool:
    """Whether the GPU kernel takes a kvctx / predictive codec meta: format 2, 32 lanes, a coded mode, a
    "mag" flag absent, 0 or 1 (a forged one is left to the CPU parser, which raises CorruptStreamError)."""
    return (isinstance(meta, dict) and meta.get("v") == 2 and type(meta.get("v")) is int
            and meta.get("lanes") == 32 and type(meta.get("lanes")) is int
            and meta.get("mode") in ("grid", "f32split") and meta.get("source") in SOURCES
            and meta.get("mag", 0) in (0, 1) and type(meta.get("mag", 0)) is int)


def grid_constants(dtype: torch.dtype) -> tuple:
    """The kernel's ``(width, sign, mb, maxmag, eoff)`` of a dtype (``bins.bin_grid``)."""
    g = bin_grid(dtype)
    return (g.width, g.sign, g.mb, g.maxmag, g.eoff)


def _stand_ins(meta, sections, front: np.ndarray | None = None) -> dict:
    """The sections as the CPU parser reads them: ``model`` on the host (from ``front``, the blob's first
    bytes already read back, when it lies there, else copied), the others size-only zero-stride arrays
    of their dtype and shape (nothing but sizes is read from them)."""
    out = {}
    for name, s in sections.items():
        if name == "model" and len(s.shape) == 1:
            inside = front is not None and s.offset + s.nbytes <= front.size
            out[name] = (front[s.offset:s.offset + s.nbytes] if inside else download(s.bytes)).view(s.dtype)
        else:
            out[name] = _size_only(s.dtype, s.shape)
    return out


@lru_cache(maxsize=64)
def _size_only(dtype, shape) -> np.ndarray:
    """A read-only zero-stride array of ``dtype`` and ``shape``, kept per (dtype, shape): np.broadcast_to
    costs ~0.01-0.04 ms a call, two calls a first decode."""
    return np.broadcast_to(np.zeros(1, dtype), shape)


def plan(meta, sections, front: np.ndarray | None = None):
    """(ParsedStream, KernelPlan) of a format 2 stream whose ``sections`` are device sections, or None
    when the kernel cannot take it: the host part of a decode. CorruptStreamError for what the CPU
    decoder refuses before decoding. ``front``: the blob's first bytes on the host (uint8), if read
    already (``device_container.read_front``): the model section is taken from there when it lies
    inside. The plan's device inputs are staged in one host buffer (``kvctx_plan.pieces``; pinned for a
    CUDA blob) for :func:`device_inputs`; an ``mfields`` stream's fields are not decoded here."""
    from kvcodec.lossless.cuda import kvctx_plan
    from kvcodec.lossless.cuda.kvctx_decode import KernelPlan

    if not gpu_decodable(meta):
        return None
    ps = pcodec.parse_stream(meta, _stand_ins(meta, sections, front))
    p2 = ps.v2
    if p2 is None or p2.lanes != 32:
        return None
    bdtype = torch.bfloat16 if ps.mode == "f32split" else ps.dtype
    grid = grid_constants(bdtype)
    g, tt, d = pcodec.kv_layout(ps.shape)
    nc = len(p2.wstart)
    parts = p2.field_parts
    raw = p2.fields.raw if parts is None else None  # one model stream ("mparts" too): decoded and checked here
    st = Staging(kvctx_plan.pieces(nc, len(p2.freq), parts, 0 if raw is None else raw.size),
                 pin=sections["model"].blob.is_cuda)
    chunks = st.view("chunks", np.int64, (nc, 8))
    kvctx_plan.fill_chunks(chunks, p2.wstart, p2.wlen, p2.bstart, p2.blen, *p2.chunks)
    layout = st.view("layout", np.int64)
    layout[:12] = p2.layout.reshape(-1)
    layout[12] = p2.field_shape[0] * p2.field_shape[1]
    st.view("freq", np.int16)[:] = p2.freq.reshape(-1)
    if raw is None:
        kvctx_plan.stage_parts(st, parts)
    else:
        st.view("raw", np.uint8)[:] = raw
    out_kind = 4 if ps.mode == "f32split" else bin_grid(bdtype).width // 8
    kp = KernelPlan(chunks=chunks, layout=layout, shared=p2.shared, grid=grid, shape=(g, tt, d), out_kind=out_kind,
                    staged=st, mag=p2.mag)
    return ps, kp


def flag_count(ps) -> int:
    """Status entries :func:`device_inputs` sets on a CUDA device: one per coded field part, one for
    the field values."""
    parts = ps.v2.field_parts
    return (0 if parts is None else len(parts.count)) + 1


def device_inputs(ps, kp, sections, device, flags: int):
    """The decode kernel's inputs on ``device`` (a ``kvctx_plan.DeviceInputs``), without synchronizing:
    the staged plan uploaded in one copy, and one buffer for the decode tables and the field bytes. On
    CUDA: an ``mfields`` stream's fields decoded there from the model section (one launch), then the
    tables built and the fields' values checked (one launch); the int32 flags at device address
    ``flags`` (:func:`flag_count` of them, zeroed) get the parts' rANS statuses and the value check (0 =
    good). Elsewhere (the tests' CPU emulation): the same buffers, the fields decoded and checked
    (CorruptStreamError) and the tables built on the host."""
    from kvcodec.lossless.cuda import kvctx_plan
    from kvcodec.lossless.predictive.format2 import FIELD_ORDER, level_limit

    p2 = ps.v2
    parts = p2.field_parts
    st = kp.staged
    classes = len(p2.freq)
    n_tabs = 4 * classes * kvctx_plan.TABLE_SLOTS
    n_raw = 0 if parts is None else -(-parts.size // 16) * 16
    n_copy = 0 if parts is None else int(parts.start[-1] + parts.length[-1] - parts.start[0])
    up = st.to(device)
    work = torch.empty(n_tabs + n_raw + n_copy + 16, dtype=torch.uint8, device=device)  # tables, fields, parts' copy
    base, tabs = up.data_ptr(), work.data_ptr()
    raw = base + st.offsets["raw"] if parts is None else tabs + n_tabs
    if device.type != "cuda":
        wv = work.numpy()
        wv[:n_tabs].view(np.uint32)[:] = p2.tabs
        if parts is not None:
            wv[n_tabs:n_tabs + parts.size] = p2.fields.raw
    else:
        if parts is not None:
            model = sections["model"]
            kvctx_plan.decode_field_parts(base, st.offsets, st.sizes["blocks"] // 16, parts,
                                          model.blob.data_ptr() + model.offset, raw + n_raw, raw, flags, device)
        lv, mq = (p2.layout[FIELD_ORDER.index(f)] for f in ("level", "mq"))
        kvctx_plan.plan_kernel(device, base + st.offsets["freq"], classes, tabs, raw,
                               0 if parts is None else int(kp.layout[-1]), (int(lv[0]), int(lv[1])),
                               level_limit(p2.layout), (int(mq[0]), int(mq[1])),
                               flags + 4 * (flag_count(ps) - 1))
    return kvctx_plan.DeviceInputs(kp, base + st.offsets["chunks"], raw, base + st.offsets["layout"], tabs, (up, work))


def layer_ranges(ps, kp) -> list[tuple[int, int]]:
    """Chunk index ranges decoded by one launch each: all chunks, or one range per layer (a
    neighbour-layer stream; its chunks are layer-major and never cross a layer)."""
    n = kp.chunks.shape[0]
    if ps.source != "neighbour_layer":
        return [(0, n)]
    per_layer = kp.shape[0] // ps.shape[0]
    layer = kp.chunks[:, 4] // per_layer
    return [(int(np.searchsorted(layer, k)), int(np.searchsorted(layer, k, side="right")))
            for k in range(ps.shape[0])]


def _aligned(sec, align: int):
    """(device address, keep-alive) of a section's bytes at ``align``: the blob itself when aligned,
    else an aligned copy."""
    if sec is None:
        return 0, None
    if (sec.blob.data_ptr() + sec.offset) % align == 0:
        return sec.blob.data_ptr() + sec.offset, None
    copy = torch.empty(-(-max(sec.nbytes, 1) // 8), dtype=torch.int64, device=sec.blob.device)
    copy.view(torch.uint8)[:sec.nbytes].copy_(sec.bytes)
    return copy.data_ptr(), copy


def _prediction_f32(prediction: torch.Tensor, g: int, t: int, d: int) -> torch.Tensor:
    """The prediction as float32 [G, T, D] on its device, the CPU's conversion (bf16 by its bits)."""
    p = prediction.detach().contiguous()
    if p.dtype == torch.bfloat16:
        return (p.reshape(-1).view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(g, t, d)
    return p.to(torch.float32).reshape(g, t, d)


def _layer_values(out: torch.Tensor, ps, values: torch.Tensor) -> torch.Tensor:
    """The float32 values of decoded patterns, the next layer's prediction: the CPU's
    ``grid.value_table`` (non-finite values as 0) looked up by pattern (a float32 element by its
    upper, bf16 half)."""
    pats = out.to(torch.int64)
    return values[(pats >> 16) & 0xFFFF if ps.mode == "f32split" else pats & (values.numel() - 1)]


def _pattern_values(ps, device) -> torch.Tensor:
    """float32 [2**width]: the value of every bit pattern as ``grid.value_table`` has it."""
    return torch.from_numpy(value_table(ps.grid)[ps.grid.k_of_bits]).to(device)


def decode(meta, sections, device, prediction=None, launch=None, planned=None, reuse: dict | None = None):
    """Decode a format 2 stream whose sections are ``device_container.DeviceSection``s on ``device``.
    Returns (tensor, status int32 [chunks + plan flags] with 0 = good, [(tensor, crc32, message)] to check) without
    synchronizing (a :class:`Decoded`), or None when the CPU must decode it. CorruptStreamError for metadata the CPU
    decoder refuses. ``launch``: ``kvctx_decode.launch`` (the default) or a stand-in with its
    signature (the tests' CPU emulation of the kernel). ``planned``: :func:`plan`'s result when the
    caller already has it. ``reuse``: a dict that keeps the device inputs for the next decode of the
    same bytes (filled when empty; ``device_container.BlobCache``: stored only after a decode whose
    checks all passed, so the plan's flags of a reused entry are known to be 0)."""
    from kvcodec.lossless.cuda import kvctx_decode as kd

    launch = launch or kd.launch
    res = planned if planned is not None else plan(meta, sections)
    if res is None:
        return None
    ps, kp = res
    g, tt, d = kp.shape
    checks = []
    pred = None
    if ps.source == "external":
        if (not isinstance(prediction, torch.Tensor) or prediction.device != device
                or tuple(prediction.shape) != ps.shape or prediction.dtype.is_complex
                or prediction.dtype == torch.bool):
            return None
        pred = _prediction_f32(prediction, g, tt, d)
        checks.append((pred, meta["pred_crc"], "the prediction differs from the one this stream was coded with"))
    words, keep_w = _aligned(sections["payload"], 2)
    bits, keep_b = _aligned(sections["bits"], 4)
    lo16, keep_l = _aligned(sections.get("lo16"), 2)
    nc = kp.chunks.shape[0]
    status = torch.zeros(nc + flag_count(ps), dtype=torch.int32, device=device)  # chunks, then the plan's flags
    dp = reuse.get("kvctx inputs") if reuse is not None else None
    if dp is None:
        dp = device_inputs(ps, kp, sections, device, status.data_ptr() + 4 * nc)
        if reuse is not None:
            reuse["kvctx inputs"] = dp
    torch_kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[kp.out_kind]
    out = torch.empty((g, tt, d), dtype=torch_kind, device=device)
    # the blob and the prediction are ready here: the container's checks wait for this, not for the kernel
    ready = torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None
    if ps.source == "neighbour_layer":  # layer by layer, each predicted by the one before (layer 0: by 0)
        per_layer = g // ps.shape[0]
        values = _pattern_values(ps, device)
        for layer, (lo, hi) in enumerate(layer_ranges(ps, kp)):
            pred = None if layer == 0 else _layer_values(out[(layer - 1) * per_layer:layer * per_layer], ps, values)
            launch(dp, words, bits, out, status, lo, hi - lo, pred, layer * per_layer, lo16)
    else:
        launch(dp, words, bits, out, status, 0, None, pred, 0, lo16)
    del keep_w, keep_b, keep_l  # freed in stream order: after the launches that read them
    tensor = out.view(torch.float32 if ps.mode == "f32split" else ps.dtype).reshape(ps.shape)
    return Decoded(tensor, status, checks, ready)


class Decoded(tuple):
    """:func:`decode`'s (tensor, status, checks), with ``ready``: a CUDA event recorded on torch's stream
    before the first launch (the blob and the prediction are written by then: ``device_container.Checks``'
    ``after``), None off CUDA."""

    def __new__(cls, tensor, status, checks, ready=None):
        self = super().__new__(cls, (tensor, status, checks))
        self.ready = ready
        return self
