"""Suite-wide pytest hooks.

A test marked ``slow`` (it loads the real model or runs a whole benchmark suite) is announced by
name when it starts, so that ``pytest -q`` shows what it is waiting for instead of printing
nothing for a minute; ``pytest -m "not slow"`` leaves those tests out.
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") is None:
        return
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and item.config.option.verbose <= 0:  # -v already prints each name
        reporter.write(f"\n[slow] {item.nodeid} ", flush=True)
