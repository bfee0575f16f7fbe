"""What a kvcodec file is, what it holds, and whether it is intact: ``kvcodec inspect [--verify]``.

kvcodec writes three kinds of bytes, told apart by their first four bytes:

- ``KVCF``: a ``.kvc`` file, a safetensors file compressed by ``kvcodec compress``
  (``kvcodec.lossless.files``);
- ``KVCC``: a container (``kvcodec.container``); its header's ``kind`` says what it holds: a saved
  ``CompressedCache`` (``kvcodec.hf.cache``), a compressed tensor (``kvcodec.tensor``), a
  quantized tensor (``kvcodec.quant.v1``), ...;
- ``KVCE``: an entropy-coded stream (``kvcodec.entropy.encode``).

``verify=True`` checks every checksum the format has by decoding everything, and raises
:class:`kvcodec.CorruptStreamError` at the first mismatch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvcodec import checksum, container, magics
from kvcodec.errors import CorruptStreamError
from kvcodec.validate import DEFAULT_MAX_OUTPUT_BYTES, check_output


@dataclass(frozen=True)
class FileFormat:
    """What a kvcodec file holds: ``key`` for code (``"kvc"``, ``"stream"`` or a container kind),
    ``description`` for people."""

    key: str
    description: str


@dataclass(frozen=True)
class Report:
    """``table``: what the file holds, as text (may be empty); ``verified``: what was checked."""

    table: str
    verified: str


# kvcodec.hf.persist's kinds, named here so that inspecting a file never imports transformers
SAVED_CACHE_KIND, SAVED_LAYER_KIND = "kvcodec.hf.cache", "kvcodec.hf.layer"
CONTAINER_KINDS = {
    SAVED_CACHE_KIND: "saved CompressedCache (CompressedCache.save; load it with CompressedCache.load(path, model))",
    "kvcodec.tensor": "compressed tensor (kvcodec.compress; restore it with kvcodec.decompress)",
    "kvcodec.quant.v1": "quantized K/V tensor (kvcodec.quant QuantizedTensor.to_bytes)",
    "kvcodec.transform": "transform-coded KV cache (kvcodec.transform)",
    "kvcodec.transform.calibration": "transform-coder calibration (kvcodec.transform)",
}


def identify(path: str | os.PathLike) -> FileFormat:
    """The format of a kvcodec file, from its magic (``kvcodec.magics``) and, for a container, its
    verified header. Raises CorruptStreamError when the file is no kvcodec format."""
    with open(path, "rb") as f:
        prefix = f.read(container.PREFIX.size)
        magic = prefix[:4]
        if magic == magics.FILE:
            return FileFormat("kvc", ".kvc file (a safetensors file compressed by 'kvcodec compress')")
        if magic == magics.STREAM:
            return FileFormat("stream", "entropy-coded stream (kvcodec.entropy.encode; decode it with kvcodec.entropy.decode)")
        if magic == magics.CONTAINER and len(prefix) == container.PREFIX.size:
            header_len = container.PREFIX.unpack(prefix)[3]
            if header_len <= container.MAX_HEADER_BYTES:
                header, _ = container.read_header(prefix + f.read(header_len))
                kind = header["kind"]
                return FileFormat(kind, CONTAINER_KINDS.get(kind, f"kvcodec container of kind {kind!r}"))
    raise CorruptStreamError(
        f"{path} is not a kvcodec file (it starts with {magic!r}; kvcodec files start with "
        f"{', '.join(map(repr, magics.LEADING))})"
    )


def describe(path: str | os.PathLike, key: str, verify: bool = False, threads: int = 0,
             max_output_bytes: int | None = DEFAULT_MAX_OUTPUT_BYTES) -> Report:
    """What the file at ``path`` (of format ``key``, from :func:`identify`) holds; with ``verify``,
    every checksum checked too, decoding at most ``max_output_bytes`` (``None``: no cap).
    Raises CorruptStreamError on damage."""
    path = Path(path)
    if key == "kvc":
        return _describe_kvc(path, verify, threads, max_output_bytes)
    data = path.read_bytes()
    if key == "stream":
        return _describe_stream(data, verify)
    if key == SAVED_CACHE_KIND:
        return _describe_saved_cache(data)
    if key == "kvcodec.tensor":
        return _describe_tensor(data, verify, threads, max_output_bytes)
    if key == "kvcodec.transform":
        return _describe_transform(data, verify, max_output_bytes)
    if key == "kvcodec.transform.calibration" and verify:
        from kvcodec.transform import Calibration

        Calibration.from_bytes(data)  # versions, shapes, finite values, orthonormal basis
    kind, meta, sections = container.loads(data)  # every section checksum
    rows = [[name, *_section_facts(v)] for name, v in sections.items()]
    table = f"meta: {', '.join(sorted(meta))}\n" + _table(["section", "type", "shape", "bytes"], rows)
    return Report(table, f"{len(sections)} sections")


# ------------------------------------------------------------------------------------- formats
def _describe_kvc(path: Path, verify: bool, threads: int, max_output_bytes: int | None) -> Report:
    from kvcodec.lossless import files

    table = files.format_inspect_table(files.inspect_file(path))
    if not verify:
        return Report(table, "")
    with files.KvcFile(path) as kf:
        check_output(kf.meta["source_bytes"], max_output_bytes, path.name)
        crc = checksum.crc32(kf.st_header)
        for entry in kf.entries:  # record crc32, then every tensor decoded with its own checks
            crc = checksum.crc32(kf.segment_bytes(entry, threads=threads, max_output_bytes=max_output_bytes), crc)
        if crc != kf.meta["source_crc32"]:
            raise CorruptStreamError("the restored safetensors bytes fail the source checksum")
        return Report(table, f"{len(kf.entries)} records decoded, the restored file's crc32 matches")


def _describe_stream(data: bytes, verify: bool) -> Report:
    from kvcodec import entropy

    head = entropy.inspect(data)
    table = (f"coder {head.coder}, {head.n} symbols of {head.dtype}, {head.streams} state(s), "
             f"header {head.header_len} B, payload {head.payload_len} B")
    if verify:
        entropy.decode(data)
    return Report(table, f"{head.n} symbols decoded")


def _describe_tensor(data: bytes, verify: bool, threads: int, max_output_bytes: int | None) -> Report:
    from kvcodec.lossless import api

    d = api.describe(data)
    shape = "x".join(map(str, d["shape"])) or "scalar"
    ratio = d["raw_bytes"] / d["compressed_bytes"] if d["compressed_bytes"] else float("nan")
    table = (f"{d['dtype']} {shape}, codec {d['codec']}, {d['raw_bytes']} -> {d['compressed_bytes']} bytes "
             f"(ratio {ratio:.3f})" + (", needs its prediction tensor to decode" if d["uses_prediction"] else ""))
    if verify:
        if d["uses_prediction"]:
            container.loads(data)  # the prediction is not in the file: section checksums only
            return Report(table, "section checksums match (decoding needs the prediction tensor)")
        api.decompress(data, threads=threads, device="cpu", max_output_bytes=max_output_bytes)
    return Report(table, "decoded, tensor crc32 matches")


def _describe_transform(data: bytes, verify: bool, max_output_bytes: int | None) -> Report:
    """A kvcodec.transform blob: shape, true bits/value, exact and coded tokens (no calibration needed)."""
    from kvcodec import transform

    d = transform.inspect(data)  # every section checksum
    table = (f"{d['dtype']} K/V {'x'.join(map(str, d['shape']))}, {d['bytes']} bytes = {d['bits_per_value']:.3f} "
             f"bits/value ({d['ratio_vs_bf16']:.2f}x vs bf16), {d['exact_tokens']} exact + {d['coded_tokens']} coded "
             f"tokens, {d['coded_components']} coded components in {d['n_streams']} rANS streams, calibration "
             f"{d['calibration']}")
    if not verify:
        return Report(table, "section checksums match")
    n = transform.verify(data, max_output_bytes)
    return Report(table, f"{n} symbols and the exact tokens decoded (reconstruction needs the calibration)")


def _describe_saved_cache(data: bytes) -> Report:
    """Per-layer tokens, blocks and bytes of a saved CompressedCache; parsing it checks every
    section checksum of the cache and of each layer."""
    _, meta, sections = container.loads(data, expect_kind=SAVED_CACHE_KIND)
    rows = []
    for name, blob in sections.items():
        _, layer_meta, tensors = container.loads(blob, expect_kind=SAVED_LAYER_KIND)
        blocks = layer_meta.get("blocks") or []
        held = [t for n, t in tensors.items() if n in ("sink_k", "win_k")]
        tokens = sum(int(b.get("length", 0)) for b in blocks if isinstance(b, dict))
        tokens += sum(int(t.shape[-2]) for t in held if t.ndim >= 2)
        rows.append([name, str(tokens), str(len(blocks)), str(len(blob))])
    options = meta.get("options") or {}
    shown = ", ".join(f"{k}={options[k]}" for k in ("method", "key_bits", "value_bits", "residual", "sink") if k in options)
    table = f"options: {shown}; model shape: {meta.get('shape')}\n" + _table(["layer", "tokens", "blocks", "bytes"], rows)
    return Report(table, f"cache and {len(rows)} layer containers, every section checksum matches")


# ------------------------------------------------------------------------------------- text
def _section_facts(value) -> list[str]:
    shape = getattr(value, "shape", None)
    if shape is None:  # a bytes section (memoryview)
        return ["bytes", str(len(value)), str(len(value))]
    nbytes = getattr(value, "nbytes", None)
    if nbytes is None:  # a torch tensor
        nbytes = value.numel() * value.element_size()
    return [str(value.dtype), "x".join(map(str, shape)) or "scalar", str(nbytes)]


def _table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(columns), fmt(["-" * w for w in widths]), *map(fmt, rows)])
