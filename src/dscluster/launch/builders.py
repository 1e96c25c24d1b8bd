"""Launch command builders: one typed LaunchPlan in, exact argv lists or script text out.

Nothing here runs anything or reads the environment: `cli.launch` gathers the facts
(hostfile, what `dscluster check` wrote, the venv) into a LaunchPlan, and these functions
turn it into the command each launcher needs. Keeping them pure lets the unit tests assert
the exact argv, and lets `--dry-run` print precisely what would run.

Every launcher ends in the same training command, `<repo>/entry_cn.sh [train args]`, so a
job behaves the same whoever starts it: entry_cn.sh loads the node's own environment,
maps the GPU, starts the node's telemetry sampler and runs `dscluster train`.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dscluster.errors import UsageError
from dscluster.files import state
from dscluster.launch import mpirun

LAUNCHERS = ("mpirun", "deepspeed", "torchrun", "slurm")
DEEPSPEED_RUNNERS = ("openmpi", "pdsh")
DEFAULT_MASTER_PORT = 29500

# Values that every rank needs in order to agree on files, not on the network: exported
# with `-x` (mpirun) or through the DeepSpeed env file, whatever the node.
PLUMBING_VARS = ("DSCLUSTER_RUN_ID", "DSCLUSTER_RUNS", "DSCLUSTER_STATE", "DSCLUSTER_HOSTFILE")

_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launcher command depends on, resolved before any command is built."""

    hostfile: str
    """Absolute path of the OpenMPI-syntax hostfile (the one `dscluster check` validated)."""
    hosts: tuple[tuple[str, int], ...]
    """(host, slots) in hostfile order; the first host is the head (rank 0, rendezvous)."""
    repo_root: str
    """Repository root, at the same path on every node (shared software, like NFS)."""
    np: int
    """Total ranks to start; at most the hostfile's slot count."""
    train_args: tuple[str, ...] = ()
    """Arguments after `--`, passed to entry_cn.sh and on to `dscluster train`."""
    exports: dict[str, str] = field(default_factory=dict)
    """Cluster-wide variables every rank gets from the launcher (run id, state dir, ...)."""
    btl_cidr: str | None = None
    """The subnet every node shares (from check): OpenMPI's TCP traffic is pinned to it."""
    master_addr: str | None = None
    """Head's address on the common subnet (from check): rendezvous for gloo/NCCL."""
    master_port: int = DEFAULT_MASTER_PORT
    as_root: bool = False
    """OpenMPI refuses to run as root unless told; only then is --allow-run-as-root added."""
    bind_to: str = "none"
    """`none` leaves data-loader threads free to use every core; `core` pins one rank per core."""
    bin_dir: str | None = None
    """Directory holding mpirun/deepspeed/torchrun (the venv's bin); None uses bare names."""
    workdir: str | None = None
    """Where ranks start (relative train arguments resolve here); None means the repo root.
    mpirun and DeepSpeed take it from the launching shell; torchrun and Slurm are told."""
    gpus: bool | None = None
    """Whether the nodes have GPUs, from check's facts; None when check could not tell, and
    then a GPU per slot is assumed (slots are usually the GPU count)."""
    node_gpus: dict[str, int] = field(default_factory=dict)
    """GPUs check found on each host it reached (a host it did not reach is absent)."""
    host_lines: dict[str, int] = field(default_factory=dict)
    """Each host's line in the hostfile, for errors that name it."""

    @property
    def entry(self) -> str:
        return str(Path(self.repo_root) / "entry_cn.sh")

    @property
    def head(self) -> str:
        return self.hosts[0][0]

    @property
    def cwd(self) -> str:
        return self.workdir or self.repo_root

    def tool(self, name: str) -> str:
        return str(Path(self.bin_dir) / name) if self.bin_dir else name


# --- command-line input -----------------------------------------------------------------

def parse_env_assignment(text: str) -> tuple[str, str]:
    """`KEY=VALUE` from the command line (`--env`), with a usage error that shows the form."""
    key, sep, value = text.partition("=")
    if not sep or not _ENV_KEY_RE.match(key):
        raise UsageError(f"--env {text!r}: expected KEY=VALUE, e.g. --env NCCL_DEBUG=INFO")
    return key, value


