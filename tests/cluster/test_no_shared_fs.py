"""A lab without a shared filesystem (`sim up --no-shared-fs`): every node has its own clone of the
checkout at the same path, its own run directories and home; only the .venv is shared software.

Commands run in node1 (the head) as the lab user, in node1's own clone (the working directory a
user of such a lab has): `dscluster setup`, `check` (which must say the layout and catch a clone
that differs), `sync`, the README's `mpirun ... ./entry_cn.sh`, `collect`, plot, and a resume
after a killed rank. Files are read from the host through `lab.path_on(node, path)`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

# Slow, and must stay so: the README mpirun on 3 nodes that share no files; then top watching the same
# command, a killed rank and that command resuming on every node.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DSCLUSTER = f"{REPO}/.venv/bin/dscluster"


def explain(res: subprocess.CompletedProcess, tail: int = 4000) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-tail:]}\n--- stderr\n{res.stderr[-tail:]}"


@pytest.fixture(scope="module")
def lab(no_shared_fs_lab_factory):
    lab = no_shared_fs_lab_factory("nofslab", nodes=3, slots=1)
    setup = lab.run("node1", f"DSCLUSTER_SSH_PASSWORD={shlex.quote(lab.password)} {DSCLUSTER} setup "
                    f"--hostfile {lab.hostfile} --trust-new-hosts --fix-path", timeout=300)
    assert setup.returncode == 0, explain(setup)
    return lab


def check(lab, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    res = lab.run("node1", f"{DSCLUSTER} check --hostfile {lab.hostfile} --skip-active {' '.join(args)}", timeout=300)
    doc = json.loads(lab.path_on("node1", REPO / ".dscluster" / "check.json").read_text())
    return res, doc


def sync(lab, *args: str) -> dict:
    res = lab.run("node1", f"{DSCLUSTER} sync --hostfile {lab.hostfile} --json {' '.join(args)}", timeout=300)
    assert res.returncode == 0, explain(res)
    return {n["node"]: n for n in json.loads(res.stdout)["nodes"]}


def test_the_nodes_do_not_share_files(lab):
    for node in ("node1", "node2"):
        lab.run(node, f"echo {node} > {lab.shared}/who && echo {node} > runs-who", check=True)
    assert lab.path_on("node2", lab.shared / "who").read_text() == "node2\n"
    assert lab.path_on("node1", REPO / "runs-who").read_text() == "node1\n"
    assert not (REPO / "runs-who").exists()   # the host's checkout is no node's
    # every node runs its own clone's code with the shared venv
    out = lab.run("node2", ".venv/bin/python -c 'import dscluster; print(dscluster.__file__)'", check=True).stdout
    assert out.strip() == f"{REPO}/src/dscluster/__init__.py"


def test_check_names_the_node_one_commit_behind_and_sync_makes_them_equal(lab):
    edit = ("echo '# a change made on node2 only' >> configs/digits.yaml && "
            "git -c user.name=lab -c user.email=lab@lab commit -qam 'one more commit on node2'")
    lab.run("node2", edit, check=True)
    res, doc = check(lab)
    assert res.returncode == 1, explain(res)
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert [(f["node"], f["check"]) for f in errors] == [("node2", "files")], errors
    assert "configs/digits.yaml" in errors[0]["what"] and "dscluster sync" in errors[0]["fix"]
    assert "node2" in res.stdout and "dscluster sync" in res.stdout
    layout = doc["layout"]["nodes"]
    assert layout["node2"]["checkout"] == "copy" and not layout["node2"]["same_as_head"]
    assert layout["node1"]["checkout"] == "shared" and layout["node3"]["same_as_head"]
    assert layout["node2"]["runs"] == "own" and layout["node3"]["runs"] == "own"
    assert layout["node2"]["commit"] != doc["layout"]["commit"]

    dry = sync(lab, "--dry-run")
    assert dry["node2"]["files"]["checkout"] == 1 and dry["node2"]["copied_files"] == 0
    first = sync(lab)
    assert first["node2"]["files"]["checkout"] == 1 and first["node2"]["copied_files"] >= 1
    assert first["node3"]["files"]["checkout"] == 0 and first["node3"]["files"]["state"] > 0  # the env files
    node2_yaml = lab.path_on("node2", REPO / "configs" / "digits.yaml")
    assert node2_yaml.read_bytes() == lab.path_on("node1", REPO / "configs" / "digits.yaml").read_bytes()
    assert lab.path_on("node3", REPO / ".dscluster" / "env" / "node3.env").exists()
    again = sync(lab)
    assert all(n["copied_files"] == 0 and not any(n["files"].values()) for n in again.values()), again
    res, doc = check(lab)
    assert res.returncode == 0, explain(res)
    assert "checkout a copy on node2, node3" in res.stdout


def test_sync_copies_a_data_folder_and_check_compares_it(lab):
    data = lab.shared / "data"
    lab.run("node1", f"mkdir -p {data}/sub && echo one > {data}/a.bin && echo two > {data}/sub/b.bin", check=True)
    res, doc = check(lab, f"--data {data}")
    assert res.returncode == 1
    assert {f["node"] for f in doc["findings"] if f["severity"] == "error"} == {"node2", "node3"}
    assert all(f"--data {data}" in f["fix"] for f in doc["findings"] if f["severity"] == "error")
    copied = sync(lab, f"--data {data}")
    assert copied["node2"]["files"]["data"] == 2
    assert lab.path_on("node3", data / "sub" / "b.bin").read_text() == "two\n"
    res, doc = check(lab, f"--data {data}")
    assert res.returncode == 0, explain(res)
    assert doc["layout"]["nodes"]["node2"]["data"] == {"present": True, "files": 2, "bytes": 8, "same_as_head": True}


# --- the whole journey: the README's mpirun, the run comes home, plot, a killed rank, resume ----------

SHRINK = ("progress=false model.depth=2 model.embed_dim=48 model.num_heads=3 model.patch_size=4 data.img_size=16 "
          "micro_batch=8 global_batch=24 grad_accum=1 log_every=1 eval_every_epochs=100 dist.timeout_s=20")
MPIRUN = f"{REPO}/.venv/bin/mpirun"


def records(path: Path, kind: str | None = None) -> list[dict]:
    from dscluster.files.fsutil import read_jsonl
    recs = read_jsonl(path) if path.exists() else []
    return [r for r in recs if kind is None or r.get("kind") == kind]


@pytest.fixture(scope="module")
def synced(lab):
    res, _ = check(lab)
    assert res.returncode == 0, explain(res)
    sync(lab)
    return lab


def test_the_readme_mpirun_brings_every_nodes_part_home_and_plot_sees_every_rank(synced):
    lab = synced
    runs = lab.path_on("node1", REPO / "runs")
    before = set(p.name for p in runs.iterdir()) if runs.is_dir() else set()
    res = lab.run("node1", f"OMP_NUM_THREADS=1 {MPIRUN} -np 3 --hostfile {lab.hostfile} ./entry_cn.sh "
                  f"--config configs/digits.yaml {SHRINK} data.limit=240 epochs=1", timeout=900)
    assert res.returncode == 0, explain(res)
    [name] = set(p.name for p in runs.iterdir()) - before
    run = runs / name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 3
    # each node wrote its part into its own copy, and pushed it to the head's when its ranks ended
    assert (lab.path_on("node2", REPO / "runs" / name / "metrics" / "rank-1.jsonl")).exists()
    assert not lab.path_on("node2", REPO / "runs" / name / "summary.json").exists()
    assert sorted(p.name for p in (run / "metrics").glob("rank-*.jsonl")) == [f"rank-{r}.jsonl" for r in range(3)]
    assert sorted(p.name for p in (run / "telemetry").glob("*.jsonl")) == ["node1.jsonl", "node2.jsonl", "node3.jsonl"]
    assert all(records(run / "metrics" / f"rank-{r}.jsonl", "end") for r in range(3))
    # every node kept the checkpoint its ranks need, `latest` included
    for node in ("node1", "node2", "node3"):
        assert lab.path_on(node, REPO / "runs" / name / "checkpoints" / "latest").exists(), node

    plot = lab.run("node1", f".venv/bin/python analysis/plot.py runs/{name}", timeout=300)
    assert plot.returncode == 0, explain(plot)
    from dscluster.analysis.load import load_run
    loaded = load_run(run)
    assert sorted(loaded.ranks) == [0, 1, 2] and sorted(loaded.telemetry) == ["node1", "node2", "node3"]

    # a node's part that did not come home is named as such, not as dead ranks; collect fetches it
    for f in [run / "metrics" / "rank-2.jsonl", run / "env" / "rank-2.json", run / "telemetry" / "node3.jsonl"]:
        f.unlink()
    diag = lab.run("node1", f"{DSCLUSTER} diagnose runs/{name} --json", timeout=120)
    found = json.loads(diag.stdout)["findings"]
    assert [(f["kind"], f["host"]) for f in found if f["severity"] == "error"] == [("files_not_here", "node3")], found
    assert "node3's files are not here (no shared filesystem): run `dscluster collect" in diag.stdout
    got = lab.run("node1", f"{DSCLUSTER} collect runs/{name} --hostfile {lab.hostfile} --json", timeout=300)
    assert got.returncode == 0, explain(got)
    per_node = {n["node"]: n for n in json.loads(got.stdout)["nodes"]}
    assert per_node["node3"]["files"] >= 3 and per_node["node2"]["files"] == 0
    print(f"collect: {json.loads(got.stdout)['seconds']} s")
    diag = lab.run("node1", f"{DSCLUSTER} diagnose runs/{name} --json", timeout=120)
    assert diag.returncode == 0, diag.stdout


def _rank_pid(lab, node: str, rank: int, run_id: str) -> int | None:
    from dscluster.sim.ns import netns_pids
    for pid in netns_pids(lab.node(node).netns):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            env = dict(kv.split("=", 1) for kv in environ if "=" in kv)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if env.get("DSCLUSTER_RUN_ID") == run_id and env.get("OMPI_COMM_WORLD_RANK") == str(rank) \
                and "train" in cmd and "python" in Path(cmd[0]).name:
            return pid
    return None


def top_sees_every_nodes_ranks(lab, run_id: str, proc: subprocess.Popen) -> None:
    """`top` on the head while the README mpirun runs: each node writes its ranks into its own copy until
    the job ends, and top's SSH sample reads them there."""
    from _wait import wait_until

    own = {rank: lab.path_on(node, REPO / "runs" / run_id / "metrics" / f"rank-{rank}.jsonl")
           for node, rank in (("node1", 0), ("node2", 1), ("node3", 2))}

    def every_rank_stepped_twice() -> bool:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        return all(len(records(f, "step")) >= 2 for f in own.values())

    wait_until(every_rank_stepped_twice, 600, "every rank's second step, in its own node's copy", interval=0.5)
    assert not lab.path_on("node1", REPO / "runs" / run_id / "metrics" / "rank-1.jsonl").exists()  # not home yet
    res = lab.run("node1", f"{DSCLUSTER} top --hostfile {lab.hostfile} --once --json", timeout=120)
    assert res.returncode == 0, explain(res)
    snap = json.loads(res.stdout)
    assert snap["run_dir"].endswith(f"runs/{run_id}"), snap["run_dir"]  # found without --run-dir
    ranks = [(r["rank"], r["host"], r["source"], r["status"]) for r in snap["ranks"]]
    hostnames = {n.name: n.hostname for n in lab.nodes}
    assert ranks == [(0, hostnames["node1"], "file", "running"), (1, hostnames["node2"], "ssh", "running"),
                     (2, hostnames["node3"], "ssh", "running")], snap["ranks"]
    assert all(r["step"] >= 2 and r["images_per_s"] > 0 for r in snap["ranks"]), snap["ranks"]
    nodes = {n["name"]: n for n in snap["nodes"]}
    # node2's and node3's figures: their job samplers' own samples, read over SSH from their copies
    assert all(nodes[name]["source"] == "telemetry" and nodes[name]["error"] is None for name in hostnames), nodes


