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

from kvcodec import checksum, container
from kvcodec.device.transfer import bytes_to_device, device_to_bytes
from kvcodec.errors import CorruptStreamError
from kvcodec.lossless import device_container, kvctx_device, kvctx_device_encode, planes_device, registry
from kvcodec.lossless.tensor_meta import KIND, blob_meta, checked_meta, dtype_from_name
from kvcodec.threads import resolve_threads
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES, check_output, numel, resolve_max_output



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


def _gpu_kv_route(tensor, prediction, codec: str, opts: dict, gpu):
    """kvctx_device_encode.route for a call's resolved codec: (codec, predictor) when the GPU encodes it."""
    if not isinstance(tensor, torch.Tensor):
        return None
    return kvctx_device_encode.route(tensor, prediction, choose_codec(codec, prediction, opts.get("layout"), tensor.dtype),
                                     opts, gpu)


def compress(tensor: torch.Tensor, prediction: torch.Tensor | None = None, codec: str = "auto",
             threads: int = 0, gpu: bool | None = None, **opts) -> bytes:
    """Losslessly compress ``tensor`` to bytes; :func:`decompress` restores every bit.

    ``prediction``: an optional tensor of the same shape that the decoder will also have (e.g. a
    cheaper model's KV); codecs that use it store only what it does not predict. ``codec``:
    ``"auto"`` (predictive if a prediction is given, ``"kvctx"`` if ``layout="kv"``, else
    ``"planes"``) or a registered codec name. ``threads``: 0 = all cores. Other keyword options
    go to the codec's ``encode``. With ``"auto"``, a tensor the chosen codec would make bigger than
    its raw bytes is stored with the ``"raw"`` codec instead (the bytes and a header of a few hundred
    bytes; e.g. one-token or incompressible tensors), a blob every version of the decoder reads.

    A CUDA tensor coded with ``planes`` is encoded on its GPU (``gpu=None``, the default, when the
    options allow it: ``max_classes=1``, the GPU default, and ``chunk_bytes`` default 64 KiB;
    :mod:`kvcodec.lossless.planes_device`); ``gpu=False`` copies it to the CPU and codes it there,
    ``gpu=True`` raises ValueError where the GPU encoder cannot take the call. Only the finished
    blob crosses to the host; :func:`compress_device` keeps it on the device.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"compress() takes a torch.Tensor, got {type(tensor).__name__}")
    routed = _gpu_kv_route(tensor, prediction, codec, opts, gpu)
    if routed is not None:  # kvctx / predictive format 2, encoded on the GPU
        blob = device_to_bytes(kvctx_device_encode.compress(tensor, prediction, *routed), threads)
        return _raw_if_smaller(blob, tensor, codec, threads)
    gpu_opts = _gpu_encode_options(tensor, prediction, codec, opts, gpu)
    if gpu_opts is not None:  # one pinned, pipelined copy of the finished blob
        return _raw_if_smaller(device_to_bytes(_compress_on_gpu(tensor, gpu_opts), threads), tensor, codec, threads)
    layout = opts.pop("layout", None)
    if layout not in (None, "kv"):
        raise ValueError(f"layout must be None or 'kv', got {layout!r}")
    resolve_threads(threads)
    container.torch_dtype_name(tensor.dtype)  # a dtype no blob can name is refused before any work
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
    meta = blob_meta(name, t.dtype, t.shape, device, checksum.crc32_parallel(tensor_bytes(t), resolve_threads(threads)),
                     pred is not None, codec_meta)
    blob = container.dumps(KIND, meta, sections)
    if codec == "auto" and name != "raw" and len(blob) > t.numel() * t.element_size():
        # the codec expanded the tensor (tiny or incompressible ones: a model's parameters and tables
        # outweigh its gain): the smaller of it and the "raw" codec's blob (the bytes verbatim, a
        # header of a few hundred bytes; decoded without the prediction)
        blob = min(blob, _raw_blob(meta, t, threads), key=len)
    return blob


def _raw_blob(meta: dict, t: torch.Tensor, threads: int) -> bytes:
    """The "raw" codec's blob of the CPU tensor ``t`` whose coded blob has ``meta`` (same crc32 and device)."""
    codec_meta, sections = registry.get("raw").encode(t, None, threads)
    return container.dumps(KIND, dict(meta, codec="raw", uses_prediction=False, codec_meta=codec_meta), sections)


