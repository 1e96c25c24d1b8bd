"""The launch path on a simulated 3-node lab: real sshd, `dscluster setup`/`check`, mpirun,
DeepSpeed's launcher and DeepSpeed training on gloo, each node with its own interface name.

Cluster commands run in node1 as the lab user from a working directory on the lab's shared
disk (like an NFS home): `dscluster check` leaves .dscluster/ there, and mpirun starts every
rank in that directory, so no exported variable is needed to find the check output or the run
directory. The README's literal `mpirun -np 3 --hostfile H entry_cn.sh` (the preset to 90%, per-node
interfaces, telemetry from every node) runs in test_demo.py, as `make demo` runs it. Three nodes here, not two:
a killed rank's job must end on node3 too, a bystander that neither runs mpirun nor lost the rank
(test_faults.py's vanished node relies on this for the daemons' teardown).
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

from _wait import Deadline, scaled, wait_until
from dscluster.files.fsutil import read_jsonl
from dscluster.sim.ns import netns_pids, pid_is_zombie

# Slow, and must stay so: each test trains digits on a 3-node lab.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DSCLUSTER = f"{REPO}/.venv/bin/dscluster"
MPIRUN = f"{REPO}/.venv/bin/mpirun"
ENTRY = f"{REPO}/entry_cn.sh"
TRAIN_TIMEOUT_S = 900


@dataclass
class Cluster:
    lab: object
    work: Path
    hostfile: str

    def sh(self, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a shell line in node1 as the lab user, from the shared working directory."""
        return self.lab.run("node1", f"cd {shlex.quote(str(self.work))} && {cmd}", timeout=timeout)

    def popen(self, cmd: str, log: Path) -> subprocess.Popen:
        """Start a shell line in node1 without waiting; its output goes to `log` (a file: a pipe
        nobody reads while the test watches would fill up and stall the job)."""
        env = {"HOME": f"/home/{self.lab.user}", "USER": self.lab.user, "PATH": "/usr/local/bin:/usr/bin:/bin",
               "LANG": "C.UTF-8"}
        argv = self.lab.command("node1", f"cd {shlex.quote(str(self.work))} && {cmd}")
        with open(log, "w") as f:
            return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def runs(self) -> Path:
        return self.work / "runs"

    def run_names(self) -> set[str]:
        return {p.name for p in self.runs.iterdir()} if self.runs.is_dir() else set()


def explain(res: subprocess.CompletedProcess, tail: int = 4000) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-tail:]}\n--- stderr\n{res.stderr[-tail:]}"


def set_up(lab_factory, name: str, nodes: int = 3) -> Cluster:
    """A lab of `nodes` nodes with a shared working directory, keys installed and host keys pinned (`setup`)."""
    lab = lab_factory(name, nodes=nodes, slots=1)
    work = lab.shared / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, lab.uid, lab.gid)
    c = Cluster(lab=lab, work=work, hostfile=str(lab.hostfile))
    setup = lab.run("node1", f"cd {work} && DSCLUSTER_SSH_PASSWORD={shlex.quote(lab.password)} "
                    f"{DSCLUSTER} setup --hostfile {c.hostfile} --trust-new-hosts --fix-path", timeout=300)
    assert setup.returncode == 0, explain(setup)
    return c


@pytest.fixture(scope="module")
def cluster(lab_factory):
    c = set_up(lab_factory, "launchlab")
    work = c.work
    check = c.sh(f"{DSCLUSTER} check --hostfile {c.hostfile}", timeout=300)
    assert check.returncode == 0, explain(check)
    assert (work / ".dscluster" / "check.json").exists()
    return c


def test_deepspeed_launcher_trains_on_the_same_lab(cluster):
    res = cluster.sh(f"{DSCLUSTER} launch --launcher deepspeed --run-id ds-launch -- "
                     f"--config {REPO}/configs/digits.yaml epochs=1", timeout=TRAIN_TIMEOUT_S)
    assert res.returncode == 0, explain(res)
    run = cluster.runs / "ds-launch"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 3
    assert sorted(summary["hosts"]) == sorted(n.hostname for n in cluster.lab.nodes)
    assert sorted(p.name for p in (run / "metrics").glob("rank-*.jsonl")) == [f"rank-{r}.jsonl" for r in range(3)]


