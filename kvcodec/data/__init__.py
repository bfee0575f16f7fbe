"""The real SmolLM2-135M KV sample that ships with kvcodec, and one shared attention reference.

Every test, demo and benchmark measures codecs on *real* keys/values/queries, and measures
attention-output error the same way (``attention_reference`` / ``attention_error``), so numbers
from different modules are comparable. The file is written by ``benchmarks/make_kv_sample.py``.

File format (``np.savez_compressed``, no pickled objects):
  keys, values, keys_fp8pred, values_fp8pred  uint16 [L, 3, T, 64]  (bf16 bit patterns)
  queries                                     uint16 [L, 9, n_q, 64] (last n_q positions)
  layer_ids int16 [L], token_ids int32 [T], meta_json uint8 (UTF-8 JSON)
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from kvcodec.errors import CorruptStreamError

SAMPLE_FILE = "smollm2_kv.npz"
FULL_SAMPLE_FILE = "smollm2_kv_full.npz"
FULL_SAMPLE_ENV = "KVCODEC_FULL_KV_SAMPLE"  # names the larger sample's file, wherever it is
_KV_ARRAYS = ("keys", "values", "keys_fp8pred", "values_fp8pred")


@dataclass
class KVSample:
    """Post-RoPE keys/values exactly as a bf16 cache stores them, plus real queries.

    keys, values, keys_fp8pred, values_fp8pred: bfloat16 [n_layers, 3, n_tokens, 64]
    (the ``_fp8pred`` pair comes from the same model with FP8-rounded weights: a predictor).
    queries: bfloat16 [n_layers, 9, n_q, 64], the queries of the last n_q positions.
    layer_ids: the model layer of each entry on axis 0.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    keys_fp8pred: torch.Tensor
    values_fp8pred: torch.Tensor
    layer_ids: list[int]
    token_ids: torch.Tensor
    meta: dict = field(default_factory=dict)
    _reference: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def n_q_heads(self) -> int:
        return self.queries.shape[1]

    @property
    def n_q(self) -> int:
        return self.queries.shape[2]


def default_sample_path() -> Path:
    """Where the shipped sample lives inside the installed package."""
    return Path(str(resources.files("kvcodec.data").joinpath(SAMPLE_FILE)))


def full_sample_location() -> Path:
    """Where ``python benchmarks/make_kv_sample.py --full`` writes the larger sample and where
    :func:`full_sample_path` looks for it: ``$KVCODEC_FULL_KV_SAMPLE`` if set, else
    ``smollm2_kv_full.npz`` in the user's cache folder (``$XDG_CACHE_HOME/kvcodec``, by default
    ``~/.cache/kvcodec``). Never a path inside the package or a source checkout."""
    named = os.environ.get(FULL_SAMPLE_ENV)
    if named:
        return Path(named).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvcodec" / FULL_SAMPLE_FILE


def full_sample_path() -> Path | None:
    """The larger benchmark sample if it has been made (see :func:`full_sample_location`), else None."""
    path = full_sample_location()
    return path if path.is_file() else None