def _raw_if_smaller(blob, tensor: torch.Tensor, codec: str, threads: int):
    """A GPU encoder's blob (host bytes, or a uint8 tensor on the device), or where ``codec`` is "auto" and it
    is bigger than the tensor's bytes the "raw" codec's blob if that is smaller, as :func:`compress` chooses
    on the CPU: a GPU and a CPU encode of one tensor give the same bytes. The rare expanded blob's header
    is read on the host."""
    size = blob.numel() if isinstance(blob, torch.Tensor) else len(blob)
    if codec != "auto" or size <= tensor.numel() * tensor.element_size():
        return blob
    host = _host_bytes(blob)
    header, _ = container.read_header(host)
    raw = _raw_blob(header["meta"], _as_cpu(tensor), threads)
    if len(raw) >= len(host):
        return blob
    return bytes_to_device(raw, blob.device, threads) if isinstance(blob, torch.Tensor) else raw


def compress_device(tensor: torch.Tensor, prediction: torch.Tensor | None = None, codec: str = "auto",
                    threads: int = 0, gpu: bool | None = None, **opts) -> torch.Tensor:
    """:func:`compress`, with the blob returned as a 1-D uint8 tensor on ``tensor``'s device.

    For a CUDA tensor coded on the GPU (see :func:`compress`) nothing but the JSON header and a few
    hundred bytes of statistics crosses to the host; give the tensor to :func:`decompress` (or
    ``bytes(blob.cpu().numpy())`` to any reader). Other calls code on the CPU and copy the blob.
    """
    routed = _gpu_kv_route(tensor, prediction, codec, opts, gpu)
    if routed is not None:
        return _raw_if_smaller(kvctx_device_encode.compress(tensor, prediction, *routed), tensor, codec, threads)
    gpu_opts = _gpu_encode_options(tensor, prediction, codec, opts, gpu)
    if gpu_opts is not None:
        return _raw_if_smaller(_compress_on_gpu(tensor, gpu_opts), tensor, codec, threads)
    blob = compress(tensor, prediction, codec, threads, gpu=False, **opts)
    return bytes_to_device(blob, tensor.device, threads)


_GPU_OPTIONS = {"chunk_bytes", "min_gain", "max_classes"}


def _gpu_encode_options(tensor, prediction, codec, opts, gpu) -> dict | None:
    """The planes encoder's options when this call is encoded on the GPU, else None."""
    if gpu not in (None, True, False):
        raise ValueError("gpu must be None, True or False")
    if gpu is False:
        return None
    why = None
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
        why = "the tensor is not on a CUDA device"
    elif prediction is not None or opts.get("layout") is not None or codec not in ("auto", "planes"):
        why = "only the planes codec (no prediction, no layout) encodes on the GPU"
    elif set(opts) - _GPU_OPTIONS or opts.get("max_classes", 1) != 1:
        why = "the GPU encoder takes chunk_bytes, min_gain and max_classes=1 (one table per plane)"
    elif tensor.numel() == 0 or tensor.element_size() > 8 or tensor.layout != torch.strided:
        why = "empty tensors and elements over 8 bytes are coded on the CPU"
    else:
        import kvcodec.device

        if not kvcodec.device.is_available():
            why = "CuPy is not available"
    if why is not None:
        if gpu:
            raise ValueError(f"gpu=True: {why}")
        return None
    from kvcodec.lossless.planes import DEFAULT_MIN_GAIN, check_options

    chunk_bytes = opts.get("chunk_bytes", planes_device.GPU_CHUNK_BYTES)
    min_gain = opts.get("min_gain", DEFAULT_MIN_GAIN)
    check_options(chunk_bytes, min_gain, 1)
    return {"chunk_bytes": chunk_bytes, "min_gain": min_gain}


