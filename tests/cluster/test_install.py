"""A non-editable install launches: the wheel built from this checkout, installed into a fresh venv on
the lab's shared disk (no checkout around it), runs the demo's journey on a simulated 2-node lab:
its own `dscluster setup`, `check` and `launch`. launch finds entry_cn.sh and the presets in
<venv>/share/dscluster, and the ranks, whose PATH holds no venv, run that venv's python.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from _install import build_wheel, installed_venv

# Slow, and must stay so: builds and installs the wheel, then sets up, checks and trains on the lab.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LAB = "installlab"
TRAIN_TIMEOUT_S = 900
WHO_AM_I = "import sys, dscluster; print('rank-python', sys.prefix, dscluster.__file__)"


def explain(res: subprocess.CompletedProcess, tail: int = 4000) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-tail:]}\n--- stderr\n{res.stderr[-tail:]}"


@pytest.fixture(scope="module")
def installed(lab_factory, tmp_path_factory):
    lab = lab_factory(LAB, nodes=2, slots=1)
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))
    # On the shared disk, like an NFS-mounted prefix: every node sees the venv at the same path.
    venv = installed_venv(lab.shared / "install" / "venv", wheel)
    work = lab.shared / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.chown(work, lab.uid, lab.gid)
    return lab, venv, work


def sh(lab, work: Path, cmd: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """A shell line in node1 as the lab user, from the shared working directory (not a checkout)."""
    return lab.run("node1", f"cd {shlex.quote(str(work))} && {cmd}", timeout=timeout, env=env)


def test_installed_wheel_sets_up_checks_and_launches_training_on_the_lab(installed):
    lab, venv, work = installed
    dscluster = venv / "bin" / "dscluster"
    hostfile = str(lab.hostfile)

    probe = sh(lab, work, f"{venv}/bin/python -c 'import sys, dscluster; print(dscluster.__file__); print(sys.path)'")
    assert probe.returncode == 0, explain(probe)
    package, path = probe.stdout.splitlines()
    assert package.startswith(str(venv)), package
    assert str(ROOT / "src") not in path, "the checkout's src/ is on the installed copy's path"

    setup = sh(lab, work, f"{dscluster} setup --hostfile {hostfile} --trust-new-hosts --fix-path",
               env={"DSCLUSTER_SSH_PASSWORD": lab.password})
    assert setup.returncode == 0, explain(setup)
    check = sh(lab, work, f"{dscluster} check --hostfile {hostfile}")
    assert check.returncode == 0, explain(check)

    # The ranks' PATH has no venv at all: entry_cn.sh must find its python from where it is installed.
    bare = "--env PATH=/usr/bin:/bin"
    dry = sh(lab, work, f"{dscluster} launch --dry-run --json {bare} -- --config configs/digits.yaml epochs=1")
    assert dry.returncode == 0, explain(dry)
    argv = json.loads(dry.stdout)["argv"]
    assert str(venv / "share" / "dscluster" / "entry_cn.sh") in argv

    res = sh(lab, work, f"{dscluster} launch --run-id installed {bare} -- --config configs/digits.yaml epochs=1",
             timeout=TRAIN_TIMEOUT_S)
    assert res.returncode == 0, explain(res)
    summary = json.loads((work / "runs" / "installed" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 2, summary
    assert sorted(summary["hosts"]) == sorted(n.hostname for n in lab.nodes)
    config = (work / "runs" / "installed" / "config.yaml").read_text()
    assert "dataset: digits" in config  # the preset came from the installed copy's configs/

    who = sh(lab, work, f"{dscluster} launch --run-id who {bare} -- python -c {shlex.quote(WHO_AM_I)}", timeout=300)
    assert who.returncode == 0, explain(who)
    ranks = [line.split()[1:] for line in who.stdout.splitlines() if line.startswith("rank-python ")]
    site = next(p for p in venv.glob("lib/python3.*/site-packages"))
    assert ranks == [[str(venv), str(site / "dscluster" / "__init__.py")]] * 2, who.stdout
