"""Shared test policy: on CI (CI=true) a skipped cluster test is a failure, not a pass.

`python -m pytest` runs with the same cache folders as `make test`: the Makefile's exports
(MPLCONFIGDIR, TORCH_EXTENSIONS_DIR, …) are read from it and set when unset. Without them
matplotlib writes its font cache into HOME, which tests point at their own empty folder to
prove a command wrote nothing.

Ctrl-C and Ctrl-\\ reach the commands under test as they reach a terminal's: a runner that started
pytest with SIGINT or SIGQUIT ignored (a detached shell) would pass the ignoring on to every
child, and the tests of what Ctrl-C does would fail for the runner's sake, not the code's.
"""

import os
import re
import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_MAKE_EXPORT = re.compile(r"^export (\w+) := (.*)$", re.M)


def pytest_configure(config):
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    for name, value in _MAKE_EXPORT.findall((ROOT / "Makefile").read_text(encoding="utf-8")):
        os.environ.setdefault(name, value.strip().replace("$(CURDIR)", str(ROOT)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        os.environ.get("CI") == "true"
        and report.skipped
        and item.get_closest_marker("cluster") is not None
    ):
        report.outcome = "failed"
        report.longrepr = f"cluster test skipped on CI (CI=true makes a skip a failure): {report.longrepr}"
