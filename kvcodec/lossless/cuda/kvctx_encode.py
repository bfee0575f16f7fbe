"""Launchers of the kvctx / predictive format 2 GPU encoder (``kvctx_encode.cu``): parameter-fit sums,
symbolise + histograms, the per-chunk raw-bit writer and rANS coder.

Each function takes torch tensors (CUDA, or CPU ones under the tests' CPU emulation of the kernels),
launches on torch's current stream and does not synchronize. Kernels are started through ``runner``:
``gpu_runner`` (CuPy, the default) or a stand-in with its signature (``tests/cuda_emulation``). The
orchestration (what to fit, the tables, the stream layout) is ``kvcodec.lossless.kvctx_device_encode``.
"""

from __future__ import annotations

import numpy as np
import torch

SOURCE = "kvcodec.lossless.cuda/kvctx_encode.cu"
WARPS = 4  # chunks per block of ke_encode and ke_bits (one warp each)
THREADS = 256  # columns per block of the per-column kernels
HIST_COPIES = 32  # KE_HIST_COPIES
LANES = 32
WIDTHS = (1, 2)  # bytes per bit pattern

_P = "const void*, const float*, const double*"
SIGNATURES = {
    "ke_fit_moments": f"({_P}, const double*, long long, long long, int, long long, long long, double*)",
    "ke_fit_residuals": (f"({_P}, const double*, const double*, const double*, int, const double*, const double*, "
                         "const double*, int, long long, long long, int, long long, long long, double*)"),
    "ke_symbolise": ("(const void*, const float*, const double*, const double*, const double*, const int*, int, "
                     "const unsigned char*, int, int, int, int, int, long long, long long, int, long long, long long, long long, "
                     "long long, int, unsigned short*, unsigned long long*, unsigned long long*, unsigned long long*)"),
    "ke_fit_location": ("(const double*, long long, int, int, const double*, double*, double*, signed char*, double*, "
                        "signed char*)"),
    "ke_fit_coefficient": "(const double*, long long, const double*, double*, signed char*)",
    "ke_fit_scale": "(const double*, const double*, long long, const double*, double*, double*)",
    "ke_bin_params": ("(const double*, const double*, const signed char*, const signed char*, const long long*, "
                      "long long, long long, int, int, const double*, double*, double*, double*, int*, int*)"),
    "ke_plane_hist": "(const unsigned char*, int, long long, int, int, unsigned long long*)",
    "ke_encode": ("(const unsigned short*, const long long*, int, const long long*, int, const unsigned int*, "
                  "const unsigned int*, unsigned short*, long long, long long*)"),
    "ke_bits": ("(const unsigned long long*, const long long*, int, const long long*, const long long*, "
                "unsigned int*, long long*)"),
}


def instance_declarations() -> list[str]:
    """Explicit instantiations for the nvcc compile check."""
    out = [f"__global__ void ke_fit_moments<{w}>{SIGNATURES['ke_fit_moments']}" for w in WIDTHS]
    out += [f"__global__ void {symbolise_name(w, mag)}{SIGNATURES['ke_symbolise']}" for w in WIDTHS
            for mag in (False, True)]
    out += [f"__global__ void ke_fit_residuals<{w}, {n}>{SIGNATURES['ke_fit_residuals']}" for w in WIDTHS
            for n in (1, 2)]
    return out + [f"__global__ void {k}<{WARPS}>{SIGNATURES[k]}" for k in ("ke_encode", "ke_bits")]


def symbolise_name(width: int, mag: bool) -> str:
    """ke_symbolise's instance for ``width``-byte patterns and the stream's "mag" flag (its own instances)."""
    return f"ke_symbolise<{width}, {str(bool(mag)).lower()}>"


_smem_raised: dict = {}  # id(kernel) -> the dynamic shared memory its limit was raised to


def gpu_runner(name: str, grid: int, block: int, args: tuple, device, smem: int = 0) -> None:
    """Launch kernel instance ``name`` (e.g. ``"ke_encode<4>"``) on torch's current stream with ``smem``
    bytes of dynamic shared memory (a kernel's limit is raised once, the first time it needs more)."""
    from kvcodec.device import build

    fn = build.get_function(SOURCE, name)
    if smem > _smem_raised.get(id(fn), 0):  # may be over the 48 KB default (kernels are cached: ids stay)
        fn.max_dynamic_shared_size_bytes = smem
        _smem_raised[id(fn)] = smem
    with build.cupy_stream(device):
        fn((grid,), (block,), args, shared_mem=smem)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(t.data_ptr() if t is not None else 0)


