"""The one mpirun builder and locator (launch, check's active tests, the benchmarks, the demo)."""

import pytest

from dscluster.bench import runner
from dscluster.launch.mpirun import App, launcher_bin_dir, mpirun_argv, mpirun_path


def test_one_program_reads_like_the_documented_command():
    argv = mpirun_argv("/v/bin/mpirun", [App(4, ["/r/entry_cn.sh", "epochs=1"], {"A": "1", "B": None})],
                       hostfile="hosts.txt", map_by="slot", bind_to="none", cidr="10.0.0.0/24", as_root=True)
    assert argv == ["/v/bin/mpirun", "-np", "4", "--hostfile", "hosts.txt", "--map-by", "slot", "--bind-to", "none",
                    "-x", "A=1", "-x", "B", "--mca", "btl_tcp_if_include", "10.0.0.0/24",
                    "--mca", "oob_tcp_if_include", "10.0.0.0/24", "--allow-run-as-root", "/r/entry_cn.sh", "epochs=1"]


def test_several_programs_share_the_options_and_keep_their_own_ranks_and_env():
    argv = mpirun_argv("mpirun", [App(1, ["a"], {"X": "1"}), App(2, ["b", "--y"])], host="localhost:3",
                       bind_to="none", oversubscribe=True)
    assert argv == ["mpirun", "--host", "localhost:3", "--bind-to", "none", "--oversubscribe",
                    "-np", "1", "-x", "X=1", "a", ":", "-np", "2", "b", "--y"]
    with pytest.raises(ValueError):
        mpirun_argv("mpirun", [])


def test_bench_jobs_meet_on_loopback_with_their_own_port():
    argv = runner.mpirun_argv([App(2, ["python", "-m", "x"])], 29600, as_root=False, mpirun="/v/bin/mpirun",
                              exports={"OMP_NUM_THREADS": "1"})
    assert argv == ["/v/bin/mpirun", "-np", "2", "--host", "localhost:2", "--bind-to", "none", "--oversubscribe",
                    "-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=29600", "-x", "OMP_NUM_THREADS=1",
                    "python", "-m", "x"]


def test_the_installation_wins_over_path_and_path_means_bare_launcher_names(tmp_path, monkeypatch):
    pybin, venv, other = tmp_path / "py" / "bin", tmp_path / "venv", tmp_path / "usr" / "bin"
    for d in (pybin, venv / "bin", other):
        d.mkdir(parents=True)
    (other / "mpirun").write_text("#!/bin/sh\n")
    (other / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    env = {"DSCLUSTER_VENV": str(venv)}
    python = str(pybin / "python3")
    assert mpirun_path(python, env) == str(other / "mpirun")
    assert launcher_bin_dir(python, env) is None  # deepspeed/torchrun by their bare names
    (venv / "bin" / "mpirun").write_text("#!/bin/sh\n")
    assert mpirun_path(python, env) == str(venv / "bin" / "mpirun")
    assert launcher_bin_dir(python, env) == str(venv / "bin")
    (pybin / "mpirun").write_text("#!/bin/sh\n")
    assert mpirun_path(python, env) == str(pybin / "mpirun")
    assert launcher_bin_dir(python, env) == str(pybin)
