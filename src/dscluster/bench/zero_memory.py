"""`python bench/zero_memory.py`: what each ZeRO stage, and ZeRO-Offload, saves of a rank's GPU memory.

On one GPU host it runs the README's own command once a setting (zero_stage 0 to 3, and 3 with
offload_optimizer=cpu, on 1 and 2 GPUs) and reads each run's peak GPU and host memory and img/s
through analysis.load; the stage-0 run of the same GPU count is the baseline of the others. What the
runs leave out, and why, is in docs/performance.md.

    python bench/zero_memory.py                      # every stage on 1 and 2 GPUs
    python bench/zero_memory.py --dry-run            # the commands, nothing run or written
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dscluster.analysis.load import load_run
from dscluster.bench import runner
from dscluster.errors import UsageError
from dscluster.files import paths
from dscluster.files.fsutil import atomic_write_json
from dscluster.launch.mpirun import App, mpirun_argv, mpirun_path

SETTINGS = (("zero0", 0, "none"), ("zero1", 1, "none"), ("zero2", 2, "none"), ("zero3", 3, "none"),
            ("zero3-offload", 3, "cpu"))
"""(name, zero_stage, offload_optimizer) of the runs, in the order they run (stage 0 first: the baseline)."""
MIN_RUN_S = 25.0
"""What each run still to come keeps of --timeout: one run may not eat the others' start-ups."""


@dataclass
class Options:
    config: str = "configs/vit_base.yaml"
    precision: str = "fp16"
    micro_batch: int = 32
    """Per rank; the vit_base preset's note: 8 GB cards ran out of memory at 64."""
    steps: int = 30
    gpus: list[int] | None = None
    """GPU counts to run on; None: 1 and 2, those the host has."""
    out: str = "bench/results"
    work_dir: str | None = None
    timeout_s: float = 340.0
    dry_run: bool = False
    train_args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    name: str
    gpus: int
    zero_stage: int
    offload: str

    @property
    def run_id(self) -> str:
        return f"{self.name}-{self.gpus}gpu"


def plan_runs(gpu_counts: list[int]) -> list[Run]:
    """Every setting on each GPU count, stage 0 first within a count."""
    return [Run(name, n, stage, off) for n in gpu_counts for name, stage, off in SETTINGS]


def train_overrides(run: Run, opts: Options) -> list[str]:
    """The README command's arguments for one run (after entry_cn.sh)."""
    return ["--config", opts.config, f"precision={opts.precision}", f"zero_stage={run.zero_stage}",
            *([f"offload_optimizer={run.offload}"] if run.offload != "none" else []),
            f"micro_batch={opts.micro_batch}", f"global_batch={opts.micro_batch * run.gpus}", "grad_accum=1",
            f"max_steps={opts.steps}", "epochs=1",
            f"data.synthetic_samples={(opts.steps + 1) * opts.micro_batch * run.gpus}",  # one epoch holds the steps
            "compile=false", "checkpoint.every_epochs=0", "checkpoint.every_steps=0", "checkpoint.resume=false",
            "progress=false", *opts.train_args]


def command(run: Run, opts: Options, hostfile: Path, *, as_root: bool) -> list[str]:
    return mpirun_argv(mpirun_path(sys.executable), [App(run.gpus, [str(paths.entry_script()),
                                                                    *train_overrides(run, opts)])],
                       hostfile=str(hostfile), as_root=as_root)


