"""The launchers that do not go through mpirun, for real on a 2-node lab: a Slurm script read by a
real Slurm (slurmctld on node1, slurmd and munged on both; tests/cluster/_slurm_lab.py) and
torchrun agents started over SSH on every node. After the real `setup` and `check`.

Per launcher: one digits job that completes (one run directory, telemetry from every node, `diagnose`
reads it) and one in which rank 1 is SIGKILLed, which must end the job on every node and name the
rank. Under Slurm the digits job is the user's mixed lab: node1 with 2 GPUs, node2 with 1, as GRES
Slurm grants (stand-in device files, the ranks train on the CPU), ranks placed as a `slots=2`/`slots=1`
hostfile says; and a cancelled job leaves a `cancelled` summary that `diagnose` and `plot` read.
The model and data are shrunk so each job is start-up plus a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from _slurm_lab import slurm_skip_reason, start_slurm
from test_faults import diagnose, job_processes, records
from test_launch_lab import DSCLUSTER, explain, set_up

from _wait import Deadline, wait_until
from dscluster.launch.slurmjob import ACTIVE
from dscluster.node.hosts import hostfile_sha256

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TIMEOUT_S = 20  # dist.timeout_s: how long a surviving rank waits for a dead one
STARTUP_S = 240  # 2 ranks starting DeepSpeed on shared cores, load-scaled by Deadline
SHRINK = ("--config", "configs/digits.yaml", "progress=false", "model.depth=2", "model.embed_dim=48",
          "model.num_heads=3", "data.img_size=16", "micro_batch=8", "global_batch=16", "grad_accum=1",
          "log_every=1", "eval_every_epochs=100", "checkpoint.every_epochs=0", f"dist.timeout_s={TIMEOUT_S}")
SHORT = (*SHRINK, "data.limit=96", "epochs=1")      # 6 steps
LONG = (*SHRINK, "data.limit=2048", "epochs=4")     # long enough to be killed at step 3
MIXED = (*(a for a in SHRINK if not a.startswith("global_batch=")), "global_batch=24", "data.limit=144",
         "epochs=1")                                # 3 ranks, 6 steps
MIXED_HOSTS = "node1 slots=2\nnode2 slots=1\n"
GPUS = {"node1": 2, "node2": 1}                     # the GRES Slurm grants on each node


@pytest.fixture(scope="module")
def lab2(lab_factory):
    c = set_up(lab_factory, "launcherslab", nodes=2)
    # what launch and the launchers read (env files, check.json); the MPI hello and all-reduce are test_check's
    check = c.sh(f"{DSCLUSTER} check --hostfile {c.hostfile} --skip-active", timeout=300)
    assert check.returncode == 0, explain(check)
    return c


@pytest.fixture(scope="module")
def slurm(lab2):
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    return start_slurm(lab2.lab, stand_in_gpus=GPUS)


def gpu_state(lab2, name: str, hosts: str, gpus: dict[str, int]) -> Path:
    """The lab's check output made over for hostfile `hosts` on nodes with `gpus`, as check leaves it on
    GPU nodes: the same nodes and environment, this hostfile's path and fingerprint, and each node's GPUs
    in its facts. The lab's nodes have no GPU for check's nvidia-smi to find, only the GRES Slurm grants."""
    hostfile = lab2.work / f"{name}.hosts"
    hostfile.write_text(hosts)
    state = lab2.work / f"{name}.state"
    shutil.copytree(lab2.work / ".dscluster", state)
    old_sha = hostfile_sha256(lab2.hostfile)
    for path in [p for p in state.rglob("*") if p.is_file() and p.suffix in (".json", ".env")]:
        path.write_text(path.read_text().replace(old_sha, hostfile_sha256(hostfile)))
    doc = json.loads((state / "check.json").read_text())
    doc["hostfile"] = str(hostfile)
    for node in doc["nodes"]:
        node["facts"]["gpus"] = [{"index": i, "name": "GRES stand-in"} for i in range(gpus[node["name"]])]
    (state / "check.json").write_text(json.dumps(doc))
    for path in (hostfile, state, *state.rglob("*")):
        os.chown(path, lab2.lab.uid, lab2.lab.gid)
    return state


def sbatch(lab2, name: str, *train_args: str, state: Path | None = None) -> tuple[str, Path]:
    """`launch --launcher slurm` writes the script, `sbatch` submits it: (job id, its output file). Not
    `sbatch --wait`: its polls grow apart (a 15 s job was seen ended 42 s after it was submitted)."""
    script = f"{name}.sbatch"
    env = f"DSCLUSTER_STATE={state} " if state else ""
    wrote = lab2.sh(f"{env}{DSCLUSTER} launch --launcher slurm --script {script} -- {' '.join(train_args)}")
    assert wrote.returncode == 0 and f"sbatch {script}" in wrote.stdout, explain(wrote)
    res = lab2.sh(f"sbatch --parsable --output={name}-%j.out {script}")
    job = res.stdout.strip().split(";")[0]
    assert job.isdigit(), explain(res)
    return job, lab2.work / f"{name}-{job}.out"


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path.name} yet)"


def job_state(slurm, job: str) -> str:
    out = slurm.sh(f"scontrol show job {job}").stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "?")


def kill_rank(lab, run: Path, rank: int, step: int, alive) -> str:
    """SIGKILL `rank` inside its node once it has logged `step`; returns its host."""
    deadline = Deadline(STARTUP_S)
    while not [r for r in records(run, rank, "step") if r["step"] >= step]:
        assert alive(), "the job ended before the rank reached the step"
        assert not deadline.passed(), f"rank {rank} did not reach step {step} in {deadline.allowed:.0f} s"
        time.sleep(0.2)
    start = records(run, rank, "start")[-1]
    node = next(n for n in lab.nodes if n.hostname == start["host"])
    lab.run(node.name, ["kill", "-KILL", str(start["pid"])], user="root", check=True)
    return node.name


def assert_trained_everywhere(lab2, run: Path, *, world: int = 2) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == world, summary
    hosts = sorted(n.hostname for n in lab2.lab.nodes)
    assert sorted(p.stem for p in (run / "telemetry").glob("*.jsonl")) == hosts
    assert {json.loads((run / "env" / f"rank-{r}.json").read_text())["host"] for r in range(world)} == set(hosts)
    assert diagnose(run)[0] == 0


# --- Slurm ------------------------------------------------------------------------------------

def test_slurm_places_a_mixed_labs_ranks_as_the_hostfile_says_each_on_its_own_gpu(lab2, slurm):
    state = gpu_state(lab2, "mixed", MIXED_HOSTS, GPUS)
    before = lab2.run_names()
    job, out = sbatch(lab2, "mixed", *MIXED, state=state)
    final = wait_until(lambda: (now := job_state(slurm, job)) not in ACTIVE and now, STARTUP_S + 300,
                       f"Slurm job {job} to end", interval=1.0, explain=lambda: tail(out))
    log = out.read_text(errors="replace")
    assert final == "COMPLETED", log[-3000:]
    assert lab2.run_names() - before == {f"slurm-{job}"}, log[-3000:]  # one run directory, named by the job
    assert f"run slurm-{job} on 2 nodes (ranks node1: 2, node2: 1), head node1" in log
    run = lab2.runs / f"slurm-{job}"
    ranks = [json.loads((run / "env" / f"rank-{r}.json").read_text()) for r in range(3)]
    # ranks 0 and 1 on node1, rank 2 on node2, each with the one GPU Slurm granted it
    assert [(r["host"], r.get("CUDA_VISIBLE_DEVICES")) for r in ranks] == [("node1", "0"), ("node1", "1"),
                                                                           ("node2", "0")], ranks
    assert_trained_everywhere(lab2, run, world=3)


def test_slurm_names_a_node_short_of_gpus_before_submitting(lab2, slurm):
    state = gpu_state(lab2, "short", MIXED_HOSTS, {"node1": 1, "node2": 1})
    res = lab2.sh(f"DSCLUSTER_STATE={state} {DSCLUSTER} launch --launcher slurm --submit --script short.sbatch")
    assert res.returncode == 2, explain(res)
    assert (f"{lab2.work}/short.hosts:1: node1 gets 2 rank(s) but `dscluster check` found 1 GPU(s) there"
            in res.stderr and "set slots=1 for node1" in res.stderr), explain(res)
    assert not (lab2.work / "short.sbatch").exists()
    assert slurm.sh("squeue -h -o %i").stdout.strip() == ""


def submit(lab2, run_id: str) -> tuple[object, Path, str]:
    """`launch --launcher slurm --submit` (LONG) started in node1: (its process, its log, the job id)."""
    log = lab2.work / f"{run_id}.log"
    proc = lab2.popen(f"{DSCLUSTER} launch --launcher slurm --submit --run-id {run_id} --script {run_id}.sbatch "
                      f"-- {' '.join(LONG)}", log)
    found = wait_until(lambda: re.search(r"Slurm job (\d+), run", log.read_text()) or proc.poll() is not None, 60,
                       "launch --submit naming the job", explain=lambda: log.read_text()[-3000:])
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc, log, found.group(1)


def ended(proc, log: Path) -> tuple[int, str]:
    try:
        return proc.wait(timeout=Deadline(TIMEOUT_S + 90).allowed), log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def assert_gone_everywhere(lab2, run_id: str) -> None:
    # every half second: each look reads every process of every node
    wait_until(lambda: not job_processes(lab2.lab, run_id), 30, f"every process of {run_id} gone", interval=0.5,
               explain=lambda: str(job_processes(lab2.lab, run_id)))


def test_rank_killed_under_srun_ends_the_job_on_every_node_naming_the_rank(lab2, slurm):
    proc, log, job = submit(lab2, "srun-kill")
    run = lab2.runs / "srun-kill"
    host = kill_rank(lab2.lab, run, 1, 3, lambda: proc.poll() is None)
    t0 = time.monotonic()
    rc, out = ended(proc, log)
    print(f"rank 1 SIGKILLed under srun: launch --submit exited {rc} after {time.monotonic() - t0:.1f} s")
    assert rc not in (0, None) and job_state(slurm, job) == "FAILED", out[-3000:]
    # streamed by launch: srun's word on task 1, its SIGKILL, unless rank 0 saw the closed connection and exited
    # first, when srun reports task 0's exit and terminates task 1 (which one srun sees first is a race of the two
    # nodes' exits); the rank that died is named by diagnose (below) either way
    assert re.search(rf"srun: error: {host}: task 1: (Exited with exit code 137|Terminated)", out), out[-3000:]
    assert f"dscluster launch: Slurm job {job} ended FAILED" in out, out[-3000:]
    assert_gone_everywhere(lab2, run.name)
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    rc, doc = diagnose(run)
    assert rc == 1 and [f["rank"] for f in doc["findings"] if f["kind"] == "rank_died"] == [1], doc["findings"]


def test_scancel_ends_the_job_on_every_node_and_launch_says_so(lab2, slurm):
    proc, log, job = submit(lab2, "scancel")
    run = lab2.runs / "scancel"
    wait_until(lambda: [r for r in records(run, 0, "step") if r["step"] >= 2] or proc.poll() is not None,
               STARTUP_S, "rank 0 at step 2", interval=0.5, explain=lambda: log.read_text()[-3000:])
    assert lab2.sh(f"scancel {job}").returncode == 0
    rc, out = ended(proc, log)
    print(f"scancel: launch --submit exited {rc}")
    assert rc == 1 and job_state(slurm, job) == "CANCELLED", out[-3000:]
    assert_gone_everywhere(lab2, run.name)
    summary = json.loads((run / "summary.json").read_text())  # Slurm's SIGTERM: rank 0 asked Slurm why
    assert summary["status"] == "cancelled" and summary["steps"] >= 2, summary
    assert summary["resume"].startswith(f"DSCLUSTER_RUN_ID=scancel sbatch {lab2.work}/scancel.sbatch "), summary
    assert (f"dscluster launch: Slurm job {job} was cancelled (scancel) at step {summary['steps']}; Slurm stopped "
            f"every rank. To resume: {summary['resume']}") in out, out[-3000:]
    rc, doc = diagnose(run)  # a cancel is no failure: said first, its stopped ranks its consequences
    assert rc == 0 and doc["findings"][0]["kind"] == "run_cancelled", doc["findings"]
    assert summary["resume"] in doc["findings"][0]["message"]
    res = lab2.sh(f"{DSCLUSTER} plot {run}", timeout=300)  # the plots read a cancelled run as any other
    assert res.returncode == 0 and list((run / "plots").glob("*.png")), explain(res)
    assert "This run was cancelled</b> at step" in (run / "report.html").read_text()


# --- torchrun, one agent per node over SSH -------------------------------------------------------

def test_torchrun_trains_digits_on_every_node(lab2):
    res = lab2.sh(f"{DSCLUSTER} launch --launcher torchrun --run-id tr-ok -- {' '.join(SHORT)}",
                  timeout=Deadline(STARTUP_S + 300).allowed)
    assert res.returncode == 0, explain(res)
    assert_trained_everywhere(lab2, lab2.runs / "tr-ok")


def test_rank_killed_under_torchrun_ends_the_job_on_every_node_naming_the_rank(lab2):
    log = lab2.work / "tr-kill.log"
    proc = lab2.popen(f"{DSCLUSTER} launch --launcher torchrun --run-id tr-kill -- {' '.join(LONG)}", log)
    run = lab2.runs / "tr-kill"
    try:
        host = kill_rank(lab2.lab, run, 1, 3, lambda: proc.poll() is None)
        t0 = time.monotonic()
        rc = proc.wait(timeout=Deadline(TIMEOUT_S + 60).allowed)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    out = log.read_text(errors="replace")
    print(f"rank 1 SIGKILLed under torchrun: launch exited {rc} after {took:.1f} s")
    assert rc not in (0, None), out[-3000:]
    assert f"dscluster launch: torchrun failed on {host} first" in out, out[-3000:]
    # torchrun's own failure report, from the node where the rank died
    assert re.search(rf"\[{host}\] +rank +: 1 \(local_rank: 0\)", out), out[-3000:]
    assert_gone_everywhere(lab2, "tr-kill")
    rc, doc = diagnose(run)
    assert rc == 1 and [f["rank"] for f in doc["findings"] if f["kind"] == "rank_died"] == [1], doc["findings"]
