"""plan's search over settings by their step (plan/model.py): gradient accumulation (ACCUM_CHOICES), then the
settings of LADDER at each (compressions, then local SGD every H steps on several nodes), in order of preference
(`options`), and the first that reaches the target efficiency within the global batch limit, else the fastest.
What is recommended is plan/advice.py's: by the whole run and by what is learned, from these options.
Pure arithmetic, no torch; docs/plan.md is the reference."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dscluster import core
from dscluster.errors import UsageError
from dscluster.plan.model import (
    ACCUM_CHOICES,
    LADDER,
    MAX_GLOBAL_BATCH,
    TARGET_EFFICIENCY,
    Prediction,
    Scenario,
    predict,
    streamed,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Option:
    """One setting the recommendation tried, and its prediction."""

    grad_accum: int
    compression: str
    prediction: Prediction

    def to_dict(self) -> dict:
        return {"grad_accum": self.grad_accum, "compression": self.compression,
                "global_batch": self.prediction.global_batch, "prediction": self.prediction.to_dict()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Recommendation:
    target_efficiency: float
    max_global_batch: int
    reached: bool
    """Some option within max_global_batch reaches target_efficiency."""
    choice: Option | None
    """The smallest change that reaches the target, else the fastest option within the limit;
    None when not even the current micro-batch × ranks fits the limit."""
    without_compression: Option | None
    """When choice compresses: the same search without compression (what accumulation alone does)."""
    needed: Option | None
    """When nothing within the limit reaches the target: the smallest accumulation (a power of 2
    up to 4096, the strongest compression tried) that would, beyond the limit; None if none does."""
    train_alone: bool
    """Even choice is slower than the fastest node alone: train there."""
    summary: str

    def to_dict(self) -> dict:
        return {"target_efficiency": self.target_efficiency, "max_global_batch": self.max_global_batch,
                "reached": self.reached, "train_alone": self.train_alone, "summary": self.summary,
                **{k: (getattr(self, k).to_dict() if getattr(self, k) else None)
                   for k in ("choice", "without_compression", "needed")}}


def options(s: Scenario, compressions: tuple[str, ...], accums, max_global_batch: int | None, *,
            stream: bool = False) -> list[Option]:
    """Options in order of preference: the smallest global batch first (a larger one changes the
    optimisation: learning rate, steps per epoch), then no compression before compression; `stream`: each
    blocking average followed by its streamed variant (what advice weighs by the whole run and evidence)."""
    out = []
    for accum in accums:
        for comp in compressions:
            # a recommended setting states its batch in full: micro × accum × ranks, split evenly
            trial = replace(s, grad_accum=accum, compression=comp, samples_per_step=None)
            if max_global_batch is None or trial.global_batch <= max_global_batch:
                out.append(Option(grad_accum=accum, compression=comp, prediction=predict(trial)))
                out += _streamed(trial) if stream else []
    return out


def _streamed(trial: Scenario) -> list[Option]:
    """After a blocking average every H steps, its streamed variant (model.streamed): staler by τ steps, so
    preferred only where the blocking one falls short."""
    if trial.sync_period < 2 or trial.sync_stream != (0, "none"):
        return []
    label = streamed(trial)
    return [Option(grad_accum=trial.grad_accum, compression=label,
                   prediction=predict(replace(trial, compression=label)))]


def _first_reaching(options: list[Option], target: float) -> Option | None:
    return next((o for o in options if o.prediction.efficiency >= target), None)


def _best(options: list[Option]) -> Option | None:
    # max() keeps the first of equals: the smaller batch, the uncompressed one
    return max(options, key=lambda o: o.prediction.images_per_s) if options else None


def ladder(current: str, allowed=None) -> tuple[str, ...]:
    """The compressions worth trying from the config's own upward (LADDER, bf16 in fp16's place if
    the config asks for bf16), those `allowed` (a predicate: training's rule, config_checks) only."""
    rungs = tuple("bf16" if c == "fp16" and current == "bf16" else c for c in LADDER)
    start = rungs.index(current) if current in rungs else 0
    return tuple(c for c in rungs[start:] if allowed is None or c == current or allowed(c)) or (current,)


def settings(s: Scenario, compressions: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The settings worth trying on scenario `s`: `compressions` (default: `ladder` from its own), only
    "none" on one rank, nothing that averages every H steps on one node."""
    comps = compressions or ladder(s.compression, allowed=lambda c: c != "powersgd" or bool(s.matrices))
    if s.world < 2:  # one rank sends nothing: no compression and no averaging to recommend
        return ("none",)
    if len(s.nodes) < 2:  # one node's ranks average every step anyway (core/localsgd.py)
        return tuple(c for c in comps if core.parse_sync_label(c)[1] == 1) or ("none",)
    return comps


def recommend(s: Scenario, *, target: float = TARGET_EFFICIENCY, max_global_batch: int = MAX_GLOBAL_BATCH,
              compressions: tuple[str, ...] | None = None) -> Recommendation:
    """The smallest gradient accumulation of ACCUM_CHOICES, with the smallest compression of
    `compressions` (default: `ladder` from the scenario's), that reaches `target` efficiency within
    `max_global_batch`; else the fastest within it."""
    if not 0 < target <= 1:
        raise UsageError(f"target efficiency {target} must be in (0, 1]")
    if max_global_batch < 1:
        raise UsageError(f"max global batch {max_global_batch} must be at least 1")
    comps = settings(s, compressions)
    tried = options(s, comps, ACCUM_CHOICES, max_global_batch)
    plain = [o for o in tried if o.compression == "none"]
    choice = _first_reaching(tried, target)
    reached = choice is not None
    choice = choice or _best(tried)
    without = None
    if choice is not None and choice.compression != "none":
        without = _first_reaching(plain, target) or _best(plain)
    needed = None
    if not reached:
        needed = _first_reaching(options(s, comps[-1:], [2**k for k in range(13)], None), target)
    train_alone = len(s.nodes) > 1 and (choice is None or choice.prediction.speedup < 1)
    return Recommendation(target_efficiency=target, max_global_batch=max_global_batch, reached=reached,
                          choice=choice, without_compression=without, needed=needed, train_alone=train_alone,
                          summary=_summary(s, choice, reached, needed, train_alone, target, max_global_batch))


def setting_words(o: Option) -> str:
    """`grad_accum 4 (global batch 256) with local sgd, the models averaged every 64 steps` (`, streamed:
    applied 7 steps later, the change sent in fp16` where it streams)."""
    comp = f" with {o.compression} gradient compression" if o.compression != "none" else ""
    mode, h = core.parse_sync_label(o.compression)
    delay, wire = core.parse_sync_stream(o.compression)
    if h > 1:
        comp = (f" with {mode.replace('_', ' ')}, the models averaged every {h} steps"
                + (f", streamed: applied {delay} steps later" if delay else "")
                + (f", the change sent in {wire}" if wire != "none" else ""))
    if o.compression == "powersgd":
        comp = " with powersgd gradient compression (low-rank, error feedback)"
    return f"grad_accum {o.grad_accum} (global batch {o.prediction.global_batch:,}){comp}"


def describe(o: Option) -> str:
    p = o.prediction
    return (f"{setting_words(o)}: {p.step_s:.2f} s/step, {p.images_per_s:,.0f} img/s, {p.efficiency:.0%} efficiency, "
            f"{p.speedup:.1f}× {p.fastest_node} alone")


def _summary(s, choice, reached, needed, train_alone, target, limit) -> str:
    if choice is None:
        return (f"micro_batch {s.micro_batch} × {s.world} ranks is already above the global batch limit "
                f"{limit:,}: lower micro_batch")
    if reached:
        return f"reaches {target:.0%}: {describe(choice)}"
    text = f"nothing within global batch {limit:,} reaches {target:.0%}; the best is {describe(choice)}"
    if needed is not None:
        text += f"; {target:.0%} would need {describe(needed)}"
    if train_alone:
        best = max(choice.prediction.node_images_per_s.items(), key=lambda kv: kv[1])
        text += f". Train on {best[0]} alone ({best[1]:,.0f} img/s) until the network is faster"
    return text