def test_plan_calibrate_runs_powersgd_on_the_nodes_and_then_predicts_what_it_measured(cluster):
    # a plan for the first two nodes of the three that check ran on: the README's mpirun takes any hostfile
    lines = [l for l in Path(cluster.hostfile).read_text().splitlines() if l.strip() and not l.startswith("#")]
    two = cluster.work / "hosts2.txt"
    two.write_text("\n".join(lines[:2]) + "\n")
    # --probe-here: the nodes of this lab share one machine's cores, and probes at once read each
    # node slower than the run goes (a calibration is exact only against the figure it was made with)
    plan = (f"{DSCLUSTER} plan --hostfile {two} --config {REPO}/configs/digits.yaml --json --probe-here "
            "comm.compression=powersgd global_batch=64")  # 32 a rank: plan's img/s is train's exactly
    before = cluster.run_names()
    res = cluster.sh(f"{plan} --calibrate", timeout=TRAIN_TIMEOUT_S)
    assert res.returncode == 0, explain(res)
    doc = json.loads(res.stdout)  # the run's own output went to stderr: stdout is the plan alone
    [run] = doc["calibration_runs"]
    assert cluster.run_names() - before == {run["run_id"]} and run["run_id"].startswith("calibrate-powersgd-")
    summary = json.loads((cluster.runs / run["run_id"] / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 2
    assert summary["images_per_s"] == run["images_per_s"]
    # train compared the run with the model step plan saved for it and kept the outcome
    assert "compression=powersgd ranks=2" in summary["plan"]["key"] and summary["plan"]["setting"] == "calibration"
    cal = doc["calibration"]["powersgd"]
    assert cal["runs"] == 1
    p = doc["prediction"]
    assert p["calibration_s"] == cal["extra_s"] and p["global_batch"] == run["global_batch"]
    # the plan for the setting it ran now predicts what the nodes measured, not what the model alone gave
    assert p["images_per_s"] == pytest.approx(run["images_per_s"], rel=1e-6), json.dumps(
        {k: doc[k] for k in ("compute", "prediction", "nodes", "calibration", "notes")})
    assert p["images_per_s"] != pytest.approx(run["model_images_per_s"], rel=1e-3)
    assert any(n.startswith("--calibrate: PowerSGD measured") for n in doc["notes"])

    again = cluster.sh(f"{plan} --calibrate", timeout=300)
    assert again.returncode == 0, explain(again)
    doc2 = json.loads(again.stdout)
    assert doc2["calibration_runs"] == [] and cluster.run_names() - before == {run["run_id"]}
    assert any("nothing to measure (PowerSGD is already calibrated" in n for n in doc2["notes"])


def test_slurm_dry_run_script_parses_and_runs_the_same_training(cluster, tmp_path):
    args = f"-- --config {REPO}/configs/digits.yaml epochs=2"
    slurm = cluster.sh(f"{DSCLUSTER} launch --launcher slurm --dry-run {args}")
    assert slurm.returncode == 0, explain(slurm)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.stdout)
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    mpirun = cluster.sh(f"{DSCLUSTER} launch --dry-run --json {args}")
    assert mpirun.returncode == 0, explain(mpirun)
    tail = json.loads(mpirun.stdout)["argv"][-4:]
    assert tail[0] == ENTRY
    srun = [l for l in slurm.stdout.splitlines() if l.startswith("srun ")]
    assert len(srun) == 1 and srun[0].endswith(shlex.join(tail))


def _lab_pids(lab) -> dict[str, set[int]]:
    return {n.name: {p for p in netns_pids(n.netns) if not pid_is_zombie(p)} for n in lab.nodes}


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return []


def test_a_killed_rank_tears_the_job_down_everywhere(cluster, tmp_path):
    lab = cluster.lab
    baseline = _lab_pids(lab)
    run = cluster.runs / "kill-rank"
    log = tmp_path / "launch.log"
    proc = cluster.popen(f"{DSCLUSTER} launch --run-id kill-rank -- --config {REPO}/configs/digits.yaml epochs=50",
                         log)

    def rank_1_stepped() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        metrics = run / "metrics" / "rank-1.jsonl"
        return metrics.exists() and any(r.get("kind") == "step" for r in read_jsonl(metrics))

    try:
        wait_until(rank_1_stepped, 300, "rank 1's first training step", interval=1.0)
        victims = [pid for pids in _lab_pids(lab).values() for pid in pids
                   if _environ(pid).get("DSCLUSTER_RUN_ID") == "kill-rank"
                   and _environ(pid).get("OMPI_COMM_WORLD_RANK") == "1"
                   and "train" in _cmdline(pid) and "python" in os.path.basename(_cmdline(pid)[0])]
        assert len(victims) == 1, victims
        t0 = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        wait_until(lambda: proc.poll() is not None, 60, "the launch to end after rank 1 was killed", interval=0.2,
                   explain=lambda: log.read_text(errors="replace")[-3000:])
        teardown_s = time.monotonic() - t0
        print(f"job ended {teardown_s:.1f} s after rank 1 was killed")
        assert proc.returncode != 0
        assert teardown_s < scaled(30), f"mpirun took {teardown_s:.1f} s to end the job"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # PID 1 reaps orphans slowly here: give leftovers a few seconds before calling them strays.
    deadline = Deadline(20)
    while True:
        left = {node: pids - baseline[node] for node, pids in _lab_pids(lab).items()}
        left = {node: sorted(p) for node, p in left.items() if p}
        if not left or deadline.passed():
            break
        time.sleep(0.5)
    described = {node: [" ".join(_cmdline(p))[:120] for p in pids] for node, pids in left.items()}
    assert not left, f"processes left on the nodes after the job ended: {described}"
    assert list((run / "telemetry").glob("*.jsonl")), "no sampler ran"

