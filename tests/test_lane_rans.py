"""The one spec of the GPU kernels' 32-bit lane rANS, kvcodec/entropy/cuda/lane_rans.cuh (CPU only).

Its constants and table entries are the Python reference's (kvcodec/entropy/rans.py, rans_lanes.py and the
GPU decoder's tables, kvcodec.entropy.cuda.rans.build_table); every kernel source that codes the rANS
includes it and keeps no copy of its own; the kernel build inlines it once from another package and nvcc
finds it; the wheel ships it; and the header's own steps, compiled by g++ (tests/cuda_emulation/
lane_rans_check.cpp), write and read the reference's streams byte for byte.
"""

from __future__ import annotations

import ast
import ctypes
import operator
import re
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pytest

from kvcodec.device import build
from kvcodec.entropy import rans, rans_lanes
from kvcodec.entropy.cuda import rans as cuda_rans
from kvcodec.lossless.cuda import kvctx_decode, kvctx_encode, kvctx_plan, planes_codec

ROOT = Path(build.source_path("kvcodec.entropy.cuda/lane_rans.cuh")).parents[2]  # the kvcodec package
HEADER = ROOT / "entropy" / "cuda" / "lane_rans.cuh"
INCLUDE = '#include "kvcodec/entropy/cuda/lane_rans.cuh"'
KERNEL_SOURCES = sorted(p for p in ROOT.rglob("*") if p.suffix in (".cu", ".cuh"))
CODERS = {"rans_decode.cu", "planes_codec.cu", "kvctx_decode.cu", "kvctx_encode.cu", "kvctx_plan.cu"}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift}


def _eval(expr: str, known: dict[str, int]) -> int:
    """A C integer macro body: literals (u suffixes), + - * <<, parentheses, earlier LR_ names."""
    tree = ast.parse(re.sub(r"\b(0x[0-9a-fA-F]+|\d+)u\b", r"\1", expr.strip()), mode="eval").body

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not an integer macro: {expr!r}")

    return ev(tree)


def header_constants() -> dict[str, int]:
    consts: dict[str, int] = {}
    for name, body in re.findall(r"^#define\s+(LR_\w+)\s+(.+?)\s*(?://.*)?$", HEADER.read_text(), re.M):
        consts[name] = _eval(body, consts)
    return consts


C = header_constants()


def skewed_freqs(rng, total: int, n_symbols: int = 256, zeros: int = 40) -> np.ndarray:
    """Frequencies summing to ``total``: a skewed distribution, some symbols absent, some at 1."""
    w = rng.pareto(1.2, n_symbols) + 1e-3
    w[rng.choice(n_symbols, zeros, replace=False)] = 0
    f = np.floor(w / w.sum() * (total - n_symbols)).astype(np.int64) + (w > 0)
    f[np.argmax(f)] += total - f.sum()
    return f