def _compress_on_gpu(tensor: torch.Tensor, opts: dict) -> torch.Tensor:
    """The planes blob of a CUDA tensor, encoded and assembled on its device (uint8 CUDA tensor)."""
    from kvcodec.device.crc32 import crc32_many

    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    codec_meta, sections = planes_device.encode(t, **opts)
    crcs = crc32_many([t.reshape(-1).view(torch.uint8), *sections.values()]).cpu().tolist()
    meta = blob_meta("planes", t.dtype, t.shape, tensor.device, crcs[0], False, codec_meta)
    return device_container.assemble(KIND, meta, sections, crcs[1:], t.device)


def _host_bytes(blob):
    """A blob given as a uint8 tensor (e.g. from :func:`compress_device`) as host bytes; others as is."""
    if isinstance(blob, torch.Tensor):
        if blob.dtype != torch.uint8 or blob.dim() != 1:
            raise CorruptStreamError("a tensor blob must be a 1-D uint8 tensor")
        if blob.is_cuda:
            return device_to_bytes(blob.contiguous())
        return blob.detach().contiguous().numpy()
    return blob


def describe(blob) -> dict[str, Any]:
    """What a blob holds without decoding it: codec, dtype, shape, raw and compressed bytes.
    ``blob``: bytes-like or a uint8 tensor (a CUDA blob's header alone is copied)."""
    if isinstance(blob, torch.Tensor) and blob.is_cuda and blob.dtype == torch.uint8 and blob.dim() == 1:
        header, _ = device_container.read_header(blob)
        nbytes = blob.numel()
    else:
        header, mv = container.read_header(_host_bytes(blob))
        nbytes = mv.nbytes
    if header["kind"] != KIND:
        raise CorruptStreamError(f"expected a {KIND!r} container, got {header['kind']!r}")
    meta = checked_meta(header["meta"])
    dtype = dtype_from_name(meta["dtype"])
    return {
        "codec": meta["codec"],
        "dtype": meta["dtype"],
        "shape": tuple(meta["shape"]),
        "raw_bytes": numel(meta["shape"]) * dtype.itemsize,
        "compressed_bytes": nbytes,
        "uses_prediction": meta["uses_prediction"],
    }


def _load(blob, max_output_bytes) -> tuple[dict, dict]:
    """Parse a tensor blob and check its meta and declared size (nothing decoded yet)."""
    resolve_max_output(max_output_bytes)  # a bad argument is a ValueError before the blob is read
    _, meta, sections = container.loads(blob, expect_kind=KIND)
    meta = checked_meta(meta)
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
    blob = _host_bytes(blob)
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
    _, meta, sections = container.loads(_host_bytes(blob), expect_kind=KIND)
    if not isinstance(meta, dict) or meta.get("codec") != "planes" or not isinstance(meta.get("codec_meta"), dict):
        raise ValueError("not a blob of the planes codec")
    meta = checked_meta(meta)
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


def _gpu_decodable(header: dict) -> bool:
    """Whether a parsed header describes a blob the GPU kernels decode: planes (32 lanes, one table
    per plane) or kvctx / predictive format 2 with 32 lanes."""
    meta = header.get("meta") if isinstance(header, dict) else None
    if not (header.get("kind") == KIND and isinstance(meta, dict) and isinstance(meta.get("device"), str)
            and isinstance(meta.get("shape"), list) and all(type(d) is int for d in meta["shape"])
            and numel(meta["shape"]) > 0):
        return False
    if meta.get("codec") == "planes":
        return meta.get("uses_prediction") is False and planes_device.gpu_decodable(meta.get("codec_meta"))
    return meta.get("codec") in ("kvctx", "predictive") and kvctx_device.gpu_decodable(meta.get("codec_meta"))


def _cuda_kernels() -> bool:
    import kvcodec.device

    return kvcodec.device.is_available()


_blob_plans = device_container.BlobCache()  # header and plan of device blobs decoded before


