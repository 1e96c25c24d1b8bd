"""Who am I in the job: the one rank-detection rule, for training, the benchmarks and entry_cn.sh.

Launchers disagree on how they tell a process its rank: torchrun and DeepSpeed's launcher set
RANK, mpirun sets OMPI_COMM_WORLD_*, MPICH/Intel set PMI_*, PMIx PMIX_RANK, Slurm SLURM_*.
`detect_ranks` tries them in that order and takes the first that names both a rank and a world
size. RANK comes first because it is set by the innermost launcher: a torchrun agent started by
mpirun hands its workers RANK while they still inherit the agent's OMPI_COMM_WORLD_RANK, and
RANK is what torch.distributed itself reads.

entry_cn.sh evaluates `shell_assignments` (it starts python for that anyway).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import socket
import sys
from dataclasses import dataclass

from dscluster.errors import UsageError

# (source, rank, local rank, world size, local world size) variables, in the order they are tried.
LAUNCHER_VARS = (
    ("torch", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ("pmix", "PMIX_RANK", "PMIX_LOCAL_RANK", "PMIX_SIZE", "PMIX_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job and which launcher variables told us."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    """0 when the launcher did not say."""
    source: str
    """"torch", "openmpi", "pmi", "pmix", "slurm", or "single" when no launcher started us."""


def _int(env, key: str) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment: {key}={value!r} is not a whole number") from None


def detect_ranks(env=None) -> RankInfo:
    """Rank, local rank and world size from whichever launcher started us (single process otherwise)."""
    env = os.environ if env is None else env
    for source, rank_var, local_rank_var, world_var, local_world_var in LAUNCHER_VARS:
        rank = _int(env, rank_var)
        if rank is None:
            continue
        world = _int(env, world_var)
        if world is None:
            continue
        local = _int(env, local_rank_var)
        local_world = None
        if local_world_var == "SLURM_NTASKS_PER_NODE":
            local_world = slurm_tasks_on_this_node(env)
        else:
            local_world = _int(env, local_world_var)
        if local is None:
            local = 0 if world == 1 else rank % (local_world or 1)
        if not 0 <= rank < world:
            raise UsageError(f"environment: {rank_var}={rank} is outside 0..{world - 1} ({world_var}={world})")
        return RankInfo(rank, local, world, local_world or (1 if world == 1 else 0), source)
    return RankInfo(0, 0, 1, 1, "single")


def slurm_tasks_on_this_node(env) -> int | None:
    """How many of the step's tasks share this node. A heterogeneous job (a mixed lab) sets no
    SLURM_NTASKS_PER_NODE, so the step's own per-node list is read first, at this node's index."""
    per_node = expand_slurm_counts(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node_index = _int(env, "SLURM_NODEID")
    if per_node and node_index is not None and 0 <= node_index < len(per_node):
        return per_node[node_index]
    counts = expand_slurm_counts(env.get("SLURM_NTASKS_PER_NODE", ""))
    return counts[0] if counts else None


def expand_slurm_counts(text: str) -> list[int]:
    """Slurm's compressed per-node counts, "2(x3),1" -> [2, 2, 2, 1]; [] when unreadable."""
    counts: list[int] = []
    for item in filter(None, text.split(",")):
        value, _, repeat = item.partition("(x")
        if not value.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            return []
        counts += [int(value)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def default_master_port(run_id: str) -> int:
    """A port every rank derives alike from the run id, so parallel jobs on one host rarely collide."""
    return 29500 + int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % 2000


def export_env(info: RankInfo, run_id: str, env: dict | None = None, warn=None) -> list[str]:
    """Set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* for DeepSpeed; returns the warnings it issued."""
    env = os.environ if env is None else env
    warnings: list[str] = []
    wanted = {"RANK": info.rank, "LOCAL_RANK": info.local_rank, "WORLD_SIZE": info.world_size}
    for key, value in wanted.items():
        old = env.get(key)
        if old is not None and old != str(value):
            warnings.append(f"{key}={old} in the environment overridden by {key}={value} (from {info.source})")
        env[key] = str(value)
    addr = env.get("MASTER_ADDR")
    if addr and is_local_address(addr) is False:
        if info.local_world_size == info.world_size:
            # check's head is not in this job: every rank is on this host, and so is the store
            env["MASTER_ADDR"] = "127.0.0.1"
        elif info.rank == 0:
            raise UsageError(
                f"MASTER_ADDR {addr} is not an address of this host ({socket.gethostname()}), where rank 0 "
                "runs: rank 0 holds the rendezvous, so the other ranks would wait for it there until "
                "dist.timeout_s. MASTER_ADDR comes from `dscluster check` (its hostfile's first host). Fix: "
                "put that host first in this mpirun's hostfile, or run `dscluster check --hostfile "
                "<this hostfile>` so its first host becomes the rendezvous")
    if not env.get("MASTER_ADDR"):
        if info.local_world_size == info.world_size:
            env["MASTER_ADDR"] = "127.0.0.1"  # every rank on this host
        else:
            warnings.append(
                "MASTER_ADDR is not set: falling back to DeepSpeed's MPI discovery (rank 0's first address, "
                "which may be an unroutable docker0); run `dscluster check` to write the right one"
            )
    if not env.get("MASTER_PORT"):
        env["MASTER_PORT"] = str(default_master_port(run_id))
    for w in warnings:
        (warn or _warn)(w)
    return warnings


def is_local_address(addr: str) -> bool | None:
    """Whether `addr` (an IP or a host name) is an address of this host: a socket can bind to it. None
    where it does not resolve here: a launcher's own name is left to the launcher."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((sockaddr[0], 0))
            return True
    return False


def _warn(msg: str) -> None:
    print(f"dscluster train: warning: {msg}", file=sys.stderr, flush=True)


def shell_assignments(info: RankInfo) -> str:
    """What entry_cn.sh evaluates: GLOBAL_RANK (empty without a launcher), LOCAL_RANK_ID, WORLD and
    LOCAL_WORLD (empty when unknown)."""
    launched = info.source != "single"
    values = {
        "GLOBAL_RANK": str(info.rank) if launched else "",
        "LOCAL_RANK_ID": str(info.local_rank),
        "WORLD": str(info.world_size) if launched else "",
        "LOCAL_WORLD": str(info.local_world_size) if launched and info.local_world_size else "",
    }
    return "".join(f"{key}={shlex.quote(value)}\n" for key, value in values.items())
