"""``compress`` / ``decompress``: bit-exact tensor compression behind one call.

The blob is a container (``kvcodec.container``) of kind ``"kvcodec.tensor"`` whose meta records
the codec name, dtype, shape, original device and the crc32 of the ORIGINAL tensor bytes. The
decoder checks that crc, so a wrong prediction (or any stream damage the codec cannot see) raises
:class:`kvcodec.CorruptStreamError` instead of returning wrong numbers.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from kvcodec import container
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES, check_output, numel, resolve_max_output
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import planes_device, registry
from kvcodec.lossless.tensor_meta import checked_shape, dtype_from_name
from kvcodec.lossless.threads import resolve_threads

KIND = "kvcodec.tensor"
_META_KEYS = {"codec", "dtype", "shape", "device", "crc32", "uses_prediction", "codec_meta"}


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU contiguous tensor as a uint8 array (a view, no copy)."""
    if t.numel() == 0:
        return np.zeros(0, np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        raise ValueError(f"only dense (strided) tensors can be compressed, got {t.layout}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


#: dtypes the KV models (kvctx, predictive) describe; others would be stored verbatim there.
_KV_MODELLED = {torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2}


def choose_codec(codec: str, prediction: torch.Tensor | None, layout: str | None,
                 dtype: torch.dtype | None = None) -> str:
    """The codec ``"auto"`` resolves to: predictive with a prediction, kvctx for KV, else planes.

    Integer, bool and float64 tensors always go to planes: the KV models only describe floats.
    """
    if codec != "auto":
        return codec
    if dtype is not None and dtype not in _KV_MODELLED:
        return "planes"
    if prediction is not None and registry.has("predictive"):
        return "predictive"
    if layout == "kv" and registry.has("kvctx"):
        return "kvctx"
    return "planes"


def compress(tensor: torch.Tensor, prediction: torch.Tensor | None = None, codec: str = "auto",
             threads: int = 0, **opts) -> bytes:
    """Losslessly compress ``tensor`` to bytes; :func:`decompress` restores every bit.

    ``prediction``: an optional tensor of the same shape that the decoder will also have (e.g. a
    cheaper model's KV); codecs that use it store only what it does not predict. ``codec``:
    ``"auto"`` (predictive if a prediction is given, ``"kvctx"`` if ``layout="kv"``, else
    ``"planes"``) or a registered codec name. ``threads``: 0 = all cores. Other keyword options
    go to the codec's ``encode``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"compress() takes a torch.Tensor, got {type(tensor).__name__}")
    layout = opts.pop("layout", None)
    if layout not in (None, "kv"):
        raise ValueError(f"layout must be None or 'kv', got {layout!r}")
    resolve_threads(threads)
    dtype_name = container.torch_dtype_name(tensor.dtype)
    device = str(tensor.device)
    t = _as_cpu(tensor)
    pred = None
    if prediction is not None:
        if not isinstance(prediction, torch.Tensor) or tuple(prediction.shape) != tuple(t.shape):
            raise ValueError("prediction must be a tensor with the same shape as the tensor")
        pred = _as_cpu(prediction)
    name = choose_codec(codec, pred, layout, t.dtype)
    try:
        impl = registry.get(name)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    try:
        inspect.signature(impl.encode).bind(t, pred, threads, **opts)
    except TypeError as exc:
        raise ValueError(f"codec {name!r} does not take these options: {exc}") from None
    codec_meta, sections = impl.encode(t, pred, threads, **opts)
    meta = {
        "codec": name,
        "dtype": dtype_name,
        "shape": list(t.shape),
        "device": device,
        "crc32": container.crc32_parallel(tensor_bytes(t), resolve_threads(threads)),
        "uses_prediction": pred is not None,
        "codec_meta": codec_meta,
    }
    return container.dumps(KIND, meta, sections)


def _checked_meta(meta: dict) -> dict:
    if not isinstance(meta, dict) or set(meta) != _META_KEYS:
        raise CorruptStreamError("tensor blob meta has the wrong keys")
    dtype_from_name(meta["dtype"])
    checked_shape(meta["shape"])
    if type(meta["crc32"]) is not int or not isinstance(meta["device"], str):
        raise CorruptStreamError("tensor blob has a bad crc32 or device")
    if not isinstance(meta["uses_prediction"], bool) or not isinstance(meta["codec_meta"], dict):
        raise CorruptStreamError("tensor blob has bad codec fields")
    if not isinstance(meta["codec"], str):
        raise CorruptStreamError("tensor blob has a bad codec name")
    # The codec's own dtype/shape drive its allocations: they must be the ones checked above.
    inner = meta["codec_meta"]
    for key in ("dtype", "shape"):
        if key in inner and inner[key] != meta[key]:
            raise CorruptStreamError(f"tensor blob's codec meta declares another {key}")
    return meta


def describe(blob) -> dict[str, Any]:
    """What a blob holds without decoding it: codec, dtype, shape, raw and compressed bytes."""
    header, mv = container.read_header(blob)
    if header["kind"] != KIND:
        raise CorruptStreamError(f"expected a {KIND!r} container, got {header['kind']!r}")
    meta = _checked_meta(header["meta"])
    dtype = dtype_from_name(meta["dtype"])
    return {
        "codec": meta["codec"],
        "dtype": meta["dtype"],
        "shape": tuple(meta["shape"]),
        "raw_bytes": numel(meta["shape"]) * dtype.itemsize,
        "compressed_bytes": mv.nbytes,
        "uses_prediction": meta["uses_prediction"],
    }


def _load(blob, max_output_bytes) -> tuple[dict, dict]:
    """Parse a tensor blob and check its meta and declared size (nothing decoded yet)."""
    resolve_max_output(max_output_bytes)  # a bad argument is a ValueError before the blob is read
    _, meta, sections = container.loads(blob, expect_kind=KIND)
    meta = _checked_meta(meta)
    check_output(numel(meta["shape"]) * dtype_from_name(meta["dtype"]).itemsize, max_output_bytes, "tensor blob")
    return meta, sections


def validate(blob, max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> dict[str, Any]:
    """Check everything about a blob that can be checked without decoding its payload.

    The container and its section checksums, the meta (types, dtype allow-list, shape, the codec's
    own dtype/shape equal to the outer ones), the declared size against ``max_output_bytes``, and
    the codec's metadata against the sections present (for codecs with a ``validate`` method).
    Returns :func:`describe`'s dict; raises CorruptStreamError. :func:`decompress` runs the same
    checks first, so a fuzzer can call either.
    """
    meta, sections = _load(blob, max_output_bytes)
    impl = registry.get_for_decoding(meta["codec"])
    check = getattr(impl, "validate", None)
    if check is not None:
        check(meta["codec_meta"], sections)
    return describe(blob)


def decode_blob_chunk(blob, c: int) -> torch.Tensor:
    """Decode chunk ``c`` of a ``compress(..., codec="planes")`` blob alone (flat elements
    ``[c * chunk, (c + 1) * chunk)``), e.g. to read part of a huge tensor. The whole-tensor crc32
    cannot be checked on a part; the container's section checksums still are."""
    _, meta, sections = container.loads(blob, expect_kind=KIND)
    if not isinstance(meta, dict) or meta.get("codec") != "planes" or not isinstance(meta.get("codec_meta"), dict):
        raise ValueError("not a blob of the planes codec")
    meta = _checked_meta(meta)
    return registry.get("planes").decode_chunk(meta["codec_meta"], sections, c)


def _target_device(stored: str, prediction: torch.Tensor | None, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if prediction is not None:
        return prediction.device
    try:
        dev = torch.device(stored)
    except (RuntimeError, ValueError):
        return torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return dev if dev.type in ("cpu", "cuda") else torch.device("cpu")


def decompress(blob, prediction: torch.Tensor | None = None, threads: int = 0, device=None,
               max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> torch.Tensor:
    """Restore the tensor from :func:`compress`'s bytes, bit for bit.

    Pass the same ``prediction`` that was given to ``compress`` (if one was). The result goes to
    ``device`` if given, else the prediction's device, else the original device when this machine
    has it, else the CPU. A ``planes`` blob bound for a CUDA device is decoded there by the GPU
    rANS decoder when its streams allow (32 lanes, one table per plane; see
    :mod:`kvcodec.lossless.planes_device`), else on the CPU and copied. Raises CorruptStreamError
    on damaged input, a wrong prediction, or a prediction missing or of another shape than the
    blob declares (CorruptStreamError is a ValueError).
    ``max_output_bytes``: refuse (CorruptStreamError) blobs that declare a bigger tensor, before
    anything is allocated (default ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES`` = 4 GiB; ``None`` = no cap): a
    constant tensor legitimately compresses to a few hundred bytes whatever its size. Every
    metadata field is validated before the codec allocates or loops (:func:`validate`).
    """
    resolve_threads(threads)
    meta, sections = _load(blob, max_output_bytes)
    shape = tuple(meta["shape"])
    target = _target_device(meta["device"], prediction, device)
    if target.type == "cuda" and meta["codec"] == "planes" and not meta["uses_prediction"]:
        gpu_plan = planes_device.plan(meta["codec_meta"], sections)
        if gpu_plan is not None:  # decoded on the GPU (kvcodec.lossless.planes_device)
            return planes_device.run(gpu_plan, target)
    pred = None
    if meta["uses_prediction"]:
        if prediction is None:
            raise CorruptStreamError("this blob was compressed with a prediction: pass the same prediction to decompress")
        if not isinstance(prediction, torch.Tensor) or tuple(prediction.shape) != shape:
            raise CorruptStreamError(f"prediction must be a tensor of shape {shape}, the blob's")
        pred = _as_cpu(prediction)
    impl = registry.get_for_decoding(meta["codec"])
    out = impl.decode(meta["codec_meta"], sections, pred, threads)
    dtype = dtype_from_name(meta["dtype"])
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != shape:
        raise CorruptStreamError("codec output does not match the stored dtype/shape")
    out = out.contiguous()
    if container.crc32_parallel(tensor_bytes(out), resolve_threads(threads)) != meta["crc32"]:
        raise CorruptStreamError(
            "decoded tensor fails its checksum: wrong prediction, or a corrupted stream"
        )
    return out if target.type == "cpu" else out.to(target)
