"""entry_cn.sh: what one rank does before and around `dscluster train`.

The script runs for real (bash, the repo's python for the run id). Only the `dscluster`
command it ends in is a recording stand-in (DSCLUSTER_VENV points at a venv whose
`dscluster` logs its arguments and environment), because a real training run takes minutes;
the cluster tests run the real one under mpirun.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _childenv import RANK_VARS
from _wait import scaled, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "entry_cn.sh"

FAKE_DSCLUSTER = r"""#!/usr/bin/env bash
log="$FAKE_LOG"
case "$1" in
  telemetry)
    echo "telemetry pid=$$ args=${*:2}" >> "$log"
    trap 'echo "telemetry-stopped pid=$$" >> "$log"; exit 0' TERM
    while true; do sleep 0.05; done ;;
  train)
    echo "train pid=$$ args=${*:2}" >> "$log"
    env | grep -E '^(CUDA_VISIBLE_DEVICES|DSCLUSTER_|NCCL_|GLOO_|MASTER_)' | sort | sed 's/^/env /' >> "$log"
    if [ -n "${FAKE_TRAIN_SLEEP:-}" ]; then
      trap 'echo train-got-term >> "$log"; exit 143' TERM
      sleep "$FAKE_TRAIN_SLEEP" & wait
    fi
    exit "${FAKE_TRAIN_RC:-0}" ;;
esac
exit 99
"""


@pytest.fixture
def rig(tmp_path):
    """A stand-in venv, a log, a clean environment and a working directory."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "dscluster"
    fake.write_text(FAKE_DSCLUSTER)
    fake.chmod(0o755)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "log"
    log.touch()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "DSCLUSTER_", "MASTER_", "NCCL_", "GLOO_"))
           and k not in (*RANK_VARS, "CUDA_VISIBLE_DEVICES")}
    env.update(DSCLUSTER_VENV=str(venv), FAKE_LOG=str(log), DSCLUSTER_RUNS=str(tmp_path / "runs"))
    return {"tmp": tmp_path, "work": work, "log": log, "env": env, "venv": venv}


def run_entry(rig, *args, extra=None, timeout=60):
    env = dict(rig["env"], **(extra or {}))
    return subprocess.run([str(ENTRY), *args], cwd=rig["work"], env=env, capture_output=True, text=True,
                          timeout=timeout)


def log_lines(rig):
    return rig["log"].read_text().splitlines()


def env_seen(rig):
    return dict(l[4:].split("=", 1) for l in log_lines(rig) if l.startswith("env "))


