"""A rank's CPUs: the one rule for undoing a launcher's default binding.

OpenMPI's mpirun binds each rank to one core (at most two ranks) or a package/NUMA domain unless
given `--bind-to none`, which the README's command does not say; every thread the rank starts
inherits it (NCCL's socket threads, PyTorch's, the loader workers) and they queue on that core
(measured in docs/gpu-lab.md). So every rank program of dscluster calls `free_launcher_binding()`
before starting threads: in a rank mpirun started, each thread gets every CPU its cgroup allows.
Other launchers bind only when asked, so their binding is left alone; DSCLUSTER_KEEP_BINDING=1
keeps mpirun's too, for whoever bound ranks on purpose.
"""

from __future__ import annotations

import os

KEEP_ENV = "DSCLUSTER_KEEP_BINDING"
THREADS_ENV = "OMP_NUM_THREADS"
"""The user's own thread count for a CPU rank; set, it wins over `share_cores`."""
MPIRUN_ENV = "OMPI_COMM_WORLD_SIZE"
"""Set in every process OpenMPI's mpirun starts: the launcher that binds unasked."""


def cpu_list(cpus) -> str:
    """`0-3,8` for {0, 1, 2, 3, 8}: the way taskset and /proc/PID/status write a CPU set."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def node_cpus() -> set[int]:
    """Every CPU number of the node; the kernel narrows it to the cgroup's cpuset when it is set."""
    return set(range(os.cpu_count() or 1))


def widen(tid: int = 0) -> None:
    """Let thread `tid` (0: the caller) run on every CPU the node allows it (OSError if none)."""
    os.sched_setaffinity(tid, node_cpus())


def free_launcher_binding(env=None) -> str | None:
    """Give every thread of this process the node's CPUs when OpenMPI's mpirun bound it to fewer.

    Returns one line for the run's notes when the binding changed (or was kept on request), None
    when the process already had every CPU it may use or was not started by mpirun. Never raises: a
    platform without CPU affinity, or a cpuset that forbids the change, leaves the process as it was."""
    env = os.environ if env is None else env
    if MPIRUN_ENV not in env:
        return None
    try:
        before = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    if len(before) >= (os.cpu_count() or 1):
        return None
    if env.get(KEEP_ENV) == "1":
        return (f"cpus: kept mpirun's binding to CPU(s) {cpu_list(before)} of {os.cpu_count()} "
                f"({KEEP_ENV}=1)")
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            widen(tid)
        except OSError:
            pass  # a thread that ended meanwhile, or a cpuset that forbids it
    after = os.sched_getaffinity(0)
    if after == before:
        return None
    return (f"cpus: mpirun bound this rank to CPU(s) {cpu_list(before)}; freed to {cpu_list(after)} "
            f"({len(after)} CPUs) so that NCCL's network threads and the loader do not queue on "
            f"{'one core' if len(before) == 1 else 'them'} (mpirun --bind-to none does the same; "
            f"{KEEP_ENV}=1 keeps a binding made on purpose)")


def threads_per_rank(ranks: int, cores: int | None = None) -> int:
    """The rule: a machine's cores (this one's unless given) over the ranks that share them, at least 1.
    `share_cores` applies it on a rank; the simulated lab (sim/plan.py) to the host's cores over its slots."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, ranks))


def share_cores(local_ranks: int, env=None) -> int | None:
    """On a CPU rank, PyTorch's thread count: the node's cores split over the ranks that share them
    (oversubscribed OpenMP threads spin and crawl, docs/simulated-lab.md). None where OMP_NUM_THREADS is set: the
    user's count stands. Training's ranks (train/loop.py) and plan's per-node probe (plan/nodeprobe.py)
    both call it, so the probe times a step with the threads training's rank will have."""
    env = os.environ if env is None else env
    if env.get(THREADS_ENV):
        return None
    import torch  # lazy: the heavy stack; sim and check import this module and must start fast

    threads = threads_per_rank(local_ranks)
    torch.set_num_threads(threads)
    return threads
