"""Launch command builders: the exact argv or script each launcher gets from one plan."""

import shlex
import subprocess

import pytest

from dscluster.errors import UsageError
from dscluster.launch import builders as launch

EXPORTS = {"DSCLUSTER_RUN_ID": "launch-1", "DSCLUSTER_STATE": "/srv/lab/.dscluster"}


def make_plan(**over):
    base = dict(
        hostfile="/srv/lab/hosts.txt",
        hosts=(("node1", 2), ("node2", 2), ("node3", 1)),
        repo_root="/opt/dscluster",
        np=5,
        train_args=("--config", "configs/digits.yaml", "epochs=3"),
        exports=dict(EXPORTS),
        btl_cidr="10.77.1.0/24",
        master_addr="10.77.1.1",
        master_port=29500,
        as_root=False,
        bind_to="none",
        bin_dir="/opt/dscluster/.venv/bin",
        workdir="/srv/lab",
    )
    base.update(over)
    return launch.LaunchPlan(**base)


def test_mpirun_argv_exact():
    assert launch.mpirun_argv(make_plan()) == [
        "/opt/dscluster/.venv/bin/mpirun", "-np", "5", "--hostfile", "/srv/lab/hosts.txt",
        "--map-by", "slot", "--bind-to", "none",
        "-x", "DSCLUSTER_RUN_ID=launch-1", "-x", "DSCLUSTER_STATE=/srv/lab/.dscluster",
        "--mca", "btl_tcp_if_include", "10.77.1.0/24", "--mca", "oob_tcp_if_include", "10.77.1.0/24",
        "/opt/dscluster/entry_cn.sh", "--config", "configs/digits.yaml", "epochs=3",
    ]


def test_mpirun_allows_root_only_when_root():
    assert "--allow-run-as-root" not in launch.mpirun_argv(make_plan(as_root=False))
    argv = launch.mpirun_argv(make_plan(as_root=True))
    # before the program: anything after entry_cn.sh would be a train argument
    assert argv.index("--allow-run-as-root") < argv.index("/opt/dscluster/entry_cn.sh")


def test_mpirun_without_common_subnet_or_venv_uses_defaults():
    argv = launch.mpirun_argv(make_plan(btl_cidr=None, bin_dir=None, exports={}, train_args=(), np=3,
                                        bind_to="core"))
    assert argv == ["mpirun", "-np", "3", "--hostfile", "/srv/lab/hosts.txt", "--map-by", "slot",
                    "--bind-to", "core", "/opt/dscluster/entry_cn.sh"]


def test_deepspeed_openmpi_argv_exact():
    argv = launch.deepspeed_argv(make_plan(as_root=True), "openmpi")
    assert argv == [
        "/opt/dscluster/.venv/bin/deepspeed", "--hostfile", "/srv/lab/hosts.txt", "--launcher", "openmpi",
        "--master_addr", "10.77.1.1", "--master_port", "29500",
        "--launcher_args", "--map-by slot --bind-to none --mca btl_tcp_if_include 10.77.1.0/24 "
        "--mca oob_tcp_if_include 10.77.1.0/24 --allow-run-as-root",
        "--no_python", "--no_local_rank",
        "/opt/dscluster/entry_cn.sh", "--config", "configs/digits.yaml", "epochs=3",
    ]
    # DeepSpeed shlex-splits --launcher_args and checks for its own btl_tcp_if_include default
    launcher_args = shlex.split(argv[argv.index("--launcher_args") + 1])
    assert launcher_args[launcher_args.index("btl_tcp_if_include") - 1] == "--mca"


def test_deepspeed_pdsh_argv_has_no_mpi_args():
    argv = launch.deepspeed_argv(make_plan(), "pdsh")
    assert argv == [
        "/opt/dscluster/.venv/bin/deepspeed", "--hostfile", "/srv/lab/hosts.txt", "--launcher", "pdsh",
        "--master_addr", "10.77.1.1", "--master_port", "29500", "--no_python", "--no_local_rank",
        "/opt/dscluster/entry_cn.sh", "--config", "configs/digits.yaml", "epochs=3",
    ]


