"""Bring your own script: a plain DeepSpeed program run by entry_cn.sh under mpirun on a simulated
2-node lab, after `dscluster setup` and `check`, gets dscluster's run directory (both ranks'
metrics through dscluster.userlog, each node's telemetry) and `analysis/plot.py` draws it. A script
that imports nothing from dscluster still gets each rank's exit record and a summary that says how
it ended, and a failing one names the rank and its exit code.

As in test_launch_lab.py, commands run in node1 as the lab user from a working directory on the
lab's shared disk, so the literal mpirun line needs no exported variable.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from test_launch_lab import Cluster, explain

from dscluster.analysis.monitor import read_csv_series
from dscluster.files.fsutil import read_jsonl

# Slow, and must stay so: unmodified DeepSpeed scripts under entry_cn.sh on a 2-node lab, one mpirun
# each.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
TRAIN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster(lab_factory) -> Cluster:
    """A 2-node lab after the user's own `dscluster setup` and `check` (no test key mesh). The scripts need
    check's env files, not its MPI hello and all-reduce, which test_check.py and the journeys (demo, install,
    ethernet, the literal mpirun) run: --skip-active spares two ranks' start-ups."""
    return set_up_and_checked(lab_factory("byolab", nodes=2, slots=1), "--skip-active")


def set_up_and_checked(lab, check_options: str = "") -> Cluster:
    """The lab after the user's own `dscluster setup` and `check`, run as the lab user on node1
    from a working directory on the shared disk."""
    work = lab.shared / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, lab.uid, lab.gid)
    c = Cluster(lab=lab, work=work, hostfile=str(lab.hostfile))
    setup = c.sh(f"DSCLUSTER_SSH_PASSWORD={shlex.quote(lab.password)} {VENV_BIN}/dscluster setup "
                 f"--hostfile {c.hostfile} --trust-new-hosts --fix-path", timeout=300)
    assert setup.returncode == 0, explain(setup)
    check = c.sh(f"{VENV_BIN}/dscluster check --hostfile {c.hostfile} {check_options}", timeout=300)
    assert check.returncode == 0, explain(check)
    return c


def test_plain_deepspeed_script_gets_metrics_telemetry_and_plots(cluster):
    lab = cluster.lab
    res = cluster.sh(f"{VENV_BIN}/mpirun -np 2 --hostfile {cluster.hostfile} {REPO}/entry_cn.sh "
                     f"python {REPO}/examples/ds_train.py --steps 5", timeout=TRAIN_TIMEOUT_S)
    assert res.returncode == 0, explain(res)
    runs = sorted(cluster.runs.iterdir())
    assert len(runs) == 1, runs
    run = runs[0]
    assert run.name.startswith("mpi-")  # the job's one run id, as for `dscluster train`

    hosts = set()
    for rank in (0, 1):
        records = read_jsonl(run / "metrics" / f"rank-{rank}.jsonl")
        assert [r["kind"] for r in records] == ["start"] + ["step"] * 5 + ["end"], records
        assert records[0]["world_size"] == 2 and records[0]["launcher"] == "openmpi"
        assert all(r["step_time"] > 0 and r["samples_per_s"] > 0 for r in records[1:-1])
        assert records[-1]["status"] == "complete"
        hosts.add(records[0]["host"])
        env = json.loads((run / "env" / f"rank-{rank}.json").read_text())
        node = next(n for n in lab.nodes if n.hostname == env["host"])
        assert env["GLOO_SOCKET_IFNAME"] == node.iface  # the node's own interface from check
    assert hosts == {n.hostname for n in lab.nodes}  # one rank per node
    assert json.loads((run / "summary.json").read_text())["status"] == "complete"

    telemetry = sorted(p.stem for p in (run / "telemetry").glob("*.jsonl"))
    assert telemetry == sorted(hosts)
    for host in telemetry:
        assert any(r.get("kind", "sample") == "sample" for r in read_jsonl(run / "telemetry" / f"{host}.jsonl"))

    plot = subprocess.run([str(VENV_BIN / "python"), str(REPO / "analysis" / "plot.py"), str(run)],
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, explain(plot)
    assert (run / "plots" / "loss.png").exists() and (run / "report.html").exists()


def _new_run(cluster, before: set) -> Path:
    runs = (set(cluster.runs.iterdir()) if cluster.runs.is_dir() else set()) - before
    assert len(runs) == 1, runs
    return runs.pop()


def test_an_unmodified_deepspeed_script_is_recorded_complete_with_its_monitor_series(cluster):
    """examples/ds_train_plain.py imports nothing from dscluster: entry_cn.sh's records say how it ended
    and DeepSpeed's csv_monitor (pointed at the run directory) gives the report its loss and lr."""
    before = set(cluster.runs.iterdir()) if cluster.runs.is_dir() else set()
    res = cluster.sh(f"{VENV_BIN}/mpirun -np 2 --hostfile {cluster.hostfile} {REPO}/entry_cn.sh "
                     f"python {REPO}/examples/ds_train_plain.py --steps 6", timeout=TRAIN_TIMEOUT_S)
    assert res.returncode == 0, explain(res)
    run = _new_run(cluster, before)
    hosts = set()
    for rank in (0, 1):
        rec = json.loads((run / "process" / f"rank-{rank}.json").read_text())
        assert (rec["exit_code"], rec["world_size"]) == (0, 2) and rec["end_t"] > rec["start_t"]
        hosts.add(rec["host"])
    assert hosts == {n.hostname for n in cluster.lab.nodes}
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("complete", 0)
    plot = subprocess.run([str(VENV_BIN / "python"), str(REPO / "analysis" / "plot.py"), str(run)],
                          capture_output=True, text=True, timeout=300)
    assert plot.returncode == 0, explain(plot)
    html = (run / "report.html").read_text()
    assert "complete (exit 0)" in html and "did not complete" not in html
    assert (run / "plots" / "monitor.png").exists()
    assert len(read_csv_series(run / "deepspeed" / "Train_Samples_train_loss.csv")) == 6


FAILING = """import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(120)  # rank 0 waits, as in a collective its peer never joins: the launcher must stop it
"""


def test_a_failing_script_names_the_rank_and_its_exit_code(cluster):
    script = cluster.work / "failing.py"
    script.write_text(FAILING)
    before = set(cluster.runs.iterdir()) if cluster.runs.is_dir() else set()
    res = cluster.sh(f"{VENV_BIN}/mpirun -np 2 --hostfile {cluster.hostfile} {REPO}/entry_cn.sh "
                     f"python {script}", timeout=TRAIN_TIMEOUT_S)
    assert res.returncode != 0, explain(res)
    run = _new_run(cluster, before)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["failed_rank"], summary["exit_code"]) == ("failed", 1, 3), summary
    diag = subprocess.run([str(VENV_BIN / "dscluster"), "diagnose", str(run), "--json"],
                          capture_output=True, text=True, timeout=120)
    errors = [f for f in json.loads(diag.stdout)["findings"] if f["severity"] == "error"]
    assert [(f["kind"], f["rank"]) for f in errors] == [("rank_failed", 1)], errors
    assert "exit 3" in errors[0]["message"]
