"""A run split in two (ranks started without the run-identity agreement): `diagnose` and `collect` say
where the missing ranks wrote, instead of "files not here" and "0 files"."""

from __future__ import annotations

import json

from _analysis_runs import make_plain_run

from dscluster.analysis import load_run
from dscluster.analysis.diagnose import diagnose
from dscluster.cli import main
from dscluster.rundir import rankrecord

JOB = "prterun-node1-4242@1"


def split_run(root):
    """runs/plain40 holds rank 0 of a 2-rank job; its rank 1 wrote under the launcher's id beside it."""
    run = make_plain_run(root, "plain40", exit_codes={0: 0}, monitor=False)
    for path in [*(run / "process").glob("rank-*.json"), run / "summary.json"]:
        path.unlink()
    env = {"RANK": "0", "WORLD_SIZE": "2", "PMIX_NAMESPACE": JOB}
    rankrecord.start(run, ["python", "train.py"], env, now=1.0)
    rankrecord.end(run, 0, env, now=2.0)
    other = run.parent / "mpi-prterun-node1-4242-1"
    env1 = {"RANK": "1", "WORLD_SIZE": "2", "PMIX_NAMESPACE": JOB}
    rankrecord.start(other, ["python", "train.py"], env1, now=1.0)
    rankrecord.end(other, 0, env1, now=2.0)
    return run, other


def test_diagnose_tells_a_split_run_from_files_still_away(tmp_path):
    run, other = split_run(tmp_path)
    found = diagnose(load_run(run))["findings"]
    split = [f for f in found if f["kind"] == "split_run"]
    assert len(split) == 1 and str(other) in split[0]["message"] and "-x DSCLUSTER_RUN_ID" in split[0]["message"]
    assert not any(f["kind"] in ("rank_missing", "files_not_here") for f in found)

    (other / "process" / "rank-1.json").unlink()  # nothing of the job beside it: rank 1's files are away
    found = diagnose(load_run(run))["findings"]
    assert not any(f["kind"] == "split_run" for f in found)


def test_collect_finds_where_a_nodes_ranks_of_the_job_wrote(tmp_path, monkeypatch, capsys):
    run, other = split_run(tmp_path / "runs")
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))  # no setup: localhost needs none
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=2\n")
    assert main(["collect", str(run), "--hostfile", str(hostfile), "--json"]) == 1
    node = json.loads(capsys.readouterr().out)["nodes"][0]
    assert node["split_into"] == [str(other)]
    assert main(["collect", str(run), "--hostfile", str(hostfile)]) == 1
    assert f"a split run: its ranks of this job wrote under {other}" in capsys.readouterr().out
