"""Faults during training: a rank that skips a collective, a full disk while checkpointing, a node
that vanishes, Ctrl-C. (A rank SIGKILLed mid-epoch and the resume, compared step by step with an
uninterrupted run: test_train_local.py.)

Real mpirun on localhost (2 CPU ranks, DeepSpeed on gloo), the digits preset shrunk with
overrides so each run is start-up plus a few seconds: marked slow. The disk-full test mounts a
small tmpfs and so needs root (skipped with the reason otherwise). Each scenario is one
module-scoped run shared by the tests that read it. A vanished node and Ctrl-C need several
machines: those run on a simulated 2-node lab (marked cluster, root only), after the real
`dscluster setup` and `check`.

Process-group timeout used here: dist.timeout_s = TIMEOUT_S (6 s; the preset's default is
120 s, PyTorch's own 30 min); on the lab LAB_TIMEOUT_S.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _local_mpirun import DSCLUSTER, MPIRUN, ROOT, require_mpirun, train_command

from _wait import Deadline, scaled
from dscluster.files.fsutil import read_jsonl
from dscluster.sim.ns import netns_pids, pid_is_zombie

pytestmark = pytest.mark.slow

TIMEOUT_S = 6
# A small, fixed model and data size, whatever the preset says: 8 samples per rank and step.
SHRINK = ("progress=false", "model.depth=2", "model.embed_dim=48", "model.num_heads=3", "model.patch_size=4",
          "data.img_size=16", "micro_batch=8", "global_batch=16", "grad_accum=1", "log_every=1",
          "eval_every_epochs=100", f"dist.timeout_s={TIMEOUT_S}")

require_mpirun()


@dataclass
class Job:
    """A 2-rank `dscluster train` under mpirun, started but not waited for."""

    run: Path
    proc: subprocess.Popen
    started: float

    log: Path

    def wait(self, timeout: float = 300) -> tuple[int, str]:
        """Wait for mpirun: `timeout` is what an idle machine needs, stretched for the load."""
        try:
            self.proc.wait(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"mpirun still running after {scaled(timeout):.0f} s (a hang):\n{self.log.read_text()[-3000:]}")
        return self.proc.returncode, self.log.read_text(errors="replace")


def start(runs: Path, run_id: str, *overrides: str, fault: str | None = None) -> Job:
    cmd, env = train_command(runs, run_id, ["--config", str(ROOT / "configs" / "digits.yaml"), *SHRINK, *overrides],
                             fault=fault, env={"OMP_NUM_THREADS": "1"})
    log = runs / f"{run_id}.{time.time_ns()}.log"  # a file, not a pipe: nobody reads while we watch the run
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=runs, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Job(runs / run_id, proc, time.time(), log)


def records(run: Path, rank: int, kind: str | None = None) -> list[dict]:
    path = run / "metrics" / f"rank-{rank}.jsonl"
    recs = read_jsonl(path) if path.exists() else []
    return [r for r in recs if kind is None or r["kind"] == kind]


def last_attempt(run: Path, rank: int) -> list[dict]:
    """Records of the latest start of this rank (a resumed run appends to the same file)."""
    recs = records(run, rank)
    starts = [i for i, r in enumerate(recs) if r["kind"] == "start"]
    return recs[starts[-1]:] if starts else []


def diagnose(run: Path) -> tuple[int, dict]:
    p = subprocess.run([str(DSCLUSTER), "diagnose", str(run), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


# --- a rank that skips a collective ---------------------------------------------------------------

@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    """Rank 1 stays away from step 3's all-reduce (it sleeps 2 × timeout + 30 s, then exits 4)."""
    runs = tmp_path_factory.mktemp("skipped")
    job = start(runs, "s", "data.limit=256", "epochs=1", "checkpoint.every_epochs=0",
                fault="skip_collective:rank=1,step=3")
    rc, out = job.wait()
    return dict(run=job.run, rc=rc, out=out, seconds=time.time() - job.started, diagnosis=diagnose(job.run))


