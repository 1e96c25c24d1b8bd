"""A run's shape, decided once: precision, micro-batch, accumulation, per-rank shares, data shape.

`resolve(cfg, world, facts)` is pure: `dscluster train` calls it with what its ranks found (precision,
the smallest auto-fit, measured shares), `dscluster plan` with what it knows before the run. Both get
the same arithmetic and the same refusals, so plan never predicts a run that train would refuse or
shape otherwise. The rules, in order: docs/training-config.md, "How a run's shape is decided".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dscluster.core.autofit import choose_micro_batch
from dscluster.errors import UsageError

DEFAULT_MICRO = 32
"""micro_batch auto where no memory fit is known and no even split of the global batch sizes it."""


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is made: micro_batch per rank per micro-step, grad_accum micro-steps."""

    micro_batch: int
    grad_accum: int
    world: int
    global_batch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceFacts:
    """What the ranks found out about themselves that shapes the run (none of it known to a plan)."""

    precision: str = "fp32"
    """The precision decided for the run (train: `precision.decide_here`, once; plan: `planned_precision`)."""
    smallest_fit: int | None = None
    """Largest micro-batch that fits the smallest GPU, after auto-fit's margin; None: no memory limit
    known (CPU ranks, or a plan)."""
    shares: tuple[int, ...] | None = None
    """Balanced batching's measured per-rank shares; None: not measured (yet)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """The run as train runs it and plan predicts it."""

    precision: str
    """bf16, fp16 or fp32."""
    batch: BatchPlan
    """DeepSpeed's bookkeeping: one micro-batch per rank, accumulation, world, train_batch_size."""
    shares: tuple[int, ...]
    """Samples each rank takes per micro-step (all equal to batch.micro_batch under uniform batching)."""
    per_rank: bool = False
    """The shares are per rank (balanced batching, or an even split of the global batch): each rank
    samples its own share and its loss is weighted by it."""
    in_chans: int
    """Image channels of the data set."""
    num_classes: int
    """Classes of the data set."""
    notes: tuple[str, ...] = field(default=())
    """How the shape was decided where the config left it open."""

    def __post_init__(self):
        if len(self.shares) != self.batch.world or min(self.shares) < 1:
            raise UsageError(f"shares {list(self.shares)} for {self.batch.world} ranks: one of at least 1 per rank")

    @property
    def micro_batch(self) -> int:
        """The largest share: the micro-batch whose step sets the pace."""
        return max(self.shares)

    @property
    def grad_accum(self) -> int:
        return self.batch.grad_accum

    @property
    def global_batch(self) -> int:
        """Samples an optimizer step trains: the shares × accumulation."""
        return sum(self.shares) * self.batch.grad_accum

    @property
    def uneven(self) -> bool:
        return len(set(self.shares)) > 1


