"""Compile the ``.cu`` kernels: CuPy ``RawModule`` at run time, ``nvcc`` for the CI compile checks.

Each owner ships its ``.cu`` / ``.cuh`` files beside its launchers (``kvcodec/quant/cuda``,
``kvcodec/lossless/cuda``, ``kvcodec/entropy/cuda``, ``kvcodec/device``) and names a source
``"<package>/<file>"``. An ``#include "file"`` names a file of the including file's package, an
``#include "kvcodec/<folders>/file"`` a file of another package, by its path from the folder that holds
``kvcodec`` (how the kernels share ``kvcodec/entropy/cuda/lane_rans.cuh``). NVRTC gets no include path
from us, so ``source_text`` inlines both textually, each file once; nvcc finds the first kind beside
the file and the second through ``-I`` of that folder (``nvcc_command``). Compiled modules are cached per
(device, source, template instance): NVRTC compiles once per process per instance, CuPy's disk cache
makes later processes fast.
Importing this module needs neither CuPy nor a GPU; only ``get_function`` does.

A second route compiles for an explicit target such as ``sm_90a`` (Hopper's arch-specific
instructions: wgmma, setmaxnreg), which CuPy's ``RawModule`` cannot ask for (it appends its own
``-arch``): NVRTC is called directly (CuPy's binding of it) to a cubin, cached on disk by a hash of
the source, options and NVRTC version, and loaded with ``cupy.RawModule(path=...)`` (``compile_cubin``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import threading
from importlib import resources
from pathlib import Path

import torch

from kvcodec import safe_write

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
_lock = threading.Lock()
_modules: dict[tuple, object] = {}

NVRTC_OPTIONS = ("-std=c++17",)


def source_path(source: str) -> Path:
    """Path of a kernel source shipped as package data, named ``"<package>/<file>"``: each owner
    ships its kernels beside its launchers (``"kvcodec.quant.cuda/tq_pack.cu"``,
    ``"kvcodec.lossless.cuda/kvctx_decode.cu"``)."""
    package, _, name = source.rpartition("/")
    if not package or not name:
        raise ValueError(f"a kernel source is named '<package>/<file>', got {source!r}")
    return Path(str(resources.files(package).joinpath(name)))


def include_root() -> Path:
    """The folder that holds the ``kvcodec`` package: where an ``#include "kvcodec/..."`` starts."""
    return Path(str(resources.files("kvcodec"))).parent


def include_source(name: str, package: str) -> str:
    """The ``"<package>/<file>"`` that ``#include "name"`` in a file of ``package`` reads: ``name`` itself in
    ``package``, or with a folder (``"kvcodec/entropy/cuda/lane_rans.cuh"``) the file of the package that
    path names."""
    folder, _, file = name.rpartition("/")
    if not folder:
        return f"{package}/{file}"
    parts = folder.split("/")
    if parts[0] != "kvcodec" or not all(p.isidentifier() for p in parts):
        raise ValueError(f"an #include with a folder is a path from the folder holding kvcodec, got {name!r}")
    return f"{'.'.join(parts)}/{file}"


def source_text(source: str) -> str:
    """The source with local ``#include "..."`` lines replaced by the included file (once each, however
    it is named); an included file is found by ``include_source``, as nvcc finds it in the file's folder
    or under ``include_root``."""
    seen: set[str] = set()

    def expand(text: str, package: str) -> str:
        def sub(m: re.Match) -> str:
            inc = include_source(m.group(1), package)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(source_path(inc).read_text(), inc.rpartition("/")[0])

        return _INCLUDE.sub(sub, text)

    return expand(source_path(source).read_text(), source.rpartition("/")[0]).replace("#pragma once", "")


def get_function(source: str, name_expression: str, defines: tuple[str, ...] = (), arch: str | None = None):
    """The compiled ``cupy.RawKernel`` for one template instance, compiled once per device.

    ``defines`` are extra ``NAME=value`` macros (such as ``TQ_REG_LUT_SYM=1``); ``arch``
    an explicit target (``"sm_90a"``: ``compile_cubin``), None for CuPy's NVRTC route (the device's
    own ``sm_XX``).
    """
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, source, name_expression, tuple(defines), arch)
    fn = _modules.get(key)
    if fn is None:
        with _lock:
            fn = _modules.get(key)
            if fn is None:
                options = NVRTC_OPTIONS + tuple(f"-D{d}" for d in defines)
                if arch is None:
                    mod = cupy.RawModule(code=source_text(source), options=options,
                                         name_expressions=[name_expression])
                    fn = mod.get_function(name_expression)
                else:
                    path, lowered = compile_cubin(source, name_expression, arch, defines)
                    fn = cupy.RawModule(path=str(path)).get_function(lowered)
                _modules[key] = fn
    return fn


def cubin_cache_dir() -> Path:
    """Where ``compile_cubin`` keeps its cubins: ``$KVCODEC_CUBIN_CACHE`` or ~/.cache/kvcodec/cubin."""
    return Path(os.environ.get("KVCODEC_CUBIN_CACHE") or Path.home() / ".cache" / "kvcodec" / "cubin")