def test_top_then_a_killed_rank_then_the_same_command_resumes_from_the_same_step_on_every_rank(synced):
    import os
    import signal

    from _wait import wait_until

    # 3 epochs of 20 steps: top looks while every rank runs, rank 1 is killed after step 14
    lab, run_id = synced, "nofs-kill"
    cmd = (f"DSCLUSTER_RUN_ID={run_id} OMP_NUM_THREADS=1 {MPIRUN} -x DSCLUSTER_RUN_ID -np 3 --hostfile {lab.hostfile} "
           f"./entry_cn.sh --config configs/digits.yaml {SHRINK} data.limit=480 epochs=3 checkpoint.every_steps=4")
    rank1 = lab.path_on("node2", REPO / "runs" / run_id / "metrics" / "rank-1.jsonl")
    # The first run only (test-only): rank 1 holds each step's last gradient bucket 250 ms, so that the 60 steps take
    # 15 s or more. Unslowed, they ran out while top sampled the nodes on a machine with a busy core, and the kill
    # found the run already finished (every node's `latest` at step 60).
    slowed = cmd.replace("-x DSCLUSTER_RUN_ID", "-x DSCLUSTER_RUN_ID -x DSCLUSTER_FAULT", 1)
    argv = lab.command("node1", f"DSCLUSTER_FAULT=slow_comm:rank=1,ms=250 {slowed}")
    proc = subprocess.Popen(argv, env=lab.env(node="node1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        top_sees_every_nodes_ranks(lab, run_id, proc)
        wait_until(lambda: any(r.get("step", 0) >= 14 for r in records(rank1, "step")), 600,
                   "rank 1 (node2) to pass step 14", interval=0.5)
        pid = _rank_pid(lab, "node2", 1, run_id)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out[-3000:]
    held = [r["comm_s"] for r in records(rank1, "step")]
    assert held and min(held) >= 0.2, held  # the slowed first run: rank 1 held every step's last bucket
    latest = {node: lab.path_on(node, REPO / "runs" / run_id / "checkpoints" / "latest").read_text().strip()
              for node in ("node1", "node2", "node3")}
    # every node, mid-run; a kill that lands between two nodes' commits of `latest` leaves them one save apart
    steps = sorted({int(tag[-8:]) for tag in latest.values()})
    assert steps[-1] < 60 and (len(steps) == 1 or (len(steps) == 2 and steps[1] - steps[0] == 4)), latest
    if len(steps) == 1:   # make that case: node2's `latest` back on its previous save, as such a kill leaves it
        node2_ckpt = lab.path_on("node2", REPO / "runs" / run_id / "checkpoints")
        previous = sorted(p.name for p in node2_ckpt.iterdir() if p.is_dir() and p.name < latest["node2"])[-1]
        (node2_ckpt / "latest").write_text(previous + "\n")
        steps = [int(previous[-8:]), steps[0]]

    again = lab.run("node1", cmd, timeout=900)
    assert again.returncode == 0, explain(again)
    resumed = {}
    for node, rank in (("node1", 0), ("node2", 1), ("node3", 2)):
        starts = records(lab.path_on(node, REPO / "runs" / run_id / "metrics" / f"rank-{rank}.jsonl"), "start")
        resumed[rank] = starts[-1]["resumed_from_step"]
    # the newest checkpoint: a node that missed committing it still holds its complete folder
    assert len(set(resumed.values())) == 1 and resumed[0] == steps[-1], (resumed, latest)
    assert "stopped while they committed it" in again.stdout + again.stderr, explain(again)
    summary = json.loads(lab.path_on("node1", REPO / "runs" / run_id / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 3

    # a node that lost its checkpoint: the resume stops before training, naming it
    lab.path_on("node3", REPO / "runs" / run_id / "checkpoints" / "latest").unlink()
    steps_before = len(records(rank1, "step"))
    lost = lab.run("node1", cmd, timeout=600)
    assert lost.returncode != 0
    assert "node3 has no checkpoint ('latest' missing)" in lost.stdout + lost.stderr, explain(lost)
    assert len(records(rank1, "step")) == steps_before   # no rank trained a step
