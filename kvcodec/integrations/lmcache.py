"""kvcodec's codecs as LMCache L2 serdes: ``kvcodec_lossless``, ``kvcodec_turboquant`` and
``kvcodec_transform``.

``import kvcodec.integrations.lmcache`` registers them with LMCache's serde factory, after which
an L2 adapter config names them like LMCache's own ``fp8`` (LMCache 0.5.6 has no plug-in entry
point for serdes, so the import must run in the process that builds the storage manager;
``python -m kvcodec.integrations.lmcache server ...`` is ``lmcache server ...`` with them registered):

    {"type": "fs", "base_path": "/kv", "serde": {"type": "kvcodec_lossless"}}
    {"type": "resp", "host": "10.0.0.5", "port": 6379,
     "serde": {"type": "kvcodec_turboquant", "head_dim": 128, "key_bits": 4, "value_bits": 4}}
    {"type": "fs", "base_path": "/kv", "serde": {"type": "kvcodec_transform", "calibration": "/models/x.kvtc",
                                                  "bits": 2.0}}

Fixed-size slots. LMCache 0.5.6 allocates the buffer an L2 adapter loads into from
``estimate_serialized_size`` and its fs and resp adapters count a stored object of any other
length as a miss ("Incomplete read"). So every object written here fills exactly its estimate:
a 32-byte frame (magic, version, kind, payload length, crc32, key digest), the payload, zero
padding. The lossless slot is ``raw / slot_ratio`` bytes, the ratio chosen from measured chunks
(``slot_ratio="auto"``, ``calibrate_slots``) or given; a chunk that does not compress into its slot
is refused (its store fails, LMCache keeps serving it from L1 or recomputes it), never truncated,
and counted (``lossless_slot_stats``).

Keys. The frame carries a digest of LMCache's ``ObjectKey`` (model, chunk hash, kv_rank, object
group, cache salt) and of the serde config that wrote it: a valid object found under another key
raises ``KeyMismatchError`` in ``deserialize``, a miss.

Errors. A damaged or mixed-up object (bad frame, checksum, key digest, container, or a stored
shape/dtype other than the one LMCache asks for) raises ``kvcodec.CorruptStreamError`` (or its
subclasses ``KeyMismatchError``, ``DeviceStagingError``) inside ``deserialize``; LMCache's serde
processor turns any exception into a failed load, i.e. a miss, never garbage KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import sys
import threading
import weakref
from dataclasses import asdict, dataclass, fields, is_dataclass
from statistics import NormalDist

import numpy as np
import torch
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)

from kvcodec import checksum, container, magics
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless.api import compress, decompress
from kvcodec.quant import QuantizedTensor, TurboQuantMSE, TurboQuantOutlier, turboquant_fast, turboquant_rows

log = logging.getLogger(__name__)

MAGIC, VERSION = magics.LMCACHE_FRAME, 2
LOSSLESS, TURBOQUANT, TRANSFORM = 1, 2, 3
# magic, version, kind, reserved, payload bytes, crc32, key digest: 32 bytes
FRAME = struct.Struct("<4sBBHQI12s")
DIGEST_BYTES = 12
TQ_KIND = "kvcodec.lmcache.turboquant"
HEADER_SLACK = 256
SLOT_FIT = 0.999  #: share of chunks a "auto" lossless slot is chosen to fit


class SlotOverflowError(ValueError):
    """A chunk's payload does not fit the fixed slot its serde allocated (the store is refused)."""


class KeyMismatchError(CorruptStreamError):
    """A valid object stored for another ObjectKey (or serde config) than the one being loaded:
    LMCache counts it as a miss, like a damaged object."""


def key_digest(key, config: str) -> bytes:
    """12-byte BLAKE2b digest binding a stored object to its LMCache ``ObjectKey`` (every field:
    model, chunk hash, kv_rank = the rank's layer/head slice, object group, cache salt) and to the
    serde config that wrote it. ``key=None`` (offline use outside a storage manager) digests no key."""
    if key is None:
        fields_ = {}
    elif is_dataclass(key):
        fields_ = {f.name: getattr(key, f.name) for f in fields(key)}
    else:
        raise ValueError(f"expected an LMCache ObjectKey or None, got {type(key).__name__}")
    canon = {k: (v.hex() if isinstance(v, (bytes, bytearray)) else v) for k, v in fields_.items()}
    text = json.dumps({"key": canon, "serde": config}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES, person=b"kvcodec-lmcache").digest()


