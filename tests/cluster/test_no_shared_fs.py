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

pytestmark = pytest.mark.cluster

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
