"""Start benchmark jobs on one host and read back what they measured.

Commands are built (pure functions, exact argv) separately from running them. Both paths
are started as separate processes exactly as a user would start them: `dscluster train`
under torchrun or mpirun, the DDP baseline under torchrun. Throughput is read from the run
directory `dscluster train` writes, through `analysis.load` (the run's own figure, core/timing.py),
never from a bench-only hook.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dscluster import __version__
from dscluster.analysis.load import RankMetrics, load_run
from dscluster.analysis.stats import job_throughput, overflow_counts
from dscluster.errors import UsageError
from dscluster.launch import mpirun as launch_mpirun
from dscluster.launch.mpirun import App, mpirun_path
from dscluster.node.netif import free_port  # noqa: F401  (each job gets its own rendezvous)
from dscluster.rundir.layout import METRICS_DIR

LAUNCHERS = ("torchrun", "mpirun")


def cell(value, fmt: str) -> str:
    """A result-table cell: the number formatted, or '-' when it was not measured."""
    return "-" if value is None else format(value, fmt)


def as_node_argv(ranks_per_node: int = 1) -> list[str]:
    """The prefix that runs an mpirun rank's program under its own host name (root: a UTS namespace),
    node1, node2, ... with `ranks_per_node` consecutive ranks each: ranks on one machine that training
    takes for separate nodes (sync.mode local_sgd / diloco averages across nodes, inside a node every
    step). They still share loopback: export GLOO_SOCKET_IFNAME=lo and MASTER_ADDR=127.0.0.1 to them."""
    name = f'node$((OMPI_COMM_WORLD_RANK / {int(ranks_per_node)} + 1))'
    return ["unshare", "--uts", "bash", "-c", f'hostname "{name}" && exec "$@"', "as-node"]


def torchrun_argv(nprocs: int, module_args: list[str], port: int, python: str = sys.executable) -> list[str]:
    """`python -m torch.distributed.run` with one process per slot on this host, running `-m MODULE ...`."""
    return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nprocs),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", *module_args]


def mpirun_argv(apps: list[App], port: int, *, as_root: bool, mpirun: str | None = None,
                exports: dict[str, str] | None = None) -> list[str]:
    """mpirun on this host only, rendezvous on loopback; several apps give different ranks
    different settings (MPMD)."""
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(exports or {})}
    apps = [App(a.np, a.argv, {**common, **a.env}) for a in apps]
    return launch_mpirun.mpirun_argv(mpirun or mpirun_path(), apps, host=f"localhost:{sum(a.np for a in apps)}",
                                     bind_to="none", oversubscribe=True, as_root=as_root)


def dscluster_train_module_args(config: str | None, overrides: list[str]) -> list[str]:
    """`dscluster train` as `-m dscluster train ...` (the same entry point the console script runs)."""
    return ["dscluster", "train", *(["--config", config] if config else []), *overrides]


@dataclass
class JobResult:
    """One launched job: exit status, wall time and where its log is."""

    argv: list[str]
    rc: int | None
    wall_s: float
    log: str
    timed_out: bool = False

    def tail(self, chars: int = 3000) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def run_job(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> JobResult:
    """Run one job to completion with its output in `log`; kill its process group on timeout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc, timed_out = None, True
    return JobResult(argv, rc, time.monotonic() - t0, str(log), timed_out)


@dataclass
class TrainFigures:
    """What one `dscluster train` run measured, from its run directory."""

    run_dir: str
    status: str
    world_size: int | None = None
    micro_batch: int | None = None
    micro_batches: list[int] | None = None
    global_batch: int | None = None
    precision: str | None = None
    images_per_s: float | None = None
    timed_steps: int = 0
    final_loss: float | None = None
    overflow_steps: int = 0
    peak_mem_mb: float | None = None
    error: str | None = None
    losses: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, seconds since rank 0's first step record, global-batch loss over all ranks)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("losses")
        return d


def _peak_mem(rm: RankMetrics) -> float | None:
    for rec in reversed([rm.start, *rm.steps, rm.end]):
        for key in ("peak_mem_mb", "max_memory_allocated_mb"):
            if rec and isinstance(rec.get(key), (int, float)):
                return float(rec[key])
    return None


