"""`python bench/imagefolder.py`: training img/s from an ImageFolder of JPEGs against synthetic data.

It writes an ImageFolder of generated, photo-like JPEGs on this host (no download), then runs the
README's own command twice on one GPU: on synthetic data (what the model alone can do) and on the
folder (decoded by the loader workers, core/loader.py). Both figures are summary.json's images_per_s,
the one throughput definition (core/timing.py). The method is in docs/performance.md.

    python bench/imagefolder.py                                        # on a GPU host
    python bench/imagefolder.py --device cpu --config configs/digits.yaml --classes 10 --image-size 24 \
        --steps 12 --micro-batch 16 --precision fp32 --out /tmp/x      # the plumbing, on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dscluster import core
from dscluster.bench import runner
from dscluster.errors import UsageError
from dscluster.files import paths
from dscluster.files.fsutil import atomic_write_json, read_jsonl
from dscluster.launch.mpirun import App, mpirun_argv, mpirun_path
from dscluster.rundir.layout import METRICS_DIR, SUMMARY_FILE

TARGET_RATIO = 0.9
"""The goal: real data at no less than 0.9× the synthetic-data throughput on one GPU."""
MARKER = "bench-folder.json"
"""Written last into a generated folder: what it holds, so a later call reuses it."""


@dataclass
class Options:
    config: str = "configs/vit_base.yaml"
    precision: str = "fp16"
    steps: int = 60
    micro_batch: str = "256"
    """The micro-batch of both runs (a number, or auto: the memory fit, which costs probes)."""
    classes: int = 1000
    image_size: int = 256
    """Side of the generated JPEGs; the loader resizes them to the config's data.img_size."""
    quality: int = 90
    workers: int | None = None
    """data.workers of the folder run (None: its default, the node's CPUs up to 8)."""
    data_dir: str | None = None
    work_dir: str | None = None
    out: str = "bench/results"
    timeout_s: float = 290.0
    device: str = "cuda"
    train_args: list[str] = field(default_factory=list)


# --- the folder ---------------------------------------------------------------------------------

def images_per_class(global_batch: int, steps: int, classes: int) -> int:
    """Enough for `steps` whole global batches and one more, so the run ends inside its first epoch."""
    return max(1, math.ceil((steps + 1) * global_batch / classes))


def photo_like(index: int, cls: int, size: int) -> np.ndarray:
    """A size×size RGB image that compresses like a photo: smooth shapes around a class colour, then grain."""
    from PIL import Image  # Pillow: loads only where images are written

    rng = np.random.default_rng(index)
    colour = np.random.default_rng(cls).integers(40, 216, 3)
    coarse = np.clip(colour + rng.normal(0, 60, (6, 6, 3)), 0, 255).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), dtype=np.float32)
    grain = rng.standard_normal(smooth.shape, dtype=np.float32) * 10
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


def _write_images(job: tuple[Path, int, int, int, int, int]) -> int:
    root, cls, first, count, size, quality = job
    from PIL import Image  # Pillow: as in photo_like

    written = 0
    folder = root / f"n{cls:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + count):
        path = folder / f"img{i:06d}.jpg"
        Image.fromarray(photo_like(cls * 1_000_003 + i, cls, size)).save(path, quality=quality)
        written += path.stat().st_size
    return written


