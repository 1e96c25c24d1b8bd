"""`dscluster launch` front end: check output gate, --dry-run/--json, Slurm script file."""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from _wait import Deadline, run_bounded, scaled
from dscluster.cli import main

HOSTS = "node1 slots=2\nnode2 slots=1\n"


@pytest.fixture
def lab_dir(tmp_path, monkeypatch):
    """A working directory with a hostfile and the files `dscluster check` leaves behind."""
    monkeypatch.chdir(tmp_path)
    for key in ("DSCLUSTER_STATE", "DSCLUSTER_RUN_ID", "DSCLUSTER_RUNS", "DS_ENV_FILE"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "hosts.txt").write_text(HOSTS)
    return tmp_path


def write_check(root, hostfile_text=HOSTS, **extra):
    state = root / ".dscluster"
    (state / "env").mkdir(parents=True)
    (state / "check.json").write_text(json.dumps({
        "created": time.time(), "hostfile": str(root / "hosts.txt"),
        "hostfile_sha256": hashlib.sha256(hostfile_text.encode()).hexdigest(), **extra}))
    (state / "cluster.env").write_text(
        "# cluster-wide\nexport MASTER_ADDR='10.9.0.1'\nexport MASTER_PORT='29511'\n"
        "export DSCLUSTER_BTL_TCP_IF_INCLUDE='10.9.0.0/24'\nexport DSCLUSTER_PRECISION='fp32'\n")
    return state


