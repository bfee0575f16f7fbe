"""Suite-wide pytest hooks.

A test marked ``slow`` (it loads the real model or runs a whole benchmark suite) is announced by
name when it starts, so that ``pytest -q`` shows what it is waiting for instead of printing
nothing for a minute; ``pytest -m "not slow"`` leaves those tests out.

``cpu_emulator(name)`` builds one of the CUDA kernel emulators in ``tests/cuda_emulation`` with g++
(once a session, however many test modules load it). ``nvcc_each_arch(...)`` compiles a kernel source
with nvcc for several targets at once (one nvcc per core).
"""

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

_slow: set[str] = set()
_config: list = []


def pytest_configure(config):
    _config[:] = [config]


def pytest_collection_modifyitems(items):
    _slow.update(item.nodeid for item in items if item.get_closest_marker("slow") is not None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    """Runs outside output capture, before the test's setup."""
    if nodeid not in _slow or not _config or _config[0].option.verbose > 0:  # -v prints names anyway
        return
    reporter = _config[0].pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write(f"\n[slow] {nodeid} ", flush=True)


@pytest.fixture(scope="session")
def cpu_emulator(tmp_path_factory):
    """``build(name)``: ``tests/cuda_emulation/<name>.cpp`` (a kernel source run on the CPU) as a loaded
    library; skipped without g++, a failure when the kernel source no longer builds there. Each emulator
    is built once a session: several test modules load the same one (a g++ -O2 build takes seconds)."""
    built: dict[str, ctypes.CDLL] = {}

    def build(name: str) -> ctypes.CDLL:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.skip("needs g++ to run the kernel on the CPU")
        if name in built:
            return built[name]
        lib_path = tmp_path_factory.mktemp(name) / f"{name}.so"
        source = Path(__file__).parent / "cuda_emulation" / f"{name}.cpp"
        cmd = [gxx, "-O2", "-std=c++20", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-o", str(lib_path),
               str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"g++ cannot build {name}: {proc.stderr[-1500:]}"  # a kernel change broke it
        built[name] = ctypes.CDLL(str(lib_path))
        return built[name]

    return build


@pytest.fixture(scope="session")
def nvcc_each_arch():
    """``nvcc_each_arch(source, instances, archs, workdir, extra=())``: ``build.nvcc_compile`` of the source for
    every target in ``archs``, the targets' nvcc runs side by side (one per core: nvcc's front end and
    ptxas are single-threaded), as ``{arch: CompletedProcess}``; skipped without nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: CUDA compile check skipped")
    from kvcodec.cuda import build

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, cores)) as pool:

        def compile_each(source: str, instances: list[str], archs, workdir, extra: tuple[str, ...] = ()) -> dict:
            runs = {arch: pool.submit(build.nvcc_compile, source, instances, arch, workdir, extra) for arch in archs}
            return {arch: run.result() for arch, run in runs.items()}

        yield compile_each