def figures(run_dir: Path, job: runner.JobResult) -> dict:
    """One run's figures from its run directory (analysis.load), each rank's peaks beside the largest."""

    fig = runner.read_train_run(run_dir)
    ends: dict[int, dict] = {}
    if fig.status != "missing":
        run = load_run(run_dir)
        ends = {r: run.ranks[r].end or {} for r in sorted(run.ranks)}
    gpu = [e.get("peak_mem_mb") for e in ends.values()]
    host = [e.get("peak_host_mb") for e in ends.values()]
    status = "timeout" if job.timed_out else fig.status
    return {"status": status, "peak_mem_mb": fig.peak_mem_mb, "peak_mem_mb_by_rank": gpu,
            "peak_host_mb": max((h for h in host if h is not None), default=None), "peak_host_mb_by_rank": host,
            "images_per_s": fig.images_per_s, "timed_steps": fig.timed_steps, "micro_batch": fig.micro_batch,
            "global_batch": fig.global_batch, "precision": fig.precision, "wall_s": round(job.wall_s, 1),
            "run_dir": str(run_dir), "log": job.log,
            **({"error": fig.error or job.tail(1500)} if status != "complete" else {})}


def against_baseline(results: list[dict]) -> None:
    """Each run beside the stage-0 run of its GPU count: MiB and percent of GPU memory saved, img/s ratio."""
    base = {r["gpus"]: r for r in results if r["zero_stage"] == 0 and r["offload"] == "none"}
    for r in results:
        b = base.get(r["gpus"], {})
        mem, b_mem = r.get("peak_mem_mb"), b.get("peak_mem_mb")
        ips, b_ips = r.get("images_per_s"), b.get("images_per_s")
        r["saved_mb"] = round(b_mem - mem, 1) if mem and b_mem else None
        r["saved_percent"] = round(100 * (b_mem - mem) / b_mem, 1) if mem and b_mem else None
        r["images_per_s_vs_zero0"] = round(ips / b_ips, 3) if ips and b_ips else None


def gpu_counts(opts: Options, info: dict) -> list[int]:
    have = int(info.get("device_count") or 0)
    if opts.gpus is not None:
        too_many = [n for n in opts.gpus if n > have]
        if too_many:
            raise UsageError(f"--gpus {','.join(map(str, opts.gpus))}: this host has {have} GPU(s)")
        return list(opts.gpus)
    if not have:
        raise UsageError(f"no CUDA GPU here ({info.get('error', 'torch sees none')}); --dry-run prints the commands")
    return [n for n in (1, 2) if n <= have]


def run_all(opts: Options) -> tuple[dict, Path | None]:
    deadline = time.monotonic() + opts.timeout_s
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(opts.work_dir or f"runs/bench-zero-memory-{stamp}").absolute()
    info = {} if opts.dry_run else runner.device_info("cuda")
    counts = (opts.gpus or [1, 2]) if opts.dry_run else gpu_counts(opts, info)
    runs, results = plan_runs(counts), []
    for i, run in enumerate(runs):
        hostfile = work / f"hosts{run.gpus}.txt"
        argv = command(run, opts, hostfile, as_root=os.geteuid() == 0)
        env = {"DSCLUSTER_RUNS": str(work / "runs"), "DSCLUSTER_RUN_ID": run.run_id}
        if opts.dry_run:
            print(f"# {run.run_id}: {hostfile} holds 'localhost slots={run.gpus}'")
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
            continue
        hostfile.parent.mkdir(parents=True, exist_ok=True)
        hostfile.write_text(f"localhost slots={run.gpus}\n")
        budget = deadline - time.monotonic() - MIN_RUN_S * (len(runs) - i - 1)
        entry = {**asdict(run), "run_id": run.run_id, "argv": argv}
        if budget < MIN_RUN_S:
            results.append({**entry, "status": "not run", "error": f"{budget:.0f} s of --timeout left for it"})
            continue
        print(f"bench zero-memory: {run.run_id} ({budget:.0f} s at most)", flush=True)
        job = runner.run_job(argv, runner.child_env("cuda", env), work / f"{run.run_id}.log", timeout=budget)
        results.append({**entry, **figures(work / "runs" / run.run_id, job)})
        r = results[-1]
        print(f"bench zero-memory: {run.run_id}: {r['status']}, peak {runner.cell(r['peak_mem_mb'], '.0f')} MiB, "
              f"{runner.cell(r['images_per_s'], '.0f')} img/s, {r['wall_s']} s", flush=True)
    if opts.dry_run:
        return {}, None
    against_baseline(results)
    card = info.get("device_name")
    doc = {"bench": "zero-memory", "date": time.strftime("%Y-%m-%d"), "created": time.time(), "card": card, **info,
           "baseline": {str(r["gpus"]): r["run_id"] for r in results if r["zero_stage"] == 0},
           "runs": results, "options": asdict(opts), "versions": runner.versions(), "work_dir": str(work)}
    path = runner.result_path(Path(opts.out), doc["date"], card, suffix="-zero-memory")
    atomic_write_json(path, doc)
    return doc, path