def test_no_check_output_says_run_check(lab_dir, capsys):
    assert main(["launch", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "check.json" in err and "dscluster check" in err


def test_hostfile_changed_since_check_says_run_check_again(lab_dir, capsys):
    write_check(lab_dir)
    (lab_dir / "hosts.txt").write_text(HOSTS + "node3 slots=1\n")
    assert main(["launch", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "does not match" in err and "dscluster check --hostfile" in err


def test_dry_run_json_describes_the_mpirun_command(lab_dir, capsys):
    write_check(lab_dir)
    rc = main(["launch", "--dry-run", "--json", "--run-id", "r1", "--env", "NCCL_DEBUG=INFO",
               "--", "--config", "configs/digits.yaml", "epochs=1"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    argv = report["argv"]
    assert report["run_id"] == "r1" and report["np"] == 3
    assert argv[argv.index("-np") + 1] == "3"
    assert argv[argv.index("--hostfile") + 1] == str(lab_dir / "hosts.txt")
    assert "DSCLUSTER_RUN_ID=r1" in argv and "NCCL_DEBUG=INFO" in argv
    assert f"DSCLUSTER_STATE={lab_dir / '.dscluster'}" in argv
    assert argv[argv.index("btl_tcp_if_include") + 1] == "10.9.0.0/24"
    assert argv[-4:] == [argv[-4], "--config", "configs/digits.yaml", "epochs=1"]
    assert argv[-4].endswith("/entry_cn.sh") and os.access(argv[-4], os.X_OK)
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)


def test_deepspeed_dry_run_uses_check_master_and_writes_nothing(lab_dir, capsys):
    write_check(lab_dir)
    assert main(["launch", "--launcher", "deepspeed", "--dry-run", "--run-id", "r2"]) == 0
    out = capsys.readouterr().out
    assert "--master_addr 10.9.0.1 --master_port 29511" in out
    assert "DS_ENV_FILE=" in out and "DSCLUSTER_RUN_ID=r2" in out
    assert not (lab_dir / ".dscluster" / "launch").exists()


def test_np_beyond_hostfile_slots_is_a_usage_error(lab_dir, capsys):
    write_check(lab_dir)
    assert main(["launch", "--dry-run", "--np", "4"]) == 2
    assert "3 slots" in capsys.readouterr().err


def test_json_without_dry_run_is_refused(lab_dir, capsys):
    write_check(lab_dir)
    assert main(["launch", "--json"]) == 2


def test_slurm_writes_an_executable_script_and_prints_how_to_submit(lab_dir, capsys):
    write_check(lab_dir)
    assert main(["launch", "--launcher", "slurm", "--script", "job.sbatch", "--", "epochs=2"]) == 0
    out = capsys.readouterr().out
    path = lab_dir / "job.sbatch"
    assert "sbatch job.sbatch" in out
    assert os.access(path, os.X_OK)
    text = path.read_text()
    assert "--kill-on-bad-exit=1 --export=ALL " in text and text.rstrip().endswith("entry_cn.sh epochs=2")
    assert "slurm-${SLURM_JOB_ID}" in text
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def _node(name, gpus):
    return {"name": name, "reachable": True, "facts": {"hostname": name, "gpus": gpus}}


@pytest.mark.parametrize("nodes, gpu", [
    ([_node("node1", [{"name": "RTX 3070"}] * 2), _node("node2", [{"name": "GTX 1080"}])], " --gpus-per-task=1"),
    ([_node("node1", []), _node("node2", [])], ""),
    ([], " --gpus-per-task=1"),  # check reached no node: a GPU per rank
])
def test_slurm_script_asks_for_gpus_only_where_check_found_them(lab_dir, capsys, nodes, gpu):
    write_check(lab_dir, nodes=nodes)
    assert main(["launch", "--launcher", "slurm", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert f"#SBATCH --nodes=1 --ntasks=2 --nodelist=node1{gpu}\n" in script
    assert f"#SBATCH --nodes=1 --ntasks=1 --nodelist=node2{gpu}\n" in script
    assert gpu or "--gpus" not in script


def test_slurm_names_a_node_short_of_gpus_and_writes_nothing(lab_dir, capsys):
    write_check(lab_dir, nodes=[_node("node1", [{"name": "RTX 3070"}]), _node("node2", [{"name": "GTX 1080"}])])
    assert main(["launch", "--launcher", "slurm", "--submit", "--script", "job.sbatch"]) == 2
    err = capsys.readouterr().err
    assert f"{lab_dir / 'hosts.txt'}:1: node1 gets 2 rank(s) but `dscluster check` found 1 GPU(s) there" in err
    assert "set slots=1 for node1" in err
    assert not (lab_dir / "job.sbatch").exists()


def stand_in_mpirun(root, monkeypatch, body):
    """A bin dir whose `mpirun` is a shell script: launch runs it in place of OpenMPI's."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mpirun"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    monkeypatch.setattr("dscluster.cli.launch._bin_dir", lambda: str(bin_dir))
    return tool


@pytest.mark.parametrize("body, code", [("exit 0", 0), ("exit 3", 3), ("exit 1", 1), ("kill -TERM $$", 128 + 15)])
def test_launch_returns_the_jobs_own_exit_code(lab_dir, monkeypatch, capsys, body, code):
    write_check(lab_dir)
    stand_in_mpirun(lab_dir, monkeypatch, body)
    assert main(["launch", "--run-id", "r3"]) == code
    err = capsys.readouterr().err
    if code == 3:
        assert "mpirun exited 3" in err and "r3" in err
    if code == 143:
        assert "killed by signal 15" in err


def test_launch_bad_input_stays_2_even_with_a_launcher_at_hand(lab_dir, monkeypatch):
    write_check(lab_dir)
    stand_in_mpirun(lab_dir, monkeypatch, "exit 3")
    assert main(["launch", "--np", "9"]) == 2


def test_torchrun_exit_code_is_the_first_failed_nodes():
    from dscluster.launch.run import NodeResult, nodes_exit_code

    assert nodes_exit_code([NodeResult("node1", 0), NodeResult("node2", 0)]) == 0
    assert nodes_exit_code([NodeResult("node1", 0), NodeResult("node2", 3), NodeResult("node3", 5)]) == 3
    assert nodes_exit_code([NodeResult("node1", None, "connection refused"), NodeResult("node2", 0)]) == 1
    assert nodes_exit_code([NodeResult("node1", -1)]) == 1  # the SSH server sent no exit status
    # the node that failed first is where the job broke: its code, wherever it stands in the hostfile
    assert nodes_exit_code([NodeResult("node1", 1, ended=2.0), NodeResult("node2", 137, ended=1.0)]) == 137


def test_the_node_where_a_rank_died_comes_first_even_when_the_survivors_node_ended_sooner(tmp_path):
    # rank 1 on node2 SIGKILLed (its metrics stop without an end record); rank 0 on node1 failed at once on the
    # closed connection and its torchrun ended first: the run directory, not the order of the ends, names node2
    from dscluster.files.fsutil import JsonlWriter
    from dscluster.launch.run import NodeResult, failed_first, nodes_exit_code

    for rank, host in ((0, "node1"), (1, "node2")):
        with JsonlWriter(tmp_path / "metrics" / f"rank-{rank}.jsonl") as w:
            w.write({"kind": "start", "t": 1.0, "rank": rank, "host": host, "world_size": 2})
            w.write({"kind": "step", "t": 2.0, "rank": rank, "host": host, "step": 1})
            if rank == 0:
                w.write({"kind": "end", "t": 3.0, "rank": 0, "host": host, "status": "failed",
                         "error": "a collective failed: another rank died or never joined"})
    results = [NodeResult("node1", 1, ended=3.0), NodeResult("node2", 2, ended=4.0)]
    assert [r.host for r in failed_first(results, tmp_path)] == ["node2", "node1"]
    assert nodes_exit_code(results, tmp_path) == 2
    # no run directory to read (no shared filesystem): the first to end, as before
    assert [r.host for r in failed_first(results, tmp_path / "absent")] == ["node1", "node2"]


# --- a launcher that does not end by itself (run_job's watch) -------------------------------------

PRTE_LOST = """cat >&2 <<'EOF'
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-node1-32753@0,0] on node node1
  Remote daemon: [prterun-node1-32753@0,2] on node node3
EOF
exit 0"""


def test_mpirun_losing_a_daemon_fails_the_launch_and_names_the_node(lab_dir, monkeypatch, capsys):
    write_check(lab_dir)
    stand_in_mpirun(lab_dir, monkeypatch, PRTE_LOST)  # OpenMPI 5.0.11 exits 0 after this
    assert main(["launch", "--run-id", "r4"]) == 1
    err = capsys.readouterr().err
    assert "Remote daemon" in err  # mpirun's own words still reach the user
    assert "node3 vanished" in err and "resumes from the last checkpoint" in err


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# `dscluster launch` in a process of its own, the watcher's grace and TERM-to-KILL interval cut
# to 1 s: a launch that does not end fails the test at its deadline instead of hanging the run.
LAUNCH_WITH_1S_WATCH = """import sys
from dscluster.cli import launch as cli_launch
from dscluster.launch import run as launch_exec
from dscluster.cli import main
launch_exec.GRACE_S = launch_exec.TERM_S = 1.0
cli_launch._bin_dir = lambda: sys.argv[1]
sys.exit(main(["launch", "--run-id", sys.argv[2]]))
"""


def _kill_left(pidfile, marker: str) -> None:
    """Kill the process group of the process named in `pidfile` if it still runs (its command
    line holds `marker`): what a launch left of its stand-in mpirun."""
    try:
        pid = int(pidfile.read_text())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            ours = marker.encode() in f.read()
        if ours and not _pid_gone(pid):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def unhung(pidfile, marker: str, seconds: float):
    """For a launch run in this process: past a load-scaled deadline, kill what it started (see
    `_kill_left`), so that a watcher that stopped nothing makes the launch return and the test
    fail on what it returned, instead of hanging the run. Yields a list, non-empty if it fired."""
    done, fired = threading.Event(), []

    def watch():
        deadline = Deadline(seconds)
        while not done.wait(0.2):
            if deadline.passed():
                fired.append(deadline.allowed)
                _kill_left(pidfile, marker)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield fired
    finally:
        done.set()
        watcher.join()
        _kill_left(pidfile, marker)


@pytest.mark.parametrize("clock_behind_s", [0, 60], ids=["at-once", "file-clock-behind"])
def test_mpirun_still_waiting_after_the_summary_is_stopped_and_the_node_named(lab_dir, monkeypatch, clock_behind_s):
    # The ranks failed and wrote summary.json, but mpirun waits for a daemon that is gone (and
    # ignores SIGTERM, as a hung one may): after the grace it is killed. The summary comes within
    # moments of the start (file times lag the clock by up to a kernel tick), or stamped by a
    # file server's clock that is behind this machine's: either way it is this attempt's.
    write_check(lab_dir)
    tool = stand_in_mpirun(lab_dir, monkeypatch, f"""trap '' TERM
mkdir -p runs/r5 && echo $$ > runs/r5/mpirun.pid
echo '{{"status": "failed", "vanished_hosts": ["node3"]}}' > runs/r5/summary.json
[ {clock_behind_s} = 0 ] || touch -d "@$(( $(date +%s) - {clock_behind_s} ))" runs/r5/summary.json
while :; do sleep 0.2; done""")
    pidfile = lab_dir / "runs" / "r5" / "mpirun.pid"
    watch = Deadline(0)
    try:
        res = run_bounded([sys.executable, "-c", LAUNCH_WITH_1S_WATCH, str(tool.parent), "r5"], 60,
                          "dscluster launch with an mpirun that waits after the summary", cwd=lab_dir)
    finally:
        _kill_left(pidfile, str(tool))
    took = watch.elapsed()
    assert res.returncode == 128 + 9, (res.returncode, res.stderr)
    assert "dscluster launch: node3 vanished" in res.stderr and "the job was ended" in res.stderr, res.stderr
    assert _pid_gone(int(pidfile.read_text()))
    # noticed within a 0.5 s poll, 1 s grace, SIGTERM ignored, SIGKILL 1 s later, plus start-up
    assert took < scaled(15), (took, res.stderr)


def test_ranks_mpirun_left_behind_get_the_timeout_then_are_stopped(lab_dir, monkeypatch, capsys):
    write_check(lab_dir)
    monkeypatch.setattr("dscluster.launch.run.GRACE_S", 1.0)
    stand_in_mpirun(lab_dir, monkeypatch, """mkdir -p runs/r6
printf 'dist:\\n  timeout_s: 1\\n' > runs/r6/config.yaml
sleep 600 &
echo $! > runs/r6/rank.pid
exit 0""")
    t0 = time.monotonic()
    with unhung(lab_dir / "runs" / "r6" / "rank.pid", "sleep", 30) as fired:
        code = main(["launch", "--run-id", "r6"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert not fired, f"the rank was still running after {fired[0]:.0f} s: {err}"
    # the rank gets the process-group timeout (1 s) plus the grace (1 s), and not much more
    assert code == 1 and 2 <= took < scaled(10), (took, err)
    assert "left ranks running on this machine" in err
    assert _pid_gone(int((lab_dir / "runs" / "r6" / "rank.pid").read_text()))


def _main_thread_watching() -> bool:
    """The main thread is inside run_job's watch (not still starting the launcher)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "run_job" in names and "__init__" not in names  # __init__: Popen's


def test_ctrl_c_is_passed_to_mpirun_and_the_launch_says_interrupted(lab_dir, monkeypatch, capsys):
    write_check(lab_dir)
    tool = stand_in_mpirun(lab_dir, monkeypatch, """trap 'echo mpirun got INT; exit 130' INT
echo $$ > mpirun.pid
touch started
while :; do sleep 0.1; done""")
    pressed = threading.Event()

    def press_ctrl_c():
        deadline = Deadline(20)
        while not ((lab_dir / "started").exists() and _main_thread_watching()):
            if deadline.passed():
                return  # the launch never got going: the assertion below says so
            time.sleep(0.05)
        pressed.set()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    with unhung(lab_dir / "mpirun.pid", str(tool), 60) as fired:
        code = main(["launch", "--run-id", "r7"])
    captured = capsys.readouterr()
    assert pressed.is_set(), f"the stand-in mpirun never started: {captured.err}"
    assert not fired, f"mpirun was still running {fired[0]:.0f} s after the launch started: {captured.err}"
    assert code == 130
    assert "mpirun got INT" in captured.out and "interrupted" in captured.err


def test_an_earlier_attempts_summary_does_not_speak_for_this_one(lab_dir, monkeypatch, capsys):
    write_check(lab_dir)
    run = lab_dir / "runs" / "r8"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"status": "failed", "vanished_hosts": ["node3"]}')
    os.utime(run / "summary.json", (time.time() - 60, time.time() - 60))
    stand_in_mpirun(lab_dir, monkeypatch, "exit 0")
    assert main(["launch", "--run-id", "r8"]) == 0
    assert "vanished" not in capsys.readouterr().err


def test_launcher_gets_prte_keepalives_unless_the_user_chose_their_own(monkeypatch):
    from dscluster.launch.run import launcher_env

    monkeypatch.delenv("PRTE_MCA_oob_tcp_keepalive_time", raising=False)
    assert launcher_env(None, {})["PRTE_MCA_oob_tcp_keepalive_time"] == "10"
    monkeypatch.setenv("PRTE_MCA_oob_tcp_keepalive_time", "60")
    assert launcher_env(None, {})["PRTE_MCA_oob_tcp_keepalive_time"] == "60"


def test_a_job_that_stopped_on_bad_input_does_not_point_at_a_run_directory_it_never_wrote(tmp_path):
    """entry_cn.sh refuses a missing program or config before the run directory exists (exit 2 on
    every rank): launch's closing line says so instead of naming logs that are not there."""
    from dscluster.cli.launch import job_report
    from dscluster.launch.run import JobOutcome

    code, line = job_report("mpirun", JobOutcome(rc=2), tmp_path / "runs" / "mpi-1")
    assert code == 2 and "no run directory was written" in line and "runs/mpi-1" not in line
    (tmp_path / "runs" / "mpi-1").mkdir(parents=True)
    assert "per-rank logs and metrics are in" in job_report("mpirun", JobOutcome(rc=2), tmp_path / "runs" / "mpi-1")[1]