def _decompress_on_device(blob: torch.Tensor, target: torch.device, max_output_bytes,
                          prediction: torch.Tensor | None = None, header=None, front=None) -> torch.Tensor | None:
    """Decode a CUDA uint8 blob on its device (None: not a blob the GPU decodes). Only the header (with,
    in the same read-back, a kvctx blob's model section) and, at the end, a few status flags cross to
    the host; checks as on the CPU (container, section crc32s, zero padding, streams, the prediction's
    and the tensor's crc32), all raising CorruptStreamError. ``header``: (header, end offset) when the
    host already parsed it from the same bytes, ``front``: those bytes (uint8; then nothing is read back
    from the device). A blob tensor decoded before reuses that decode's header and plan
    (``device_container.BlobCache``; the checks still run every time)."""
    import kvcodec.device

    if not kvcodec.device.is_available():
        return None  # no CuPy: the CPU decodes
    if not blob.is_contiguous() or blob.data_ptr() % 2:
        blob = blob.clone()  # the stream words must be 2-byte aligned
    entry = _blob_plans.get(blob) if header is None else None
    if entry is not None:
        header, header_end, header_crc = entry["header"]
    elif header is not None:
        (header, header_end), header_crc = header, None
    else:
        window = _blob_plans.front_window(blob.numel())
        header, header_end, header_crc, front = device_container.read_front(blob, window)
    if entry is None:
        if header["kind"] != KIND:
            raise CorruptStreamError(f"expected a {KIND!r} container, got {header['kind']!r}")
        meta = checked_meta(header["meta"])
    else:  # header, meta and sections as the decode that stored the entry checked them
        meta = header["meta"]
    dtype = dtype_from_name(meta["dtype"])
    check_output(numel(meta["shape"]) * dtype.itemsize, max_output_bytes, "tensor blob")
    if entry is not None:
        secs, gaps = device_container.bound(entry["sections"], blob)
    elif not _gpu_decodable(header):
        return None
    else:
        secs, gaps = device_container.sections(blob, header, header_end)
    reuse = entry if entry is not None else {} if header_crc is not None else None  # filled for the next decode
    planned = None
    if meta["codec"] != "planes":  # kvctx / predictive: a prediction only for a predictive blob coded with one
        with_pred = meta["codec"] == "predictive" and meta["uses_prediction"]
        if with_pred and prediction is None:
            return None  # the CPU path raises
        # planned before the section checks are queued: the plan copies the model section to the host
        # and waits for it, which would otherwise also wait for the checks' pass over the whole blob
        planned = reuse.get("kvctx plan") if reuse is not None else None
        if planned is None:
            planned = kvctx_device.plan(meta["codec_meta"], secs, front)
            if planned is None:
                return None
            if reuse is not None:
                reuse["kvctx plan"] = planned
    if front is not None and header_crc is not None:  # read back here (read_front): the next blobs' window
        model = secs.get("model") if planned is not None else None
        _blob_plans.note_front(blob.numel(), model.offset + model.nbytes if model is not None else header_end)
    # section crc32s on a side stream (with an entry, the header's crc32 too), queued once the decode kernel
    # is: for kvctx / predictive waiting on the device only for an event recorded before the kernel's
    # launch (they run beside the kernel); for planes after the kernel, in one pass with the decoded
    # tensor's crc32 (a planes decode is host-bound: a second pass's launch costs the host more than
    # the pass costs the device)
    header_check = (header_end, header_crc) if entry is not None else None
    if meta["codec"] == "planes":
        res = planes_device.decode(meta["codec_meta"], secs, blob.device, reuse)
        if res is not None:
            res = (*res, [])  # no checks beyond the container's
        stream_error = "planes: a rANS chunk stream is corrupt"
    else:
        res = kvctx_device.decode(meta["codec_meta"], secs, blob.device, prediction if with_pred else None,
                                  planned=planned, reuse=reuse)
        stream_error = "predictive stream payload is corrupted (rANS state check failed)"
    if res is None:
        return None
    out, status, checks = res
    if meta["codec"] == "planes":  # the tensor's crc32 in the same pass as the sections' (see above)
        integrity, extra = device_container.Checks(blob, secs, gaps, header_check, [(out, meta["crc32"])]), []
    else:
        integrity = device_container.Checks(blob, secs, gaps, header_check, [(t, c) for t, c, _ in checks],
                                            getattr(res, "ready", None))
        extra = [(out, meta["crc32"])]
    failed = integrity.read(extra, status)  # the one sync
    if failed.header_changed:  # the header changed under the entry (a write torch did not count): decode afresh
        _blob_plans.drop(blob)
        return _decompress_on_device(blob, target, max_output_bytes, prediction)
    tensor_failed, input_failed = (failed.early[0], []) if meta["codec"] == "planes" else (failed.extra[0], failed.early)
    if failed.sections:
        raise CorruptStreamError(f"section {failed.sections[0]!r}: checksum mismatch")
    if failed.padding:
        raise CorruptStreamError("nonzero padding in container")
    for (_, _, message), bad in zip(checks, input_failed):
        if bad:
            raise CorruptStreamError(message)
    if failed.stream:
        raise CorruptStreamError(stream_error)
    if tensor_failed:
        raise CorruptStreamError("decoded tensor fails its checksum: wrong prediction, or a corrupted stream")
    if reuse is not None and entry is None:  # every check passed: kept for the next decode of this tensor
        reuse["header"] = (header, header_end, header_crc)
        reuse["sections"] = device_container.unbound(secs, gaps)
        _blob_plans.put(blob, reuse)
    return out if target == blob.device else out.to(target)