def test_deepspeed_refuses_partial_np_and_missing_master():
    with pytest.raises(UsageError, match="--np"):
        launch.deepspeed_argv(make_plan(np=3))
    with pytest.raises(UsageError, match="dscluster check"):
        launch.deepspeed_argv(make_plan(master_addr=None))
    with pytest.raises(UsageError, match="openmpi, pdsh"):
        launch.deepspeed_argv(make_plan(), "ssh")


def test_deepspeed_env_file_is_bare_key_value_lines_with_exports_winning():
    text = launch.deepspeed_env_text(make_plan(), {"NCCL_P2P_DISABLE": "1", "DSCLUSTER_RUN_ID": "old"}, home={})
    assert text == ("DSCLUSTER_RUN_ID=launch-1\nDSCLUSTER_STATE=/srv/lab/.dscluster\nNCCL_P2P_DISABLE=1\n")


def test_torchrun_one_agent_per_node_with_rendezvous_on_head():
    cmds = launch.torchrun_node_commands(make_plan())
    assert [c.host for c in cmds] == ["node1", "node2", "node3"]
    assert cmds[2].argv == [
        "/opt/dscluster/.venv/bin/torchrun", "--nnodes=3", "--nproc-per-node=1", "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.77.1.1:29500", "--rdzv-id=launch-1", "--max-restarts=0", "--no-python",
        "/opt/dscluster/entry_cn.sh", "--config", "configs/digits.yaml", "epochs=3",
    ]
    assert "--nproc-per-node=2" in cmds[0].argv
    assert cmds[0].shell == (
        "cd /srv/lab && env DSCLUSTER_RUN_ID=launch-1 DSCLUSTER_STATE=/srv/lab/.dscluster "
        + shlex.join(cmds[0].argv))


def test_torchrun_shell_line_quotes_values():
    cmds = launch.torchrun_node_commands(make_plan(exports={"NOTE": "a b;c"}, workdir="/srv/my lab"))
    assert cmds[0].shell.startswith("cd '/srv/my lab' && env NOTE='a b;c' ")


def test_slurm_script_runs_the_same_training_command_and_parses(tmp_path):
    plan = make_plan(hosts=(("node1", 2), ("node2", 2)), np=4, exports={"DSCLUSTER_STATE": "/srv/lab/.dscluster"})
    script = launch.slurm_script(plan)
    lines = script.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks=4" in lines
    assert "#SBATCH --ntasks-per-node=2" in lines
    srun = [l for l in lines if l.startswith("srun ")]
    assert srun == ["srun --kill-on-bad-exit=1 --export=ALL " + shlex.join(launch.train_command(plan))]
    assert 'export DSCLUSTER_RUN_ID="${DSCLUSTER_RUN_ID:-slurm-${SLURM_JOB_ID}}"' in lines
    assert "export DSCLUSTER_STATE=/srv/lab/.dscluster" in lines
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_slurm_mixed_slots_make_one_component_per_node_and_keep_given_run_id():
    # node1/node2 slots=2, node3 slots=1: Slurm's own distribution of --ntasks=5 put ranks where it liked
    lines = launch.slurm_script(make_plan()).splitlines()
    assert [l for l in lines if l.startswith("#SBATCH")] == [
        "#SBATCH --job-name=dscluster",
        "#SBATCH --chdir=/srv/lab",
        "#SBATCH --nodes=1 --ntasks=2 --nodelist=node1 --gpus-per-task=1",
        "#SBATCH hetjob",
        "#SBATCH --nodes=1 --ntasks=2 --nodelist=node2 --gpus-per-task=1",
        "#SBATCH hetjob",
        "#SBATCH --nodes=1 --ntasks=1 --nodelist=node3 --gpus-per-task=1",
    ]
    srun = [l for l in lines if l.startswith("srun ")]
    assert srun == ["srun --het-group=0-2 --kill-on-bad-exit=1 --export=ALL /opt/dscluster/entry_cn.sh "
                    "--config configs/digits.yaml epochs=3"]
    assert 'on 3 nodes (ranks node1: 2, node2: 2, node3: 1), head ${MASTER_ADDR}"' in lines[-3]
    assert "export DSCLUSTER_RUN_ID=launch-1" in lines
    assert not any("slurm-${SLURM_JOB_ID}" in l for l in lines)