def _bf16(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def load_kv_sample(path: str | Path | None = None, prefer_full: bool = False) -> KVSample:
    """Load the shipped sample (``path=None``) or a larger one written with
    ``python benchmarks/make_kv_sample.py --full`` (to :func:`full_sample_location`).
    ``prefer_full=True`` (for benchmarks) loads that larger sample when it exists and the shipped
    one otherwise; check ``sample.meta``.
    Raises CorruptStreamError for a damaged file."""
    if path is None and prefer_full:
        path = full_sample_path()
    path = Path(path) if path is not None else default_sample_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"KV sample {path} not found"
            + ("; create it with: python benchmarks/make_kv_sample.py --full" if path.name != SAMPLE_FILE else "")
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        raise CorruptStreamError(f"{path}: not a readable KV sample ({exc})") from exc
    needed = (*_KV_ARRAYS, "queries", "layer_ids", "token_ids", "meta_json")
    missing = [n for n in needed if n not in arrays]
    if missing:
        raise CorruptStreamError(f"{path}: KV sample lacks {', '.join(missing)}")
    shape = arrays["keys"].shape
    q = arrays["queries"]
    if len(shape) != 4 or any(arrays[n].shape != shape for n in _KV_ARRAYS):
        raise CorruptStreamError(f"{path}: keys/values shapes disagree")
    if q.ndim != 4 or q.shape[0] != shape[0] or q.shape[3] != shape[3] or q.shape[2] > shape[2]:
        raise CorruptStreamError(f"{path}: queries shape {q.shape} does not fit keys {shape}")
    if q.shape[1] % shape[1] != 0 or arrays["layer_ids"].shape != (shape[0],) or arrays["token_ids"].shape != (shape[2],):
        raise CorruptStreamError(f"{path}: head counts, layer ids or token ids do not fit keys {shape}")
    if any(arrays[n].dtype != np.uint16 for n in (*_KV_ARRAYS, "queries")):
        raise CorruptStreamError(f"{path}: tensors must be stored as uint16 bf16 bit patterns")
    try:
        meta = json.loads(arrays["meta_json"].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStreamError(f"{path}: metadata is not valid JSON ({exc})") from exc
    return KVSample(
        keys=_bf16(arrays["keys"]),
        values=_bf16(arrays["values"]),
        queries=_bf16(q),
        keys_fp8pred=_bf16(arrays["keys_fp8pred"]),
        values_fp8pred=_bf16(arrays["values_fp8pred"]),
        layer_ids=[int(i) for i in arrays["layer_ids"]],
        token_ids=torch.from_numpy(arrays["token_ids"].astype(np.int64)),
        meta=meta,
    )


def causal_gqa_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64 of the last n_q positions of a causal sequence.

    queries [Hq, n_q, D], keys/values [Hkv, T, D]; query j sits at position T - n_q + j and sees
    keys 0..T - n_q + j; query head h uses KV head h // (Hq // Hkv). Returns [Hq, n_q, D] float64."""
    if queries.ndim != 3 or keys.ndim != 3 or values.shape != keys.shape:
        raise ValueError("expected queries [Hq, n_q, D] and keys == values shape [Hkv, T, D]")
    hq, n_q, d = queries.shape
    hkv, t, dk = keys.shape
    if dk != d or hq % hkv or n_q > t:
        raise ValueError(f"incompatible shapes: queries {tuple(queries.shape)}, keys {tuple(keys.shape)}")
    group = hq // hkv
    q = queries.to(torch.float64)
    k = keys.to(torch.float64).repeat_interleave(group, dim=0)
    v = values.to(torch.float64).repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2) / d**0.5
    pos_q = torch.arange(t - n_q, t).unsqueeze(1)
    pos_k = torch.arange(t).unsqueeze(0)
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_reference(
    sample: KVSample, layer: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention output [9, n_q, 64] (float64) of the sample's real queries at entry ``layer``
    (an index into ``sample.layer_ids``), over the true keys/values or the given
    reconstructions ``keys``/``values`` [3, n_tokens, 64] (any float dtype)."""
    if not 0 <= layer < sample.n_layers:
        raise ValueError(f"layer index {layer} outside [0, {sample.n_layers})")
    k = sample.keys[layer] if keys is None else keys
    v = sample.values[layer] if values is None else values
    return causal_gqa_attention(sample.queries[layer], k, v)


def attention_error(
    sample: KVSample, keys_hat: torch.Tensor | None = None, values_hat: torch.Tensor | None = None
) -> float:
    """Relative error ||O_hat - O|| / ||O|| of the attention outputs over every layer, head and
    query of the sample (Frobenius norms, float64). ``keys_hat``/``values_hat`` are shaped like
    ``sample.keys``; pass only one of them to measure the key or the value error alone."""
    for name, t in (("keys_hat", keys_hat), ("values_hat", values_hat)):
        if t is not None and tuple(t.shape) != tuple(sample.keys.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(sample.keys.shape)}")
    num = 0.0
    den = 0.0
    for i in range(sample.n_layers):
        if i not in sample._reference:  # the exact outputs are reused by every later call
            sample._reference[i] = attention_reference(sample, i)
        ref = sample._reference[i]
        out = attention_reference(
            sample,
            i,
            None if keys_hat is None else keys_hat[i],
            None if values_hat is None else values_hat[i],
        )
        num += float((out - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / den) ** 0.5


__all__ = [
    "KVSample",
    "load_kv_sample",
    "default_sample_path",
    "full_sample_path",
    "full_sample_location",
    "causal_gqa_attention",
    "attention_reference",
    "attention_error",
]