def _columns(shape, tb: int) -> tuple[int, int]:
    g, tt, d = shape
    nblk = -(-tt // tb)
    return nblk, g * nblk * d


def fit_moments(pats, pred, val, lw, shape, tb: int, runner=gpu_runner) -> torch.Tensor:
    """float64 [G, nblk, D, 7] per-column sums (n, sum x, sum p, sum x p, sum p p, n widths, sum log2
    width: params._fit_moments' fields)."""
    g, tt, d = shape
    nblk, cols = _columns(shape, tb)
    out = torch.empty((g, nblk, d, 7), dtype=torch.float64, device=pats.device)
    runner(f"ke_fit_moments<{pats.element_size()}>", -(-cols // THREADS), THREADS,
           (_ptr(pats), _ptr(pred), _ptr(val), _ptr(lw), np.int64(g), np.int64(tt), np.int32(d), np.int64(tb),
            np.int64(nblk), _ptr(out)), pats.device)
    return out


def fit_residuals(pats, pred, val, locations, shape, tb: int, runner=gpu_runner) -> torch.Tensor:
    """float64 [G, nblk, D, len(locations), 3] per-column sums (residual x previous deviation, previous
    deviation squared, residual squared) under each of one or two ``locations`` (m, c, a, shared): m, c,
    a float64 [Gp * D] device tensors, Gp = 1 when shared), in one pass over the tensor."""
    g, tt, d = shape
    nblk, cols = _columns(shape, tb)
    sets = len(locations)
    out = torch.empty((g, nblk, d, sets, 3), dtype=torch.float64, device=pats.device)
    args = []
    for m, c, a, shared in (*locations, (None, None, None, False))[:2]:
        args += [_ptr(m), _ptr(c), _ptr(a), np.int32(shared)]
    runner(f"ke_fit_residuals<{pats.element_size()}, {sets}>", -(-cols // THREADS), THREADS,
           (_ptr(pats), _ptr(pred), _ptr(val), *args, np.int64(g), np.int64(tt), np.int32(d), np.int64(tb),
            np.int64(nblk), _ptr(out)), pats.device)
    return out


def _per_channel(name: str, n: int, args: tuple, device, runner) -> None:
    runner(name, max(1, -(-n // THREADS)), THREADS, args, device)


def fit_location(mom, gain: int, prev_one: bool, consts, runner=gpu_runner):
    """(m, c float64, c_q int8, a float64, a_q int8) [n] of each channel's moments ``mom`` (float64 [n, 7]):
    ``gain`` 0 (none), 1 (one) or 2 (fitted); ``consts``: kvctx_device_fit's float64 constants."""
    n, dev = mom.shape[0], mom.device
    m, c, a = (torch.empty(n, dtype=torch.float64, device=dev) for _ in range(3))
    c_q, a_q = (torch.empty(n, dtype=torch.int8, device=dev) for _ in range(2))
    _per_channel("ke_fit_location", n, (_ptr(mom), np.int64(n), np.int32(gain), np.int32(prev_one), _ptr(consts),
                                        _ptr(m), _ptr(c), _ptr(c_q), _ptr(a), _ptr(a_q)), dev, runner)
    return m, c, c_q, a, a_q


def fit_coefficient(res, consts, runner=gpu_runner):
    """(a float64, a_q int8) [n]: the previous-token coefficient from residual sums ``res`` (float64 [n, 3])."""
    n, dev = res.shape[0], res.device
    a, a_q = torch.empty(n, dtype=torch.float64, device=dev), torch.empty(n, dtype=torch.int8, device=dev)
    _per_channel("ke_fit_coefficient", n, (_ptr(res), np.int64(n), _ptr(consts), _ptr(a), _ptr(a_q)), dev, runner)
    return a, a_q


def fit_scale(mom, res, consts, runner=gpu_runner):
    """(s, estimated bits) float64 [n] of each channel's moments and residual sums."""
    n, dev = mom.shape[0], mom.device
    s, bits = torch.empty(n, dtype=torch.float64, device=dev), torch.empty(n, dtype=torch.float64, device=dev)
    _per_channel("ke_fit_scale", n, (_ptr(mom), _ptr(res), np.int64(n), _ptr(consts), _ptr(s), _ptr(bits)), dev,
                 runner)
    return s, bits


def bin_params(s, m, c_q, a_q, won, shared_row: int, n: int, d: int, eoff: int, consts, runner=gpu_runner):
    """(kernel arguments [m, c, a float64 [n], (es, level) int32 [n, 2]], stored field values int32 [4, n])
    of the first ``n`` stacked channels, or of the shared row ``shared_row`` broadcast where the 0-d int64
    device tensor ``won`` is nonzero (None: never)."""
    dev = s.device
    pm, pc, pa = (torch.empty(n, dtype=torch.float64, device=dev) for _ in range(3))
    pel = torch.empty((n, 2), dtype=torch.int32, device=dev)
    values = torch.empty((4, n), dtype=torch.int32, device=dev)
    _per_channel("ke_bin_params", n, (_ptr(s), _ptr(m), _ptr(c_q), _ptr(a_q), _ptr(won), np.int64(shared_row),
                                      np.int64(n), np.int32(d), np.int32(eoff), _ptr(consts), _ptr(pm), _ptr(pc),
                                      _ptr(pa), _ptr(pel), _ptr(values)), dev, runner)
    return [pm, pc, pa, pel], values


def plane_histograms(planes, d: int, runner=gpu_runner) -> torch.Tensor:
    """int64 [2, P, 256]: the byte histogram of each plane of ``planes`` (uint8 [P, n]) over its first ``d``
    bytes and over all of them."""
    n_planes, n = planes.shape
    out = torch.zeros((2, n_planes, 256), dtype=torch.int64, device=planes.device)
    per_plane = max(1, min(64, -(-n // 4096)))
    runner("ke_plane_hist", n_planes * per_plane, 32, (_ptr(planes), np.int32(n_planes), np.int64(n), np.int32(d),
                                                      np.int32(per_plane), _ptr(out)), planes.device)
    return out


def symbolise(pats, pred, margs, shared: bool, escape, grid: tuple, shape, tb: int, gb: int, unit: int,
              n_chunks: int, n_keys: int, spare: int = 0, runner=gpu_runner, mag: bool = False):
    """(keys int16 [G*T*D + spare]: class << 8 | symbol, raw int64 [G*T*D]: raw code << 8 | bit count,
    hist int64 [HIST_COPIES, n_keys], chunk raw-bit totals int64 [n_chunks]);
    ``margs``: device tensors m, c, a (float64 [Gp * D]) and es, level (int32 [Gp * D, 2]);
    ``grid``: the dtype's ``(width, sign, mb, maxmag, eoff)``; chunks of ``gb`` leading indices a block,
    blocks within multiples of ``unit`` (``format2.chunk_layout``); ``spare``: keys after the tensor's
    values left for the caller (the model's field bytes, coded in the same :func:`encode_chunks` launch);
    ``mag``: symbols and classes counted by magnitude (the stream's "mag" flag, ``bins.magnitude_symbol``)."""
    g, tt, d = shape
    nblk, cols = _columns(shape, tb)
    dev = pats.device
    keys = torch.empty(g * tt * d + spare, dtype=torch.int16, device=dev)
    raw = torch.empty(g * tt * d, dtype=torch.int64, device=dev)
    hist = torch.zeros((HIST_COPIES, n_keys), dtype=torch.int64, device=dev)
    chunk_bits = torch.zeros(n_chunks, dtype=torch.int64, device=dev)
    width, sign, mb, maxmag, eoff = grid
    runner(symbolise_name(pats.element_size(), mag), -(-cols // THREADS), THREADS,
           (_ptr(pats), _ptr(pred), *(_ptr(x) for x in margs), np.int32(shared), _ptr(escape), np.int32(width),
            np.int32(sign), np.int32(mb), np.int32(maxmag), np.int32(eoff), np.int64(g), np.int64(tt), np.int32(d),
            np.int64(tb), np.int64(nblk), np.int64(gb), np.int64(unit), np.int32(n_keys), _ptr(keys), _ptr(raw),
            _ptr(hist), _ptr(chunk_bits)), dev, 4 * n_keys)  # the block's histogram in shared memory
    return keys, raw, hist, chunk_bits


def raw_bits(raw, chunks, totals, starts, n_bad, n_words: int, runner=gpu_runner):
    """bits int32 [n_words]: every chunk's raw bits (``chunks`` int64 [n, 4] device tensor: first value in
    ``raw`` (:func:`symbolise`'s), g count, values per g, stride between g's; ``totals``: their raw-bit
    totals, ``starts``: the word where each chunk's bits begin); ``n_bad`` (int64 [1], zeroed) counts the
    chunks whose raw bits do not add up to their total (internal error). Needs no table: launched before
    the host has fitted them."""
    n = chunks.shape[0]
    dev = raw.device
    bits = torch.empty(max(n_words, 1), dtype=torch.int32, device=dev)
    runner(f"ke_bits<{WARPS}>", max(1, -(-n // WARPS)), 32 * WARPS,
           (_ptr(raw), _ptr(chunks), np.int32(n), _ptr(totals), _ptr(starts), _ptr(bits), _ptr(n_bad)), dev)
    return bits[:n_words]


def encode_chunks(keys, chunks, parts, ftab, rcp, cap: int, runner=gpu_runner):
    """(scratch int16 [n * cap], lens int64 [n]) of the rANS streams of every chunk of ``chunks`` then
    ``parts`` (int64 [., 4] device tensors as :func:`raw_bits`' ``chunks``, over ``keys``; n in all): chunk
    j's stream is the last lens[j] words of scratch slot j (-1: a symbol without frequency, an internal
    error)."""
    n = chunks.shape[0] + parts.shape[0]
    dev = keys.device
    scratch = torch.empty(n * cap, dtype=torch.int16, device=dev)
    lens = torch.empty(n, dtype=torch.int64, device=dev)
    runner(f"ke_encode<{WARPS}>", max(1, -(-n // WARPS)), 32 * WARPS,
           (_ptr(keys), _ptr(chunks), np.int32(chunks.shape[0]), _ptr(parts), np.int32(parts.shape[0]), _ptr(ftab),
            _ptr(rcp), _ptr(scratch), np.int64(cap), _ptr(lens)), dev)
    return scratch, lens
