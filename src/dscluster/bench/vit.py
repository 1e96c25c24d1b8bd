"""`dscluster bench vit`: dscluster's DeepSpeed training path vs plain PyTorch DDP, 1..N GPUs.

For each GPU count both paths train the same ViT on synthetic data with the same micro-batch, one
process per GPU, on the same cards, in one invocation. Reported per count: images/s, images/s per GPU,
scaling efficiency, MFU (bench/models.py), peak memory and the ratio dscluster ÷ baseline; with
`--repeat N`, the median of N alternating runs (docs/performance.md). The DeepSpeed path is `dscluster
train` itself with `micro_batch=auto`; the baseline then uses the micro-batch that auto-fit chose.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dscluster.bench import runner
from dscluster.bench.models import TINY_VITS, model_spec, peak_bf16_flops
from dscluster.errors import UsageError
from dscluster.files.fsutil import atomic_write_json


@dataclass
class VitBenchOptions:
    """Everything one `bench vit` invocation runs with (recorded in the result file)."""

    model: str = "vit_base_patch16_224"
    gpu_counts: list[int] = field(default_factory=lambda: [1])
    precision: str = "bf16"
    zero: int = 0
    compile: bool = False
    micro_batch: str = "auto"
    memory_cap_gb: float | None = None
    steps: int = 30
    warmup: int = 10
    repeat: int = 1
    device: str = "cuda"
    launcher: str = "torchrun"
    config: str | None = None
    baseline: bool = True
    baseline_compile: bool = True
    baseline_precision: str | None = None
    peak_tflops: float | None = None
    out: str = "bench/results"
    work_dir: str | None = None
    timeout_s: float = 1800.0
    train_overrides: list[str] = field(default_factory=list)


def model_overrides(model: str) -> list[str]:
    """`dscluster train` keys that select `model` on synthetic data of its own image size."""
    spec = model_spec(model)
    if model in TINY_VITS:
        kw = TINY_VITS[model]
        return ["model.name=vit_small_image", f"model.patch_size={kw['patch_size']}",
                f"model.embed_dim={kw['embed_dim']}", f"model.depth={kw['depth']}",
                f"model.num_heads={kw['num_heads']}", "data.dataset=synthetic", f"data.img_size={spec.img_size}",
                f"data.num_classes={spec.num_classes}", "data.augment=false"]
    return [f"model.name={model}", "data.dataset=synthetic", f"data.img_size={spec.img_size}",
            f"data.num_classes={spec.num_classes}", "data.augment=false"]


def synthetic_samples(total_steps: int, micro_batch: str | int, ranks: int, autofit_max: int = 1024) -> int:
    """Enough synthetic samples for one epoch to outlast the run (the sampler shuffles them all)."""
    micro = int(micro_batch) if str(micro_batch).isdigit() else autofit_max
    return (total_steps + 1) * micro * ranks


def train_overrides(opts: VitBenchOptions) -> list[str]:
    """The `dscluster train` key=value list for one benchmark run (no bench-only switches)."""
    total = opts.warmup + opts.steps
    ov = model_overrides(opts.model) + [
        f"micro_batch={opts.micro_batch}",
        f"precision={opts.precision}",
        f"zero_stage={opts.zero}",
        f"compile={'true' if opts.compile else 'false'}",
        f"max_steps={total}",
        "epochs=1",
        # One epoch longer than the run: no epoch-end eval or checkpoint inside the timing.
        f"data.synthetic_samples={synthetic_samples(total, opts.micro_batch, max(opts.gpu_counts))}",
        "checkpoint.every_epochs=0",
        "checkpoint.resume=false",
        "progress=false",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        f"log_every={log_every(opts)}",
    ]
    if opts.memory_cap_gb:
        ov.append(f"memory_cap_gb={opts.memory_cap_gb}")
    return ov + list(opts.train_overrides)


def log_every(opts: VitBenchOptions) -> int:
    """Host syncs only every L steps (no sync inside the step); L divides warmup and steps so the
    timed window starts and ends on a logged step (records are stamped when a window is flushed)."""
    return next(L for L in (10, 5, 2, 1) if opts.warmup % L == 0 and opts.steps % L == 0)


def ds_command(opts: VitBenchOptions, gpus: int, port: int) -> list[str]:
    module_args = runner.dscluster_train_module_args(opts.config, train_overrides(opts))
    if opts.launcher == "torchrun":
        return runner.torchrun_argv(gpus, module_args, port)
    ctx = runner.App(gpus, [sys.executable, "-m", *module_args])
    return runner.mpirun_argv([ctx], port, as_root=runner.is_root())


def baseline_command(opts: VitBenchOptions, gpus: int, micro_batch: int, out_json: Path, port: int) -> list[str]:
    args = ["dscluster.bench.ddp_baseline", "--model", opts.model, "--micro-batch", str(micro_batch),
            "--steps", str(opts.steps), "--warmup", str(opts.warmup),
            "--precision", opts.baseline_precision or opts.precision, "--device", opts.device,
            "--out", str(out_json)]
    if opts.baseline_compile:
        args.append("--compile")
    if opts.memory_cap_gb:
        args += ["--memory-cap-gb", str(opts.memory_cap_gb)]
    return runner.torchrun_argv(gpus, args, port)


def validate(opts: VitBenchOptions, device_count: int | None) -> None:
    if not opts.gpu_counts or any(g < 1 for g in opts.gpu_counts):
        raise UsageError(f"--gpus: need at least 1 GPU, got {opts.gpu_counts}")
    if opts.device == "cuda" and device_count is not None and max(opts.gpu_counts) > device_count:
        raise UsageError(f"--gpus {max(opts.gpu_counts)}: this machine has {device_count} GPU(s); "
                         f"use --gpus {device_count} or fewer")
    if opts.micro_batch != "auto" and not (opts.micro_batch.isdigit() and int(opts.micro_batch) > 0):
        raise UsageError(f"--micro-batch {opts.micro_batch!r}: give 'auto' or a positive whole number")
    if opts.repeat < 1:
        raise UsageError(f"--repeat {opts.repeat}: give 1 or more")
    if opts.steps < 2:
        raise UsageError(f"--steps {opts.steps}: at least 2 timed steps are needed for a rate")
    if opts.launcher not in runner.LAUNCHERS:
        raise UsageError(f"--launcher {opts.launcher!r}: one of {', '.join(runner.LAUNCHERS)}")


def _rates(figures: dict, gpus: int, one_gpu_rate: float | None, flops: float, peak: float | None) -> dict:
    rate = figures.get("images_per_s")
    if rate is None:
        return figures
    figures["images_per_s_per_gpu"] = rate / gpus
    figures["scaling_efficiency"] = rate / (gpus * one_gpu_rate) if one_gpu_rate else None
    figures["tflops"] = rate * flops / 1e12
    figures["mfu"] = rate * flops / (gpus * peak) if peak else None
    return figures


def _ds_run(opts: VitBenchOptions, gpus: int, work: Path, run_id: str) -> dict:
    env = runner.child_env(opts.device, {"DSCLUSTER_RUNS": str(work), "DSCLUSTER_RUN_ID": run_id})
    job = runner.run_job(ds_command(opts, gpus, runner.free_port()), env, work / f"{run_id}.log", opts.timeout_s)
    fig = runner.read_train_run(work / run_id).to_dict()
    fig.update(rc=job.rc, wall_s=round(job.wall_s, 1), log=job.log)
    if job.rc != 0 or fig.get("images_per_s") is None:
        fig["status"] = "failed"
        fig["error"] = fig.get("error") or ("timed out" if job.timed_out else job.tail(1500))
    return fig


def _baseline_run(opts: VitBenchOptions, gpus: int, micro: int, work: Path, name: str) -> dict:
    out_json = work / f"{name}.json"
    bjob = runner.run_job(baseline_command(opts, gpus, micro, out_json, runner.free_port()),
                          runner.child_env(opts.device), work / f"{name}.log", opts.timeout_s)
    base = {"status": "complete", "log": bjob.log, "wall_s": round(bjob.wall_s, 1)}
    if bjob.rc == 0 and out_json.is_file():
        base.update(json.loads(out_json.read_text()))
    else:
        base.update(status="failed", error="timed out" if bjob.timed_out else bjob.tail(1500))
    return base


def median_run(runs: list[dict]) -> dict:
    """The run with the median images/s (the lower middle one for an even count), with every run's
    rate attached; a failed run wins, so a failure is never hidden behind a repeat."""
    bad = [r for r in runs if r.get("status") == "failed" or r.get("images_per_s") is None]
    pick = bad[0] if bad else sorted(runs, key=lambda r: r["images_per_s"])[(len(runs) - 1) // 2]
    return {**pick, "repeats": [r.get("images_per_s") for r in runs]} if len(runs) > 1 else dict(pick)


def run(opts: VitBenchOptions) -> tuple[dict, Path]:
    """Run every GPU count with both paths (`repeat` times, alternating); write and return the result file."""
    info = runner.device_info(opts.device)
    validate(opts, info.get("device_count") if opts.device == "cuda" else None)
    spec = model_spec(opts.model)
    peak = opts.peak_tflops * 1e12 if opts.peak_tflops else (
        peak_bf16_flops(info.get("device_name")) if opts.device == "cuda" else None)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(opts.work_dir or f"runs/bench-vit-{stamp}").resolve()
    results: list[dict] = []
    ds_one = base_one = None
    for gpus in sorted(set(opts.gpu_counts)):
        row: dict = {"gpus": gpus}
        ds_runs: list[dict] = []
        base_runs: list[dict] = []
        micro = int(opts.micro_batch) if opts.micro_batch.isdigit() else None
        for r in range(opts.repeat):
            # alternating, so a drift of the host (clocks, neighbours) hits both paths alike
            suffix = f"-r{r + 1}" if r else ""
            ds_runs.append(_ds_run(opts, gpus, work, f"ds-g{gpus}{suffix}"))
            micro = ds_runs[0].get("micro_batch") or micro
            if opts.baseline and micro:
                base_runs.append(_baseline_run(opts, gpus, micro, work, f"baseline-g{gpus}{suffix}"))
        fig = median_run(ds_runs)
        if gpus == 1:
            ds_one = fig.get("images_per_s")
        row["dscluster"] = _rates(fig, gpus, ds_one, spec.train_flops_per_image, peak)
        if base_runs:
            base = median_run(base_runs)
            if gpus == 1:
                base_one = base.get("images_per_s")
            row["baseline"] = _rates(base, gpus, base_one, spec.train_flops_per_image, peak)
            ds_rate, base_rate = row["dscluster"].get("images_per_s"), base.get("images_per_s")
            row["ratio"] = ds_rate / base_rate if ds_rate and base_rate else None
            pairs = [(d.get("images_per_s"), b_.get("images_per_s")) for d, b_ in zip(ds_runs, base_runs, strict=True)]
            if len(pairs) > 1:
                row["ratios"] = [d / b_ if d and b_ else None for d, b_ in pairs]
        elif opts.baseline:
            row["baseline"] = {"status": "skipped", "error": "no micro-batch: the dscluster run did not report one"}
        results.append(row)
    doc = {
        "bench": "vit",
        "date": time.strftime("%Y-%m-%d"),
        "created": time.time(),
        **info,
        "versions": runner.versions(),
        "options": asdict(opts),
        "model": opts.model,
        "train_flops_per_image": spec.train_flops_per_image,
        "flops_source": spec.flops_source,
        "peak_bf16_flops": peak,
        "work_dir": str(work),
        "results": results,
    }
    path = runner.result_path(Path(opts.out), doc["date"], info.get("device_name") if opts.device == "cuda" else "cpu")
    atomic_write_json(path, doc)
    return doc, path


def failed(doc: dict) -> bool:
    return any(row.get(p, {}).get("status") == "failed" for row in doc["results"] for p in ("dscluster", "baseline"))


def table_rows(doc: dict) -> list[list[str]]:
    """Compact table: one line per GPU count and path."""

    rows = []
    for row in doc["results"]:
        for path in ("dscluster", "baseline"):
            f = row.get(path)
            if not f:
                continue
            rows.append([
                str(row["gpus"]), path, f.get("status", ""), runner.cell(f.get("micro_batch"), "d"),
                runner.cell(f.get("images_per_s"), ",.1f"), runner.cell(f.get("images_per_s_per_gpu"), ",.1f"),
                runner.cell(f.get("scaling_efficiency") and 100 * f["scaling_efficiency"], ".1f"),
                runner.cell(f.get("mfu") and 100 * f["mfu"], ".1f"),
                runner.cell(f.get("peak_mem_mb") and f["peak_mem_mb"] / 1024, ".1f"),
                runner.cell(row.get("ratio"), ".3f") if path == "dscluster" else "",
            ])
    return rows


TABLE_HEADER = ["gpus", "path", "status", "micro", "img/s", "img/s/gpu", "scaling %", "MFU %", "peak GiB",
                "ds/base"]