# -------------------------------------------------------------------------------- KV layout
def kv_chunk(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """keys/values [layers, kv_heads, tokens, head_dim] -> LMCache's chunk layout
    [2, layers, tokens, kv_heads * head_dim] (contiguous)."""
    n_layers, n_heads, n_tokens, d = keys.shape
    return torch.stack([t.transpose(1, 2).reshape(n_layers, n_tokens, n_heads * d) for t in (keys, values)]).contiguous()


def kv_unchunk(chunk: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``kv_chunk``: (keys, values), each [layers, kv_heads, tokens, head_dim] (views)."""
    _, n_layers, n_tokens, hidden = chunk.shape
    kv = chunk.reshape(2, n_layers, n_tokens, n_heads, hidden // n_heads).transpose(2, 3)
    return kv[0], kv[1]


def host_memory_obj(t: torch.Tensor):
    """Wrap a contiguous CPU tensor as an LMCache ``TensorMemoryObj`` sharing its bytes (no copy):
    to run a serializer/deserializer outside a storage manager (offline conversion, tests, benchmarks)."""
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = _bytes_of(t)
    meta = MemoryObjMetadata(shape=t.shape, dtype=t.dtype, address=0, phy_size=raw.size, ref_count=1,
                             shapes=[t.shape], dtypes=[t.dtype])
    return TensorMemoryObj(t.reshape(-1).view(torch.uint8), meta, None)


# ---------------------------------------------------------------------------------------- frame
def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 numpy view (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"expected a contiguous CPU buffer, got {t.device} contiguous={t.is_contiguous()}")
    return t.reshape(-1).view(torch.uint8).numpy()


def write_frame(dst: torch.Tensor, kind: int, payload, digest: bytes = bytes(DIGEST_BYTES),
                slot: int | None = None) -> int:
    """Frame ``payload`` into the first ``slot`` bytes of ``dst`` (default: all of it) and zero the
    rest of the slot; returns the slot's size (LMCache stores and later loads exactly that many
    bytes). ``digest``: ``key_digest``."""
    body = np.frombuffer(payload, np.uint8)
    size = dst.numel() * dst.element_size()
    if slot is None:
        slot = size
    elif slot > size:
        raise SlotOverflowError(f"a {slot}-byte slot does not fit the {size}-byte buffer LMCache allocated")
    dst = dst.reshape(-1).view(torch.uint8)[:slot]
    if FRAME.size + body.size > slot:
        raise SlotOverflowError(f"payload of {body.size} bytes does not fit a {slot}-byte slot")
    head = FRAME.pack(MAGIC, VERSION, kind, 0, body.size, 0, digest)
    crc = checksum.crc32(body, checksum.crc32(head[:16]))
    head = FRAME.pack(MAGIC, VERSION, kind, 0, body.size, crc, digest)
    host = _bytes_of(dst) if dst.device.type == "cpu" else np.empty(slot, np.uint8)
    host[:FRAME.size] = np.frombuffer(head, np.uint8)
    host[FRAME.size:FRAME.size + body.size] = body
    host[FRAME.size + body.size:] = 0  # never ship stale L1 memory
    if dst.device.type != "cpu":
        dst.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(host))
    return slot


def read_frame(src: torch.Tensor, kind: int, digest: bytes = bytes(DIGEST_BYTES)) -> np.ndarray:
    """The payload (a view into ``src``) after checking magic, version, kind, length, crc32 and the
    key digest (``KeyMismatchError``: a valid object of another key or serde config)."""
    data = _bytes_of(src if src.device.type == "cpu" else src.cpu())
    if data.size < FRAME.size:
        raise CorruptStreamError(f"stored object of {data.size} bytes is shorter than its frame")
    magic, version, got_kind, _, n, crc, got_digest = FRAME.unpack(data[:FRAME.size].tobytes())
    if magic != MAGIC:
        raise CorruptStreamError("stored object is not a kvcodec LMCache frame (bad magic)")
    if version != VERSION or got_kind != kind:
        raise CorruptStreamError(f"stored object has version {version}, kind {got_kind}; expected {VERSION}, {kind}")
    if n > data.size - FRAME.size:
        raise CorruptStreamError(f"stored object declares {n} payload bytes, holds {data.size - FRAME.size}")
    body = data[FRAME.size:FRAME.size + n]
    if checksum.crc32(body, checksum.crc32(data[:16])) != crc:
        raise CorruptStreamError("stored object fails its crc32")
    if got_digest != digest:
        raise KeyMismatchError("stored object was written for another key or serde config")
    return body


def _the_tensor(obj, what: str) -> torch.Tensor:
    t = obj.tensor
    if t is None:
        raise ValueError(f"kvcodec serdes need a single-tensor MemoryObj for {what}")
    return t


def _raw_nbytes(layout_desc) -> int:
    return sum(math.prod(int(d) for d in s) * torch.empty(0, dtype=dt).element_size()
               for s, dt in zip(layout_desc.shapes, layout_desc.dtypes))


def _check_target(shape, dtype_name: str, out: torch.Tensor) -> None:
    if tuple(shape) != tuple(out.shape) or dtype_name != container.torch_dtype_name(out.dtype):
        raise CorruptStreamError(f"stored chunk is {dtype_name} {tuple(shape)}, LMCache expects "
                                 f"{container.torch_dtype_name(out.dtype)} {tuple(out.shape)}")


# ---------------------------------------------------------------------------------- GPU staging
class DeviceStagingError(CorruptStreamError):
    """The GPU a ``cuda_device`` serde stages on failed (out of memory, a device error): the store is
    not made, the load is a miss, as for a damaged object."""


def resolve_cuda_device(spec) -> torch.device | None:
    """``cuda_device`` option -> a CUDA device, or None (CPU). ``""``/``"auto"``: the visible GPU with
    the most free memory; ``"cuda:N"`` or ``N``: that one. ValueError without CUDA or for a bad name."""
    if spec is None:
        return None
    if isinstance(spec, bool) or not isinstance(spec, (str, int)):
        raise ValueError(f"cuda_device must be null, 'auto', 'cuda:N' or N, got {spec!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"cuda_device={spec!r} but CUDA is not available here: leave cuda_device out to code on the CPU")
    if spec in ("", "auto"):
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        return torch.device("cuda", int(np.argmax(free)))
    try:
        dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
    except RuntimeError as exc:
        raise ValueError(f"cuda_device {spec!r}: {exc}") from None
    if dev.type != "cuda" or (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"cuda_device {spec!r} is not a visible CUDA device")
    return torch.device("cuda", dev.index or 0)


class CudaStage:
    """Moves chunks between LMCache's host buffers and one GPU through a pinned bounce buffer per
    thread (pageable host memory would make every copy synchronous and slower); device failures
    become ``DeviceStagingError``."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()

    def _pinned(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            self._local.buf = buf
        return buf[:nbytes]

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._pinned(t.nbytes)
        buf.copy_(t.reshape(-1).view(torch.uint8))
        with torch.cuda.device(self.device):
            dev = buf.to(self.device, non_blocking=True)
            torch.cuda.current_stream().synchronize()  # the bounce buffer is reused by the next call
        return dev.view(t.dtype).reshape(t.shape)

    def download(self, d: torch.Tensor, out: torch.Tensor) -> None:
        buf = self._pinned(d.numel() * d.element_size())
        with torch.cuda.device(self.device):
            buf.copy_(d.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
            torch.cuda.current_stream().synchronize()
        out.reshape(-1).view(torch.uint8).copy_(buf)

    def run(self, what: str, fn):
        """``fn()`` with device errors turned into DeviceStagingError (kvcodec's own errors pass)."""
        try:
            return fn()
        except (CorruptStreamError, SlotOverflowError):
            raise
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            raise DeviceStagingError(f"{what} on {self.device} failed: {exc}") from exc


# ------------------------------------------------------------------------------------ lossless
def choose_slot_ratio(ratios, fit: float = SLOT_FIT) -> float:
    """The slot ratio (raw bytes / slot bytes) that a share ``fit`` of chunks is expected to fit,
    from measured per-chunk ratios (raw / framed payload): the lower of the empirical
    ``1 - fit`` quantile and a log-normal bound exp(mean - z * std) of the log ratios (with
    few chunks the empirical quantile is just the minimum, which alone would promise too much),
    floored to a multiple of 0.01 (servers that measured slightly different chunks then mostly
    agree) and never below 1.0."""
    r = np.asarray([float(x) for x in ratios], dtype=np.float64)
    if r.size == 0 or not np.all(np.isfinite(r)) or np.any(r <= 0):
        raise ValueError("choose_slot_ratio needs at least one finite positive ratio")
    if not 0.5 <= fit < 1:
        raise ValueError(f"fit must be in [0.5, 1), got {fit!r}")
    logs = np.log(r)
    z = NormalDist().inv_cdf(fit)
    bound = math.exp(float(logs.mean() - z * (logs.std(ddof=1) if r.size > 1 else 0.0)))
    quantile = float(np.quantile(r, 1 - fit, method="lower"))
    return max(1.0, math.floor(min(bound, quantile) * 100 + 1e-9) / 100)


def _layout_key(shape, dtype) -> str:
    return f"{container.torch_dtype_name(dtype)}{list(int(d) for d in shape)}"


@dataclass
class SlotStats:
    """What a ``kvcodec_lossless`` serializer did with the chunks LMCache handed it."""

    stored: int = 0
    refused: int = 0  #: did not fit the slot (no L2 copy; a miss later)
    calibrating: int = 0  #: measured for ``slot_ratio="auto"`` and not stored
    slot_ratios: dict = None  #: layout ("bfloat16[2, 30, 256, 576]") -> slot ratio in use

    @property
    def refused_share(self) -> float:
        """Refused / (stored + refused): the share of chunks past calibration that found no slot."""
        n = self.stored + self.refused
        return self.refused / n if n else 0.0


_LOSSLESS_SERIALIZERS: "weakref.WeakSet" = weakref.WeakSet()


def lossless_slot_stats() -> list[tuple[str, SlotStats]]:
    """(serde config, counters) of every live ``kvcodec_lossless`` serializer in this process: how a
    deployment reads its refused share (LMCache builds the serde; this finds it)."""
    return [(ser.config, ser.stats()) for ser in list(_LOSSLESS_SERIALIZERS)]


class LosslessSerializer(Serializer):
    """Bit-exact: ``kvcodec.compress`` of the chunk, in a slot of ``raw / slot_ratio`` bytes.

    ``slot_ratio="auto"``: the first ``calibration_chunks`` chunks of every layout (shape and dtype,
    which stands for the model) are compressed, measured and not stored; then ``choose_slot_ratio``
    fixes that layout's slot for good (written to ``slot_file`` when given, and read from it at
    startup, so restarts and other servers sharing the L2 use the same slot)."""

    def __init__(self, codec: str, slot_ratio, threads: int, calibration_chunks: int = 32,
                 slot_file: str | None = None, fit: float = SLOT_FIT, stage: CudaStage | None = None):
        self.codec, self.slot_ratio, self.threads, self.stage = codec, slot_ratio, threads, stage
        self.calibration_chunks, self.slot_file, self.fit = calibration_chunks, slot_file, fit
        self.config = json.dumps({"type": "kvcodec_lossless", "codec": codec}, sort_keys=True)
        self._lock = threading.Lock()
        self._stats = SlotStats(slot_ratios={})
        self._measured: dict = {}
        if slot_file and os.path.exists(slot_file):
            self._stats.slot_ratios.update(load_slot_file(slot_file, codec))
        _LOSSLESS_SERIALIZERS.add(self)

    def stats(self) -> SlotStats:
        with self._lock:
            return SlotStats(self._stats.stored, self._stats.refused, self._stats.calibrating,
                             dict(self._stats.slot_ratios))

    def _ratio(self, layout: str) -> float | None:
        """The slot ratio of ``layout``, or None while ``auto`` is still measuring it."""
        if self.slot_ratio != "auto":
            return self.slot_ratio
        return self._stats.slot_ratios.get(layout)

    def estimate_serialized_size(self, layout_desc) -> int:
        raw = _raw_nbytes(layout_desc)
        if len(layout_desc.shapes) != 1:
            raise ValueError("kvcodec_lossless handles single-tensor KV chunks")
        ratio = self._ratio(_layout_key(layout_desc.shapes[0], layout_desc.dtypes[0]))
        return FRAME.size + (raw if ratio is None else math.ceil(raw / ratio))

    def serialize(self, src, dst, key) -> int:
        t = _the_tensor(src, "serialize")
        layout = _layout_key(t.shape, t.dtype)
        with self._lock:
            ratio = self._ratio(layout)
        if self.stage is None:
            blob = compress(t, codec=self.codec, threads=self.threads)
        else:  # kvcodec's GPU encoders; only the blob comes back
            blob = self.stage.run("compress", lambda: compress(self.stage.upload(t), codec=self.codec,
                                                                threads=self.threads))
        if ratio is None:
            self._calibrate(layout, t.nbytes / (FRAME.size + len(blob)))
            raise SlotOverflowError(f"kvcodec_lossless is measuring {layout} for slot_ratio='auto': not stored")
        try:  # the slot of the ratio in force now (the buffer came from an estimate that may predate it)
            n = write_frame(_the_tensor(dst, "serialize"), LOSSLESS, blob, key_digest(key, self.config),
                            slot=FRAME.size + math.ceil(t.nbytes / ratio))
        except SlotOverflowError as exc:
            with self._lock:
                self._stats.refused += 1
            raise SlotOverflowError(
                f"chunk compresses {t.nbytes / len(blob):.3f}x, less than slot_ratio={ratio}: "
                f"not stored ({exc})") from None
        with self._lock:
            self._stats.stored += 1
        return n

    def _calibrate(self, layout: str, ratio: float) -> None:
        with self._lock:
            self._stats.calibrating += 1
            seen = self._measured.setdefault(layout, [])
            seen.append(ratio)
            if len(seen) < self.calibration_chunks or layout in self._stats.slot_ratios:
                return
            chosen = choose_slot_ratio(seen, self.fit)
            self._stats.slot_ratios[layout] = chosen
        log.info("kvcodec_lossless: %s slot ratio %.2f from %d chunks (measured %.3f-%.3f)", layout, chosen,
                 len(seen), min(seen), max(seen))
        if self.slot_file:
            save_slot_file(self.slot_file, self.codec, {layout: chosen}, {layout: seen})


def load_slot_file(path: str, codec: str) -> dict:
    """{layout: slot ratio} for ``codec`` from a slot file (JSON written by ``save_slot_file``)."""
    try:
        with open(path) as f:
            doc = json.load(f)
        slots = doc[codec]
        out = {str(k): float(v["slot_ratio"]) for k, v in slots.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"kvcodec_lossless: cannot read slot file {path!r}: {exc}") from None
    if any(not (r >= 1.0 and math.isfinite(r)) for r in out.values()):
        raise ValueError(f"kvcodec_lossless: slot file {path!r} holds a slot ratio < 1.0")
    return out


def save_slot_file(path: str, codec: str, slots: dict, measured: dict | None = None) -> None:
    """Merge ``{layout: slot ratio}`` (with the measured ratios it came from) into a slot file."""
    doc = {}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    entry = doc.setdefault(codec, {})
    for layout, ratio in slots.items():
        seen = (measured or {}).get(layout, [])
        entry[layout] = {"slot_ratio": ratio, "chunks": len(seen),
                         "min_ratio": min(seen) if seen else None, "median_ratio": float(np.median(seen)) if seen else None}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def calibrate_slots(chunks, codec: str = "planes", fit: float = SLOT_FIT, path: str | None = None,
                    threads: int = 0) -> dict:
    """Offline calibration: compress ``chunks`` (KV chunks in LMCache's layout, a model's real KV),
    choose every layout's slot ratio with ``choose_slot_ratio`` and, with ``path``, write a slot
    file for ``{"slot_ratio": "auto", "slot_file": path}``. Returns {layout: slot ratio}."""
    measured: dict = {}
    for c in chunks:
        blob = compress(c.contiguous(), codec=codec, threads=threads)
        measured.setdefault(_layout_key(c.shape, c.dtype), []).append(c.nbytes / (FRAME.size + len(blob)))
    slots = {layout: choose_slot_ratio(r, fit) for layout, r in measured.items()}
    if path:
        save_slot_file(path, codec, slots, measured)
    return slots


class LosslessDeserializer(Deserializer):
    def __init__(self, threads: int, config: str, stage: CudaStage | None = None):
        self.threads, self.config, self.stage = threads, config, stage

    def deserialize(self, src, dst, key) -> None:
        out = _the_tensor(dst, "deserialize")
        body = read_frame(_the_tensor(src, "deserialize"), LOSSLESS, key_digest(key, self.config))
        if self.stage is None:
            t = decompress(body, threads=self.threads, device="cpu", max_output_bytes=out.nbytes)
            _check_target(t.shape, container.torch_dtype_name(t.dtype), out)
            out.copy_(t)
            return

        def on_gpu():
            t = decompress(body, threads=self.threads, device=self.stage.device, max_output_bytes=out.nbytes)
            _check_target(t.shape, container.torch_dtype_name(t.dtype), out)
            self.stage.download(t, out)

        self.stage.run("decompress", on_gpu)


# ---------------------------------------------------------------------------------- turboquant
@dataclass(frozen=True)
class TurboQuantOptions:
    """kvcodec_turboquant's options (the L2 config's ``serde`` keys besides ``type``).

    Chunks are LMCache's KV layout [2, layers, tokens, heads * head_dim]. ``exact_tokens``: the
    first tokens of every chunk stay exact (the chunk holding position 0 keeps the attention
    sink; 16 bits per value for those tokens only). ``outliers``: TurboQuant's outlier split
    (that many channels at bits + 1). Preconditioning as in ``kvcodec.hf.CompressedCache``.
    """

    head_dim: int = 128
    key_bits: int = 4
    value_bits: int = 4
    exact_tokens: int = 1
    outliers: int = 0
    key_precondition: str = "scale"
    value_precondition: str = "none"
    seed: int = 0

    def quantizer(self, part: int):
        bits = (self.key_bits, self.value_bits)[part]
        pre = (self.key_precondition, self.value_precondition)[part]
        if self.outliers:
            return TurboQuantOutlier(self.head_dim, self.outliers, bits + 1, bits, seed=self.seed + part,
                                     precondition="none" if pre == "none" else "center")
        return TurboQuantMSE(self.head_dim, bits, seed=self.seed + part, precondition=pre)


def _split_kv(kv: torch.Tensor, head_dim: int) -> tuple[int, int, int, int]:
    if kv.ndim != 4 or kv.shape[0] not in (1, 2) or not kv.is_floating_point():
        raise ValueError("kvcodec_turboquant expects float KV chunks [2, layers, tokens, hidden] (MHA/GQA) or "
                         f"[1, layers, tokens, latent] (MLA), got {kv.dtype} {tuple(kv.shape)}")
    _, n_layers, n_tokens, hidden = kv.shape
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of head_dim={head_dim}")
    return n_layers, n_tokens, hidden // head_dim, head_dim


def _part_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """One part of a chunk [layers, tokens, heads * d] -> [layers, heads, tokens, d] float32 (the
    quantizer's input; fp8 KV is widened exactly, bf16/fp16 as quantize itself would)."""
    n_layers, n_tokens, hidden = x.shape
    return x.reshape(n_layers, n_tokens, n_heads, hidden // n_heads).transpose(1, 2).float()


def _narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> the chunk's dtype; fp8 saturates at its largest finite value (a reconstruction a
    little past it would otherwise become NaN)."""
    if dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)


class TurboQuantSerializer(Serializer):
    """Lossy: TurboQuant codes + norms of every (layer, head), keys and values at their own bits;
    MLA chunks (one part, the latent) use the key settings."""

    def __init__(self, opts: TurboQuantOptions, threads: int = 0, stage: CudaStage | None = None):
        self.opts, self.threads, self.stage = opts, threads, stage
        self.quantizers = (opts.quantizer(0), opts.quantizer(1))
        self.config = json.dumps({"type": "kvcodec_turboquant", **asdict(opts)}, sort_keys=True)
        self._slots: dict = {}

    def payload(self, kv: torch.Tensor) -> bytes:
        _, n_tokens, n_heads, _ = _split_kv(kv, self.opts.head_dim)
        e = min(self.opts.exact_tokens, n_tokens)
        meta = {"shape": list(kv.shape), "dtype": container.torch_dtype_name(kv.dtype), "exact_tokens": e}
        tensors = {"exact": kv[:, :, :e].contiguous()}
        if n_tokens > e:
            for part, name in zip(range(kv.shape[0]), "kv"):
                with turboquant_fast.workers(self.threads):
                    # read in place where the compiled path takes the chunk, else through a float32 copy
                    q = turboquant_rows.quantize_chunk(self.quantizers[part], kv[part], e, n_heads)
                    if q is None:
                        q = turboquant_rows.quantize(self.quantizers[part], _part_heads(kv[part, :, e:], n_heads))
                    q = q.to_dict()
                meta[name] = q["meta"]
                tensors.update({f"{name}.{k}": t.cpu() for k, t in q["tensors"].items()})
        return container.dumps(TQ_KIND, meta, {k: t.cpu() for k, t in tensors.items()})

    def estimate_serialized_size(self, layout_desc) -> int:
        """Exact for the layout (probed once on zeros) plus HEADER_SLACK: what the container's JSON
        header can grow by for real data (crc32 digits and norm dtype names of its <= 8 sections:
        < 100 characters, at most two more 64-byte alignment units)."""
        key = (tuple(tuple(s) for s in layout_desc.shapes), tuple(layout_desc.dtypes))
        if key not in self._slots:
            if len(layout_desc.shapes) != 1:
                raise ValueError("kvcodec_turboquant handles single-tensor KV chunks")
            probe = torch.zeros(tuple(layout_desc.shapes[0]), dtype=layout_desc.dtypes[0])
            self._slots[key] = FRAME.size + len(self.payload(probe)) + HEADER_SLACK
        return self._slots[key]

    def serialize(self, src, dst, key) -> int:
        kv = _the_tensor(src, "serialize")
        if self.stage is None:
            body = self.payload(kv)
        else:  # torch's CUDA kernels; the codes come back (GPU rounding may pick other codes than the CPU)
            body = self.stage.run("quantize", lambda: self.payload(self.stage.upload(kv)))
        return write_frame(_the_tensor(dst, "serialize"), TURBOQUANT, body, key_digest(key, self.config))


class TurboQuantDeserializer(Deserializer):
    def __init__(self, config: str = "", threads: int = 0, stage: CudaStage | None = None):
        self.config, self.threads, self.stage = config, threads, stage

    def deserialize(self, src, dst, key) -> None:
        out = _the_tensor(dst, "deserialize")
        body = read_frame(_the_tensor(src, "deserialize"), TURBOQUANT, key_digest(key, self.config))
        _, meta, tensors = container.loads(body, expect_kind=TQ_KIND)
        if not isinstance(meta, dict) or not {"shape", "dtype", "exact_tokens"} <= set(meta):
            raise CorruptStreamError("turboquant chunk meta lacks shape/dtype/exact_tokens")
        _check_target(meta["shape"], meta["dtype"], out)
        if out.ndim != 4 or out.shape[0] not in (1, 2):
            raise CorruptStreamError(f"turboquant chunk shape {tuple(out.shape)} is not a KV chunk")
        e = meta["exact_tokens"]
        n_tokens = out.shape[2]
        exact = tensors.get("exact")
        if (type(e) is not int or not 0 <= e <= n_tokens or not isinstance(exact, torch.Tensor)
                or exact.dtype != out.dtype or tuple(exact.shape) != (*out.shape[:2], e, out.shape[3])):
            raise CorruptStreamError("turboquant chunk's exact tokens do not fit the chunk")
        out[:, :, :e] = exact
        for part, name in zip(range(out.shape[0]), "kv"):
            if e == n_tokens:
                break
            q = QuantizedTensor.from_dict({"meta": meta.get(name), "tensors": {
                k[2:]: t for k, t in tensors.items() if k.startswith(name + ".")}})
            d = q.dim
            want = (out.shape[1], out.shape[3] // d, n_tokens - e, d) if d and out.shape[3] % d == 0 else None
            if want is None or (*q.lead_shape, q.num_tokens, q.dim) != want:
                raise CorruptStreamError(f"turboquant {name} codes do not fit the chunk {tuple(out.shape)}")
            if self.stage is None:
                with turboquant_fast.workers(self.threads):
                    if turboquant_rows.dequantize_into_chunk(q, out[part], e):  # bf16 / f32: straight in
                        continue
                    rec = turboquant_rows.dequantize(q, torch.float32)  # [layers, heads, tokens, d]
                out[part, :, e:] = _narrow(rec.transpose(1, 2).reshape(out.shape[1], n_tokens - e, out.shape[3]),
                                           out.dtype)
            else:
                def on_gpu(q=q, part=part):
                    rec = q.to(self.stage.device).dequantize(torch.float32)
                    rec = _narrow(rec.transpose(1, 2).reshape(out.shape[1], n_tokens - e, out.shape[3]), out.dtype)
                    host = torch.empty(rec.shape, dtype=rec.dtype)
                    self.stage.download(rec, host)
                    out[part, :, e:] = host

                self.stage.run("dequantize", on_gpu)


# ---------------------------------------------------------------------------------- transform
class TransformSerializer(Serializer):
    """Lossy, KVTC-class: ``kvcodec.transform.encode`` of the chunk at ``bits`` true bits per value
    (everything counted), in a slot of ``bits`` x raw values + 2% (the rate control's promise).

    LMCache hands a serde a chunk and a content hash, not the chunk's token positions, so keys are
    taken back from RoPE *relative to the chunk start* (positions 0..tokens-1): the calibration
    must be fitted the same way (``fit_chunk_calibration``). ``exact_tokens``: the first tokens of
    every chunk stay exact (the chunk at position 0 keeps the attention sink)."""

    def __init__(self, calib, bits: float, exact_tokens: int, threads: int):
        self.calib, self.bits, self.exact_tokens, self.threads = calib, bits, exact_tokens, threads
        self.config = transform_config(calib)

    def estimate_serialized_size(self, layout_desc) -> int:
        if len(layout_desc.shapes) != 1:
            raise ValueError("kvcodec_transform handles single-tensor KV chunks")
        n_values = math.prod(int(d) for d in layout_desc.shapes[0])
        return FRAME.size + math.ceil(self.bits * n_values / 8 * (1 + 2 * _rate_tolerance()))

    def serialize(self, src, dst, key) -> int:
        from kvcodec import transform

        kv = _the_tensor(src, "serialize")
        c = self.calib
        if kv.ndim != 4 or kv.shape[0] != 2 or kv.shape[1] != c.n_layers or kv.shape[3] != c.n_kv_heads * c.head_dim:
            raise ValueError(f"kvcodec_transform: chunk {tuple(kv.shape)} does not match the calibration "
                             f"([2, {c.n_layers}, tokens, {c.n_kv_heads * c.head_dim}])")
        keys, values = kv_unchunk(kv, c.n_kv_heads)
        blob = transform.encode(keys, values, c, self.bits, sinks=self.exact_tokens, window=0, positions_start=0)
        return write_frame(_the_tensor(dst, "serialize"), TRANSFORM, blob, key_digest(key, self.config))


class TransformDeserializer(Deserializer):
    def __init__(self, calib, threads: int):
        self.calib, self.threads = calib, threads
        self.config = transform_config(calib)

    def deserialize(self, src, dst, key) -> None:
        from kvcodec import transform

        out = _the_tensor(dst, "deserialize")
        body = read_frame(_the_tensor(src, "deserialize"), TRANSFORM, key_digest(key, self.config))
        keys, values = transform.decode(body, self.calib, threads=self.threads,
                                        max_output_bytes=8 * out.numel() + (1 << 20))
        chunk = kv_chunk(keys, values)
        _check_target(chunk.shape, container.torch_dtype_name(chunk.dtype), out)
        out.copy_(chunk)


def transform_config(calib) -> str:
    """kvcodec_transform's part of the key digest: the calibration (bits vary per object and are
    in the blob; the slot size already differs between rates)."""
    return json.dumps({"type": "kvcodec_transform", "calibration": str(calib.fingerprint)}, sort_keys=True)


def _rate_tolerance() -> float:
    from kvcodec.transform.codec import RATE_TOLERANCE

    return RATE_TOLERANCE


def fit_chunk_calibration(keys, values, rope, chunk_tokens: int = 256, **fit_options):
    """A transform calibration for ``kvcodec_transform``: calibration K/V [L, H, T, D] (a tensor or
    a list, post-RoPE, each sequence starting at position 0) cut into LMCache chunks of
    ``chunk_tokens``, every chunk's keys un-rotated from its own start, as the serde does.
    ``fit_options`` go to ``kvcodec.transform.fit`` (layers_per_group, joint_kv, weights, ...)."""
    from kvcodec import transform

    ks = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    vs = list(values) if isinstance(values, (list, tuple)) else [values]
    ck, cv = [], []
    for k, v in zip(ks, vs):
        for t0 in range(0, k.shape[2] - 1, chunk_tokens):
            ck.append(k[:, :, t0:t0 + chunk_tokens])
            cv.append(v[:, :, t0:t0 + chunk_tokens])
    return transform.fit(ck, cv, rope, positions_start=0, skip_sinks=fit_options.pop("skip_sinks", 1), **fit_options)


# ------------------------------------------------------------------------------ registration
def _options(cls, kwargs: dict, name: str, extra=("max_workers", "threads", "cuda_device")) -> dict:
    allowed = {f.name for f in fields(cls)} if cls else set()
    unknown = set(kwargs) - allowed - set(extra)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed | set(extra))}")
    return {k: v for k, v in kwargs.items() if k in allowed}


def _int(kwargs: dict, key: str, default: int, lo: int) -> int:
    v = kwargs.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{key} must be an integer >= {lo}, got {v!r}")
    return v


def lossless_serde(kwargs: dict):
    """Factory for ``{"type": "kvcodec_lossless", "codec": "planes", "slot_ratio": "auto",
    "calibration_chunks": 32, "slot_file": None, "threads": 0, "max_workers": 1}``."""
    own = ("codec", "slot_ratio", "calibration_chunks", "slot_file", "fit")
    _options(None, {k: v for k, v in kwargs.items() if k not in own}, "kvcodec_lossless")
    codec = kwargs.get("codec", "planes")
    if codec not in ("planes", "kvctx"):
        raise ValueError(f"kvcodec_lossless: codec must be 'planes' or 'kvctx', got {codec!r}")
    ratio = kwargs.get("slot_ratio", DEFAULT_SLOT_RATIO)
    if ratio != "auto":
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1.0 or not math.isfinite(ratio):
            raise ValueError(f"kvcodec_lossless: slot_ratio must be 'auto' or a number >= 1.0, got {ratio!r}")
        ratio = float(ratio)
    slot_file = kwargs.get("slot_file")
    if slot_file is not None and (not isinstance(slot_file, str) or not slot_file):
        raise ValueError(f"kvcodec_lossless: slot_file must be a path, got {slot_file!r}")
    fit = kwargs.get("fit", SLOT_FIT)
    if isinstance(fit, bool) or not isinstance(fit, (int, float)) or not 0.5 <= fit < 1:
        raise ValueError(f"kvcodec_lossless: fit must be a number in [0.5, 1), got {fit!r}")
    threads = _int(kwargs, "threads", 0, 0)
    stage = _stage(kwargs)
    ser = LosslessSerializer(codec, ratio, threads, _int(kwargs, "calibration_chunks", 32, 2), slot_file, float(fit),
                             stage)
    return AsyncSerdeProcessor(ser, LosslessDeserializer(threads, ser.config, stage),
                               max_workers=_int(kwargs, "max_workers", 1, 1))


def _stage(kwargs: dict) -> CudaStage | None:
    device = resolve_cuda_device(kwargs.get("cuda_device"))
    return None if device is None else CudaStage(device)


def turboquant_serde(kwargs: dict):
    """Factory for ``{"type": "kvcodec_turboquant", **TurboQuantOptions fields, "max_workers": 1}``."""
    opts = TurboQuantOptions(**_options(TurboQuantOptions, kwargs, "kvcodec_turboquant"))
    for f in ("head_dim", "key_bits", "value_bits", "exact_tokens", "outliers", "seed"):
        _int({f: getattr(opts, f)}, f, 0, 0)
    threads = _int(kwargs, "threads", 0, 0)
    stage = _stage(kwargs)
    ser = TurboQuantSerializer(opts, threads, stage)  # builds the quantizers: bad bits/head_dim fail here
    log.info("kvcodec_turboquant is lossy: keys %d bits, values %d bits per value (+ norms); "
             "measured attention-output error in kvcodec's docs/lmcache.md", opts.key_bits, opts.value_bits)
    return AsyncSerdeProcessor(ser, TurboQuantDeserializer(ser.config, threads, stage),
                               max_workers=_int(kwargs, "max_workers", 1, 1))


def transform_serde(kwargs: dict):
    """Factory for ``{"type": "kvcodec_transform", "calibration": path, "bits": 2.0, "exact_tokens": 1,
    "threads": 1, "max_workers": 1}``. The calibration file is loaded (and validated) here, at startup."""
    from kvcodec.transform import Calibration

    _options(None, {k: v for k, v in kwargs.items() if k not in ("calibration", "bits", "exact_tokens")},
             "kvcodec_transform", extra=("max_workers", "threads"))
    path = kwargs.get("calibration")
    if not isinstance(path, str) or not path:
        raise ValueError("kvcodec_transform: 'calibration' must name a calibration file (kvcodec.transform)")
    try:
        calib = Calibration.load(path)
    except (OSError, CorruptStreamError) as exc:
        raise ValueError(f"kvcodec_transform: cannot load calibration {path!r}: {exc}") from None
    bits = kwargs.get("bits", 2.0)
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= 16:
        raise ValueError(f"kvcodec_transform: bits must be a number in (0, 16], got {bits!r}")
    threads = _int(kwargs, "threads", 0, 0)
    ser = TransformSerializer(calib, float(bits), _int(kwargs, "exact_tokens", 1, 0), threads)
    log.info("kvcodec_transform is lossy: %.2f true bits per value, calibration %s (%s)", bits, path,
             calib.fingerprint)
    return AsyncSerdeProcessor(ser, TransformDeserializer(calib, threads), max_workers=_int(kwargs, "max_workers", 1, 1))


DEFAULT_SLOT_RATIO = "auto"
SERDES = {"kvcodec_lossless": lossless_serde, "kvcodec_turboquant": turboquant_serde,
          "kvcodec_transform": transform_serde}


def register() -> None:
    """Register the kvcodec serdes with LMCache (idempotent; runs on import)."""
    known = set(get_registered_serde_types())
    for name, factory in SERDES.items():
        if name not in known:
            register_serde_factory(name, factory)


register()


def main(argv=None) -> None:
    """``python -m kvcodec.integrations.lmcache <lmcache CLI args>``: LMCache's CLI with these serdes registered."""
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