def read_train_run(run_dir: Path) -> TrainFigures:
    """What a `dscluster train` run measured, read through `analysis.load` like every reader of
    a run directory. Throughput is the run's own (core/timing.py, via `analysis.stats`):
    wall-clock windows closed after the device sync, warm-up left out."""
    try:
        run = load_run(run_dir)
    except UsageError:
        return TrainFigures(str(run_dir), "missing", error=f"no metrics in {Path(run_dir) / METRICS_DIR}")
    summary = run.summary or {}
    ranks = [run.ranks[r] for r in sorted(run.ranks)]
    if not ranks:
        return TrainFigures(str(run_dir), summary.get("status", "missing"),
                            error=summary.get("error") or f"no metrics in {Path(run_dir) / METRICS_DIR}")
    starts = [rm.start or {} for rm in ranks]
    end = ranks[0].end or {}
    fig = TrainFigures(
        run_dir=str(run_dir),
        status=summary.get("status") or end.get("status") or "unknown",
        world_size=starts[0].get("world_size"),
        micro_batch=starts[0].get("micro_batch"),
        micro_batches=[s.get("micro_batch") for s in starts],
        global_batch=starts[0].get("global_batch"),
        precision=starts[0].get("precision"),
        error=summary.get("error") or end.get("error"),
        overflow_steps=overflow_counts(run)[0],
        peak_mem_mb=max((m for m in map(_peak_mem, ranks) if m is not None), default=None),
    )
    if ranks[0].steps:
        fig.losses = global_losses([rm.steps for rm in ranks], ranks[0].steps[0]["t"])
        fig.final_loss = fig.losses[-1][2] if fig.losses else None
    fig.images_per_s, fig.timed_steps = job_throughput(run)
    return fig


def global_losses(per_rank: list[list[dict]], t0: float) -> list[tuple[int, float, float]]:
    """Per step, the loss over the whole global batch: each rank's mean loss weighted by its samples.

    Rank 0's own loss covers only its share, which differs between uniform and balanced
    batching; the sample-weighted mean over all ranks is the same quantity in both, so the
    two runs' curves can be compared step by step. Time is rank 0's stamp since t0.
    """
    by_step: dict[int, list[tuple[float, int]]] = {}
    stamp: dict[int, float] = {}
    for rank, recs in enumerate(per_rank):
        for r in recs:
            if r.get("kind") != "step" or r.get("loss") is None:
                continue
            by_step.setdefault(r["step"], []).append((float(r["loss"]), int(r.get("samples") or 1)))
            if rank == 0:
                stamp[r["step"]] = r["t"] - t0
    out = []
    for step in sorted(stamp):
        parts = by_step[step]
        if len(parts) == len(per_rank):
            total = sum(n for _, n in parts)
            out.append((step, stamp[step], sum(loss * n for loss, n in parts) / total))
    return out


def time_to_loss(losses: list[tuple[int, float, float]], target: float, window: int = 5) -> float | None:
    """Seconds until the running mean of the last `window` losses first reaches `target`."""
    for i in range(len(losses)):
        recent = [loss for _, _, loss in losses[max(0, i - window + 1):i + 1]]
        if len(recent) == window and sum(recent) / window <= target:
            return losses[i][1]
    return None


def smoothed_final_loss(losses: list[tuple[int, float, float]], window: int = 5) -> float | None:
    if len(losses) < window:
        return None
    return sum(loss for _, _, loss in losses[-window:]) / window


def device_info(device: str) -> dict:
    """Card name and count, asked in a child process so this one never holds a CUDA context."""
    if device != "cuda":
        return {"device": "cpu", "device_name": platform.processor() or platform.machine(),
                "device_count": os.cpu_count(), "memory_gb": None}
    code = ("import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps({"
            "'device_name': torch.cuda.get_device_name(0), 'device_count': torch.cuda.device_count(), "
            "'memory_gb': round(p.total_memory / 2**30, 1), 'cuda': torch.version.cuda, "
            "'nccl': '.'.join(map(str, torch.cuda.nccl.version()))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return {"device": "cuda", "device_name": None, "device_count": 0, "error": out.stderr[-500:]}
    return {"device": "cuda", **json.loads(out.stdout.strip().splitlines()[-1])}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "timm", "dscluster"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if out["dscluster"] is None:  # run from a checkout on PYTHONPATH, not installed
        out["dscluster"] = __version__
    return out


def result_path(out_dir: Path, date: str, device_name: str | None, suffix: str = "") -> Path:
    """bench/results/<date>-<device>[suffix].json, never overwriting an earlier result."""
    slug = "".join(c if c.isalnum() else "-" for c in (device_name or "unknown")).strip("-").lower()
    while "--" in slug:
        slug = slug.replace("--", "-")
    base = f"{date}-{slug}{suffix}"
    path = out_dir / f"{base}.json"
    n = 2
    while path.exists():
        path = out_dir / f"{base}-{n}.json"
        n += 1
    return path


def child_env(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a job: CPU runs hide any GPU and use one thread per rank."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0

