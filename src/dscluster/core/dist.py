"""Who am I in the job, and bringing up the process group with a timeout.

The rank comes from `dscluster.node.ranks.detect_ranks`, the one rule (shared with the benchmarks and
entry_cn.sh; re-exported here for training's callers). `export_env` writes the result as
RANK/LOCAL_RANK/WORLD_SIZE for DeepSpeed and warns when that overrides a different value already
in the environment.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

# re-exported for the loop: which failure is a peer's is guards.py's rule, pure so that diagnose reads it
from dscluster.core.guards import PEER_FAILURE, is_peer_failure  # noqa: F401
from dscluster.errors import UsageError
from dscluster.node.netif import free_port

# re-exported for training's callers: the rank and the rendezvous are node/ranks.py's rules
from dscluster.node.ranks import RankInfo, default_master_port, detect_ranks, export_env  # noqa: F401


def enable_nccl_diagnostics(trace_dir: Path, env: dict | None = None) -> None:
    """Async NCCL error handling and the flight recorder, so a hang leaves per-rank traces."""
    env = os.environ if env is None else env
    trace_dir.mkdir(parents=True, exist_ok=True)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # flight recorder (was TORCH_NCCL_TRACE_BUFFER_SIZE)
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(trace_dir / "nccl_trace_rank_"))
    env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(trace_dir / "nccl_trace_rank_"))


def prepare_accelerator(env: dict | None = None) -> bool:
    """Tell DeepSpeed it runs on CPU when there is no GPU (must happen before importing deepspeed)."""
    env = os.environ if env is None else env
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return has_cuda


def default_extensions_dir(env: dict | None = None) -> str:
    """Set TORCH_EXTENSIONS_DIR (when unset) to a per-user cache keyed by Python and torch version.

    Any op DeepSpeed JIT-compiles is then built once per user and reused by every later run
    and every rank of that user on the node, instead of once per differing directory."""
    env = os.environ if env is None else env
    if not env.get("TORCH_EXTENSIONS_DIR"):
        base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
        env["TORCH_EXTENSIONS_DIR"] = str(base / "dscluster" / "torch_extensions" / tag)
    return env["TORCH_EXTENSIONS_DIR"]


def skip_cpu_shm_build() -> bool:
    """Stop DeepSpeed's CPU backend from JIT-compiling its shared-memory all-reduce op.

    deepspeed.comm.torch.TorchBackend.__init__ calls build_shm_op(), which compiles the
    ShareMemComm C++ op on the CPU accelerator. Training never uses it: only
    inference_all_reduce does, and without the op that falls back to
    torch.distributed.all_reduce (it checks torch.ops.deepspeed.inference_all_reduce_ and
    shm_vector_kernel_level, both absent then). The build took minutes per rank on a loaded
    2-core node whenever a rank had no cached copy (a fresh home, another
    TORCH_EXTENSIONS_DIR), all before the first step. Returns whether the patch was applied.
    """
    try:
        # by module path: the attribute `deepspeed.comm.torch` is the torch package itself
        ds_torch = importlib.import_module("deepspeed.comm.torch")
        from deepspeed.accelerator import get_accelerator  # deepspeed: as in init_process_group
    except ImportError:
        return False
    if get_accelerator().device_name() != "cpu" or not hasattr(ds_torch, "build_shm_op"):
        return False
    ds_torch.build_shm_op = lambda: None
    return True


def init_process_group(info: RankInfo, backend: str, timeout_s: float, device=None) -> None:
    """The process group, bound to this rank's own device, then DeepSpeed's comm on top of it.

    torch is initialised here rather than by deepspeed.init_distributed, which binds the group
    to cuda:$LOCAL_RANK: that index is wrong whenever a rank sees fewer GPUs than the node has
    ranks (a user's own CUDA_VISIBLE_DEVICES, one GPU shared by two ranks) and died with
    "device_id cuda:2 is out of range". DeepSpeed finds the group initialised and adopts it.
    """
    # deepspeed chooses its accelerator when imported: only after prepare_accelerator has set it
    import deepspeed

    default_extensions_dir()
    skip_cpu_shm_build()
    timeout = datetime.timedelta(seconds=timeout_s)
    discover = not os.environ.get("MASTER_ADDR") and info.world_size > 1
    if discover:
        # No rendezvous address from `dscluster check` or the launcher: DeepSpeed asks MPI for it.
        deepspeed.comm.comm.mpi_discovery(distributed_port=int(os.environ.get("MASTER_PORT") or 29500), verbose=False)
    if not tdist.is_initialized():
        kwargs = {}
        if device is not None and device.type == "cuda" and info.world_size > 1:
            # Binding the device lets NCCL set up eagerly; a single rank has no peer (DeepSpeed #8248).
            kwargs["device_id"] = device
        tdist.init_process_group(backend, init_method="env://", rank=info.rank, world_size=info.world_size,
                                 timeout=timeout, **kwargs)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                               rank=info.rank, world_size=info.world_size, verbose=False)


def device_for(local_rank: int, visible: int) -> int:
    """The CUDA index a local rank uses among the GPUs it sees.

    Every rank of a node sees all of the node's GPUs (or the user's CUDA_VISIBLE_DEVICES), the
    convention of torchrun and DeepSpeed's launcher: local rank r takes the r-th visible GPU. A
    rank that sees one GPU (Slurm's --gpus-per-task) takes that one; whether two ranks then share
    a card is only known once they compare (`shared_gpus`)."""
    if visible <= 0:
        raise UsageError("no GPU is visible to this rank (CUDA_VISIBLE_DEVICES is empty?)")
    return local_rank % visible


def shared_gpus(placements: list[str]) -> list[list[int]]:
    """Groups of ranks that ended up on the same physical GPU, from each rank's GPU UUID."""
    by_gpu: dict[str, list[int]] = {}
    for rank, where in enumerate(placements):
        by_gpu.setdefault(where, []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def ensure_single_process_group() -> None:
    """A one-rank gloo group on loopback, for code that needs deepspeed.comm outside a launched job
    (a DeepSpeed engine or loss scaler in a tool or a test). Nothing happens when a group exists."""
    import deepspeed  # as in init_process_group: after the accelerator is chosen

    if deepspeed.comm.is_initialized():
        return
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    # The rendezvous address is this group's alone: its store keeps listening on the port, so a
    # training started from this process must not inherit it (it failed with EADDRINUSE).
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    added = [k for k in rendezvous if k not in os.environ]
    os.environ.update({k: rendezvous[k] for k in added})
    skip_cpu_shm_build()  # as training does: the op is for inference and took minutes to build
    try:
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    finally:
        for k in added:
            os.environ.pop(k, None)


def dump_flight_recorder(trace_dir: Path, rank: int) -> Path | None:
    """Write torch's flight recorder (the last collectives of every process group, gloo or NCCL)
    to trace_dir/nccl_trace_rank_R, where `dscluster diagnose` compares ranks' sequence numbers.
    Must run before the process group is destroyed; never raises (it serves a failing run)."""
    try:
        data = torch._C._distributed_c10d._dump_fr_trace(True, True, False)
        trace_dir.mkdir(parents=True, exist_ok=True)
        path = trace_dir / f"nccl_trace_rank_{rank}"
        path.write_bytes(data)
        return path
    except Exception:
        return None


def destroy() -> None:
    if tdist.is_available() and tdist.is_initialized():
        try:
            tdist.destroy_process_group()
        except Exception:  # a broken group must not hide the real error
            pass


_PRIMARY: bool | None = None


def is_primary() -> bool:
    """The one process that logs, evaluates, writes the summary and the checkpoint pointer."""
    if _PRIMARY is not None:
        return _PRIMARY
    return detect_ranks().rank == 0


def set_primary(value: bool) -> None:
    global _PRIMARY
    _PRIMARY = value


def hostname() -> str:
    return socket.gethostname()


MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def node_identity() -> str:
    """This rank's machine, as local SGD groups ranks into nodes: host name, machine id and boot id.
    Machines cloned from one image can share a host name, and often /etc/machine-id, but never a
    running kernel's boot id; the simulated lab's nodes share one kernel but each has its own machine id."""
    machine = next((line for path in MACHINE_ID_FILES if (line := _first_line(path))), "")
    return f"{hostname()}/{machine}/{_first_line(BOOT_ID_FILE)}"


def _first_line(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip().splitlines()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return ""


def barrier() -> None:
    if tdist.is_initialized():
        tdist.barrier()


def all_gather_ints(values: list[int], device) -> list[list[int]]:
    """Gather a short int vector from every rank (one collective)."""
    mine = torch.tensor(values, dtype=torch.long, device=device)
    if not tdist.is_initialized():
        return [values]
    gathered = [torch.zeros_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(gathered, mine)
    return [each.tolist() for each in gathered]


def all_gather_strings(value: str) -> list[str]:
    if not tdist.is_initialized():
        return [value]
    gathered: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, value)
    return gathered


def apply_timeout_everywhere(timeout_s: float) -> int:
    """Give every process group the job's timeout; returns how many groups were set.

    DeepSpeed creates its data-parallel groups with torch's default timeout (30 minutes for
    gloo), so without this a rank missing a gradient all-reduce hangs its peers for half an
    hour instead of dist.timeout_s.
    """
    if not tdist.is_initialized():
        return 0
    c10d = tdist.distributed_c10d
    timeout = datetime.timedelta(seconds=timeout_s)
    setter = getattr(tdist, "set_timeout", None) or c10d._set_pg_timeout
    count = 0
    for group in list(c10d._world.pg_map.keys()):
        try:
            setter(timeout, group)
            count += 1
        except (ValueError, RuntimeError):
            continue  # not a member, or a backend that cannot change it
    return count
