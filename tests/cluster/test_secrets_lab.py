"""The one secret rule on a real journey: secrets planted in the user's environment (one of each kind:
a word in the name, a known name, a value that is a private key) never reach a file dscluster writes.

On a 2-node lab after the user's own `dscluster setup` (its password a secret too) and `check`: the
README's mpirun of entry_cn.sh (forwarding the planted variables with -x, as a user forwards
WANDB_API_KEY), then plot, diagnose --json and env --json. Every file under the state directory, the
run directory and the commands' own output is searched for every planted value.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from test_launch_lab import Cluster, explain, set_up

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"

PLANTED = {
    "DSCLUSTER_SSH_PASSWD": "plantedPasswd41", "DS_CREDENTIALS": "plantedCredential42",
    "NCCL_IB_SECRET": "plantedNcclSecret43", "DSCLUSTER_AUTH": "plantedAuth44", "NCCL_PASS": "plantedPass45",
    "DSCLUSTER_TOKEN": "plantedToken46", "DSCLUSTER_API_KEY": "plantedKey47",
    "WANDB_API_KEY": "plantedWandb48", "HF_TOKEN": "plantedHf49", "AWS_SECRET_ACCESS_KEY": "plantedAws50",
    "DSCLUSTER_NOTE": "-----BEGIN OPENSSH PRIVATE KEY-----plantedPrivateKey51-----END OPENSSH PRIVATE KEY-----",
}


@pytest.fixture(scope="module")
def cluster(lab_factory) -> Cluster:
    c = set_up(lab_factory, "secretlab", nodes=2)
    check = c.sh(f"{VENV_BIN}/dscluster check --hostfile {c.hostfile} --skip-active", timeout=300)
    assert check.returncode == 0, explain(check)
    return c


def test_no_planted_secret_reaches_any_file_of_the_journey(cluster):
    exports = " ".join(f"export {k}={shlex.quote(v)};" for k, v in PLANTED.items())
    forward = " ".join(f"-x {k}" for k in PLANTED)
    outputs = []
    train = cluster.sh(f"{exports} {VENV_BIN}/mpirun -np 2 --hostfile {cluster.hostfile} {forward} "
                       f"{REPO}/entry_cn.sh --config configs/digits.yaml epochs=1 data.limit=256", timeout=600)
    assert train.returncode == 0, explain(train)
    [run] = sorted(cluster.runs.iterdir())
    for cmd in (f"{VENV_BIN}/python {REPO}/analysis/plot.py {run} --json",
                f"{VENV_BIN}/dscluster diagnose {run} --json", f"{VENV_BIN}/dscluster env --json --no-ops"):
        res = cluster.sh(f"{exports} {cmd}", timeout=300)
        assert res.returncode in (0, 1), explain(res)
        outputs.append((cmd, res.stdout + res.stderr))
    outputs.append(("mpirun", train.stdout + train.stderr))
    env_doc = outputs[2][1]
    assert '"NCCL_IB_SECRET": "***"' in env_doc and '"DSCLUSTER_NOTE": "***"' in env_doc, env_doc[-3000:]

    files = [p for root in (cluster.work / ".dscluster", run) for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "rank-1.json" for p in files) and any(p.name == "check.json" for p in files)
    secrets = {**PLANTED, "DSCLUSTER_SSH_PASSWORD": cluster.lab.password}
    leaks = [f"{name} in {where}" for where, text in
             [(str(p), p.read_bytes().decode("utf-8", "replace")) for p in files] + outputs
             for name, value in secrets.items() if value in text]
    assert not leaks, leaks