def nvrtc_arch_options(arch: str, defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    """NVRTC options of the explicit-target route: ours, the target, the macros."""
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError(f"arch must look like sm_90, sm_90a or sm_100a, got {arch!r}")
    return NVRTC_OPTIONS + (f"--gpu-architecture={arch}",) + tuple(f"-D{d}" for d in defines)


def cubin_key(text: str, name_expression: str, options: tuple[str, ...], compiler: str) -> str:
    """Disk-cache key of one cubin: a hash of everything its bytes depend on."""
    h = hashlib.sha256()
    for part in (text, name_expression, *options, compiler):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_cubin(source: str, name_expression: str, arch: str, defines: tuple[str, ...] = ()) -> tuple[Path, str]:
    """NVRTC (CuPy's binding) straight to a cubin for ``arch`` with one template instance; returns
    (cubin path, the instance's mangled name). Cached in ``cubin_cache_dir`` by ``cubin_key``: the
    name file is written before the cubin, each atomically, so a cubin on disk always has its name."""
    from cupy_backends.cuda.libs import nvrtc

    text = source_text(source)
    options = nvrtc_arch_options(arch, tuple(defines))
    key = cubin_key(text, name_expression, options, "nvrtc %d.%d" % nvrtc.getVersion())
    folder = cubin_cache_dir()
    cubin, name_file = folder / f"{key}.cubin", folder / f"{key}.name"
    if cubin.exists():
        return cubin, name_file.read_text()
    prog = nvrtc.createProgram(text, f"{Path(source).stem}_{arch}.cu", (), ())
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        data = nvrtc.getCUBIN(prog)
        lowered = nvrtc.getLoweredName(prog, name_expression)
    finally:
        nvrtc.destroyProgram(prog)
    folder.mkdir(parents=True, exist_ok=True)
    # content-addressed files: a concurrent compile writes the same bytes, so the last rename may win
    safe_write.write_bytes(name_file, lowered.encode(), overwrite=True)
    safe_write.write_bytes(cubin, data, overwrite=True)
    return cubin, lowered


_streams: dict = {}
# torch's current cudaStream_t without building a torch.cuda.Stream object (what torch's own generated
# code uses; CUDA builds of torch have it): the value of torch.cuda.current_stream(device).cuda_stream
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cupy_stream(device: torch.device):
    """CuPy's handle of torch's current stream on ``device`` (launch inside ``with cupy_stream(dev):``),
    one object per (stream, device)."""
    ptr = _raw_stream(device.index) if _raw_stream else torch.cuda.current_stream(device).cuda_stream
    stream = _streams.get((ptr, device.index))
    if stream is None:
        import cupy

        if len(_streams) >= 64:
            _streams.clear()
        stream = _streams[(ptr, device.index)] = cupy.cuda.ExternalStream(ptr, device.index or 0)
    return stream


_sm_counts: dict = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (launch grids are sized by it), queried once per device."""
    n = _sm_counts.get(device)
    if n is None:
        n = _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


_derived: dict = {}


def derived(t, what: str, fn):
    """fn(t), cached per (tensor, version, what): per-call conversions (codebook to float32 on the
    device, transposed rotation, thresholds) run once. The tensor is kept alive in the cache so its
    id cannot be reused by another tensor."""
    key = (id(t), t._version, what)
    hit = _derived.get(key)
    if hit is None or hit[0] is not t:
        if len(_derived) > 512:
            _derived.clear()
        hit = (t, fn(t))
        _derived[key] = hit
    return hit[1]


def instantiation_wrapper(source: str, instances: list[str]) -> str:
    """C++ text that includes ``source`` and explicitly instantiates the given kernel instances.

    ``instances`` are full declarations without the leading ``template``, e.g.
    ``__global__ void tq_decode_merge<128>(const float*, ...)``; nvcc then emits them into the cubin.
    """
    lines = [f'#include "{source_path(source)}"']
    lines += [f"template {inst};" for inst in instances]
    return "\n".join(lines) + "\n"


def nvcc_command(wrapper_path: str | Path, arch: str, out_path: str | Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The nvcc command line that compiles a wrapper to a cubin for ``arch`` (e.g. ``"sm_90"``)."""
    nvcc = shutil.which("nvcc") or "nvcc"
    # arch-specific targets (sm_90a) in the -gencode form: the -arch=sm_90a shorthand of nvcc 13.0 can
    # also run a plain sm_90 pass, which rejects the sm_90a-only instructions
    target = f"-gencode=arch=compute_{arch[3:]},code={arch}" if arch[-1].isalpha() else f"-arch={arch}"
    return [nvcc, target, "-std=c++17", "-cubin", f"-I{include_root()}", *extra, "-o", str(out_path),
            str(wrapper_path)]


def nvcc_compile(source: str, instances: list[str], arch: str, workdir: str | Path,
                 extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Compile ``source`` with the given explicit instances for ``arch`` with nvcc; returns the process."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stem = Path(source).stem
    wrapper = workdir / f"{stem}_{arch}.cu"
    safe_write.write_bytes(wrapper, instantiation_wrapper(source, instances).encode(), overwrite=True)
    cmd = nvcc_command(wrapper, arch, workdir / f"{stem}_{arch}.cubin", extra)
    return subprocess.run(cmd, capture_output=True, text=True)
