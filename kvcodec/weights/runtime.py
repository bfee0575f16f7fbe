"""Weights held compressed inside a model and decoded just before the module that uses them runs.

Each compressed ``nn.Linear`` / ``nn.Embedding`` loses its ``weight`` parameter: the attribute is a
meta-device placeholder (shape and dtype, no data) outside the module's call. A forward pre-hook
decodes the blob and sets ``weight`` to the decoded tensor; a forward hook puts the placeholder back.

- CPU: the numba decoder (``blob.HostWeight``) writes into one scratch buffer the size of the
  largest weight, reused by every module (they run one at a time). An embedding lookup decodes only
  the 64 KiB chunks that hold the looked-up rows. When autograd may need the weight later (grad mode
  on and an input that requires grad) the weight is decoded into a fresh tensor instead.
- CUDA: the GPU planes decoder (``device.DeviceWeight``). The module that ran after this one last time
  is decoded next, on a side stream, while this one computes; the main stream waits on its event
  only when it needs it. At most two decoded weights are alive (this one and the next).

Inference only: the compressed tensors are not parameters, so nothing trains them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvcodec.weights.blob import DTYPES, HostWeight, encode
from kvcodec.weights.report import WeightReport, WeightRow

ATTR = "_kvcodec_weights"


def compressible(module: nn.Module, on_meta: bool = False) -> bool:
    """A Linear or Embedding whose weight is a parameter of a dtype the format takes (with data, or with
    ``on_meta`` a meta-device placeholder of a model about to be loaded)."""
    p = module._parameters.get("weight") if isinstance(module, (nn.Linear, nn.Embedding)) else None
    return (isinstance(p, torch.Tensor) and p.dtype in DTYPES and p.numel() > 0
            and (p.device.type == "meta") == on_meta)


class Held:
    """One compressed tensor (tied weights: one for all its modules) and the modules that use it."""

    def __init__(self, holder, names: list[str], modules: list[nn.Module], requires_grad: bool = False):
        self.holder = holder
        self.names = names
        self.modules = modules
        self.requires_grad = requires_grad
        self.placeholder = torch.empty(holder.shape, dtype=holder.dtype, device="meta")
        self.pending = None  # CUDA: (tensor, event) decoded ahead on the side stream

    def row(self) -> WeightRow:
        h = self.holder
        return WeightRow(self.names[0], tuple(self.names[1:]), str(h.dtype).removeprefix("torch."), tuple(h.shape),
                         h.nbytes_decoded, h.nbytes)


class Runtime:
    """The hooks and buffers of one compressed model (kept on the model as ``_kvcodec_weights``)."""

    def __init__(self, held: list[Held], device: torch.device, threads: int = 0):
        self.held = held
        self.device = device
        self.threads = threads
        self.by_module = {id(m): h for h in held for m in h.modules}
        self.cuda = device.type == "cuda"
        largest = max((h.holder.nbytes_decoded for h in held), default=0)
        self.scratch = None if self.cuda else torch.empty(largest, dtype=torch.uint8)
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.successor: dict[int, nn.Module] = {}
        self.last: nn.Module | None = None
        self.handles = []
        for h in held:
            for m in h.modules:
                m._parameters.pop("weight", None)
                m.__dict__["weight"] = h.placeholder
                self.handles.append(m.register_forward_pre_hook(self._pre_cuda if self.cuda else self._pre_cpu))
                self.handles.append(m.register_forward_hook(self._post))

    # ---- CPU
    def _pre_cpu(self, module, args):
        h = self.by_module[id(module)]
        w = h.holder
        fresh = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        buf = torch.empty(w.nbytes_decoded, dtype=torch.uint8) if fresh else self.scratch[: w.nbytes_decoded]
        w.decode_into(buf.numpy(), self._embedding_chunks(module, w, args), self.threads)
        module.__dict__["weight"] = buf.view(w.dtype).view(w.shape)

    @staticmethod
    def _embedding_chunks(module, w: HostWeight, args):
        """The chunks an embedding lookup reads (None: decode all)."""
        if not isinstance(module, nn.Embedding) or module.max_norm is not None or not args:
            return None
        ids = args[0]
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
            return None
        flat = ids.reshape(-1)
        if int(flat.min()) < 0 or int(flat.max()) >= module.num_embeddings:
            return None  # F.embedding raises; let it see the whole (decoded) table
        chunks = w.chunks_of_rows(flat.cpu().numpy(), module.embedding_dim)
        return chunks if chunks.size < w.n_chunks else None

    # ---- CUDA
    def _pre_cuda(self, module, args):
        h = self.by_module[id(module)]
        main = torch.cuda.current_stream(self.device)
        if self.last is not None:
            self.successor[id(self.last)] = module
        self.last = module
        if h.pending is not None:
            t, ev = h.pending
            h.pending = None
            main.wait_event(ev)
            t.record_stream(main)  # made on the side stream: its memory is not reused before main is done with it
        else:
            t = h.holder.decode()
        nxt = self.successor.get(id(module))
        hn = self.by_module.get(id(nxt)) if nxt is not None else None
        if hn is not None and hn is not h and hn.pending is None:
            with torch.cuda.stream(self.side):
                ahead = hn.holder.decode()
                ev = torch.cuda.Event()
                ev.record(self.side)
            hn.pending = (ahead, ev)
        module.__dict__["weight"] = t.view(h.holder.dtype).view(h.holder.shape)

    def _post(self, module, args, output):
        module.__dict__["weight"] = self.by_module[id(module)].placeholder

    # ---- whole model
    def report(self) -> WeightReport:
        return WeightReport(str(self.device), [h.row() for h in self.held],
                            0 if self.scratch is None else self.scratch.numel())

    def restore(self) -> None:
        """Decode every weight back into a parameter and remove the hooks."""
        for hd in self.handles:
            hd.remove()
        for h in self.held:
            h.pending = None
            t = h.holder.decode()
            p = nn.Parameter(t.view(h.holder.dtype).view(h.holder.shape), requires_grad=h.requires_grad)
            for m in h.modules:
                m.__dict__.pop("weight", None)
                m._parameters["weight"] = p
        self.held, self.by_module, self.scratch = [], {}, None


def groups(model: nn.Module, on_meta: bool = False) -> list[tuple[list[str], list[nn.Module], torch.Tensor]]:
    """(parameter names, modules, the parameter) of each distinct compressible weight, model order."""
    found: dict[int, tuple[list[str], list[nn.Module], torch.Tensor]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if compressible(m, on_meta):
            p = m._parameters["weight"]
            names, mods, _ = found.setdefault(id(p), ([], [], p))
            names.append(f"{name}.weight" if name else "weight")
            if all(x is not m for x in mods):
                mods.append(m)
    return list(found.values())


def holder_for(blob, device: torch.device, verify: bool = True):
    """The CPU or CUDA holder of a weight blob (bytes-like, or a uint8 tensor) for ``device``."""
    if device.type == "cuda":
        from kvcodec.device.transfer import bytes_to_device
        from kvcodec.weights.device import DeviceWeight

        if not isinstance(blob, torch.Tensor):
            blob = bytes_to_device(blob, device)
        return DeviceWeight(blob.to(device), verify)
    if device.type != "cpu":
        raise ValueError(f"compressed weights live on a CPU or CUDA device, not {device}")
    return HostWeight(blob, verify)


def target_device(device) -> torch.device:
    """Where a loaded model goes: ``device`` (default CPU), a CUDA device with its index."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def attach(model: nn.Module, held: list[Held], device: torch.device, threads: int = 0) -> WeightReport:
    rt = Runtime(held, device, threads)
    object.__setattr__(model, ATTR, rt)
    return rt.report()


