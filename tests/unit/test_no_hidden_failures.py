"""The suite's own rules, so that a failure cannot pass unseen: under CI=true every kind of skip fails except
a GPU test's (tests/conftest.py), and no parametrized case runs with nothing to check."""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path

import pytest
import test_config_ranges as ranges

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]
# tests/conftest.py as a module of its own: pytest has it loaded as a conftest, whose name is not importable.
_SPEC = importlib.util.spec_from_file_location("suite_policy", TESTS / "conftest.py")
POLICY = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(POLICY)

# Every way a test or a module is skipped, each as a test module of its own, and two that are no skip.
SKIPPING_MODULES = {
    "test_marked": 'import pytest\n\n\n@pytest.mark.skipif(True, reason="sshd not installed")\n'
                   "def test_marked():\n    pass\n",
    "test_in_fixture": 'import pytest\n\n\n@pytest.fixture\ndef lab():\n    pytest.skip("not root")\n\n\n'
                       "def test_in_fixture(lab):\n    pass\n",
    "test_in_body": 'import pytest\n\n\ndef test_in_body():\n    pytest.skip("this mpirun did not bind")\n',
    "test_at_import": 'import pytest\n\npytest.skip("no mpirun next to this Python", allow_module_level=True)\n\n\n'
                      "def test_never_run():\n    pass\n",
    "test_no_skip": 'import pytest\n\n\n@pytest.mark.xfail(strict=True, reason="a known miss")\n'
                    "def test_expected_to_fail():\n    assert 1 == 2\n\n\ndef test_passes():\n    pass\n",
}


def _run_with_the_ci_rule(pytester) -> pytest.RunResult:
    pytester.makepyfile(**SKIPPING_MODULES)
    rule = types.ModuleType("ci_skip_rule")  # the two hooks alone, not the rest of tests/conftest.py
    rule.pytest_runtest_makereport = POLICY.pytest_runtest_makereport
    rule.pytest_make_collect_report = POLICY.pytest_make_collect_report
    # without it pytest stops at the failed module and runs nothing else; pytest-xdist (make test) goes on anyway
    return pytester.runpytest_inprocess("--continue-on-collection-errors", "-p", "no:xdist", plugins=[rule])


def test_under_ci_every_kind_of_skip_fails_and_names_its_reason(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = _run_with_the_ci_rule(pytester)
    # a skip in setup (a mark, a fixture) and at import are errors, one in the test's body a failure
    result.assert_outcomes(passed=1, failed=1, errors=3, xfailed=1)
    failures = [line for line in result.outlines if line.startswith(("FAILED ", "ERROR "))]
    for reason in ("sshd not installed", "not root", "this mpirun did not bind", "no mpirun next to this Python"):
        said = [line for line in failures if "on CI (CI=true makes a skip a failure" in line and reason in line]
        assert len(said) == 1, (reason, failures)


def test_off_ci_a_skip_stays_a_skip(pytester, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    _run_with_the_ci_rule(pytester).assert_outcomes(passed=1, skipped=4, xfailed=1)


def _skipped(nodeid: str) -> pytest.TestReport:
    return pytest.TestReport(nodeid=nodeid, location=(nodeid, 1, "t"), keywords={}, outcome="skipped",
                             longrepr=(nodeid, 1, "Skipped: needs a CUDA GPU"), when="setup")


def test_under_ci_only_the_tests_that_need_a_gpu_may_skip(monkeypatch):
    monkeypatch.setenv("CI", "true")
    for nodeid, may_skip in (
            ("tests/gpu/test_no_host_sync.py::test_dscluster_clip_needs_no_host_sync", True),
            ("tests/gpu/test_train_step_sync.py::test_training_steps_make_no_host_sync[bf16-ddp-2gpus]", True),
            ("tests/unit/test_comm.py::test_on_a_gpu_data_is_only_the_time_the_device_waited_for_the_batch", True),
            ("tests/unit/test_comm.py::test_gloo_reduces_fp16_and_bf16_on_cpu", False),
            ("tests/cluster/test_sim_gpu_lab.py::test_a_1gbit_link_carries_at_most_1gbit_each_way", False)):
        report = _skipped(nodeid)
        POLICY._fail_a_skip_on_ci(report, TESTS.parent / nodeid.split("::")[0])
        assert report.skipped is may_skip, (nodeid, report.longrepr)


def test_every_test_the_gpu_list_names_exists():
    # a renamed test would leave its name here, and the test it became would fail on CI for want of a GPU
    for entry in POLICY.NEEDS_A_GPU:
        file, _, name = entry.partition("::")
        assert (TESTS / file).exists(), entry
        assert not name or f"def {name}(" in (TESTS / file).read_text(encoding="utf-8"), entry


# The parametrized tests of test_config_ranges.py whose cases loop over values computed from the config model,
# each with what one case tries: a case with no value would pass having checked nothing (20 did).
TRIED = {
    ranges.test_out_of_range_values_are_refused_naming_the_key_and_where: ranges.out_of_range,
    ranges.test_wrong_types_are_refused_naming_the_key_and_where: ranges.wrong_types,
    ranges.test_boundary_values_load: ranges.boundaries,
    ranges.test_a_key_without_a_range_takes_values_of_its_type: ranges.own_type_values,
}


def _cases(test) -> list[str]:
    (mark,) = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    return list(mark.args[1])


def test_no_config_range_case_runs_with_nothing_to_try():
    keyed = {test for _, test in inspect.getmembers(ranges, inspect.isfunction)
             if test.__name__.startswith("test_") and any(m.name == "parametrize" and m.args[0] == "key"
                                                          for m in getattr(test, "pytestmark", []))}
    # every test over the config's keys is counted here, or asserts on the key itself (no values to loop over)
    assert keyed - set(TRIED) == {ranges.test_a_key_without_a_range_is_a_switch_or_text}
    empty = [f"{test.__name__}[{key}]" for test, tried in TRIED.items() for key in _cases(test) if not tried(key)]
    assert empty == [], f"{len(empty)} cases try nothing"
    # and no key was dropped to get there: each is a case of the range tests or of those for keys without one
    for test in (ranges.test_out_of_range_values_are_refused_naming_the_key_and_where,
                 ranges.test_boundary_values_load):
        assert sorted(_cases(test) + ranges.UNRANGED) == sorted(ranges.FIELDS), test.__name__
