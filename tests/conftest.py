"""Suite-wide pytest hooks.

A test marked ``slow`` (it loads the real model or runs a whole benchmark suite) is announced by
name when it starts, so that ``pytest -q`` shows what it is waiting for instead of printing
nothing for a minute; ``pytest -m "not slow"`` leaves those tests out.

Compiler runs start in the background when the session starts (``_Builds``): the nvcc builds that
tests parametrized over ``nvcc_build`` check, and the g++ builds of the CUDA kernel emulators in
``tests/cuda_emulation`` when a selected test uses ``cpu_emulator``. They run at low priority on the
cores the (mostly single-threaded) tests leave idle, and the nvcc build checks run last; each test
waits for its own build. A build is the same command a test would run itself, and each runs once a
session.

``benchmarks/`` goes on ``sys.path``: the tests load the real model with the benchmarks' own
``smollm2`` module (one module, so one loaded model per process for the tests and the suites they
run) and build CUDA kernel cases with ``cuda_cases``; neither ships in the kvcodec package.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))

_slow: set[str] = set()
_config: list = []
EMULATORS = Path(__file__).parent / "cuda_emulation"


def pytest_configure(config):
    _config[:] = [config]


def _nvcc_build(item):
    return getattr(getattr(item, "callspec", None), "params", {}).get("nvcc_build")


def pytest_collection_modifyitems(items):
    _slow.update(item.nodeid for item in items if item.get_closest_marker("slow") is not None)
    # the nvcc build checks go last: their builds then have the whole session to finish in the background
    items[:] = [item for item in items if _nvcc_build(item) is None] + [item for item in items if _nvcc_build(item)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    """Runs outside output capture, before the test's setup."""
    if nodeid not in _slow or not _config or _config[0].option.verbose > 0:  # -v prints names anyway
        return
    reporter = _config[0].pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write(f"\n[slow] {nodeid} ", flush=True)


def _lower_priority():
    """Pool threads (and the compilers they start, which inherit it) yield the CPU to the tests."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class _Builds:
    """Compiler runs shared by the session, keyed by what they build, started at most once."""

    def __init__(self):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(max_workers=max(1, cores), initializer=_lower_priority)
        self._dir = tempfile.TemporaryDirectory(prefix="kvcodec-test-builds-")
        self._runs: dict[tuple, Future] = {}

    def _start(self, key: tuple, fn, *args) -> Future:
        if key not in self._runs:
            self._runs[key] = self._pool.submit(fn, *args)
        return self._runs[key]

    def workdir(self) -> Path:
        return Path(tempfile.mkdtemp(dir=self._dir.name))

    def nvcc(self, build: tuple) -> dict:
        """``build`` = (source, instances, archs, extra): {arch: Future of build.nvcc_compile's process}."""
        from kvcodec.device import build as cuda_build

        source, instances, archs, extra = build
        return {arch: self._start(("nvcc", source, tuple(instances), arch, tuple(extra)), cuda_build.nvcc_compile,
                                  source, list(instances), arch, self.workdir(), tuple(extra)) for arch in archs}

    def emulator(self, name: str) -> Future:
        """g++ build of ``cuda_emulation/<name>.cpp``: Future of (process, library path)."""
        return self._start(("g++", name), _build_emulator, name, self.workdir())

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._dir.cleanup()


def _build_emulator(name: str, workdir: Path) -> tuple[subprocess.CompletedProcess, Path]:
    lib_path = workdir / f"{name}.so"
    # -I the checkout: the kernels' #include "kvcodec/..." lines (kvcodec.device.build.include_root)
    cmd = [shutil.which("g++") or "g++", "-O2", "-std=c++20", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
           f"-I{EMULATORS.parents[1]}", "-o", str(lib_path), str(EMULATORS / f"{name}.cpp")]
    return subprocess.run(cmd, capture_output=True, text=True), lib_path


_builds: list[_Builds] = []


def _session_builds() -> _Builds:
    if not _builds:
        _builds.append(_Builds())
    return _builds[0]


def pytest_collection_finish(session):
    """Start every build the selected tests will wait for: the emulators (needed mid-session) first."""
    if session.config.option.collectonly:
        return
    if shutil.which("g++") is not None and any("cpu_emulator" in getattr(i, "fixturenames", ()) for i in session.items):
        for cpp in sorted(EMULATORS.glob("*.cpp")):
            _session_builds().emulator(cpp.stem)
    if shutil.which("nvcc") is not None:
        for item in session.items:
            if _nvcc_build(item) is not None:
                _session_builds().nvcc(_nvcc_build(item))


def pytest_sessionfinish(session):
    if _builds:
        _builds.pop().close()


@pytest.fixture(scope="session")
def cpu_emulator():
    """``build(name)``: ``tests/cuda_emulation/<name>.cpp`` (a kernel source run on the CPU) as a loaded
    library; skipped without g++, a failure when the kernel source no longer builds there. Built once a
    session (several test modules load the same emulator; a g++ -O2 build takes seconds)."""

    def build(name: str) -> ctypes.CDLL:
        if shutil.which("g++") is None:
            pytest.skip("needs g++ to run the kernel on the CPU")
        proc, lib_path = _session_builds().emulator(name).result()
        assert proc.returncode == 0, f"g++ cannot build {name}: {proc.stderr[-1500:]}"  # a kernel change broke it
        return ctypes.CDLL(str(lib_path))

    return build


@pytest.fixture
def nvcc_result(nvcc_build) -> dict:
    """``{arch: CompletedProcess}`` of ``kvcodec.device.build.nvcc_compile`` for the test's ``nvcc_build``
    parameter, ``(source, instances, archs, extra)`` (started when the session started; the cubins lie
    where each process's ``-o`` says); skipped without nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: CUDA compile check skipped")
    return {arch: run.result() for arch, run in _session_builds().nvcc(nvcc_build).items()}