def decompress(blob, prediction: torch.Tensor | None = None, threads: int = 0, device=None,
               max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> torch.Tensor:
    """Restore the tensor from :func:`compress`'s bytes, bit for bit.

    ``blob``: bytes-like, or a 1-D uint8 tensor (e.g. from :func:`compress_device`). Pass the same
    ``prediction`` that was given to ``compress`` (if one was). The result goes to ``device`` if
    given, else the prediction's device, else the blob tensor's CUDA device, else the original
    device when this machine has it, else the CPU. A ``planes`` blob bound for a CUDA device is
    decoded there (32 lanes and one table per plane: what the GPU encoder writes; see
    :mod:`kvcodec.lossless.planes_device`): a CUDA blob without leaving the device, a host blob
    after one upload; other blobs are decoded on the CPU and copied. Raises CorruptStreamError
    on damaged input, a wrong prediction, or a prediction missing or of another shape than the
    blob declares (CorruptStreamError is a ValueError).
    ``max_output_bytes``: refuse (CorruptStreamError) blobs that declare a bigger tensor, before
    anything is allocated (default ``kvcodec.validate.DEFAULT_MAX_OUTPUT_BYTES`` = 4 GiB; ``None`` = no cap): a
    constant tensor legitimately compresses to a few hundred bytes whatever its size. Every
    metadata field is validated before the codec allocates or loops (:func:`validate`).
    """
    resolve_threads(threads)
    resolve_max_output(max_output_bytes)
    gpu_tried = False
    if isinstance(blob, torch.Tensor) and blob.is_cuda and blob.dtype == torch.uint8 and blob.dim() == 1:
        target = torch.device(device) if device is not None else (
            prediction.device if prediction is not None else blob.device)
        out = _decompress_on_device(blob, target, max_output_bytes, prediction)
        if out is not None:
            return out
        gpu_tried = True  # a blob the GPU kernels cannot take: decoded on the CPU below
    blob = _host_bytes(blob)
    cuda_pred = prediction is None or (isinstance(prediction, torch.Tensor) and prediction.is_cuda)
    if not gpu_tried and cuda_pred and _cuda_kernels() and (device is None or torch.device(device).type == "cuda"):
        head, mv = container.read_header(blob)  # header only: is this a blob the GPU decodes, to a GPU?
        if _gpu_decodable(head):
            target = _target_device(head["meta"]["device"], prediction, device)
            if target.type == "cuda":
                head_end = container.PREFIX.size + container.PREFIX.unpack_from(mv, 0)[3]
                out = _decompress_on_device(bytes_to_device(blob, target, threads), target, max_output_bytes,
                                            prediction, header=(head, head_end),
                                            front=np.frombuffer(mv, np.uint8))
                if out is not None:
                    return out
    meta, sections = _load(blob, max_output_bytes)
    shape = tuple(meta["shape"])
    target = _target_device(meta["device"], prediction, device)
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
    if checksum.crc32_parallel(tensor_bytes(out), resolve_threads(threads)) != meta["crc32"]:
        raise CorruptStreamError(
            "decoded tensor fails its checksum: wrong prediction, or a corrupted stream"
        )
    return out if target.type == "cpu" else out.to(target)