def compress_model(model: nn.Module, device=None, threads: int = 0) -> WeightReport:
    """Compress the model's Linear and Embedding weights in place (tied weights once); see the module doc.

    ``device``: where the blobs are held and decoded (default: the weights' device); the rest of the
    model is moved there after its big weights are compressed. Each weight is encoded, checked by a
    full decode, and its dense parameter dropped before the next one is encoded.
    """
    if getattr(model, ATTR, None) is not None:
        raise ValueError("the model's weights are already compressed")
    found = groups(model)
    devices = {p.device for _, _, p in found}
    if device is None and len(devices) > 1:
        raise ValueError(f"weights on several devices {devices}: pass device=")
    dev = torch.device(device) if device is not None else (devices.pop() if devices else torch.device("cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    held = []
    for names, mods, p in found:
        t = p.detach().to(dev if dev.type == "cuda" else "cpu")
        held.append(Held(holder_for(encode(t.contiguous(), threads), dev), names, mods, p.requires_grad))
        for m in mods:
            m._parameters.pop("weight", None)
            m.__dict__["weight"] = held[-1].placeholder
        del t, p
    if device is not None:
        model.to(dev)
    return attach(model, held, dev, threads)


def decompress_model(model: nn.Module) -> None:
    """Undo :func:`compress_model` / a compressed ``load_model``: dense parameters, no hooks."""
    rt = getattr(model, ATTR, None)
    if rt is None:
        raise ValueError("the model's weights are not compressed")
    rt.restore()
    object.__delattr__(model, ATTR)


def model_report(model: nn.Module) -> WeightReport:
    """The report of a compressed model (what :func:`compress_model` returned, current)."""
    rt = getattr(model, ATTR, None)
    if rt is None:
        raise ValueError("the model's weights are not compressed")
    return rt.report()
