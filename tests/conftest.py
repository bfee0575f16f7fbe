"""Suite-wide pytest hooks.

A test marked ``slow`` (it loads the real model or runs a whole benchmark suite) is announced by
name when it starts, so that ``pytest -q`` shows what it is waiting for instead of printing
nothing for a minute; ``pytest -m "not slow"`` leaves those tests out.

``cpu_emulator(name)`` builds one of the CUDA kernel emulators in ``tests/cuda_emulation`` with g++.
"""

import ctypes
import shutil
import subprocess
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
    library; skipped without g++, a failure when the kernel source no longer builds there."""

    def build(name: str) -> ctypes.CDLL:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.skip("needs g++ to run the kernel on the CPU")
        lib_path = tmp_path_factory.mktemp(name) / f"{name}.so"
        source = Path(__file__).parent / "cuda_emulation" / f"{name}.cpp"
        cmd = [gxx, "-O2", "-std=c++20", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-o", str(lib_path),
               str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"g++ cannot build {name}: {proc.stderr[-1500:]}"  # a kernel change broke it
        return ctypes.CDLL(str(lib_path))

    return build
