"""The README's command does not say `--bind-to none`, and OpenMPI binds each of two ranks to one
core: training must free them (dscluster.cpus), or NCCL's socket threads queue on that core."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from _local_mpirun import ROOT, require_mpirun, train_command

pytestmark = pytest.mark.slow

require_mpirun()


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or len(os.sched_getaffinity(0)) < 2,
                    reason="OpenMPI binds to a core only when each rank can have its own: needs 2 CPUs")
def test_ranks_that_mpirun_bound_to_a_core_train_on_every_cpu_and_the_run_says_so(tmp_path):
    cmd, env = train_command(tmp_path, "bound", ["--config", "configs/digits.yaml", "progress=false",
                                                 "data.limit=128", "max_steps=2", "checkpoint.every_epochs=0"])
    cmd.remove("--oversubscribe")  # as a user types it: mpirun binds each of 2 ranks to its own core
    cmd[1:1] = ["--report-bindings"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    if "bound to" not in out:
        pytest.skip(f"this mpirun did not bind the ranks (no binding report): {out[:300]}")
    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    for rank in (0, 1):
        snap = json.loads((tmp_path / "bound" / "env" / f"rank-{rank}.json").read_text())
        assert snap["cpus_note"] and "mpirun bound this rank to CPU(s)" in snap["cpus_note"], snap["cpus_note"]
        assert ",".join(str(c) for c in _expand(snap["cpus"])) == every
    assert "freed to" in out  # rank 0 tells the user


def _expand(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out