def build_folder(root: Path, classes: int, per_class: int, size: int, quality: int) -> dict:
    """root/train/<class>/<image>.jpg (train/ alone: no held-out split, no evaluation in the timing)."""
    want = {"classes": classes, "per_class": per_class, "image_size": size, "quality": quality}
    marker = root / MARKER
    if marker.is_file():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want} == want:
            return {**have, "reused": True, "seconds": 0.0}
    t0 = time.monotonic()
    train = root / "train"
    jobs = [(train, c, 0, per_class, size, quality) for c in range(classes)]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        total = sum(pool.map(_write_images, jobs, chunksize=max(1, classes // (4 * (os.cpu_count() or 1)))))
    doc = {**want, "images": classes * per_class, "bytes": total, "format": "JPEG",
           "seconds": round(time.monotonic() - t0, 1)}
    atomic_write_json(marker, doc)
    return {**doc, "reused": False}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# --- the two runs --------------------------------------------------------------------------------

def train_argv(mpirun: str, hostfile: Path, opts: Options, data_args: list[str], *, as_root: bool) -> list[str]:
    """The README command on one GPU, bounded to `opts.steps` steps, with this run's data."""
    program = [str(paths.entry_script()), "--config", opts.config, f"precision={opts.precision}",
               f"micro_batch={opts.micro_batch}", f"max_steps={opts.steps}", "epochs=1",
               "checkpoint.every_epochs=0", "checkpoint.every_steps=0", "checkpoint.resume=false",
               *data_args, *opts.train_args]
    return mpirun_argv(mpirun, [App(1, program)], hostfile=str(hostfile), as_root=as_root)


def data_args(kind: str, opts: Options, folder: Path, samples: int) -> list[str]:
    if kind == "synthetic":
        return ["data.dataset=synthetic", f"data.synthetic_samples={samples}", f"data.num_classes={opts.classes}"]
    workers = [] if opts.workers is None else [f"data.workers={opts.workers}"]
    return ["data.dataset=imagefolder", f"data.path={folder}", *workers]


def second_half_rate(run_dir: Path) -> float | None:
    """img/s of the run's second half alone, from rank 0's step records (one rank: its samples are the
    global batch). The loader's queue was filled while the first steps compiled; were the loader slower
    than the GPU, the queue would carry the first timed steps and only the later ones would show it."""
    records = read_jsonl(run_dir / METRICS_DIR / "rank-0.jsonl") if (run_dir / METRICS_DIR).is_dir() else []
    steps = [r for r in records if r.get("kind") == "step" and r.get("step_time")]
    late = [r for r in steps if r["step"] > (steps[-1]["step"] if steps else 0) / 2]
    seconds = sum(r["step_time"] for r in late)
    return sum(r["samples"] for r in late) / seconds if late and seconds > 0 else None


def read_run(run_dir: Path, job: runner.JobResult) -> dict:
    summary = json.loads((run_dir / SUMMARY_FILE).read_text()) if (run_dir / SUMMARY_FILE).is_file() else {}
    notes = [line.split("dscluster train: ", 1)[1] for line in job.tail(200_000).splitlines()
             if "dscluster train: data:" in line]
    status = "timeout" if job.timed_out else summary.get("status") or f"exit {job.rc}"
    return {"status": status, "images_per_s": summary.get("images_per_s"), "timed_steps": summary.get("timed_steps"),
            "second_half_images_per_s": second_half_rate(run_dir),
            "global_batch": summary.get("global_batch"), "steps": summary.get("steps"), "wall_s": round(job.wall_s, 1),
            "run_dir": str(run_dir), "log": job.log, "loader_notes": notes, "argv": job.argv,
            **({"error": summary.get("error") or job.tail(1500)} if status != "complete" else {})}


def global_batch_of(opts: Options) -> int:
    # entry_cn.sh reads a relative --config that is not here as the checkout's preset: so does this
    config = opts.config if Path(opts.config).exists() else paths.assets_root() / opts.config
    cfg = core.load_config(config, [f"precision={opts.precision}", f"micro_batch={opts.micro_batch}", *opts.train_args])
    if cfg.global_batch:
        return cfg.global_batch
    if str(cfg.micro_batch).isdigit():
        return int(cfg.micro_batch) * (cfg.grad_accum or 1)
    raise UsageError(f"{opts.config}: micro_batch=auto without a global_batch: the folder's size depends on the "
                     "batch; pass --micro-batch N or global_batch=N after --")


def run(opts: Options) -> tuple[dict, Path]:
    deadline = time.monotonic() + opts.timeout_s

    info = runner.device_info(opts.device)
    if opts.device == "cuda" and not info.get("device_count"):
        raise UsageError(f"no CUDA GPU here ({info.get('error', 'torch sees none')}); on a CPU use --device cpu")
    global_batch = global_batch_of(opts)
    per_class = images_per_class(global_batch, opts.steps, opts.classes)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(opts.work_dir or f"runs/bench-imagefolder-{stamp}").absolute()
    folder = Path(opts.data_dir or f"runs/bench-imagefolder-data/{opts.classes}x{per_class}-{opts.image_size}px")
    folder = folder.absolute()
    print(f"bench imagefolder: {opts.classes} classes x {per_class} JPEGs of {opts.image_size}px in {folder}",
          flush=True)
    made = build_folder(folder, opts.classes, per_class, opts.image_size, opts.quality)
    print(f"bench imagefolder: folder {'reused' if made['reused'] else 'written'} "
          f"({made['images']} images, {made['bytes'] / 2**20:.0f} MiB, {made['seconds']} s)", flush=True)
    hostfile = work / "localhost.txt"
    hostfile.parent.mkdir(parents=True, exist_ok=True)
    hostfile.write_text("localhost slots=1\n")
    mpirun = mpirun_path(sys.executable)
    runs: dict[str, dict] = {}
    for i, kind in enumerate(("synthetic", "imagefolder")):
        left = deadline - time.monotonic()
        budget = left / (2 - i)  # the first run may not eat the second one's time
        if budget < 20:
            runs[kind] = {"status": "not run", "error": f"{left:.0f} s of --timeout left"}
            continue
        run_id = f"{kind}-{stamp}"
        data = data_args(kind, opts, folder / "train", (opts.steps + 1) * global_batch)
        argv = train_argv(mpirun, hostfile, opts, data, as_root=os.geteuid() == 0)
        env = runner.child_env(opts.device, {"DSCLUSTER_RUNS": str(work / "runs"), "DSCLUSTER_RUN_ID": run_id})
        print(f"bench imagefolder: {kind} run ({budget:.0f} s at most): {' '.join(argv)}", flush=True)
        job = runner.run_job(argv, env, work / f"{kind}.log", timeout=budget)
        runs[kind] = read_run(work / "runs" / run_id, job)
        print(f"bench imagefolder: {kind}: {runs[kind]['status']}, {runner.cell(runs[kind]['images_per_s'], '.1f')} "
              f"img/s in {runs[kind]['wall_s']} s", flush=True)
    synthetic = runs["synthetic"].get("images_per_s")
    real = runs["imagefolder"].get("images_per_s")

    card = info.get("device_name") if opts.device == "cuda" else "cpu"
    doc = {
        "bench": "imagefolder", "date": time.strftime("%Y-%m-%d"), "created": time.time(),
        "card": card, "link": "none", **info, "cpu_count": os.cpu_count(),
        "workers": opts.workers if opts.workers is not None else core.default_workers(1),
        "synthetic_images_per_s": synthetic, "imagefolder_images_per_s": real,
        "ratio": _ratio(real, synthetic), "target_ratio": TARGET_RATIO,
        "second_half_ratio": _ratio(runs["imagefolder"].get("second_half_images_per_s"),
                                    runs["synthetic"].get("second_half_images_per_s")),
        "folder": {**made, "path": str(folder), "page_cache": "just written (or reused): read from RAM"},
        "runs": runs, "options": asdict(opts), "versions": runner.versions(), "work_dir": str(work),
    }
    path = runner.result_path(Path(opts.out), doc["date"], card, suffix="-imagefolder")
    atomic_write_json(path, doc)
    return doc, path


def parse(argv: list[str] | None) -> Options:
    d = Options()
    p = argparse.ArgumentParser(prog="python bench/imagefolder.py", description=__doc__.split("\n")[0],
                                epilog="arguments after -- go to both runs' `dscluster train`")
    p.add_argument("--config", default=d.config, help=f"training preset (default {d.config})")
    p.add_argument("--precision", default=d.precision, help=f"default {d.precision}")
    p.add_argument("--steps", type=int, default=d.steps, help=f"steps per run (default {d.steps})")
    p.add_argument("--micro-batch", default=d.micro_batch, help=f"N or auto (default {d.micro_batch})")
    p.add_argument("--classes", type=int, default=d.classes, help=f"class folders (default {d.classes})")
    p.add_argument("--image-size", type=int, default=d.image_size, help=f"JPEG side in pixels (default {d.image_size})")
    p.add_argument("--quality", type=int, default=d.quality, help=f"JPEG quality (default {d.quality})")
    p.add_argument("--workers", type=int, help="data.workers of the folder run (default: train's default)")
    p.add_argument("--data-dir", help="where the folder is (re)used (default runs/bench-imagefolder-data/...)")
    p.add_argument("--work-dir", help="run directories and logs (default runs/bench-imagefolder-<time>)")
    p.add_argument("--out", default=d.out, help=f"result folder (default {d.out})")
    p.add_argument("--timeout", type=float, default=d.timeout_s,
                   help=f"seconds for everything (default {d.timeout_s:.0f})")
    p.add_argument("--device", choices=("cuda", "cpu"), default=d.device, help="cpu: the plumbing only")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- KEY=VALUE ... for both runs")
    a = p.parse_args(argv)
    if a.steps < 1 or a.classes < 2 or a.image_size < 8 or a.timeout <= 0 or not 1 <= a.quality <= 100:
        p.error("--steps >= 1, --classes >= 2, --image-size >= 8, --quality 1..100 and --timeout > 0")
    if not (a.micro_batch == "auto" or a.micro_batch.isdigit()):
        p.error(f"--micro-batch {a.micro_batch!r}: a number or auto")
    extra = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    return Options(config=a.config, precision=a.precision, steps=a.steps, micro_batch=a.micro_batch,
                   classes=a.classes, image_size=a.image_size, quality=a.quality, workers=a.workers,
                   data_dir=a.data_dir, work_dir=a.work_dir, out=a.out, timeout_s=a.timeout, device=a.device,
                   train_args=list(extra))


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        doc, path = run(opts)
    except UsageError as e:
        print(f"bench imagefolder: {e}", file=sys.stderr)
        return 2
    ratio = doc["ratio"]
    print(json.dumps({k: doc[k] for k in ("card", "link", "date", "synthetic_images_per_s",
                                          "imagefolder_images_per_s", "ratio", "second_half_ratio", "workers",
                                          "cpu_count")}, indent=1))
    print(f"bench imagefolder: ImageFolder at {runner.cell(ratio, '.2f')}x synthetic "
          f"(target >= {TARGET_RATIO}); result {path}")
    return 0 if all(r.get("status") == "complete" for r in doc["runs"].values()) else 1
