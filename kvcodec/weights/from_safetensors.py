"""Compress on load: a Hugging Face safetensors checkpoint straight into the compressed-in-memory form.

Why: ``compress_model`` needs the dense model first (its weights materialised once, on the host or the
device). Here the model is built on the meta device, and each Linear / Embedding weight is read from
the file alone, encoded (on the target device), checked and dropped before the next one is read, so
the peak is the compressed model plus one dense weight. Other parameters and persistent buffers are
copied as stored; non-persistent buffers (rotary frequencies and the like, which checkpoints do not
hold) are made by the model's own ``_init_weights``, as transformers' ``from_pretrained`` makes them.

A checkpoint is a ``.safetensors`` file, or a folder with ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (and ``config.json`` when no config is given).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from kvcodec.weights.blob import DTYPES, encode
from kvcodec.weights.runtime import Held, attach, groups, holder_for, target_device


def checkpoint_files(path: str | os.PathLike) -> list[Path] | None:
    """The safetensors files of a checkpoint path, or None when the path is not one."""
    p = Path(path)
    if p.is_file():
        return [p] if p.suffix == ".safetensors" else None
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map")
            return sorted({p / name for name in weight_map.values()})
        if (p / "model.safetensors").is_file():
            return [p / "model.safetensors"]
    return None


def meta_model(config) -> nn.Module:
    """The model of a transformers config on the meta device (no weight memory), in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def _set(model: nn.Module, name: str, value: torch.Tensor) -> bool:
    """Put a stored tensor in its parameter or persistent buffer; False when the model has no such tensor
    (transformers skips those keys too: older checkpoints hold per-layer rotary frequencies)."""
    mod, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(mod)
    except AttributeError:
        return False
    if attr in owner._parameters:
        old = owner._parameters[attr]
    elif attr in owner._buffers and attr not in owner._non_persistent_buffers_set:
        old = owner._buffers[attr]
    else:
        return False
    if old is not None and tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, the model's is {tuple(old.shape)}")
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else False)
    else:
        owner._buffers[attr] = value
    return True


def load(path: str | os.PathLike, config=None, device=None, threads: int = 0) -> nn.Module:
    """The model of a safetensors checkpoint with its Linear / Embedding weights held compressed (see the
    module doc). ``config``: a transformers config (default: ``config.json`` beside the weights)."""
    from safetensors import safe_open

    files = checkpoint_files(path)
    if files is None:
        raise ValueError(f"{path} is not a safetensors checkpoint (a .safetensors file or a folder holding one)")
    if config is None:
        from transformers import AutoConfig

        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        config = AutoConfig.from_pretrained(folder)
    dev = target_device(device)
    model = meta_model(config)
    where = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            where.update(dict.fromkeys(sf.keys(), f))

    def read(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt", device="cpu") as sf:
            return sf.get_tensor(name)

    held, done = [], set()
    for names, mods, p in groups(model, on_meta=True):  # each distinct (tied once) weight, its names
        stored = [n for n in names if n in where]
        if not stored:
            raise ValueError(f"the checkpoint does not hold {names[0]!r}")
        t = read(stored[0])
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"checkpoint tensor {stored[0]!r} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
        if t.dtype not in DTYPES:  # the format holds bf16, fp16 and fp8: other dtypes stay dense
            continue
        t = t.to(dev)
        held.append(Held(holder_for(encode(t.contiguous(), threads), dev), names, mods, False))
        for m in mods:
            m._parameters.pop("weight", None)
        done.update(names)
        del t
    skipped = [name for name in where if name not in done and not _set(model, name, read(name).to(dev))]
    if skipped:
        warnings.warn(f"{len(skipped)} checkpoint tensors have no place in the model, e.g. {skipped[:3]}", stacklevel=2)
    # non-persistent buffers are not in checkpoints: the model's own initialisation makes them
    for mod in model.modules():
        meta = [k for k, b in mod._buffers.items() if b is not None and b.device.type == "meta"]
        if meta and not any(isinstance(p, torch.Tensor) and p.device.type == "meta" for p in mod._parameters.values()):
            for k in meta:
                mod._buffers[k] = torch.empty_like(mod._buffers[k], device=dev)
            with torch.no_grad():
                model._init_weights(mod)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"the checkpoint does not hold {left[:5]} ({len(left)} tensors)")
    attach(model, held, dev, threads)
    return model