def test_slurm_fewer_ranks_than_slots_fill_the_hostfile_in_order():
    assert launch.slurm_layout(make_plan(np=3)) == [("node1", 2), ("node2", 1)]
    assert launch.slurm_layout(make_plan(np=4)) == [("node1", 2), ("node2", 2)]
    lines = launch.slurm_script(make_plan(np=4)).splitlines()
    assert "#SBATCH --nodelist=node1,node2" in lines and "#SBATCH --ntasks-per-node=2" in lines


@pytest.mark.parametrize("gpus", [True, None])
def test_slurm_script_asks_for_the_hostfiles_nodes_and_a_gpu_per_rank(gpus):
    # None: check could not tell whether the nodes have GPUs, so every rank gets one.
    lines = launch.slurm_script(make_plan(hosts=(("node1", 2), ("node2", 2)), np=4, gpus=gpus)).splitlines()
    assert [l for l in lines if l.startswith("#SBATCH")] == [
        "#SBATCH --job-name=dscluster",
        "#SBATCH --chdir=/srv/lab",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks=4",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --nodelist=node1,node2",
        "#SBATCH --gpus-per-task=1",
    ]


@pytest.mark.parametrize("hosts, np", [((("node1", 1), ("node2", 1)), 2), ((("node1", 2), ("node2", 1)), 3)])
def test_slurm_script_on_cpu_nodes_asks_for_no_gpus(hosts, np):
    script = launch.slurm_script(make_plan(hosts=hosts, np=np, gpus=False))
    placed = "#SBATCH --nodes=1 --ntasks=1 --nodelist=node2\n" if np == 3 else "#SBATCH --ntasks-per-node=1\n"
    assert placed in script and "gpu" not in script


def test_slurm_refuses_a_node_with_fewer_gpus_than_its_ranks():
    plan = make_plan(gpus=True, node_gpus={"node1": 2, "node2": 1, "node3": 1}, host_lines={"node2": 4})
    with pytest.raises(UsageError) as refused:
        launch.slurm_script(plan)
    assert str(refused.value).startswith("/srv/lab/hosts.txt:4: node2 gets 2 rank(s) but `dscluster check` found "
                                         "1 GPU(s) there, and under Slurm every rank gets a GPU of its own: set "
                                         "slots=1 for node2")
    with pytest.raises(UsageError, match="take node3 out of the hostfile"):
        launch.slurm_script(make_plan(gpus=True, node_gpus={"node3": 0}))
    # fewer ranks than slots on it, a node check did not reach, or CPU nodes: nothing to refuse
    launch.slurm_script(make_plan(np=3, gpus=True, node_gpus={"node1": 2, "node2": 1}))
    launch.slurm_script(make_plan(gpus=True, node_gpus={"node1": 2}))
    launch.slurm_script(make_plan(gpus=False, node_gpus={"node1": 0}))


def test_every_launcher_ends_in_the_same_training_command():
    plan = make_plan()
    tail = launch.train_command(plan)
    n = len(tail)
    assert launch.mpirun_argv(plan)[-n:] == tail
    assert launch.deepspeed_argv(plan)[-n:] == tail
    assert all(c.argv[-n:] == tail for c in launch.torchrun_node_commands(plan))
    assert shlex.join(tail) in launch.slurm_script(plan)


def test_env_assignment_parsing():
    assert launch.parse_env_assignment("NCCL_DEBUG=INFO") == ("NCCL_DEBUG", "INFO")
    assert launch.parse_env_assignment("A=b=c") == ("A", "b=c")
    for bad in ("NCCL_DEBUG", "1A=x", "=x"):
        with pytest.raises(UsageError, match="KEY=VALUE"):
            launch.parse_env_assignment(bad)