def plan_batch(micro: int, grad_accum: int | None, global_batch: int | None, world: int) -> BatchPlan:
    """Fill in the missing one of (grad_accum, global_batch) and check the product."""
    if micro < 1 or world < 1:
        raise UsageError(f"micro_batch ({micro}) and world size ({world}) must be at least 1")
    if global_batch is None:
        ga = grad_accum or 1
        return BatchPlan(micro, ga, world, micro * ga * world)
    per_step = micro * world
    if grad_accum is None:
        if global_batch % per_step:
            raise UsageError(
                f"global_batch={global_batch} is not a multiple of micro_batch × world = {micro} × {world} = "
                f"{per_step}: gradient accumulation needs a whole number of micro-steps "
                f"(e.g. global_batch={max(1, global_batch // per_step) * per_step} or another micro_batch)"
            )
        return BatchPlan(micro, global_batch // per_step, world, global_batch)
    if micro * grad_accum * world != global_batch:
        raise UsageError(
            f"global_batch={global_batch} but micro_batch × grad_accum × world = {micro} × {grad_accum} × {world} = "
            f"{micro * grad_accum * world}; DeepSpeed needs them equal (drop global_batch or grad_accum to derive it)"
        )
    return BatchPlan(micro, grad_accum, world, global_batch)


def even_split(cfg, smallest_fit: int | None, world: int) -> list[int] | None:
    """Per-rank shares of a fixed global batch, one micro-step per step, as even as can be.

    micro_batch=auto with a global_batch keeps the global batch, and so the number of steps and the
    learning rate, the same for any number of ranks: a demo on 5 ranks learns as one on 2 does. 64
    over 5 ranks is 13+13+13+13+12; uneven shares are weighted like balanced batching's. Used where
    no memory limit applies (CPU ranks) or where the largest share fits every GPU and the global
    batch does not divide by the ranks (otherwise the GPU path keeps equal micro-batches)."""
    if cfg.micro_batch != "auto" or cfg.global_batch is None or cfg.batching == "balanced" or cfg.grad_accum:
        return None
    g = cfg.global_batch
    if smallest_fit is not None and (g % world == 0 or -(-g // world) > smallest_fit):
        return None
    if g < world:
        raise UsageError(f"global_batch={g} gives fewer than one sample per rank per step ({world} ranks): "
                         f"raise global_batch to at least {world}")
    return [g // world + (1 if r < g % world else 0) for r in range(world)]


def data_shape(cfg) -> tuple[int, int]:
    """(in_chans, num_classes) as core/data.py builds each data set, without loading it."""
    d = cfg.data
    if d.dataset == "digits":
        return 1, 10
    if d.dataset == "cifar10":
        return 3, 10
    if d.dataset == "imagefolder" and d.path:
        root = Path(d.path) / "train" if (Path(d.path) / "train").is_dir() else Path(d.path)
        classes = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
        if classes:
            return 3, len(classes)
    return 3, d.num_classes


def _micro(cfg, world: int, facts: DeviceFacts, notes: list[str]) -> int:
    """The per-rank micro-batch before any share is decided."""
    if cfg.micro_batch != "auto":
        return int(cfg.micro_batch)
    if facts.smallest_fit is None:
        return DEFAULT_MICRO
    micro, accum = choose_micro_batch(facts.smallest_fit, world, cfg.global_batch)
    if cfg.global_batch is not None and cfg.grad_accum is None:
        notes.append(f"auto-fit: micro_batch {micro} × grad_accum {accum} × world {world} = global_batch "
                     f"{cfg.global_batch}")
    return micro


def _shares(cfg, world: int, micro: int, facts: DeviceFacts, notes: list[str]) -> list[int]:
    """Balanced batching's per-rank shares: the config's, else the measured ones, else equal."""
    if cfg.shares is not None:
        if len(cfg.shares) != world:
            raise UsageError(f"shares has {len(cfg.shares)} entries for {world} ranks; give one per rank")
        return list(cfg.shares)
    if facts.shares is not None:
        return list(facts.shares)
    notes.append(f"balanced batching: shares not measured yet, taken as {micro} a rank")
    return [micro] * world


def resolve(cfg, world: int, facts: DeviceFacts = DeviceFacts()) -> RunShape:
    """The run's shape on `world` ranks (cfg.batching already resolved: uniform or balanced); bad
    arithmetic is a UsageError naming the keys and the fix."""
    if world < 1:
        raise UsageError(f"world size {world}: at least one rank")
    notes: list[str] = []
    even = even_split(cfg, facts.smallest_fit, world)
    if even is not None:
        notes.append(f"global_batch {cfg.global_batch} split over {world} ranks: {even}")
    micro = _micro(cfg, world, facts, notes) if even is None else max(even)
    if cfg.batching == "balanced" or even is not None:
        shares = even if even is not None else _shares(cfg, world, micro, facts, notes)
        global_micro = sum(shares)
        accum = cfg.grad_accum or (cfg.global_batch // global_micro if cfg.global_batch else 1)
        if cfg.global_batch is not None and global_micro * accum != cfg.global_batch:
            raise UsageError(f"balanced shares {shares} (sum {global_micro}) × grad_accum {accum} != global_batch "
                             f"{cfg.global_batch}")
        nominal = max(1, global_micro // world)  # DeepSpeed's bookkeeping wants one number per rank
        batch = BatchPlan(nominal, accum, world, nominal * accum * world)
    else:
        batch = plan_batch(micro, cfg.grad_accum, cfg.global_batch, world)
        shares = [batch.micro_batch] * world
    in_chans, num_classes = data_shape(cfg)
    return RunShape(precision=facts.precision, batch=batch, shares=tuple(shares), in_chans=in_chans,
                    num_classes=num_classes, notes=tuple(notes),
                    per_rank=cfg.batching == "balanced" or even is not None)