# ------------------------------------------------------------------------------------ the spec's values
def test_header_constants_are_the_python_references():
    assert set(C) == {"LR_L", "LR_WORD_BITS", "LR_LANES", "LR_PREC", "LR_M", "LR_HEAD_WORDS", "LR_HEAD_BYTES",
                      "LR_ENTRY_SYM_SHIFT", "LR_WIDE_BITS", "LR_FULL"}
    assert C["LR_L"] == rans.RANS_L == rans_lanes.RANS_L == 1 << 16
    assert C["LR_WORD_BITS"] == rans.WORD_BITS
    assert C["LR_LANES"] == rans.MAX_STREAMS == cuda_rans.STATES == max(rans_lanes.LANES)
    assert (C["LR_PREC"], C["LR_M"]) == (rans_lanes.PRECISION, rans_lanes.M)
    assert C["LR_HEAD_BYTES"] == cuda_rans.HEAD == 2 * C["LR_HEAD_WORDS"]
    assert C["LR_FULL"] == (1 << C["LR_LANES"]) - 1
    # an empty stream is its head alone: the 32 states as two words each
    words = np.zeros(C["LR_HEAD_WORDS"], np.uint16)
    freq = np.full((1, 256), rans_lanes.M // 256, np.int64)
    assert rans_lanes.encode(np.zeros(0, np.uint8), 0, 1, np.zeros(1, np.int64), freq, rans_lanes.cumulative(freq),
                             C["LR_LANES"], words) == 0
    assert len(rans.encode([], [1] * 16, 4, n_streams=C["LR_LANES"])) == C["LR_HEAD_BYTES"]


def test_header_table_entries_are_the_python_references():
    """The packed entry (symbol << LR_ENTRY_SYM_SHIFT | (f - 1) << LR_PREC | slot - cum) is rans_lanes' decode
    table and build_table's mode 0; the wide one ((f - 1) << LR_WIDE_BITS | slot - cum) its mode 2."""
    rng = np.random.default_rng(3)
    freq = skewed_freqs(rng, C["LR_M"])
    packed = np.array([s << C["LR_ENTRY_SYM_SHIFT"] | (freq[s] - 1) << C["LR_PREC"] | r
                       for s in range(256) for r in range(freq[s])], np.uint32)
    assert np.array_equal(packed, rans_lanes.decode_table(freq))
    lo = int(np.flatnonzero(freq)[0])
    mode0 = cuda_rans.build_table(freq, C["LR_PREC"], np.uint8, mode=0)
    assert np.array_equal(mode0.data.view("<u4")[:C["LR_M"]], packed - (lo << C["LR_ENTRY_SYM_SHIFT"]))
    f16 = skewed_freqs(rng, 1 << 16, n_symbols=1000, zeros=100)
    wide = np.array([(f16[s] - 1) << C["LR_WIDE_BITS"] | r for s in range(1000) for r in range(f16[s])], np.uint32)
    mode2 = cuda_rans.build_table(f16, 16, np.uint16, mode=2)
    assert np.array_equal(mode2.data.view("<u4")[:1 << 16], wide)


# ------------------------------------------------------------------------------------ one copy
def test_every_rans_kernel_includes_the_header_and_keeps_no_copy():
    """A kernel source that codes the rANS includes the header; no kernel source defines a constant of the
    header's (a name ending as one of its names does, or, in a coder, the state bound's value), or writes out
    the steps the header holds (the reciprocal division, the entries' frequency fields)."""
    roles = {name.removeprefix("LR_") for name in C} - {"FULL"}  # the kernels' warp masks are their own
    sources = [p for p in KERNEL_SOURCES if p != HEADER]
    coders = {p.name for p in sources if re.search(r"\brANS\b", p.read_text())}
    assert coders == CODERS
    copies = ("__umulhi(", "0x100000000ull", "0xFFFu) + 1u", ">> 16) + 1u")
    for p in sources:
        text = p.read_text()
        assert (INCLUDE in text) == (p.name in CODERS), p.name
        for name, body in re.findall(r"^\s*#define\s+(\w+)[ \t]+([^\n]*)", text, re.M):
            assert not name.startswith("LR_"), f"{p.name} defines {name}"
            assert not any(name.endswith("_" + role) for role in roles), f"{p.name} defines {name}"
            literal = re.fullmatch(r"\(?\s*(0x[0-9a-fA-F]+|\d+)u?\s*\)?\s*(//.*)?", body.strip())
            if p.name in CODERS and literal:
                assert int(literal.group(1), 0) != C["LR_L"], f"{p.name}: {name} {body}"
        for step in copies:
            assert step not in text, f"{p.name} writes out {step!r}"
    assert "__umulhi(" in HEADER.read_text() and "0x100000000ull" in HEADER.read_text()


@pytest.mark.parametrize("source", [cuda_rans.SOURCE, planes_codec.SOURCE, kvctx_decode.SOURCE, kvctx_encode.SOURCE,
                                    kvctx_plan.SOURCE])
def test_the_build_inlines_the_header_once(source):
    """kvctx_encode.cu includes it twice (itself and through kvctx_decode.cu): NVRTC gets one copy."""
    text = build.source_text(source)
    assert text.count("#define LR_L ") == 1 and text.count("typedef unsigned int lr_u32;") == 1
    assert "#include \"" not in text and "#pragma once" not in text


def test_include_names_and_the_nvcc_include_path():
    assert build.include_source("kvctx_decode.cu", "kvcodec.lossless.cuda") == "kvcodec.lossless.cuda/kvctx_decode.cu"
    name = build.include_source("kvcodec/entropy/cuda/lane_rans.cuh", "kvcodec.lossless.cuda")
    assert name == "kvcodec.entropy.cuda/lane_rans.cuh" and build.source_path(name) == HEADER
    for bad in ("../../entropy/cuda/lane_rans.cuh", "torch/x.cuh", "kvcodec/entropy-x/a.cuh"):
        with pytest.raises(ValueError):
            build.include_source(bad, "kvcodec.lossless.cuda")
    cmd = build.nvcc_command("w.cu", "sm_90", "o.cubin")
    assert f"-I{build.include_root()}" in cmd and (build.include_root() / INCLUDE.split('"')[1]) == HEADER


def test_package_data_ships_every_kernel_source():
    tomllib = pytest.importorskip("tomllib")
    globs = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for p in KERNEL_SOURCES:
        package = ".".join(p.parent.relative_to(ROOT.parent).parts)
        assert any(fnmatch(p.name, g) for g in globs.get(package, ())), f"{package}: {p.name} is not shipped"


# ------------------------------------------------------------------------------------ the steps, run by g++
@pytest.fixture(scope="module")
def lib(cpu_emulator):
    lib = cpu_emulator("lane_rans_check")
    p, ll, i = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    lib.lr_check_table.argtypes = [p, p]
    lib.lr_check_encode.argtypes = [p, ll, p, p, ll]
    lib.lr_check_encode.restype = ll
    lib.lr_check_decode.argtypes = [p, ll, p, i, p, ll]
    lib.lr_check_decode.restype = i
    lib.lr_check_decode_wide.argtypes = [p, ll, p, p, i, p, ll]
    lib.lr_check_decode_wide.restype = i
    return lib


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _encode(lib, sym: np.ndarray, freq: np.ndarray) -> np.ndarray | None:
    f32 = np.ascontiguousarray(freq, np.uint32)
    cap = sym.size + 2 * C["LR_LANES"]
    words = np.zeros(cap, np.uint16)
    first = lib.lr_check_encode(_ptr(sym), sym.size, _ptr(f32), _ptr(words), cap)
    return None if first < 0 else words[first:]


def _reference(sym: np.ndarray, freq: np.ndarray) -> np.ndarray:
    words = np.zeros(sym.size + 2 * C["LR_LANES"], np.uint16)
    f = freq.reshape(1, 256).astype(np.int64)
    first = rans_lanes.encode(sym, 0, max(sym.size, 1), np.zeros(1, np.int64), f, rans_lanes.cumulative(f),
                              C["LR_LANES"], words)
    return words[first:]


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000, 6000])
def test_header_steps_code_the_reference_stream(lib, n):
    """lr_encode_step / lr_encode_head write rans_lanes.encode's words; lr_decode_entry, lr_needs_word,
    lr_refill, lr_rank and lr_state read them back; the table from lr_entry is rans_lanes.decode_table."""
    rng = np.random.default_rng(n)
    freq = skewed_freqs(rng, C["LR_M"])
    sym = rng.choice(256, n, p=freq / freq.sum()).astype(np.uint8)
    ones = np.flatnonzero(freq == 1)[:8]  # symbols of frequency 1: lr_reciprocal's 0xffffffff
    sym[: min(n, ones.size)] = ones[: min(n, ones.size)]
    words = _encode(lib, sym, freq)
    assert np.array_equal(words, _reference(sym, freq))
    tab = np.zeros(C["LR_M"], np.uint32)
    lib.lr_check_table(_ptr(np.ascontiguousarray(freq, np.uint32)), _ptr(tab))
    assert np.array_equal(tab, rans_lanes.decode_table(freq))
    out = np.zeros(n, np.uint8)
    assert lib.lr_check_decode(_ptr(words), words.size, _ptr(tab), C["LR_PREC"], _ptr(out), n) == 0
    assert np.array_equal(out, sym)
    if n >= 1000:  # a stream one word short, or with a word too many, fails the end checks
        assert lib.lr_check_decode(_ptr(words), words.size - 1, _ptr(tab), C["LR_PREC"], _ptr(out), n) == 3
        longer = np.append(words, np.uint16(7))
        assert lib.lr_check_decode(_ptr(longer), longer.size, _ptr(tab), C["LR_PREC"], _ptr(out), n) == 3


