"""dscluster's series for TensorBoard, beside DeepSpeed's own, in RUN_DIR/tensorboard/dscluster/.

DeepSpeed's tensorboard monitor writes only its own series (learning rate, loss scale); the ones a
user of this project looks for (loss, accuracy, img/s, step split, telemetry) live in our files, so
`plot` writes them as TensorBoard scalars and one `tensorboard --logdir runs/<id>` shows both. The
tags are listed in docs/run-directory.md. Written only where the run enabled a DeepSpeed tensorboard
monitor (or already holds event files) and the tensorboard package is installed. The folder is ours:
each `plot` replaces its events file.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from dscluster.analysis.load import RunData
from dscluster.analysis.monitor import EXPORT_DIR

SPLIT = ("compute_s", "comm_s", "data_s", "other_s")
GPU_FIELDS = {"util_percent": 1.0, "mem_used_mb": 1 / 1024, "temp_c": 1.0, "power_w": 1.0}


def wanted(run: RunData) -> bool:
    tb = (run.ds_config or {}).get("tensorboard")
    enabled = isinstance(tb, dict) and bool(tb.get("enabled"))
    return enabled or any(p.relative_to(run.path).parts[:2] != EXPORT_DIR.parts
                          for p in run.path.rglob("events.out.tfevents.*"))


def scalars(run: RunData) -> list[tuple[str, int, float, float]]:
    """(tag, step, wall time, value) of every series above: pure, tested without tensorboard."""
    out: list[tuple[str, int, float, float]] = []
    job: dict[int, list[float]] = defaultdict(list)
    for rank in sorted(run.ranks):
        for s in run.ranks[rank].steps:
            step, t = int(s["step"]), float(s.get("t") or 0.0)
            if isinstance(s.get("loss"), (int, float)):
                out.append((f"loss/rank_{rank}", step, t, float(s["loss"])))
            if isinstance(s.get("samples_per_s"), (int, float)):
                out.append((f"throughput/rank_{rank}", step, t, float(s["samples_per_s"])))
                job[step].append(float(s["samples_per_s"]))
            for part in SPLIT:
                if isinstance(s.get(part), (int, float)):
                    out.append((f"step_split/{part}/rank_{rank}", step, t, float(s[part])))
    ranks = len(run.ranks)
    for step, rates in sorted(job.items()):
        if len(rates) == ranks:  # a step every rank finished
            out.append(("throughput/images_per_s", step, 0.0, sum(rates)))
    for e in run.evals():
        if isinstance(e.get("accuracy"), (int, float)):
            acc = float(e["accuracy"])
            out.append(("accuracy/held_out", int(e.get("step") or 0), float(e.get("t") or 0.0),
                        100.0 * acc if acc <= 1.0 else acc))
    t0 = run.t0 or 0.0
    for host, tel in sorted(run.telemetry.items()):
        for s in tel.samples:
            step = int(round(s["t"] - t0))
            if isinstance(s.get("cpu_percent"), (int, float)):
                out.append((f"node/{host}/cpu_percent", step, s["t"], float(s["cpu_percent"])))
            for g in s["gpus"]:
                for key, scale in GPU_FIELDS.items():
                    if isinstance(g.get(key), (int, float)):
                        name = "mem_used_gib" if key == "mem_used_mb" else key
                        out.append((f"gpu/{host}/gpu{g.get('index', 0)}/{name}", step, s["t"], float(g[key]) * scale))
    return out


def export(run: RunData) -> Path | None:
    """Write RUN_DIR/tensorboard/dscluster/ (replacing the last export); None where not wanted or
    tensorboard is not installed."""
    if not wanted(run):
        return None
    try:  # optional: the tensorboard package is installed only where wanted
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        return None
    target = run.path / EXPORT_DIR
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".dscluster-", dir=target.parent))
    try:
        writer = EventFileWriter(str(staging))
        for tag, step, wall, value in scalars(run):
            writer.add_event(Event(wall_time=wall, step=step,
                                   summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))
        writer.close()
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