def table(doc: dict) -> str:
    """The result as docs/training-config.md keeps it: a row per GPU count, a column per setting; each cell
    the peak MiB (the largest rank's), what it saves against zero0 of that row, and img/s."""
    names = [name for name, _, _ in SETTINGS]
    rows = ["| GPUs | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for gpus in sorted({r["gpus"] for r in doc["runs"]}):
        by_name = {r["name"]: r for r in doc["runs"] if r["gpus"] == gpus}
        cells = []
        for name in names:
            r = by_name.get(name, {})
            saved = "" if not r.get("saved_percent") else f" ({-r['saved_percent']:+.0f} %)"  # -25 %: a quarter less
            cells.append(f"{runner.cell(r.get('peak_mem_mb'), ',.0f')} MiB{saved}, "
                         f"{runner.cell(r.get('images_per_s'), ',.0f')} img/s" if r.get("peak_mem_mb") else
                         r.get("status", "-"))
        rows.append(f"| {gpus} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(prog="python bench/zero_memory.py", description=__doc__.split("\n")[0],
                                epilog="arguments after -- go to every run's `dscluster train`")
    p.add_argument("--config", default=d.config, help=f"training preset (default {d.config})")
    p.add_argument("--precision", default=d.precision, help=f"default {d.precision}")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help=f"per rank (default {d.micro_batch})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"steps per run (default {d.steps})")
    p.add_argument("--gpus", help="GPU counts, e.g. 1,2 (default: 1 and 2, those the host has)")
    p.add_argument("--out", default=d.out, help=f"result folder (default {d.out})")
    p.add_argument("--work-dir", help="run directories and logs (default runs/bench-zero-memory-<time>)")
    p.add_argument("--timeout", type=float, default=d.timeout_s,
                   help=f"seconds for everything (default {d.timeout_s:.0f})")
    p.add_argument("--dry-run", action="store_true", help="print the commands; run and write nothing")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- KEY=VALUE ... for every run")
    a = p.parse_args(argv)
    try:
        gpus = [int(g) for g in a.gpus.split(",")] if a.gpus else None
    except ValueError:
        p.error(f"--gpus {a.gpus!r}: GPU counts separated by commas, e.g. 1,2")
    if a.steps < 6 or a.micro_batch < 1 or a.timeout <= 0 or (gpus is not None and min(gpus) < 1):
        p.error("--steps >= 6 (5 are warm-up), --micro-batch >= 1, --gpus >= 1 and --timeout > 0")
    extra = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    return Options(config=a.config, precision=a.precision, micro_batch=a.micro_batch, steps=a.steps, gpus=gpus,
                   out=a.out, work_dir=a.work_dir, timeout_s=a.timeout, dry_run=a.dry_run, train_args=list(extra))


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        doc, path = run_all(opts)
    except UsageError as e:
        print(f"bench zero-memory: {e}", file=sys.stderr)
        return 2
    if path is None:
        return 0
    print(table(doc))
    print(json.dumps({"card": doc["card"], "date": doc["date"], "baseline": doc["baseline"]}))
    print(f"bench zero-memory: result {path}")
    return 0 if all(r.get("status") == "complete" for r in doc["runs"]) else 1