# --- the common tail --------------------------------------------------------------------

def train_command(plan: LaunchPlan) -> list[str]:
    """What every launcher starts on each rank: entry_cn.sh with the train arguments."""
    return [plan.entry, *plan.train_args]


# --- mpirun (OpenMPI 5) ---------------------------------------------------------------------

def mpirun_argv(plan: LaunchPlan) -> list[str]:
    """`mpirun -np N --hostfile H --map-by slot --bind-to B -x ... --mca ... ./entry_cn.sh ARGS`."""
    app = mpirun.App(plan.np, train_command(plan), {key: plan.exports[key] for key in sorted(plan.exports)})
    return mpirun.mpirun_argv(plan.tool("mpirun"), [app], hostfile=plan.hostfile, map_by="slot",
                              bind_to=plan.bind_to, cidr=plan.btl_cidr, as_root=plan.as_root)


# --- DeepSpeed's own launcher -----------------------------------------------------------------

def deepspeed_argv(plan: LaunchPlan, runner: str = "openmpi") -> list[str]:
    """`deepspeed --hostfile H --launcher R ... --no_python entry_cn.sh ARGS`.

    --no_python runs entry_cn.sh itself on every rank, so the node's env, GPU mapping and
    telemetry are the same as under mpirun; --no_local_rank keeps DeepSpeed from appending
    `--local_rank=N` to the train arguments (the rank comes from the environment).
    The cluster-wide exports travel in the env file (`deepspeed_env_text`), which both of
    DeepSpeed's runners forward to every rank.
    """
    if runner not in DEEPSPEED_RUNNERS:
        raise UsageError(f"--deepspeed-runner {runner!r}: choose one of {', '.join(DEEPSPEED_RUNNERS)}")
    if not plan.master_addr:
        raise UsageError("no MASTER_ADDR in the check output: run `dscluster check` again")
    argv = [plan.tool("deepspeed"), "--hostfile", plan.hostfile, "--launcher", runner,
            "--master_addr", plan.master_addr, "--master_port", str(plan.master_port)]
    if runner == "openmpi":
        launcher_args = ["--map-by", "slot", "--bind-to", plan.bind_to, *mpirun.network_args(plan.btl_cidr)]
        if plan.as_root:
            launcher_args.append("--allow-run-as-root")
        argv += ["--launcher_args", shlex.join(launcher_args)]
        if plan.np != sum(slots for _, slots in plan.hosts):
            raise UsageError("--np: DeepSpeed's openmpi runner always starts every hostfile slot; "
                             "edit the hostfile or use --launcher mpirun")
    else:
        if plan.np != sum(slots for _, slots in plan.hosts):
            raise UsageError("--np: DeepSpeed's launcher starts every hostfile slot; edit the hostfile "
                             "or use --launcher mpirun")
    return argv + ["--no_python", "--no_local_rank", *train_command(plan)]


def deepspeed_env_text(plan: LaunchPlan, base: dict[str, str], home: dict[str, str] | None = None) -> str:
    """The per-run env file handed to DeepSpeed through DS_ENV_FILE (notes on stderr).

    Pointing DS_ENV_FILE at it hides ~/.deepspeed_env from DeepSpeed, so that file (`home`; None
    reads it, the one read of a builder) is merged in here: `deepspeed_env_layers` has the order.
    DeepSpeed splits each line on the first '=' with no comment or blank-line handling, so the
    file is bare `KEY=VALUE` lines only.
    """
    if home is None:
        home_path = state.home_deepspeed_env_path()
        home = state.read_deepspeed_env(home_path) if home_path and home_path.is_file() else {}
    merged, notes = deepspeed_env_layers(plan, base, home)
    for note in notes:
        print(f"dscluster launch: {note}", file=sys.stderr)
    return "".join(f"{key}={merged[key]}\n" for key in sorted(merged))