def test_skipped_collective_fails_within_the_process_group_timeout(skipped):
    assert skipped["rc"] != 0
    steps = records(skipped["run"], 0, "step")
    end = records(skipped["run"], 0, "end")
    assert [s["step"] for s in steps] == [1, 2]
    assert end and end[-1]["status"] == "failed"
    waited = end[-1]["t"] - steps[-1]["t"]
    print(f"rank 0 waited {waited:.1f} s in step 3's all-reduce (timeout {TIMEOUT_S} s): {end[-1]['error'][:120]}")
    assert "timed out" in end[-1]["error"].lower() or "timeout" in end[-1]["error"].lower(), end[-1]["error"]
    assert waited < scaled(2 * TIMEOUT_S)


def test_diagnose_names_the_rank_that_skipped_the_collective(skipped):
    rc, doc = skipped["diagnosis"]
    assert rc == 1 and not doc["healthy"]
    named = {f["rank"] for f in doc["findings"] if f["severity"] == "error" and f["rank"] is not None}
    assert 1 in named, doc["findings"]
    # rank 0 reports an error of its own (the failed collective), but only rank 1 left no end record
    assert [f["rank"] for f in doc["findings"] if f["kind"] == "rank_died"] == [1], doc["findings"]


def test_the_rank_that_waited_blames_no_one_and_points_to_diagnose(skipped):
    # rank 0 only waited: its summary must not name itself; the run directory names rank 1 (diagnose, above)
    summary = json.loads((skipped["run"] / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failed_rank"] is None and summary["failed_host"] is None
    assert summary["error"].startswith("a collective failed: another rank died or never joined"), summary["error"]
    assert "dscluster diagnose" in summary["error"] and summary["steps"] == 2


def test_skipped_collective_leaves_traces_in_the_run_directory(skipped):
    rc, doc = skipped["diagnosis"]
    files = [p for p in skipped["run"].rglob("*") if p.is_file() and p.stat().st_size > 0
             and ("trace" in p.name or "trace" in p.parent.name)]
    assert files, f"no trace files in {skipped['run']}"
    assert doc["traces"], "diagnose lists no traces"


# --- disk full while checkpointing ----------------------------------------------------------------

def test_disk_full_keeps_the_previous_checkpoint_latest_and_loadable(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the checkpoint folder needs root")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # One checkpoint of this model (58.8 k parameters) is ~750 kB (weights + AdamW moments):
    # 1100 KiB holds the first one, not a second.
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100k", "dscluster-test-full", str(ckpt)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        _disk_full_scenario(tmp_path, ckpt)
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)


def _disk_full_scenario(runs: Path, ckpt: Path) -> None:
    # An odd dataset size too: 75 samples over 2 ranks × 8 are 4 full steps per epoch, and the 11 left over
    # (6 on rank 0, 5 on rank 1) are dropped on every rank: a rank that took a fifth, short step would wait
    # in an all-reduce the other never joins (dist.timeout_s=6 would fail the run).
    overrides = ("data.limit=75", "epochs=3", "checkpoint.every_epochs=1", f"checkpoint.dir={ckpt}")
    spe = 75 // 16
    job = start(runs, "d", *overrides)
    rc, out = job.wait()
    for rank in (0, 1):
        assert [r["step"] for r in records(job.run, rank, "step")] == list(range(1, 3 * spe + 1)), out[-3000:]
    first = f"epoch0000-step{spe:08d}"
    assert (ckpt / "latest").exists(), f"not even the first checkpoint fitted:\n{out[-3000:]}"
    assert (ckpt / "latest").read_text().strip() == first
    # The stated rule (docs/failure-behaviour.md): one failed save is a warning and training goes on; a
    # second in a row (here the save after the last epoch) stops the run, exit 1, naming the folder and
    # its free space. Every step was trained, and `latest` still names the one complete checkpoint.
    assert rc != 0, f"two failed saves in a row did not stop the run:\n{out[-3000:]}"
    assert "training goes on without this checkpoint" in out and "2 checkpoint saves failed in a row: stopping" in out
    assert f"{ckpt} has " in out and " MB free" in out and "still points to " + first in out
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["latest", first]), "a half-written checkpoint was left"

    # The fix the message gives: free space there and run the same command; it resumes from `latest`.
    grown = subprocess.run(["mount", "-o", "remount,size=8m", str(ckpt)], capture_output=True, text=True)
    assert grown.returncode == 0, grown.stderr
    again = start(runs, "d2", *overrides, "checkpoint.resume=true")
    rc, out = again.wait()
    assert rc == 0, out[-3000:]
    for rank in (0, 1):
        attempt = last_attempt(again.run, rank)
        assert attempt[0]["resumed_from_step"] == spe
        assert [r["step"] for r in attempt if r["kind"] == "step"] == list(range(spe + 1, 3 * spe + 1))


# --- a node that vanishes, and Ctrl-C, on the simulated lab ---------------------------------------

LAB_TIMEOUT_S = 30
BOUND_S = 90            # the promise: the job has ended within dist.timeout_s + BOUND_S
STARTUP_S = 300         # ranks starting DeepSpeed on 2 shared cores, beside other tests' jobs
LAB_AT = 10             # the fault comes once the last rank has logged this step (a checkpoint was at 8)
# node1 runs the commands; the other node is the one that vanishes: its cable pulled, the head's own rank ending
# within the bound, the vanished node named, with one rank fewer to start in each of the five jobs here than on
# three nodes. A bystander node's ranks, which mpirun ends through its daemon there whatever ended the job, are
# watched on test_launch_lab.py's third node (test_a_killed_rank_tears_the_job_down_everywhere).
LAB_NODES = 2
GONE = f"node{LAB_NODES}"
LAST_RANK = LAB_NODES - 1
LAB_ARGS = ("--config", "configs/digits.yaml", "data.limit=640", "epochs=3", "checkpoint.every_steps=4",
            "progress=false")


@dataclass
class LabJob:
    lab: object
    work: Path
    run: Path
    proc: subprocess.Popen
    log: Path

    def wait(self, timeout: float) -> tuple[int | None, str]:
        """Exit code, or None if the command was still running after `timeout` (then it is killed)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return None, self.log.read_text(errors="replace")
        return self.proc.returncode, self.log.read_text(errors="replace")

    def reach_step(self, rank: int, step: int) -> None:
        deadline = Deadline(STARTUP_S)
        while not [r for r in records(self.run, rank, "step") if r["step"] >= step]:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
            assert not deadline.passed(), f"rank {rank} did not reach step {step} in {deadline.allowed:.0f} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def faultlab(lab_factory):
    """LAB_NODES nodes after the real `dscluster setup` (which writes ~/.prte/mca-params.conf) and `check`;
    commands run in node1 as the lab user from a working directory on the shared disk."""
    lab = lab_factory("faultlab", nodes=LAB_NODES, slots=1)
    work = lab.shared / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, lab.uid, lab.gid)
    setup = f"{DSCLUSTER} setup --hostfile {lab.hostfile} --trust-new-hosts --fix-path"
    for cmd in (f"DSCLUSTER_SSH_PASSWORD={shlex.quote(lab.password)} {setup}",
                f"{DSCLUSTER} check --hostfile {lab.hostfile} --skip-active"):  # active tests: test_check
        res = lab.run("node1", f"cd {work} && {cmd}", timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return lab, work


def lab_start(faultlab, run_id: str, cmd: str) -> LabJob:
    lab, work = faultlab
    log = work / f"{run_id}.{time.time_ns()}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(lab.command("node1", f"cd {work} && exec {cmd}"), env=lab.env(node="node1"),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return LabJob(lab, work, work / "runs" / run_id, proc, log)


def launch_cmd(run_id: str, timeout_s: int = LAB_TIMEOUT_S) -> str:
    return f"{DSCLUSTER} launch --run-id {run_id} -- {' '.join(LAB_ARGS)} dist.timeout_s={timeout_s}"


def mpirun_cmd(run_id: str, lab, timeout_s: int) -> str:
    """The hand-typed command (with a fixed run id, so the test can find the run directory)."""
    return (f"env DSCLUSTER_RUN_ID={run_id} {MPIRUN} -x DSCLUSTER_RUN_ID -np {LAB_NODES} --hostfile {lab.hostfile} "
            f"{ROOT}/entry_cn.sh {' '.join(LAB_ARGS)} dist.timeout_s={timeout_s}")


def alive(node) -> list[tuple[list[bytes], list[bytes]]]:
    """(argv, environment) of each live process on the node (its network namespace)."""
    found = []
    for pid in netns_pids(node.netns):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and not pid_is_zombie(pid):
            found.append((argv, environ))
    return found


def shown(argv: list[bytes]) -> str:
    return b" ".join(argv).decode(errors="replace")[:100]


def job_processes(lab, run_id: str) -> dict[str, list[str]]:
    """Ranks, entry_cn.sh and telemetry samplers of this run still alive, per node."""
    left: dict[str, list[str]] = {}
    for node in lab.nodes:
        for argv, environ in alive(node):
            if f"DSCLUSTER_RUN_ID={run_id}".encode() in environ:
                left.setdefault(node.name, []).append(shown(argv))
    return left


def wait_until_gone(lab, run_id: str, deadline: float) -> dict[str, list[str]]:
    while (left := job_processes(lab, run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def daemons(lab, node: str) -> list[str]:
    """OpenMPI's daemons (prted) alive on `node`: mpirun starts one per node and job, over SSH."""
    return [shown(argv) for argv, _ in alive(lab.node(node)) if argv[0].rsplit(b"/", 1)[-1] == b"prted"]


def latest_step(run: Path) -> int:
    return int((run / "checkpoints" / "latest").read_text().strip().rsplit("step", 1)[1])


def assert_resumes(faultlab, run_id: str, cmd: str) -> None:
    """The same command again finishes the run, every rank starting after the last checkpoint."""
    job = lab_start(faultlab, run_id, cmd)
    done = latest_step(job.run)
    rc, out = job.wait(scaled(STARTUP_S + 300))
    assert rc == 0, out[-3000:]
    for rank in range(LAB_NODES):
        again = last_attempt(job.run, rank)
        assert again[0]["resumed_from_step"] == done
        total = again[0]["steps_per_epoch"] * 3  # epochs=3
        assert [r["step"] for r in again if r["kind"] == "step"] == list(range(done + 1, total + 1))


def pull_the_cable(job: LabJob, timeout_s: int) -> tuple:
    """Disconnect GONE once its rank (the last) reached LAB_AT; wait (within the promised bound) for the
    command and then for every process of the run on the other nodes; diagnose; reconnect.
    Returns (exit code or None, output, s to exit, s until the run's processes were gone,
    processes left per node, diagnose document). Once back, GONE keeps no daemon of the ended job, and the
    next job's daemon starts on a node the old one has left (on a busy machine, the next mpirun's daemon there
    once failed to report back, exit 213; the old one may still have been ending: not reproduced here)."""
    job.reach_step(LAST_RANK, LAB_AT)
    run_id, t0 = job.run.name, time.monotonic()
    job.lab.disconnect(GONE)
    try:
        rc, out = job.wait(timeout_s + BOUND_S)
        took = time.monotonic() - t0
        left = wait_until_gone(job.lab, run_id, t0 + timeout_s + BOUND_S)
        gone = time.monotonic() - t0
        doc = diagnose(job.run)[1]
    finally:
        job.lab.reconnect(GONE)
    back = time.monotonic()
    while (old := daemons(job.lab, GONE)) and time.monotonic() < back + BOUND_S:
        time.sleep(0.5)
    assert not old, f"{GONE} kept the ended job's daemons {BOUND_S} s after it came back: {old}"
    return rc, out, took, gone, {n: p for n, p in left.items() if n != GONE}, doc


@pytest.mark.cluster
def test_launch_ends_within_the_timeout_when_a_node_vanishes_names_it_and_resumes_after_ctrl_c(faultlab):
    lab, _ = faultlab
    job = lab_start(faultlab, "vanish", launch_cmd("vanish"))
    rc, out, took, _, left, doc = pull_the_cable(job, LAB_TIMEOUT_S)
    print(f"{GONE} disconnected after step {LAB_AT}: launch returned {rc} after {took:.1f} s "
          f"(dist.timeout_s {LAB_TIMEOUT_S})")
    assert rc not in (None, 0), out[-3000:]
    assert took < LAB_TIMEOUT_S + BOUND_S
    assert not left, left
    assert f"dscluster launch: {GONE} vanished" in out, out[-2000:]
    summary = json.loads((job.run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["vanished_hosts"] == [GONE], summary
    assert summary["failed_host"] == GONE
    assert [(f["kind"], f["host"]) for f in doc["findings"]][0] == ("host_vanished", GONE), doc["findings"]
    assert not wait_until_gone(lab, "vanish", time.monotonic() + BOUND_S), f"{GONE} kept its rank after reconnecting"
    # The same command resumes from the checkpoint before the fault; Ctrl-C on it stops every rank and sampler
    # (below), and the same command again finishes the run.
    done = latest_step(job.run)
    resumed = lab_start(faultlab, "vanish", launch_cmd("vanish"))
    ctrl_c_stops_every_rank(faultlab, resumed, "launch", LAB_AT + 4)
    for rank in range(LAB_NODES):
        assert [r["resumed_from_step"] for r in records(job.run, rank, "start")][1] == done
    assert_resumes(faultlab, "vanish", launch_cmd("vanish"))


@pytest.mark.cluster
def test_hand_typed_mpirun_ends_when_a_node_vanishes_through_setups_keepalives(faultlab):
    # No PRTE_MCA_* in this environment: mpirun and its daemons read ~/.prte/mca-params.conf,
    # written by setup. Without it mpirun waited until the node came back.
    lab, _ = faultlab
    timeout_s = LAB_TIMEOUT_S
    job = lab_start(faultlab, "vanish-mpirun", mpirun_cmd("vanish-mpirun", lab, timeout_s))
    # mpirun leaves node1's rank to fail on its own; that rank writes the summary as it goes
    rc, out, took, stopped, left, doc = pull_the_cable(job, timeout_s)
    print(f"{GONE} disconnected: hand-typed mpirun returned {rc} after {took:.1f} s, its last rank ended "
          f"after {stopped:.1f} s (dist.timeout_s {timeout_s})")
    assert rc is not None and took < timeout_s + BOUND_S, out[-3000:]
    assert "Remote daemon" in out and f"on node {GONE}" in out
    assert not left, left
    summary = json.loads((job.run / "summary.json").read_text())
    assert summary["vanished_hosts"] == [GONE], summary
    assert any(f["kind"] == "host_vanished" and f["host"] == GONE for f in doc["findings"])


def ctrl_c_stops_every_rank(faultlab, job: LabJob, how: str, at_step: int) -> None:
    """Ctrl-C on the command once the last rank has logged `at_step` (a checkpoint behind it): it ends within the
    process-group timeout, with nothing of the run left on any node; launch exits 130."""
    lab, _ = faultlab
    job.reach_step(LAST_RANK, at_step)
    assert latest_step(job.run) >= at_step - at_step % 4 - 4
    t0 = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    rc, out = job.wait(LAB_TIMEOUT_S)
    left = wait_until_gone(lab, job.run.name, t0 + LAB_TIMEOUT_S)
    print(f"Ctrl-C on {how}: returned {rc} after {time.monotonic() - t0:.1f} s")
    assert rc not in (None, 0), out[-3000:]
    assert rc == 130 or how == "mpirun"
    assert not left, f"still running {LAB_TIMEOUT_S} s after Ctrl-C: {left}"


@pytest.mark.cluster
def test_ctrl_c_on_the_hand_typed_mpirun_stops_every_rank_and_sampler_within_the_timeout(faultlab):
    # Ctrl-C on launch, and the same command resuming after it: the vanished-node test above
    lab, _ = faultlab
    job = lab_start(faultlab, "ctrl-c-mpirun", mpirun_cmd("ctrl-c-mpirun", lab, LAB_TIMEOUT_S))
    ctrl_c_stops_every_rank(faultlab, job, "mpirun", LAB_AT)
