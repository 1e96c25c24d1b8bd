"""dscluster.userlog: a user's own script writes run-directory records that plot and diagnose read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.analysis import analyse
from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.load import load_run
from dscluster.files.fsutil import read_jsonl
from dscluster.rundir import userlog

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """A wall clock the test moves: step times are then exact."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def mpi_env(run: Path, rank: int, world: int = 2) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1", userlog.RUN_DIR_ENV: str(run)}


def write_rank(run: Path, rank: int, *, step_s: float, steps: int = 8, fail: bool = False) -> None:
    log = userlog.open_run(device="cpu", precision="fp32", micro_batch=16, global_batch=32, env=mpi_env(run, rank))
    clock = Clock()
    log._clock, log._last, log._t0 = clock, clock.t, clock.t
    with pytest.raises(RuntimeError) if fail else _nothing():
        with log:
            for step in range(1, steps + 1):
                clock.t += step_s
                log.step(step, loss=2.0 / step, samples=16, lr=1e-3)
                if fail and step == 3:
                    raise RuntimeError("CUDA out of memory")
            if rank == 0:
                log.eval(0.75, loss=0.9, samples=100)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_records_follow_the_run_directory_schema(tmp_path):
    run = tmp_path / "runs" / "byo"
    write_rank(run, 0, step_s=0.5)
    records = read_jsonl(run / "metrics" / "rank-0.jsonl")
    assert [r["kind"] for r in records] == ["start"] + ["step"] * 8 + ["eval", "end"]
    start, step, end = records[0], records[1], records[-1]
    assert start["world_size"] == 2 and start["launcher"] == "openmpi" and start["micro_batch"] == 16
    assert {"t", "rank", "host", "pid", "local_rank"} <= set(start)
    assert step["step"] == 1 and step["loss"] == 2.0 and step["samples"] == 16
    assert step["step_time"] == pytest.approx(0.5) and step["samples_per_s"] == pytest.approx(32.0)
    assert step["overflow"] is False and step["loss_scale"] is None
    assert end["status"] == "complete" and end["error"] is None
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["images_per_s"] is None  # rank 0 alone cannot know the job's figure
    assert json.loads((run / "env" / "rank-0.json").read_text())["OMPI_COMM_WORLD_SIZE"] == "2"


def test_two_ranks_load_plot_and_name_the_straggler(tmp_path):
    run = tmp_path / "runs" / "byo"
    write_rank(run, 0, step_s=0.5)
    write_rank(run, 1, step_s=1.0)
    data = load_run(run)
    assert sorted(data.ranks) == [0, 1] and data.completed
    assert [s["step"] for s in data.ranks[1].steps] == list(range(1, 9))
    (res,) = analyse([run])
    plots = {p.name: p for p in res.plots}
    assert plots["loss"].series["loss rank 0 (%s)" % data.ranks[0].host]["x"] == list(range(1, 9))
    assert plots["loss"].series["held-out accuracy"]["y"] == pytest.approx([75.0])
    assert res.summary["stragglers"] == [1]
    # No figure in summary.json: core/timing.py's, from the records; the job goes at its slowest
    # rank's pace (3 timed steps of 1.0 s for a global batch of 32).
    assert res.summary["images_per_s"] == pytest.approx(32.0)
    assert res.report.exists() and all(p.path.exists() for p in res.plots)


def test_an_exception_ends_the_rank_as_failed_and_diagnose_names_it(tmp_path):
    run = tmp_path / "runs" / "byo"
    write_rank(run, 0, step_s=0.5, steps=3)  # rank 0 finished its steps; rank 1 failed
    write_rank(run, 1, step_s=0.5, fail=True)
    end = read_jsonl(run / "metrics" / "rank-1.jsonl")[-1]
    assert end["kind"] == "end" and end["status"] == "failed" and "CUDA out of memory" in end["error"]
    data = load_run(run)
    assert data.ranks[1].end["status"] == "failed"
    report = diagnose(data)
    assert "CUDA out of memory" in json.dumps(report)


def test_plot_script_exits_0_on_a_userlog_run(tmp_path):
    import subprocess
    import sys

    run = tmp_path / "runs" / "byo"
    write_rank(run, 0, step_s=0.2)
    out = subprocess.run([sys.executable, str(ROOT / "analysis" / "plot.py"), str(run)], capture_output=True,
                         text=True, env=dict(os.environ, MPLCONFIGDIR=str(tmp_path / "mpl")), timeout=120)
    assert out.returncode == 0, out.stderr
    assert (run / "plots" / "loss.png").exists()


def test_run_dir_is_entry_cn_s_else_the_layout_s_rule(tmp_path):
    assert userlog.run_dir({userlog.RUN_DIR_ENV: "/r/x"}) == Path("/r/x")
    assert userlog.run_dir({"DSCLUSTER_RUNS": "/r", "DSCLUSTER_RUN_ID": "abc"}) == Path("/r/abc")


def test_program_exports_single_process(tmp_path):
    out = userlog.program_exports({"DSCLUSTER_RUNS": str(tmp_path), "DSCLUSTER_RUN_ID": "one"})
    assert out["RANK"] == "0" and out["LOCAL_RANK"] == "0" and out["WORLD_SIZE"] == "1"
    assert out[userlog.LAUNCHER_ENV] == "single"
    assert out["MASTER_ADDR"] == "127.0.0.1" and out["MASTER_PORT"].isdigit()
    assert out[userlog.RUN_DIR_ENV] == str(tmp_path / "one")


def test_program_exports_under_mpirun_keep_the_check_s_rendezvous(tmp_path):
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.77.1.11", "MASTER_PORT": "29500",
           "DSCLUSTER_RUNS": "runs", "DSCLUSTER_RUN_ID": "mpi-x"}
    out = userlog.program_exports(env)
    assert (out["RANK"], out["LOCAL_RANK"], out["WORLD_SIZE"], out["LOCAL_WORLD_SIZE"]) == ("3", "1", "4", "2")
    assert out[userlog.LAUNCHER_ENV] == "openmpi"  # the start record says mpirun, not torch
    assert "MASTER_ADDR" not in out and "MASTER_PORT" not in out  # check's values stand
    assert out[userlog.RUN_DIR_ENV] == os.path.abspath("runs/mpi-x")


def test_program_exports_leave_a_launcher_s_own_ranks(tmp_path):
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
           "MASTER_PORT": "1", "DSCLUSTER_RUN_DIR": "/r/ds"}
    assert userlog.program_exports(env) == {userlog.RUN_DIR_ENV: "/r/ds"}


def test_exports_cli_names_a_bad_launcher_variable(capsys, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "x")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert userlog.main(["--exports"]) == 2
    assert "OMPI_COMM_WORLD_RANK='x'" in capsys.readouterr().err
    assert userlog.main([]) == 2


def test_users_scripts_keep_their_import_and_entry_cn_its_command(tmp_path):
    # `from dscluster import userlog` (docs/byo-script.md) and `python -m dscluster.userlog --exports`
    # (entry_cn.sh) hand on the run directory package's API
    from dscluster import userlog as public

    assert public.open_run is userlog.open_run and public.program_exports is userlog.program_exports
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM", "RANK", "WORLD"))}
    out = subprocess.run([sys.executable, "-m", "dscluster.userlog", "--exports"], capture_output=True, text=True,
                         env={**env, userlog.RUN_DIR_ENV: str(tmp_path)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"export {userlog.RUN_DIR_ENV}={tmp_path}" in out.stdout.splitlines()
