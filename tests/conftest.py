"""Suite-wide pytest hooks.

A test marked ``slow`` (it loads the real model or runs a whole benchmark suite) is announced by
name when it starts, so that ``pytest -q`` shows what it is waiting for instead of printing
nothing for a minute; ``pytest -m "not slow"`` leaves those tests out.
"""

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