def deepspeed_env_layers(plan: LaunchPlan, base: dict[str, str], home: dict[str, str]
                         ) -> tuple[dict[str, str], list[str]]:
    """DeepSpeed's own precedence (~/.deepspeed_env, then the cwd's file), with check's keys in the cwd
    file (those its mark lists) under both of yours, and the run's exports over everything: every rank
    must agree on the run id, state and hostfile. Returns the values and a note per value of yours
    that lost or won against ours."""
    base = dict(base)
    checks = set(filter(None, base.pop(state.DEEPSPEED_ENV_MARK, "").split(",")))
    merged = {k: v for k, v in base.items() if k in checks}
    yours: dict[str, str] = {}  # key -> the file of yours its value came from
    notes = []
    for where, layer in (("~/.deepspeed_env", home), (".deepspeed_env", base)):
        for key, value in layer.items():
            if key == state.DEEPSPEED_ENV_MARK or (layer is base and key in checks):
                continue
            if key in checks and base[key] != value:
                notes.append(f"kept {key}={value} from {where} (check found {base[key]})")
            merged[key], yours[key] = value, where
    for key, value in plan.exports.items():
        if key in yours and merged[key] != value:
            notes.append(f"{key}={merged[key]} from {yours[key]} is replaced by this run's {key}={value}")
        merged[key] = value
    return merged, notes


# --- torchrun, one agent per node over SSH ----------------------------------------------------

@dataclass(frozen=True)
class NodeCommand:
    """A command for one node: run through SSH by `cli.launch` (or by hand)."""

    host: str
    argv: list[str]
    shell: str
    """The same command as one shell line (cd to the repo, set exports, exec argv)."""


def torchrun_argv(plan: LaunchPlan, slots: int) -> list[str]:
    if not plan.master_addr:
        raise UsageError("no MASTER_ADDR in the check output: run `dscluster check` again")
    run_id = plan.exports.get("DSCLUSTER_RUN_ID", "dscluster")
    return [plan.tool("torchrun"), f"--nnodes={len(plan.hosts)}", f"--nproc-per-node={slots}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}",
            f"--rdzv-id={run_id}", "--max-restarts=0", "--no-python", *train_command(plan)]


def torchrun_node_commands(plan: LaunchPlan) -> list[NodeCommand]:
    """One torchrun agent per hostfile line; c10d rendezvous on the head's common address.

    The node rank is left to the rendezvous; entry_cn.sh keeps the MASTER_ADDR/PORT that
    torchrun hands its workers instead of the check's values.
    """
    if plan.np != sum(slots for _, slots in plan.hosts):
        raise UsageError("--np: torchrun starts every hostfile slot; edit the hostfile or use --launcher mpirun")
    commands = []
    for host, slots in plan.hosts:
        argv = torchrun_argv(plan, slots)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(plan.exports.items()))
        shell = f"cd {shlex.quote(plan.cwd)} && " + (f"env {env} " if env else "") + shlex.join(argv)
        commands.append(NodeCommand(host=host, argv=argv, shell=shell))
    return commands


# --- Slurm ------------------------------------------------------------------------------------

def slurm_layout(plan: LaunchPlan) -> list[tuple[str, int]]:
    """(host, ranks) in hostfile order: the first `np` slots, filled as mpirun --map-by slot fills them."""
    layout = []
    left = plan.np
    for host, slots in plan.hosts:
        ranks = min(slots, left)
        if ranks:
            layout.append((host, ranks))
        left -= ranks
    return layout


def refuse_gpu_shortfall(plan: LaunchPlan, layout: list[tuple[str, int]]) -> None:
    """A node that gets more ranks than check found GPUs there: Slurm would never grant the job (it
    waits, or sbatch refuses it), so it is bad input here, before anything is written or submitted."""
    for host, ranks in layout:
        found = plan.node_gpus.get(host)
        if found is None or found >= ranks:
            continue
        line = plan.host_lines.get(host)
        where = f"{plan.hostfile}:{line}" if line else plan.hostfile
        fix = f"set slots={found} for {host}" if found else f"take {host} out of the hostfile"
        raise UsageError(f"{where}: {host} gets {ranks} rank(s) but `dscluster check` found {found} GPU(s) there, "
                         f"and under Slurm every rank gets a GPU of its own: {fix} (or run --np fewer ranks), "
                         "then run `dscluster check` again")


