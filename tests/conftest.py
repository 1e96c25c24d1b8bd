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
# The checkout's own state directory (`dscluster check` run in it writes there; ranks launched from it read it).
# A test's commands keep state of their own: in this one they would read a developer's check.json and leave their
# runs' curves and plan outcomes for the developer's next `plan`, which took them as measurements.
CHECKOUT_STATE = ROOT / ".dscluster"
_STATE_BEFORE = pytest.StashKey[dict]()
_MAKE_EXPORT = re.compile(r"^export (\w+) := (.*)$", re.M)


def pytest_configure(config):
    config.stash[_STATE_BEFORE] = _checkout_state()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    for name, value in _MAKE_EXPORT.findall((ROOT / "Makefile").read_text(encoding="utf-8")):
        os.environ.setdefault(name, value.strip().replace("$(CURDIR)", str(ROOT)))


def _checkout_state() -> dict[str, tuple[int, int]]:
    files = CHECKOUT_STATE.rglob("*") if CHECKOUT_STATE.is_dir() else ()
    return {p.relative_to(CHECKOUT_STATE).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in files if p.is_file()}


def pytest_sessionfinish(session, exitstatus):
    """The whole run (pytest-xdist's controller, or a run without workers) fails when a test wrote into the
    checkout's .dscluster."""
    if hasattr(session.config, "workerinput"):
        return
    before, after = session.config.stash.get(_STATE_BEFORE, {}), _checkout_state()
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    if changed:
        print(f"\nFAILED: the tests wrote into the checkout's state directory {CHECKOUT_STATE}: {', '.join(changed)}; "
              "give the command a DSCLUSTER_STATE of its own (tests/cluster/_local_mpirun.py: train_command)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


# `make test` runs three pytest-xdist workers that each take whole files (--dist loadfile), in collection
# order. The files that take minutes go first, longest first (as `make test`'s --durations list showed them:
# a fresh clone with one core busy, 2026-11-29), so that no worker is left alone with one of them at the end
# while the others have finished.
LONG_FILES_FIRST = (
    "cluster/test_faults.py", "cluster/test_train_local.py", "cluster/test_comm_local.py",
    "unit/test_bench_cpu.py", "cluster/test_launchers_lab.py", "cluster/test_no_shared_fs.py",
    "unit/test_plan_accuracy.py", "cluster/test_ethernet.py", "cluster/test_launch_lab.py",
    "cluster/test_sync_local.py", "cluster/test_demo.py", "cluster/test_zero_local.py", "cluster/test_plan_lab.py",
    "cluster/test_byo_script.py", "cluster/test_install.py", "cluster/test_secrets_lab.py",
    "cluster/test_balanced_exact.py", "unit/test_zero.py",
)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONG_FILES_FIRST)}

    def rank(item) -> int:
        path = Path(str(item.fspath)).resolve()
        try:
            return order.get(path.relative_to(ROOT / "tests").as_posix(), len(order))
        except ValueError:
            return len(order)

    items.sort(key=rank)  # stable: the tests of a file keep their order
