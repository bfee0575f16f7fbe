"""Checkpoints of compressed-in-memory models: one ``kvcodec.container`` file of kind ``kvcodec.weights``.

Sections: ``w<i>`` the weight blobs (``blob.encode``'s bytes, as held in memory), ``p<i>`` the other
parameters and ``b<i>`` every buffer (non-persistent ones too, so a model built on the meta device
needs nothing else), stored raw. Meta: ``{"v": 1, "weights": [{"names", "requires_grad"}], "params":
[{"names", "requires_grad"}], "buffers": [{"names"}]}``; ``names`` lists every name of a tied tensor.
Every section carries its crc32 (the container's); a weight blob is also checked by a full decode
against its own crc32 when loaded, one weight at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from kvcodec import container, safe_write
from kvcodec.errors import CorruptStreamError
from kvcodec.weights import from_safetensors
from kvcodec.weights.blob import encode
from kvcodec.weights.runtime import ATTR, Held, attach, groups, holder_for, target_device

KIND = "kvcodec.weights"
VERSION = 1


def _blob_bytes(blob):
    """A held blob as host bytes (a CUDA blob is copied back)."""
    if isinstance(blob, torch.Tensor):
        from kvcodec.device.transfer import device_to_bytes

        return device_to_bytes(blob)
    return blob


def _plain(named, skip: set[int]) -> list[tuple[list[str], torch.Tensor]]:
    """(names, tensor) of each distinct tensor of ``named`` not in ``skip`` (ids)."""
    out: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in named:
        if t is not None and id(t) not in skip:
            out.setdefault(id(t), ([], t))[0].append(name)
    return list(out.values())


def save_model(model: nn.Module, path: str | os.PathLike, overwrite: bool = False, threads: int = 0) -> int:
    """Write the model as a compressed checkpoint; returns the file's size in bytes.

    A compressed model (``compress_model``) writes the blobs it holds; a dense one has its Linear and
    Embedding weights encoded here, one at a time, and is left as it was. The file appears whole or
    not at all (``kvcodec.safe_write``: a temporary beside it, fsync'ed, then renamed); an existing file
    is replaced only with ``overwrite=True`` (else ``kvcodec.errors.WriteRefusedError``).
    """
    rt = getattr(model, ATTR, None)
    meta = {"v": VERSION, "weights": [], "params": [], "buffers": []}
    sections: dict = {}
    if rt is not None:
        weights = [(h.names, h.requires_grad, _blob_bytes(h.holder.blob)) for h in rt.held]
        skip: set[int] = set()
    else:
        found = groups(model)
        weights = [(names, p.requires_grad, encode(p.detach().cpu().contiguous(), threads)) for names, _, p in found]
        skip = {id(p) for _, _, p in found}
    for i, (names, rg, blob) in enumerate(weights):
        meta["weights"].append({"names": names, "requires_grad": bool(rg)})
        sections[f"w{i}"] = blob
    for i, (names, p) in enumerate(_plain(model.named_parameters(remove_duplicate=False), skip)):
        meta["params"].append({"names": names, "requires_grad": bool(p.requires_grad)})
        sections[f"p{i}"] = p.detach()
    for i, (names, b) in enumerate(_plain(model.named_buffers(remove_duplicate=False), set())):
        meta["buffers"].append({"names": names})
        sections[f"b{i}"] = b.detach()
    data = container.dumps(KIND, meta, sections)
    safe_write.write_bytes(path, data, overwrite=overwrite)
    return len(data)


def _entries(meta, key: str, fields: set[str]) -> list[dict]:
    entries = meta.get(key) if isinstance(meta, dict) else None
    if not isinstance(entries, list):
        raise CorruptStreamError(f"weights checkpoint: bad {key!r} list")
    for e in entries:
        if (not isinstance(e, dict) or set(e) != fields or not isinstance(e["names"], list) or not e["names"]
                or not all(isinstance(n, str) and n for n in e["names"])
                or ("requires_grad" in e and not isinstance(e["requires_grad"], bool))):
            raise CorruptStreamError(f"weights checkpoint: bad {key!r} entry")
    return entries


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod, _, attr = name.rpartition(".")
    try:
        return model.get_submodule(mod), attr
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} has no module in this model") from None


def load_model(path: str | os.PathLike, model_or_config=None, device=None, threads: int = 0) -> nn.Module:
    """A model whose Linear / Embedding weights are held compressed, from :func:`save_model`'s file, or
    compressed as it loads from a Hugging Face safetensors checkpoint (a ``.safetensors`` file or a folder
    holding ``model.safetensors`` or a sharded index: ``kvcodec.weights.from_safetensors``).

    ``model_or_config``: a model to load into (its tensors are replaced; meta-device models welcome),
    or a transformers config (the model is built on the meta device, so no dense weight is ever made);
    for a safetensors checkpoint, its config (default: the ``config.json`` beside it).
    ``device``: where everything goes (default CPU); CUDA holds the blobs on the device and decodes
    them there. The file's bytes are read once; the CPU holds the weight blobs as views of them. Each
    weight blob is checked by a full decode (one at a time); a damaged file raises CorruptStreamError.
    """
    if from_safetensors.checkpoint_files(path) is not None:  # compress on load
        if isinstance(model_or_config, nn.Module):
            raise ValueError("a safetensors checkpoint loads into a model built from its config: pass the config")
        return from_safetensors.load(path, model_or_config, device, threads)
    if model_or_config is None:
        raise ValueError("a kvcodec weights checkpoint needs the model, or its config, to load into")
    dev = target_device(device)
    data = Path(path).read_bytes()
    _, meta, secs = container.loads(data, expect_kind=KIND)
    if not isinstance(meta, dict) or meta.get("v") != VERSION or set(meta) != {"v", "weights", "params", "buffers"}:
        raise CorruptStreamError("weights checkpoint: bad meta")
    weights = _entries(meta, "weights", {"names", "requires_grad"})
    params = _entries(meta, "params", {"names", "requires_grad"})
    buffers = _entries(meta, "buffers", {"names"})
    expected = {f"w{i}" for i in range(len(weights))} | {f"p{i}" for i in range(len(params))} \
        | {f"b{i}" for i in range(len(buffers))}
    if set(secs) != expected or not all(isinstance(secs[k], torch.Tensor) for k in expected if k[0] != "w") \
            or not all(isinstance(secs[k], memoryview) for k in expected if k[0] == "w"):
        raise CorruptStreamError("weights checkpoint: sections do not match the meta")
    model = model_or_config if isinstance(model_or_config, nn.Module) else from_safetensors.meta_model(model_or_config)
    if getattr(model, ATTR, None) is not None:
        raise ValueError("the model's weights are already compressed")
    for i, e in enumerate(params):
        p = nn.Parameter(secs[f"p{i}"].to(dev), requires_grad=e["requires_grad"])
        for name in e["names"]:
            m, attr = _owner(model, name)
            _check_shape(m, attr, p, name)
            m._parameters[attr] = p
    for i, e in enumerate(buffers):
        b = secs[f"b{i}"].to(dev)
        for name in e["names"]:
            m, attr = _owner(model, name)
            _check_shape(m, attr, b, name)
            m._buffers[attr] = b
    held = []
    for i, e in enumerate(weights):
        holder = holder_for(secs[f"w{i}"], dev)
        mods = []
        for name in e["names"]:
            m, attr = _owner(model, name)
            if attr != "weight" or not isinstance(m, (nn.Linear, nn.Embedding)):
                raise ValueError(f"checkpoint weight {name!r} is not the weight of a Linear or Embedding")
            _check_shape(m, attr, holder, name)
            m._parameters.pop("weight", None)
            if all(x is not m for x in mods):
                mods.append(m)
        held.append(Held(holder, e["names"], mods, e["requires_grad"]))
    attach(model, held, dev, threads)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"the checkpoint does not hold {left[:5]} ({len(left)} tensors)")
    if not isinstance(model_or_config, nn.Module):
        model.eval()
    return model


def _check_shape(module: nn.Module, attr: str, t, name: str) -> None:
    """The stored tensor must have the shape of the one it replaces (if the model has one)."""
    old = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
    if old is not None and tuple(old.shape) != tuple(t.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model's is {tuple(old.shape)}")