def test_header_encoder_edges(lib):
    """A certain symbol (f = LR_M: never renormalises, reciprocal 0xffffffff path at f = 1 beside it) and a
    symbol without frequency (reported, as the kernels report it)."""
    freq = np.zeros(256, np.int64)
    freq[7] = C["LR_M"]
    sym = np.full(500, 7, np.uint8)
    assert np.array_equal(_encode(lib, sym, freq), _reference(sym, freq))
    assert _encode(lib, sym, freq).size == C["LR_HEAD_WORDS"]
    freq[7], freq[8], freq[9] = C["LR_M"] - 2, 1, 1
    sym[::3] = 8
    sym[1::7] = 9
    assert np.array_equal(_encode(lib, sym, freq), _reference(sym, freq))
    sym[100] = 10
    assert _encode(lib, sym, freq) is None


@pytest.mark.parametrize("precision", [12, 16])
def test_header_wide_entries_decode_rans_py_payloads(lib, precision):
    """lr_entry_freq / lr_entry_low at LR_WIDE_BITS with lr_decode_advance read the spec's own 32-state
    payloads (rans.encode) through build_table's mode 2 entries, 16-bit symbols."""
    rng = np.random.default_rng(precision)
    freq = skewed_freqs(rng, 1 << precision, n_symbols=700, zeros=50)
    sym = rng.choice(700, 3000, p=freq / freq.sum()).astype(np.uint16)
    payload = rans.encode(sym, freq, precision, n_streams=C["LR_LANES"])
    tb = cuda_rans.build_table(freq, precision, np.uint16, mode=2)
    m = 1 << precision
    tab = np.ascontiguousarray(tb.data[: 4 * m].view("<u4"))
    syms = np.ascontiguousarray(tb.data[tb.aux: tb.aux + 2 * m].view("<u2"))
    words = np.frombuffer(payload, "<u2").copy()
    out = np.zeros(sym.size, np.uint16)
    assert lib.lr_check_decode_wide(_ptr(words), words.size, _ptr(tab), _ptr(syms), precision, _ptr(out),
                                    sym.size) == 0
    assert np.array_equal(out, sym)
    words[0] = words[1] = 0  # lane 0's state below LR_L
    assert lib.lr_check_decode_wide(_ptr(words), words.size, _ptr(tab), _ptr(syms), precision, _ptr(out),
                                    sym.size) == 2