def under_mpirun(local_rank=0, rank=0):
    """A rank of a 4-rank job on two machines (two ranks here)."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
            "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_NAMESPACE": "prterun-head-4242@1"}


def write_node_env(rig, text):
    env_dir = rig["work"] / ".dscluster" / "env"
    env_dir.mkdir(parents=True, exist_ok=True)
    (env_dir / f"{socket.gethostname()}.env").write_text(text)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is not running
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_outside_mpirun_trains_as_one_process_with_default_config(rig):
    out = run_entry(rig)
    assert out.returncode == 0, out.stderr
    assert "not under mpirun: training as a single process" in out.stderr
    train = [l for l in log_lines(rig) if l.startswith("train ")]
    assert len(train) == 1 and train[0].endswith(f"args=--config {ROOT}/configs/digits.yaml")
    assert env_seen(rig)["DSCLUSTER_RUN_ID"].startswith("run-")


def test_train_arguments_and_exit_code_pass_through(rig):
    (rig["work"] / "x.yaml").write_text("data:\n  dataset: digits\n")
    out = run_entry(rig, "--config", "x.yaml", "epochs=2", extra={"FAKE_TRAIN_RC": "3"})
    assert out.returncode == 3
    assert any(l.endswith("args=--config x.yaml epochs=2") for l in log_lines(rig))


def test_a_relative_config_reaches_train_as_given(rig):
    """Ranks start in the launch directory: train resolves `configs/x.yaml` (paths.config_path)."""
    out = run_entry(rig, "--config", "configs/digits.yaml", "epochs=1")
    assert out.returncode == 0, out.stderr
    assert any(l.endswith("args=--config configs/digits.yaml epochs=1") for l in log_lines(rig))


def test_under_mpirun_without_check_output_stops_with_exit_2(rig):
    out = run_entry(rig, extra=under_mpirun())
    assert out.returncode == 2
    assert "run 'dscluster check" in out.stderr
    assert f"{socket.gethostname()}.env" in out.stderr
    assert not any(l.startswith(("train", "telemetry")) for l in log_lines(rig))


def test_single_host_job_needs_no_check_output(rig):
    extra = dict(under_mpirun(), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    out = run_entry(rig, extra=extra)
    assert out.returncode == 0, out.stderr
    assert "all 2 ranks are on this host: using loopback" in out.stderr
    assert any(l.startswith("train ") for l in log_lines(rig))


def test_node_env_is_loaded_and_the_mpi_run_id_is_shared(rig):
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='enp3s0'\nexport NCCL_SOCKET_IFNAME='enp3s0'\n"
                        "export MASTER_ADDR='10.77.1.1'\nexport MASTER_PORT='29500'\n")
    out = run_entry(rig, extra=under_mpirun(local_rank=1, rank=1))
    assert out.returncode == 0, out.stderr
    seen = env_seen(rig)
    assert seen["GLOO_SOCKET_IFNAME"] == "enp3s0" and seen["NCCL_SOCKET_IFNAME"] == "enp3s0"
    assert seen["MASTER_ADDR"] == "10.77.1.1"
    # every rank of one mpirun job derives the same id from PMIX_NAMESPACE
    assert seen["DSCLUSTER_RUN_ID"] == "mpi-prterun-head-4242-1"
    assert seen["DSCLUSTER_LOCAL_RANK"] == "1"
    assert "not under mpirun" not in out.stderr


def test_launcher_rendezvous_wins_over_check_values(rig):
    write_node_env(rig, "export MASTER_ADDR='10.77.1.1'\nexport MASTER_PORT='29500'\n")
    out = run_entry(rig, extra={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.9",
                                "MASTER_PORT": "4000"})
    assert out.returncode == 0, out.stderr
    assert env_seen(rig)["MASTER_ADDR"] == "10.0.0.9" and env_seen(rig)["MASTER_PORT"] == "4000"


def test_the_rank_is_trainings_rule_when_launchers_disagree(rig):
    """torchrun started under mpirun: its workers get RANK/LOCAL_RANK and still inherit the agent's
    OMPI_COMM_WORLD_*. entry_cn.sh and training take the same one (dscluster.node.ranks)."""
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    out = run_entry(rig, extra={**under_mpirun(local_rank=0, rank=0), **torchrun})
    assert out.returncode == 0, out.stderr
    assert env_seen(rig)["DSCLUSTER_LOCAL_RANK"] == "1"
    assert not any(l.startswith("telemetry ") for l in log_lines(rig))  # local rank 1 starts no sampler


def test_a_rank_outside_the_world_stops_with_exit_2(rig):
    out = run_entry(rig, extra={"RANK": "5", "WORLD_SIZE": "2"})
    assert out.returncode == 2
    assert "RANK=5 is outside 0..1" in out.stderr
    assert not any(l.startswith(("train", "telemetry")) for l in log_lines(rig))


def test_without_local_state_a_rank_uses_the_checkouts(tmp_path):
    from dscluster.files.state import rank_state_dir

    checkout, work = tmp_path / "repo", tmp_path / "work"
    work.mkdir()
    assert rank_state_dir(checkout, {}, work) == work / ".dscluster"  # neither: where check would write
    (checkout / ".dscluster").mkdir(parents=True)
    assert rank_state_dir(checkout, {}, work) == checkout / ".dscluster"
    (work / ".dscluster").mkdir()
    assert rank_state_dir(checkout, {}, work) == work / ".dscluster"
    assert rank_state_dir(checkout, {"DSCLUSTER_STATE": "st"}, work) == work / "st"
    assert rank_state_dir(checkout, {"DSCLUSTER_STATE": "/srv/st"}, work) == Path("/srv/st")


def test_changed_hostfile_warns_but_runs(rig):
    hostfile = rig["work"] / "hosts.txt"
    hostfile.write_text("node1 slots=1\n")
    write_node_env(rig, "export DSCLUSTER_HOSTFILE_SHA256='0000'\n")
    out = run_entry(rig, extra=dict(under_mpirun(), DSCLUSTER_HOSTFILE=str(hostfile)))
    assert out.returncode == 0
    assert "changed since 'dscluster check'" in out.stderr


def fake_nvidia_smi(rig, count):
    bindir = rig["tmp"] / "gpubin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA GeForce RTX 3070 (UUID: GPU-{i})'\n" for i in range(count))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}{rig['env']['PATH']}"}


def test_every_rank_sees_all_of_its_nodes_gpus(rig):
    # DeepSpeed binds the process group to cuda:$LOCAL_RANK: local rank 1 of a two-GPU node must
    # still see both GPUs, or it dies with "device_id cuda:1 is out of range".
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    extra = {**under_mpirun(local_rank=1, rank=3), **fake_nvidia_smi(rig, 2)}
    rig["env"].pop("CUDA_VISIBLE_DEVICES", None)
    out = run_entry(rig, extra=extra)
    assert out.returncode == 0, out.stderr
    assert "CUDA_VISIBLE_DEVICES" not in env_seen(rig)
    assert "DSCLUSTER_CUDA_MAPPED" not in env_seen(rig)


def test_users_cuda_visible_devices_is_kept(rig):
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    out = run_entry(rig, extra={**under_mpirun(local_rank=1), **fake_nvidia_smi(rig, 2), "CUDA_VISIBLE_DEVICES": "0,1"})
    assert out.returncode == 0, out.stderr
    assert env_seen(rig)["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_local_rank_0_runs_one_sampler_and_stops_it(rig):
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    out = run_entry(rig, extra=dict(under_mpirun(), FAKE_TRAIN_SLEEP="0.5"))
    assert out.returncode == 0, out.stderr
    started = [l for l in log_lines(rig) if l.startswith("telemetry ")]
    assert len(started) == 1
    run_dir = rig["tmp"] / "runs" / "mpi-prterun-head-4242-1"
    assert f"--run-dir {run_dir} --parent-pid " in started[0]
    pid = int(started[0].split()[1].split("=")[1])
    assert f"telemetry-stopped pid={pid}" in log_lines(rig)
    assert not pid_alive(pid)


def test_other_local_ranks_start_no_sampler(rig):
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    out = run_entry(rig, extra=under_mpirun(local_rank=1, rank=1))
    assert out.returncode == 0, out.stderr
    assert not any(l.startswith("telemetry ") for l in log_lines(rig))


def test_sigterm_stops_training_and_sampler(rig):
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    env = dict(rig["env"], **under_mpirun(), FAKE_TRAIN_SLEEP="60")
    proc = subprocess.Popen([str(ENTRY)], cwd=rig["work"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = log_lines(rig)
        if any(l.startswith("train ") for l in lines) and any(l.startswith("telemetry ") for l in lines):
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("training and sampler did not start")
    time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=15)
    assert time.monotonic() - t0 < 5
    assert rc == 143
    lines = log_lines(rig)
    assert "train-got-term" in lines
    train_pid = int([l for l in lines if l.startswith("train ")][0].split()[1].split("=")[1])
    sampler_pid = int([l for l in lines if l.startswith("telemetry ")][0].split()[1].split("=")[1])
    assert any(l.startswith("telemetry-stopped") for l in lines)
    assert not pid_alive(train_pid) and not pid_alive(sampler_pid)


# --- bring your own script: `entry_cn.sh python my_train.py ...` -------------------------------

FAKE_PROGRAM = r"""#!/usr/bin/env bash
echo "program pid=$$ args=$*" >> "$FAKE_LOG"
env | grep -E '^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|(DSCLUSTER|NCCL|GLOO|MASTER)_[A-Z_]*)=' | sort \
  | sed 's/^/env /' >> "$FAKE_LOG"
