"""A rank that a launcher bound to one core gets the node back (dscluster.node.cpus)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dscluster.node import cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2
                                or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ CPUs and CPU affinity")

# A child bound to CPU 0 the way mpirun binds a rank, with a thread already running (as torch's
# and NCCL's are by the time training starts): every thread must be freed, not only the caller.
CHILD = r"""
import json, os, sys, threading
if os.environ.get("BIND_TO_0") == "1":
    os.sched_setaffinity(0, {0})
started, stop = threading.Event(), threading.Event()
info = {}
def worker():
    info["tid"] = threading.get_native_id()
    started.set()
    stop.wait()
t = threading.Thread(target=worker); t.start(); started.wait()
from dscluster.node import cpus
note = cpus.free_launcher_binding()
out = {"note": note, "main": sorted(os.sched_getaffinity(0)), "thread": sorted(os.sched_getaffinity(info["tid"]))}
stop.set(); t.join()
later = threading.Thread(target=lambda: out.update(later=sorted(os.sched_getaffinity(0)))); later.start(); later.join()
print(json.dumps(out))
"""


def run_child(bind: bool = True, mpirun: bool = True, **env) -> dict:
    """The child as a rank of OpenMPI's mpirun (its OMPI_COMM_WORLD_* variables) unless mpirun=False."""
    env["BIND_TO_0"] = "1" if bind else "0"
    base = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_COMM_WORLD")}
    if mpirun:
        base.update(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                         env={**base, **env})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_rank_bound_to_one_core_is_freed_with_every_thread_and_says_so():
    allowed = sorted(os.sched_getaffinity(0))
    out = run_child()
    assert out["main"] == allowed and out["thread"] == allowed and out["later"] == allowed
    assert "mpirun bound this rank to CPU(s) 0;" in out["note"] and f"({len(allowed)} CPUs)" in out["note"]
    assert "DSCLUSTER_KEEP_BINDING=1" in out["note"]


def test_keep_binding_leaves_a_deliberate_binding_alone_and_says_so():
    out = run_child(DSCLUSTER_KEEP_BINDING="1")
    assert out["main"] == [0] and out["thread"] == [0]
    assert out["note"].startswith("cpus: kept mpirun's binding to CPU(s) 0 of")


def test_a_binding_without_mpirun_was_asked_for_and_is_left_alone():
    # taskset by hand, DeepSpeed's --bind_cores_to_rank, srun --cpu-bind: no OMPI_COMM_WORLD_* here
    out = run_child(mpirun=False)
    assert out["note"] is None and out["main"] == [0] and out["thread"] == [0]


def test_an_unbound_process_is_left_as_it_is_without_a_note():
    out = run_child(bind=False)
    assert out["note"] is None and out["main"] == sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("cpus_in, text", [({0}, "0"), ({0, 1, 2, 3}, "0-3"), ({0, 2, 3, 8}, "0,2-3,8"),
                                           (set(), "")])
def test_cpu_lists_are_written_as_taskset_writes_them(cpus_in, text):
    assert cpus.cpu_list(cpus_in) == text