def _slurm_placement(plan: LaunchPlan, layout: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
    """The #SBATCH lines that place the ranks, and srun's options to match.

    One count of ranks on every node: one job, --ntasks-per-node. Nodes with different counts
    (`node1 slots=2`, `node2 slots=1`): a heterogeneous job, one component per node, each asking
    for its own ranks (and a GPU per rank): Slurm's own distribution of a plain --ntasks job put
    the ranks where it liked, and a GPU request is per node for the whole job (docs/launchers.md).
    """
    gpu_options = ["--gpus-per-task=1"] if plan.gpus is not False else []
    counts = {ranks for _, ranks in layout}
    if len(counts) == 1:
        lines = [f"#SBATCH --nodes={len(layout)}", f"#SBATCH --ntasks={plan.np}",
                 f"#SBATCH --ntasks-per-node={counts.pop()}",
                 f"#SBATCH --nodelist={','.join(host for host, _ in layout)}"]
        return lines + [f"#SBATCH {option}" for option in gpu_options], []
    lines = ["# One component per node (a heterogeneous job): each node runs the ranks the hostfile gives it."]
    for index, (host, ranks) in enumerate(layout):
        if index:
            lines.append("#SBATCH hetjob")
        lines.append(" ".join(["#SBATCH --nodes=1", f"--ntasks={ranks}", f"--nodelist={host}", *gpu_options]))
    return lines, [f"--het-group=0-{len(layout) - 1}"]


def slurm_script(plan: LaunchPlan, job_name: str = "dscluster") -> str:
    """An sbatch script that runs the same training command with srun, the hostfile's ranks on each
    node (`slurm_layout`) and, on GPU nodes, one GPU per rank.

    Slurm hides GPUs it did not grant (cgroups), so GPU nodes get --gpus-per-task=1: each rank then
    sees its own GPU only. Without DSCLUSTER_RUN_ID in the exports the run id is `slurm-<job id>`;
    the head's address is Slurm's first node unless the environment already names one.
    """
    layout = slurm_layout(plan)
    if plan.gpus:
        refuse_gpu_shortfall(plan, layout)
    placement, srun_options = _slurm_placement(plan, layout)
    where = ", ".join(f"{host}: {ranks}" for host, ranks in layout)
    lines = [
        "#!/usr/bin/env bash",
        "# Written by `dscluster launch --launcher slurm`; submit with: sbatch THIS_FILE",
        f"# Hostfile: {plan.hostfile}",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --chdir={plan.cwd}",
        *placement,
        "set -euo pipefail",
        f"cd {shlex.quote(plan.cwd)}",
    ]
    for key in sorted(plan.exports):
        lines.append(f"export {key}={shlex.quote(plan.exports[key])}")
    if "DSCLUSTER_RUN_ID" not in plan.exports:
        lines.append('export DSCLUSTER_RUN_ID="${DSCLUSTER_RUN_ID:-slurm-${SLURM_JOB_ID}}"')
    lines += [
        'if [ -z "${MASTER_ADDR:-}" ]; then',
        '  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "fi",
        "export MASTER_ADDR",
        f'export MASTER_PORT="${{MASTER_PORT:-{plan.master_port}}}"',
        f'echo "dscluster: run ${{DSCLUSTER_RUN_ID}} on {len(layout)} nodes (ranks {where}), head ${{MASTER_ADDR}}"',
        "# A rank that fails ends the whole step instead of leaving the others waiting.",
        shlex.join(["srun", *srun_options, "--kill-on-bad-exit=1", "--export=ALL", *train_command(plan)]),
        "",
    ]
    return "\n".join(lines)


def sbatch_argv(script_path: str) -> list[str]:
    return ["sbatch", script_path]


def display(argv: list[str]) -> str:
    """The argv as a line a user can paste into a shell."""
    return shlex.join(argv)
