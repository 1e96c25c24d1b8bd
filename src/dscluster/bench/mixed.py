"""`dscluster bench balanced`: uniform vs balanced batches on ranks of unequal speed.

The heterogeneity is real, not simulated. busy-gpu: one GPU also runs another process's matrix products
(a busy neighbour, bench/gpu_load), so its rank gets part of the card. share-gpu: more ranks than devices
(CPU/gloo only: NCCL refuses two ranks of one communicator on one GPU, NVIDIA/nccl#418). memory-cap:
`--memory-cap-gb` on one rank. Each scenario runs `dscluster train` twice with the same global batch,
uniform then balanced, and reports images/s, the speed-up and the time each run needs to reach the loss
both reach (balanced batching keeps the update the global-batch mean, so the loss curves should match).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dscluster.bench import runner
from dscluster.bench.vit import model_overrides, synthetic_samples
from dscluster.errors import UsageError
from dscluster.files.fsutil import atomic_write_json


@dataclass
class MixedBenchOptions:
    """One `bench balanced` invocation (recorded in the result file)."""

    model: str = "vit_base_patch16_224"
    ranks: int = 5
    gpus: int = 4
    micro_batch: int = 64
    precision: str = "bf16"
    steps: int = 60
    warmup: int = 10
    device: str = "cuda"
    memory_cap_gb: float | None = None
    capped_rank: int = 0
    scenarios: list[str] = field(default_factory=lambda: ["busy-gpu"])
    busy_gpu: int | None = None
    """GPU that gets the busy neighbour (default: the last one used)."""
    target_loss: float | None = None
    config: str | None = None
    out: str = "bench/results"
    work_dir: str | None = None
    timeout_s: float = 1800.0
    train_overrides: list[str] = field(default_factory=list)


SCENARIOS = ("busy-gpu", "share-gpu", "memory-cap")


def validate(opts: MixedBenchOptions, device_count: int | None) -> None:
    unknown = [s for s in opts.scenarios if s not in SCENARIOS]
    if unknown or not opts.scenarios:
        raise UsageError(f"--scenario {unknown or opts.scenarios}: choose from {', '.join(SCENARIOS)}")
    if opts.device == "cuda" and "share-gpu" in opts.scenarios and opts.ranks > opts.gpus:
        raise UsageError(
            f"--scenario share-gpu with {opts.ranks} ranks on {opts.gpus} GPUs: NCCL refuses two ranks of one job on "
            "one GPU ('Duplicate GPU detected'); use --scenario busy-gpu (a neighbour process halves one GPU)"
        )
    if opts.device == "cpu" and "busy-gpu" in opts.scenarios:
        raise UsageError("--scenario busy-gpu needs GPUs; on --device cpu use --scenario share-gpu")
    if opts.busy_gpu is not None and not 0 <= opts.busy_gpu < opts.gpus:
        raise UsageError(f"--busy-gpu {opts.busy_gpu}: must be one of the GPUs used, 0..{opts.gpus - 1}")
    if opts.ranks < 2 or opts.gpus < 1:
        raise UsageError(f"--ranks {opts.ranks} --gpus {opts.gpus}: need at least 2 ranks and 1 GPU")
    if opts.device == "cuda" and device_count is not None and opts.gpus > device_count:
        raise UsageError(f"--gpus {opts.gpus}: this machine has {device_count} GPU(s)")
    if "memory-cap" in opts.scenarios and not opts.memory_cap_gb:
        raise UsageError("--scenario memory-cap needs --memory-cap-gb (e.g. 8 for an RTX 3070-sized rank)")
    if not 0 <= opts.capped_rank < max(opts.gpus, 2):
        raise UsageError(f"--capped-rank {opts.capped_rank}: must be a rank of the memory-cap scenario")
    if opts.steps < 2 or opts.micro_batch < 1:
        raise UsageError(f"--steps {opts.steps} / --micro-batch {opts.micro_batch}: need ≥ 2 steps and ≥ 1 sample")


def train_overrides(opts: MixedBenchOptions, batching: str, scenario: str = "busy-gpu") -> list[str]:
    total = opts.warmup + opts.steps
    micro = [f"micro_batch={opts.micro_batch}"]
    if scenario == "memory-cap" and batching == "uniform":
        # What uniform batching can do beside a small card: auto-fit to the smallest card and
        # keep the same global batch by accumulation (micro_batch itself may not fit there).
        ranks = scenario_layout(opts, scenario)[0]
        micro = ["micro_batch=auto", f"global_batch={ranks * opts.micro_batch}"]
    return model_overrides(opts.model) + [
        f"batching={batching}",
        *micro,
        f"precision={opts.precision}",
        f"max_steps={total}",
        "epochs=1",
        # Balanced shares never exceed ranks × micro_batch in total per step.
        f"data.synthetic_samples={synthetic_samples(total, opts.micro_batch, max(opts.ranks, opts.gpus))}",
        "checkpoint.every_epochs=0",
        "checkpoint.resume=false",
        "progress=false",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "log_every=1",  # the loss curve is part of the result
    ] + list(opts.train_overrides)


def scenario_layout(opts: MixedBenchOptions, scenario: str) -> tuple[int, int, dict[int, list[str]]]:
    """(ranks, gpus, per-rank extra overrides) of a scenario."""
    if scenario == "share-gpu":
        return opts.ranks, opts.gpus, {}
    if scenario == "busy-gpu":
        return max(opts.gpus, 2), opts.gpus, {}
    ranks = max(opts.gpus, 2) if opts.device == "cuda" else opts.ranks
    return ranks, opts.gpus, {opts.capped_rank: [f"memory_cap_gb={opts.memory_cap_gb}"]}


def command(opts: MixedBenchOptions, scenario: str, batching: str, port: int) -> tuple[list[str], dict[str, str]]:
    """mpirun command (one context per distinct per-rank setting) and the extra environment."""
    ranks, gpus, extra = scenario_layout(opts, scenario)
    base = runner.dscluster_train_module_args(opts.config, train_overrides(opts, batching, scenario))
    contexts: list[runner.App] = []
    for rank in range(ranks):
        argv = [sys.executable, "-m", *base, *extra.get(rank, [])]
        if contexts and contexts[-1].argv == argv:
            contexts[-1] = runner.App(contexts[-1].np + 1, argv)
        else:
            contexts.append(runner.App(1, argv))
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))} if opts.device == "cuda" else {}
    argv = runner.mpirun_argv(contexts, port, as_root=runner.is_root(), exports=env)
    return argv, env


@contextlib.contextmanager
def busy_neighbour(opts: MixedBenchOptions, scenario: str, log: Path):
    """Run bench/gpu_load on the busy GPU for the duration of the block (busy-gpu scenario only)."""
    if scenario != "busy-gpu":
        yield None
        return
    gpu = opts.gpus - 1 if opts.busy_gpu is None else opts.busy_gpu
    env = runner.child_env("cuda", {"CUDA_VISIBLE_DEVICES": str(gpu)})
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dscluster.bench.gpu_load", "--seconds", str(opts.timeout_s)],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(opts: MixedBenchOptions) -> tuple[dict, Path]:
    info = runner.device_info(opts.device)
    validate(opts, info.get("device_count") if opts.device == "cuda" else None)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(opts.work_dir or f"runs/bench-balanced-{stamp}").resolve()
    scenarios = []
    for scenario in opts.scenarios:
        runs = {}
        for batching in ("uniform", "balanced"):
            run_id = f"{scenario}-{batching}"
            argv, extra_env = command(opts, scenario, batching, runner.free_port())
            env = runner.child_env(opts.device, {"DSCLUSTER_RUNS": str(work), "DSCLUSTER_RUN_ID": run_id,
                                                 **extra_env})
            with busy_neighbour(opts, scenario, work / f"{run_id}-gpu_load.log"):
                job = runner.run_job(argv, env, work / f"{run_id}.log", opts.timeout_s)
            fig = runner.read_train_run(work / run_id)
            d = fig.to_dict()
            d.update(rc=job.rc, wall_s=round(job.wall_s, 1), log=job.log,
                     smoothed_final_loss=runner.smoothed_final_loss(fig.losses))
            if job.rc != 0 or fig.images_per_s is None:
                d["status"] = "failed"
                d["error"] = d.get("error") or ("timed out" if job.timed_out else job.tail(1500))
            runs[batching] = (d, fig.losses)
        scenarios.append(compare(scenario, scenario_layout(opts, scenario)[:2], runs, opts.target_loss))
    doc = {
        "bench": "balanced",
        "date": time.strftime("%Y-%m-%d"),
        "created": time.time(),
        **info,
        "versions": runner.versions(),
        "options": asdict(opts),
        "work_dir": str(work),
        "scenarios": scenarios,
    }
    path = runner.result_path(Path(opts.out), doc["date"], info.get("device_name") if opts.device == "cuda" else "cpu",
                              "-balanced")
    atomic_write_json(path, doc)
    return doc, path


def compare(name: str, layout: tuple[int, int], runs: dict, target_loss: float | None) -> dict:
    """Speed-up and time to a common loss for one scenario's uniform/balanced pair."""
    (uniform, uniform_losses), (balanced, balanced_losses) = runs["uniform"], runs["balanced"]
    out = {"scenario": name, "ranks": layout[0], "gpus": layout[1], "uniform": uniform, "balanced": balanced}
    if uniform.get("images_per_s") and balanced.get("images_per_s"):
        out["speedup"] = balanced["images_per_s"] / uniform["images_per_s"]
    finals = [x for x in (uniform.get("smoothed_final_loss"), balanced.get("smoothed_final_loss")) if x is not None]
    target = target_loss if target_loss is not None else (max(finals) if len(finals) == 2 else None)
    out["target_loss"] = target
    if target is not None:
        uniform["time_to_target_s"] = runner.time_to_loss(uniform_losses, target)
        balanced["time_to_target_s"] = runner.time_to_loss(balanced_losses, target)
        if uniform["time_to_target_s"] and balanced["time_to_target_s"]:
            out["time_to_target_ratio"] = uniform["time_to_target_s"] / balanced["time_to_target_s"]
    # Same global batch at every step (one shared order), so the global-batch loss per step
    # should agree up to float noise: report the largest gap over the steps both logged.
    uniform_curve = {s: loss for s, _, loss in uniform_losses}
    balanced_curve = {s: loss for s, _, loss in balanced_losses}
    common = sorted(set(uniform_curve) & set(balanced_curve))
    if common:
        gaps = {s: abs(uniform_curve[s] - balanced_curve[s]) for s in common}
        out["loss_curve_max_abs_diff"] = max(gaps.values())
        out["loss_curve_max_rel_diff"] = max(gaps[s] / max(abs(uniform_curve[s]), 1e-12) for s in common)
    return out


def failed(doc: dict) -> bool:
    return any(s[b].get("status") == "failed" for s in doc["scenarios"] for b in ("uniform", "balanced"))


TABLE_HEADER = ["scenario", "ranks/gpus", "batching", "status", "micro", "img/s", "speed-up", "t→loss s",
                "final loss"]


def table_rows(doc: dict) -> list[list[str]]:
    rows = []
    for s in doc["scenarios"]:
        for batching in ("uniform", "balanced"):
            f = s[batching]
            micro = f.get("micro_batches") or []
            where = s["gpus"] if doc.get("device") == "cuda" else "cpu"
            rows.append([
                s["scenario"], f"{s['ranks']}/{where}", batching, f.get("status", ""),
                "/".join(str(m) for m in micro) if micro else "-",
                runner.cell(f.get("images_per_s"), ",.1f"),
                runner.cell(s.get("speedup"), ".2f") + "x" if batching == "balanced" and s.get("speedup") else "",
                runner.cell(f.get("time_to_target_s"), ".1f"), runner.cell(f.get("smoothed_final_loss"), ".4f"),
            ])
    return rows
