"""Shared test policy: on CI (CI=true) a skip is a failure, not a pass, unless the test needs a GPU.

CI installs everything else the suite needs (.ci/run): a skip there is a broken image hiding tests, whether
it came from a skipif mark, a fixture, the test itself or a module skipped at import. NEEDS_A_GPU names the
tests that may skip there.

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


# The tests that need hardware CI's machine does not have, a GPU: under CI=true these alone may skip. A folder
# ends in "/"; a test is named as FILE::NAME, relative to tests/, and covers all its parameters.
NEEDS_A_GPU = (
    "gpu/",
    "unit/test_comm.py::test_split_marks_on_a_gpu_are_events_read_after_the_window_without_a_host_sync",
    "unit/test_comm.py::test_on_a_gpu_data_is_only_the_time_the_device_waited_for_the_batch",
    "cluster/test_sim_gpu_lab.py::test_real_gpus_one_per_node_and_nccl_goes_through_the_shaped_link",
)


def needs_a_gpu(path: Path, nodeid: str) -> bool:
    """Whether the test (or the module, collected from `path`) is one NEEDS_A_GPU names."""
    try:
        name = Path(path).resolve().relative_to(ROOT / "tests").as_posix()
    except ValueError:
        return False
    if "::" in nodeid:
        name += nodeid[nodeid.index("::"):]
    return any(name.startswith(entry) if entry.endswith("/") else name == entry or name.startswith(entry + "[")
               for entry in NEEDS_A_GPU)


def _fail_a_skip_on_ci(report, path: Path, what: str = "skipped") -> None:
    # An expected failure (xfail) reports as skipped too: it is no skip, and strict ones fail when they pass.
    if (os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail")
            or needs_a_gpu(path, report.nodeid)):
        return
    reason = report.longrepr
    if isinstance(reason, tuple):  # a skip's (file, line, message)
        reason = f"{reason[0]}:{reason[1]}: {reason[2]}"
    report.outcome = "failed"
    report.longrepr = (f"{what} on CI (CI=true makes a skip a failure; only tests/conftest.py's NEEDS_A_GPU may "
                       f"skip): {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Skips of a test: its skipif marks, pytest.skip in its fixtures or in its body."""
    report = yield
    _fail_a_skip_on_ci(report, item.path)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Skips of a whole module at import (pytest.skip(..., allow_module_level=True)): no test of it is ever run,
    so only its collection can fail. Named in the message: pytest-xdist shows one of several equal collection errors."""
    report = yield
    _fail_a_skip_on_ci(report, collector.path, f"{report.nodeid} skipped at import")
    return report


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
