"""plan's whole-run model: a run as configured, phase by phase, from the step model's step times.

Pure arithmetic, no torch: a run is more than its steady step (plan/model.py), so it adds the warm-up,
the uncompressed steps before PowerSGD starts, the data cache's fill, the evaluations, checkpoints and
loader restarts (docs/plan.md, "The whole run", has the table). Step g (1-based, global) is
uncompressed when g <= start_step. train's end-of-run comparison (runmodel/predicted.py) predicts the
steps it timed with the same `span`, so the whole run's steady figure is what train reports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from dscluster.errors import UsageError

WARMUP_STEPS = 5
"""core/timing.py's WARMUP_STEPS (kept equal by a test; this module imports no torch)."""
POWERSGD_START_STEP = 30
"""The start step the recommendation pastes with PowerSGD (when the config's is later): compressing
from early on is what makes the recommendation's prediction hold for the whole run."""
POWERSGD_START_EVIDENCE = ("digits on the 4-rank GPU lab at 1 Gbit, 4 seeds: PowerSGD from step 30 ended within "
                           "0.1 point of no compression (96.0 % against 96.0 %), fp16 and bf16 within 1 point "
                           '(docs/advisor.md, "Shipped curves and evidence")')
"""The measurement behind POWERSGD_START_STEP, cited in plan's output."""
FORWARD_SHARE = 1 / 3
"""A forward pass is about a third of a forward+backward (plan/model.py's BACKWARD_SHARE is the rest)."""
CHECKPOINT_BYTES_PER_PARAM = 16
"""A ZeRO-0 checkpoint: fp32 weights (4 bytes), AdamW's two moments (8), the module's copy (4)."""
CHECKPOINT_WRITE_GBps = 0.5
"""Assumed write rate of a checkpoint save (a local SSD or NFS); a stated guess, not measured."""
HOST_TO_DEVICE_GBps = 6.0
"""Copy rate of the held-out batches from the data cache to the GPU: views of pageable memory, not
pinned. Fitted on GPU runs (docs/plan.md, "The whole run")."""
LOADER_REFILL_GBps = 11.0
"""Rate at which a rank's loader workers refill their prefetch (workers × data.prefetch micro-batches of
uint8 images, through shared memory into pinned memory) at an epoch end, during the held-out pass. Fitted
as HOST_TO_DEVICE_GBps is."""


def fill_seconds(images: int, s_per_image: float, start_s: float, passes: int = 1) -> float:
    """The data cache's fill: `images` made once, front to back, by the rank's loader workers at
    `s_per_image` wall-clock seconds each (the workers in parallel: plan/datafeed.py's fill probe),
    started afresh (`start_s`) for each of `passes` splits."""
    return images * s_per_image + passes * start_s if images else 0.0


def evaluation_seconds(forward_s: float, images: int, s_per_image: float | None, start_s: float) -> float:
    """One held-out evaluation: the forward pass, or where its images are made again at each pass
    (not cached: `s_per_image` wall-clock seconds each by the workers in parallel) the making of them
    by freshly started workers, whichever is longer (the workers make the next chunks while the GPU
    runs one)."""
    if s_per_image is None or not images:
        return forward_s
    return max(forward_s, images * s_per_image + start_s)