exit "${FAKE_PROGRAM_RC:-0}"
"""


def write_program(rig) -> str:
    prog = rig["work"] / "my_train.sh"
    prog.write_text(FAKE_PROGRAM)
    prog.chmod(0o755)
    return "./my_train.sh"


def test_a_program_runs_instead_of_train_with_its_place_in_the_job(rig):
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='enp3s0'\nexport MASTER_ADDR='10.77.1.1'\n"
                        "export MASTER_PORT='29500'\n")
    prog = write_program(rig)
    out = run_entry(rig, prog, "--steps", "5", "lr=0.1", extra={**under_mpirun(local_rank=1, rank=3),
                                                               "FAKE_PROGRAM_RC": "7"})
    assert out.returncode == 7, out.stderr  # the program's exit code is the rank's
    lines = log_lines(rig)
    assert not any(l.startswith("train ") for l in lines)
    assert [l.split(" ", 2)[2] for l in lines if l.startswith("program ")] == ["args=--steps 5 lr=0.1"]
    seen = env_seen(rig)
    assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"]) == ("3", "1", "4", "2")
    assert seen["GLOO_SOCKET_IFNAME"] == "enp3s0" and seen["MASTER_ADDR"] == "10.77.1.1"
    assert seen["MASTER_PORT"] == "29500" and seen["DSCLUSTER_LAUNCHER"] == "openmpi"
    assert seen["DSCLUSTER_RUN_ID"] == "mpi-prterun-head-4242-1"
    assert seen["DSCLUSTER_RUN_DIR"] == str(rig["tmp"] / "runs" / "mpi-prterun-head-4242-1")


def test_a_program_on_local_rank_0_gets_the_node_sampler_in_its_run_dir(rig):
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    prog = write_program(rig)
    out = run_entry(rig, prog, extra=under_mpirun())
    assert out.returncode == 0, out.stderr
    started = [l for l in log_lines(rig) if l.startswith("telemetry ")]
    assert len(started) == 1 and f"--run-dir {env_seen(rig)['DSCLUSTER_RUN_DIR']} " in started[0]
    pid = int(started[0].split()[1].split("=")[1])
    assert f"telemetry-stopped pid={pid}" in log_lines(rig)


def test_options_and_overrides_first_still_mean_train(rig):
    write_program(rig)
    for first in ("epochs=2", "fp16.guard_window=50"):  # train's arguments: train refuses the program name
        out = run_entry(rig, first, "./my_train.sh")
        assert out.returncode == 2 and "override './my_train.sh'" in out.stderr, out.stderr
    out = run_entry(rig, "-h", "./my_train.sh")
    assert out.returncode == 0, out.stderr
    train = [l for l in log_lines(rig) if l.startswith("train ")]
    assert [l.split("args=")[1] for l in train] == ["-h ./my_train.sh"]
    assert not any(l.startswith("program ") for l in log_lines(rig))


@pytest.mark.parametrize("args, expect", [
    (["./nonexistent_program", "--steps", "3"], "cannot run './nonexistent_program': no such program"),
    (["./not_executable.sh"], "cannot run './not_executable.sh'"),
    (["no-such-command-on-path"], "cannot run 'no-such-command-on-path'"),
    (["--config", "nope.yaml"], "nope.yaml: no such config"),
    (["--config", "configs/digits.yaml", "epochs=zero"], "override 'epochs=zero'"),
], ids=["program-missing", "program-not-executable", "command-not-on-path", "config-missing", "bad-override"])
def test_bad_program_or_config_stops_before_the_sampler_and_the_run_directory(rig, args, expect):
    write_node_env(rig, "export NCCL_SOCKET_IFNAME='eth0'\n")
    (rig["work"] / "not_executable.sh").write_text("echo hi\n")
    out = run_entry(rig, *args, extra=under_mpirun())
    assert out.returncode == 2 and expect in out.stderr, out.stderr
    assert not any(l.startswith(("telemetry ", "train ", "program ")) for l in log_lines(rig))
    assert not (rig["tmp"] / "runs").exists()


def test_a_python_script_writes_its_metrics_beside_the_telemetry(rig):
    """The real path: the venv's python runs a script that logs through dscluster.userlog."""
    script = rig["work"] / "train.py"
    script.write_text("import os, sys\nfrom dscluster import userlog\n"
                      "os.chdir('/')  # the run directory is absolute: a script may move\n"
                      "with userlog.open_run(micro_batch=4) as log:\n"
                      "    for step in range(1, 4):\n"
                      "        log.step(step, loss=1.0 / step, samples=4)\n"
                      "print('args', sys.argv[1:])\n")
    out = run_entry(rig, "python", "train.py", "--steps", "3")
    assert out.returncode == 0, out.stderr
    assert "args ['--steps', '3']" in out.stdout
    runs = list((rig["tmp"] / "runs").iterdir())
    assert len(runs) == 1
    records = (runs[0] / "metrics" / "rank-0.jsonl").read_text().splitlines()
    assert len(records) == 5  # start, 3 steps, end
    assert (runs[0] / "summary.json").exists()
    assert any(l.startswith("telemetry ") and f"--run-dir {runs[0]} " in l for l in log_lines(rig))


