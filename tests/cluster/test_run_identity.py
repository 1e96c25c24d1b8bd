"""One run identity for every rank, on 2 localhost ranks under the real mpirun: a rank given another
DSCLUSTER_RUN_ID (as mpirun leaves node2's rank without the head's variable) stops the job with exit 2
and the fix before anything is trained, through entry_cn.sh and through `dscluster train` alone."""

from __future__ import annotations

import subprocess

from _local_mpirun import DSCLUSTER, ROOT, require_mpirun, train_command

from _wait import scaled

require_mpirun()

# Rank 1 alone loses the head's run id (entry_cn.sh) or gets another one (train): a node mpirun started over SSH.
LOSE_ON_RANK_1 = 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then {}; fi; exec "$@"'


def _run(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=scaled(240))
    return p.returncode, p.stdout


def test_a_rank_without_the_run_id_stops_entry_cn_before_the_program_runs(tmp_path):
    cmd, env = train_command(tmp_path, "plain40", [])
    env.pop("MASTER_PORT")  # entry_cn.sh's rule: the launcher job's port, not the (differing) run id's
    head = cmd[:cmd.index(str(DSCLUSTER))]
    rc, out = _run(head + ["bash", "-c", LOSE_ON_RANK_1.format("unset DSCLUSTER_RUN_ID"), "_",
                           str(ROOT / "entry_cn.sh"), "python", "-c", "print('TRAINED')"], env)
    assert rc == 2, out[-3000:]
    assert "would write different run directories" in out and "mpi-" in out
    assert "rank 0 (" in out and f"{tmp_path}/plain40 (DSCLUSTER_RUN_ID set)" in out
    assert "(DSCLUSTER_RUN_ID not set)" in out
    assert "mpirun -x DSCLUSTER_RUN_ID" in out and "dscluster launch --run-id plain40" in out
    assert "TRAINED" not in out
    assert not any(tmp_path.iterdir()), "nothing is written before the ranks agree"


def test_dscluster_train_alone_refuses_ranks_with_different_run_ids(tmp_path):
    cmd, env = train_command(tmp_path, "plain41", ["--config", "configs/digits.yaml", "progress=false"])
    at = cmd.index(str(DSCLUSTER))
    rc, out = _run(cmd[:at] + ["bash", "-c", LOSE_ON_RANK_1.format("export DSCLUSTER_RUN_ID=other"), "_"]
                   + cmd[at:], env)
    assert rc == 2, out[-3000:]
    assert f"{tmp_path}/plain41" in out and f"{tmp_path}/other" in out and "--run-id plain41" in out
    assert not (tmp_path / "plain41" / "metrics").exists() and not (tmp_path / "other" / "metrics").exists()


def test_ranks_that_agree_run(tmp_path):
    cmd, env = train_command(tmp_path, "plain42", [])
    head = cmd[:cmd.index(str(DSCLUSTER))]
    rc, out = _run(head + [str(ROOT / "entry_cn.sh"), "python", "-c", "print('TRAINED')"], env)
    assert rc == 0 and out.count("TRAINED") == 2, out[-3000:]
    assert "run directories" not in out