def evaluation_share(images: int, ranks: int) -> int:
    """The held-out images the busiest of `ranks` evaluates where they share the pass (core/evaluation.py's
    contiguous shares; 1: the whole set, rank 0 alone)."""
    return -(-images // max(1, ranks))


def evaluation_copy_seconds(images: int, image_bytes: int) -> float:
    """Copying a cached held-out set's uint8 images to the GPU for its evaluation (HOST_TO_DEVICE_GBps)."""
    return images * image_bytes / (HOST_TO_DEVICE_GBps * 1e9)


def loader_restart_seconds(items: int, images_per_item: int, image_bytes: int) -> float:
    """A loader's restart at an epoch end: its workers refill `items` prefetch slots of `images_per_item`
    uint8 images each (LOADER_REFILL_GBps); 0 where the rank has no loader workers."""
    return items * images_per_item * image_bytes / (LOADER_REFILL_GBps * 1e9)


def feed_step_seconds(images_per_rank: int, s_per_image: float | None) -> float:
    """The least a step can take when a rank's loader workers make its images (not cached): its
    micro-batches × grad_accum images at `s_per_image` wall-clock seconds each by its workers in
    parallel (persistent: no start)."""
    return 0.0 if s_per_image is None else images_per_rank * s_per_image


@dataclass(frozen=True, kw_only=True, slots=True)
class RunCosts:
    """What a run's time is made of, for one setting (plans.json keeps it with each setting)."""

    plain_step_s: float
    """An optimizer step with a plain all-reduce (before PowerSGD starts)."""
    step_s: float
    """An optimizer step with the setting's compression."""
    start_step: int | None = None
    """Steps up to this one are plain (PowerSGD's start); None: every step takes step_s."""
    warmup_extra_s: float = 0.0
    """Paid once in the first steps: compilation, allocator, kernel choice."""
    eval_s: float = 0.0
    """One held-out evaluation (0: no held-out set)."""
    save_s: float = 0.0
    """One checkpoint save."""
    restart_s: float = 0.0
    """The loader's restart at an epoch end another epoch follows (`loader_restart_seconds`)."""
    steps_per_epoch: int
    eval_every_epochs: int = 1
    checkpoint_every_epochs: int = 0
    checkpoint_every_steps: int = 0
    cache_fill_s: float = 0.0
    """Making the cached splits once before the first step (rank 0's: training and held-out)."""
    cache_images: int = 0
    cache_workers: int = 0

    def __post_init__(self):
        if self.steps_per_epoch < 1:
            raise UsageError(f"steps per epoch {self.steps_per_epoch}: the training set is smaller than one "
                             "global batch")
        spent = (self.warmup_extra_s, self.eval_s, self.save_s, self.cache_fill_s, self.restart_s)
        if not (self.plain_step_s > 0 and self.step_s > 0 and min(spent) >= 0):
            raise UsageError(f"run costs out of range: {self}")

    def to_dict(self) -> dict:
        return asdict(self)


def measured_epoch_ends(c: RunCosts, eval_s: float | None, save_s: float | None = None) -> RunCosts:
    """Run costs `c` with a run's measured epoch ends: its held-out pass (as train times it, the loader's
    refill for the next epoch is under it, so the evaluation is what is left beyond the modelled restart)
    and its checkpoint save. What was not measured stays as modelled."""
    if isinstance(eval_s, (int, float)) and eval_s > 0:
        c = replace(c, eval_s=max(0.0, eval_s - c.restart_s))
    if isinstance(save_s, (int, float)) and save_s > 0 and c.save_s > 0:
        c = replace(c, save_s=float(save_s))
    return c


def total_steps(steps_per_epoch: int, epochs: int, max_steps: int) -> int:
    """core/setup_engine.py's rule: every epoch, or max_steps where it is smaller (0: no cap)."""
    full = steps_per_epoch * epochs
    return full if max_steps <= 0 else min(max_steps, full)


def plain_steps(first: int, last: int, start_step: int | None) -> int:
    """Steps of first..last (1-based, inclusive) that send a plain all-reduce."""
    if start_step is None or last < first:
        return 0
    return max(0, min(last, start_step) - first + 1)


def events_after(step: int, c: RunCosts, total: int, epochs: int) -> tuple[int, int, int]:
    """(evaluations, checkpoint saves, loader restarts) train/loop.py runs after global step `step` of a
    `total`-step run: a restart at every epoch end another epoch follows."""
    spe = c.steps_per_epoch
    done, epoch_end = step >= total, step % spe == 0
    last = done or (step - 1) // spe + 1 >= epochs
    saves = int(bool(c.checkpoint_every_steps and step % c.checkpoint_every_steps == 0 and not epoch_end))
    if not (epoch_end or done):
        return 0, saves, 0
    epoch = (step - 1) // spe + 1  # 1-based: the epoch this step ended
    evals = int(c.eval_s > 0 and (last or epoch % c.eval_every_epochs == 0))
    if epoch_end and c.checkpoint_every_epochs and (epoch % c.checkpoint_every_epochs == 0 or last):
        saves += 1
    return evals, saves, int(epoch_end and not last)


def _event_steps(first: int, last: int, c: RunCosts) -> list[int]:
    """The steps of first..last after which an evaluation, a save or a restart may come."""
    marks = {last}
    for every in (c.steps_per_epoch, c.checkpoint_every_steps):
        if every:
            marks.update(range((first + every - 1) // every * every, last + 1, every))
    return sorted(m for m in marks if first <= m <= last)


def span(c: RunCosts, first: int, last: int, *, total: int, epochs: int, events_from: int | None = None,
         events_to: int | None = None) -> dict[str, float]:
    """Seconds of steps first..last by kind, and of the evaluations, saves and loader restarts after the
    steps events_from..events_to (default first..last): {"plain_s", "steady_s", "evaluation_s",
    "checkpoints_s", "restart_s", "evaluations", "saves", "restarts", "epoch_ends"}."""
    plain = plain_steps(first, last, c.start_step)
    steady = max(0, last - first + 1) - plain
    events_first = events_from if events_from is not None else first
    events_last = events_to if events_to is not None else last
    evals = saves = restarts = ends = 0
    for g in _event_steps(max(1, events_first), events_last, c):
        evaluated, saved, restarted = events_after(g, c, total, epochs)
        evals += evaluated
        saves += saved
        restarts += restarted
        ends += g % c.steps_per_epoch == 0 or g >= total
    return {"plain_s": plain * c.plain_step_s, "steady_s": steady * c.step_s, "evaluation_s": evals * c.eval_s,
            "checkpoints_s": saves * c.save_s, "restart_s": restarts * c.restart_s, "evaluations": evals,
            "saves": saves, "restarts": restarts, "epoch_ends": ends, "plain_steps": plain, "steady_steps": steady}


def _events_s(s: dict) -> float:
    return s["evaluation_s"] + s["checkpoints_s"] + s["restart_s"]


def whole_run(c: RunCosts, *, epochs: int, max_steps: int, global_batch: int, warmup_source: str = "modelled",
              epoch_end_source: str = "modelled") -> dict:
    """The run as configured: its phases (name, steps, seconds), the time to finish, the mean img/s, the
    steady img/s as train reports it (`timed_mean_step`), its epoch ends, and where the warm-up's first-step
    costs and an epoch end's held-out pass come from ("measured in run X" or "modelled ...")."""
    total = total_steps(c.steps_per_epoch, epochs, max_steps)
    warm = min(WARMUP_STEPS, total)
    head = span(c, 1, warm, total=total, epochs=epochs, events_to=0)
    rest = span(c, warm + 1, total, total=total, epochs=epochs, events_from=1)
    compressed = c.start_step is not None or c.step_s != c.plain_step_s
    warm_s = head["plain_s"] + head["steady_s"] + c.warmup_extra_s
    phases: list[dict[str, Any]] = [
        {"name": "data cache", "steps": 0, "seconds": c.cache_fill_s,
         "note": f"{c.cache_images:,} images made once into memory by {c.cache_workers} worker(s)"},
        {"name": "warm-up", "steps": warm, "seconds": warm_s,
         "note": f"the first {warm} steps, compilation and first-step costs included ({warmup_source})"},
        {"name": "uncompressed", "steps": rest["plain_steps"], "seconds": rest["plain_s"],
         "note": f"plain all-reduces up to comm.powersgd_start_step={c.start_step}"},
        {"name": "compressed" if compressed else "steady", "steps": rest["steady_steps"], "seconds": rest["steady_s"],
         "note": "the setting's steady step"},
        {"name": "evaluation", "steps": 0, "seconds": rest["evaluation_s"],
         "note": f"{rest['evaluations']} held-out pass(es) on rank 0"},
        {"name": "checkpoints", "steps": 0, "seconds": rest["checkpoints_s"], "note": f"{rest['saves']} save(s)"},
        {"name": "loader restarts", "steps": 0, "seconds": rest["restart_s"],
         "note": f"{rest['restarts']} restart(s) of the loader workers at epoch ends, each refilling its prefetch"},
    ]
    phases = [p for p in phases if p["steps"] or p["seconds"] > 0 or p["name"] == "warm-up"]
    seconds = sum(p["seconds"] for p in phases)
    first, last = timed_steps(0, total)
    timed = timed_span(c, first, last, total=total, epochs=epochs)
    steady_step = timed_mean_step(c, first, last, total=total, epochs=epochs) or c.step_s
    return {"total_steps": total, "steps_per_epoch": c.steps_per_epoch, "epochs": epochs, "phases": phases,
            "seconds": seconds, "images_per_s": total * global_batch / seconds if seconds > 0 else None,
            "steady_images_per_s": global_batch / steady_step, "step_images_per_s": global_batch / c.step_s,
            "epoch_ends": {"count": rest["epoch_ends"], "in_steady": timed["epoch_ends"],
                           "evaluation_s": c.eval_s, "save_s": c.save_s if c.checkpoint_every_epochs else 0.0,
                           "loader_restart_s": c.restart_s, "source": epoch_end_source,
                           "seconds": _events_s(rest), "steady_seconds": _events_s(timed)},
            "warmup": {"seconds": warm_s, "extra_s": c.warmup_extra_s, "source": warmup_source},
            "costs": c.to_dict()}


def timed_steps(resumed_at: int, last: int) -> tuple[int, int]:
    """(first, last) global steps train times (core/timing.py `is_timed`): those after the warm-up of
    this process's run, or every step of a run no longer than the warm-up."""
    run_length = last - resumed_at
    return (resumed_at + WARMUP_STEPS + 1 if run_length > WARMUP_STEPS else resumed_at + 1), last


def timed_span(c: RunCosts, first: int, last: int, *, total: int, epochs: int, resumed_at: int = 0) -> dict:
    """`span` of the steps train timed (first..last) with the evaluations, saves and loader restarts its
    windows hold: those after step first−1 (the warm-up's last, where this process ran it) up to the step
    before the last (core/timing.py: the windows follow each other without a gap; the last evaluation
    comes after the last window)."""
    after = first - 1 if first - 1 > resumed_at else first
    return span(c, first, last, total=total, epochs=epochs, events_from=after, events_to=last - 1)


def timed_mean_step(c: RunCosts, first: int, last: int, *, total: int, epochs: int,
                    resumed_at: int = 0) -> float | None:
    """Mean seconds per step over the steps train timed (first..last), epoch ends inside them included
    (`timed_span`): train's steady images/s is the global batch over it."""
    if last < first:
        return None
    s = timed_span(c, first, last, total=total, epochs=epochs, resumed_at=resumed_at)
    return (s["plain_s"] + s["steady_s"] + _events_s(s)) / (last - first + 1)


def recommended_start(config_start: int | None) -> int | None:
    """The start step a recommendation that turns PowerSGD on pastes: POWERSGD_START_STEP where the
    config's own (resolved) start is later; None where the config's is already that early."""
    if config_start is not None and config_start <= POWERSGD_START_STEP:
        return None
    return POWERSGD_START_STEP