def _only_run(rig) -> Path:
    runs = list((rig["tmp"] / "runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_a_program_without_userlog_leaves_each_ranks_exit_and_a_complete_summary(rig):
    """A plain script (no dscluster.userlog): its rank's record and the summary say it exited 0."""
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='eth0'\n")
    prog = write_program(rig)
    out = run_entry(rig, prog, extra=under_mpirun())
    assert out.returncode == 0, out.stderr
    run = _only_run(rig)
    rec = json.loads((run / "process" / "rank-0.json").read_text())
    assert (rec["rank"], rec["world_size"], rec["exit_code"], rec["status"]) == (0, 4, 0, "complete")
    assert rec["host"] == socket.gethostname() and rec["argv"] == [prog]
    assert rec["end_t"] >= rec["start_t"] > 0 and "gpu" in rec
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("complete", 0)

    from dscluster.analysis import load_run
    from dscluster.analysis.stats import summary_row
    assert summary_row(load_run(run))["status"] == "complete (exit 0)"


def test_a_failing_rank_names_itself_and_its_exit_code_in_the_summary(rig):
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='eth0'\n")
    prog = write_program(rig)
    out = run_entry(rig, prog, extra={**under_mpirun(local_rank=1, rank=3), "FAKE_PROGRAM_RC": "7"})
    assert out.returncode == 7
    run = _only_run(rig)
    assert json.loads((run / "process" / "rank-3.json").read_text())["exit_code"] == 7
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["failed_rank"], summary["exit_code"]) == ("failed", 3, 7)

    from dscluster.analysis import load_run
    from dscluster.analysis.diagnose import diagnose
    from dscluster.analysis.stats import summary_row
    loaded = load_run(run)
    assert summary_row(loaded)["status"] == "failed (exit 7) on rank 3"
    assert any(f["kind"] == "rank_failed" and f["rank"] == 3 and "exit 7" in f["message"]
               for f in diagnose(loaded)["findings"])


def test_a_program_stopped_by_sigterm_records_exit_143(rig):
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='eth0'\n")
    prog = rig["work"] / "sleeper.sh"
    prog.write_text('#!/usr/bin/env bash\necho "program pid=$$" >> "$FAKE_LOG"\nsleep 60 & wait\n')
    prog.chmod(0o755)
    env = dict(rig["env"], **under_mpirun())
    proc = subprocess.Popen([str(ENTRY), "./sleeper.sh"], cwd=rig["work"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_until(lambda: any(l.startswith("program ") for l in log_lines(rig)), 30, "the program started")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=scaled(15)) == 143
    run = _only_run(rig)
    assert json.loads((run / "process" / "rank-0.json").read_text())["exit_code"] == 143
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["failed_rank"], summary["exit_code"]) == ("failed", 0, 143)


def test_sigterm_to_the_whole_process_group_still_records_the_programs_exit(rig):
    """A launcher that signals the rank's process group ends the program and entry_cn.sh at once."""
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='eth0'\n")
    prog = rig["work"] / "sleeper.sh"
    prog.write_text('#!/usr/bin/env bash\necho "program pid=$$" >> "$FAKE_LOG"\nexec sleep 60\n')
    prog.chmod(0o755)
    proc = subprocess.Popen([str(ENTRY), "./sleeper.sh"], cwd=rig["work"], env=dict(rig["env"], **under_mpirun()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_until(lambda: any(l.startswith("program ") for l in log_lines(rig)), 30, "the program started")
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=scaled(15))
    assert proc.returncode == 143, err
    rec = json.loads((_only_run(rig) / "process" / "rank-0.json").read_text())
    assert (rec["exit_code"], rec["status"]) == (143, "failed") and rec["end_t"] is not None, (rec, err)


def test_a_rerun_into_a_failed_runs_directory_tells_its_own_story(rig):
    """The same run id again after a failure: the new run's exit 0 is the summary, the failure kept aside."""
    write_node_env(rig, "export GLOO_SOCKET_IFNAME='eth0'\n")
    prog = write_program(rig)
    first = run_entry(rig, prog, extra={**under_mpirun(), "DSCLUSTER_RUN_ID": "plain40", "FAKE_PROGRAM_RC": "1"})
    assert first.returncode == 1
    run = rig["tmp"] / "runs" / "plain40"
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    again = run_entry(rig, prog, extra={**under_mpirun(), "DSCLUSTER_RUN_ID": "plain40"})
    assert again.returncode == 0, again.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("complete", 0)
    earlier = json.loads((run / "summary.previous-1.json").read_text())
    assert (earlier["status"], earlier["exit_code"]) == ("failed", 1)
    assert "held an earlier run: its summary is kept as summary.previous-1.json" in again.stderr


def test_a_rank_that_died_building_a_deepspeed_op_is_diagnosed_with_the_fix(rig):
    """The op builder's real traceback (TORCH_CUDA_ARCH_LIST=9.0a, tests/data/opbuild) on the program's stderr:
    entry_cn.sh keeps it, and diagnose says which rank died building an op, and how to mend it."""
    from dscluster.analysis import load_run
    from dscluster.analysis.diagnose import diagnose

    recorded = ROOT / "tests" / "data" / "opbuild" / "fused_adam_arch_9.0a.txt"
    prog = rig["work"] / "ds_adam.sh"
    prog.write_text(f"#!/bin/sh\ncat {recorded} >&2\nexit 1\n")
    prog.chmod(0o755)
    out = run_entry(rig, "./ds_adam.sh", extra={"DSCLUSTER_RUN_ID": "adam"})
    assert out.returncode == 1 and "invalid literal for int() with base 10: '0a'" in out.stderr  # still shown
    run = rig["tmp"] / "runs" / "adam"
    assert json.loads((run / "summary.json").read_text())["error"] == "exit 1 on rank 0"
    found = [f for f in diagnose(load_run(run))["findings"] if f["kind"] == "op_build_failed"]
    assert len(found) == 1 and found[0]["rank"] == 0
    said = found[0]["message"]
    assert "died building a DeepSpeed op" in said and "TORCH_CUDA_ARCH_LIST" in said and "'0a'" in said
    assert "dscluster check" in said and "9.0 for 9.0a" in said
