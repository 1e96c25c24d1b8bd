"""Whether a setting that changes what is learned was shown to learn as well (docs/advisor.md, "Learning
changes need evidence"): another global batch (fewer optimizer steps an epoch, the learning rate scaled
with it), a sync period (local SGD), a compression. Recorded held-out curves decide (runmodel/accuracy.py):
the setting's own against every-step uncompressed ones at the config's global batch, at equal epochs,
within TOLERANCE. Without such curves the setting is untested; where they trail it is left out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from dscluster import core
from dscluster.runmodel import accuracy

TOLERANCE = accuracy.TRAIL_POINTS
"""Held-out accuracy a setting may end below every-step training at equal epochs (1 point)."""
KEPT = "kept"
"""Nothing learned changes: the config's global batch, its synchronisation or none."""
TESTED = "tested"
TRAILS = "trails"
UNTESTED = "untested"


@dataclass(frozen=True, slots=True)
class Evidence:
    kind: str
    """KEPT, TESTED (curves within TOLERANCE), TRAILS (curves below it) or UNTESTED (no curves to compare)."""
    changes: str = ""
    """What the setting changes in what is learned, in words; empty where nothing."""
    why: str = ""
    """What the recorded curves say, in words."""


def changes(label: str, global_batch: int, *, own_label: str, own_batch: int, lr_scaled: bool) -> str:
    """What a setting of sync label `label` at `global_batch` changes against the config's own, in words."""
    parts = []
    if global_batch != own_batch:
        parts.append(f"global batch {own_batch:,} → {global_batch:,}"
                     + (" with the learning rate scaled to it" if lr_scaled else ""))
    period = core.parse_sync_label(label)[1]
    delay = core.parse_sync_stream(label)[0]
    if label not in ("none", own_label):
        parts.append((f"the models averaged every {period} steps" + (f", applied {delay} steps later" if delay else ""))
                     if period > 1 else f"{label} gradient compression")
    return ", ".join(parts)


def by_epoch(points, steps_per_epoch: int) -> dict[int, float]:
    """A curve's accuracies by the epoch each evaluation closed (the last one may close a partial epoch)."""
    return {math.ceil(int(step) / steps_per_epoch): float(acc) for step, acc in points}


def gaps(mine: list[dict], base: list[dict], mine_per_epoch: int,
         base_per_epoch: int) -> list[tuple[float, int, float, float]]:
    """Each curve of `mine` against the `base` curves: (its accuracy less their median, the epoch, its accuracy,
    their median) at the last epoch it evaluated that every base curve did too; none where nothing compares."""
    plain = [by_epoch(c["points"], base_per_epoch) for c in base]
    out = []
    for c in mine:
        own = by_epoch(c["points"], mine_per_epoch)
        common = [e for e in sorted(own) if plain and all(e in q for q in plain)]
        if common:
            epoch = common[-1]
            median = statistics.median(q[epoch] for q in plain)
            out.append((own[epoch] - median, epoch, own[epoch], median))
    return out


def judge(label: str, global_batch: int, *, own_label: str, own_batch: int, lr_scaled: bool,
          curves_at: Callable[[int], list[dict]], steps_per_epoch: Callable[[int], int | None],
          family_says: Callable[[str], str | None]) -> Evidence:
    """The evidence for one setting. `curves_at(batch)`: the recorded curves of the config's trajectory at that
    global batch, as the setting's pasted line trains it; `steps_per_epoch(batch)`: None where the data set's size
    is unknown (only the config's own batch then compares, step by step); `family_says(label)`: why the curves of
    another run length show the label learning more slowly (runmodel/accuracy.py `slower`), else None. A label whose
    curves trail at the config's batch trails at any batch: a larger one only adds a change."""
    what = changes(label, global_batch, own_label=own_label, own_batch=own_batch, lr_scaled=lr_scaled)
    if not what:
        return Evidence(KEPT)
    base = [c for c in curves_at(own_batch) if c.get("compression", "none") == "none"]
    found = _compared(label, global_batch, own_batch, base, curves_at, steps_per_epoch)
    if found:
        kind, why = found
        return Evidence(kind, what, why)
    if label not in ("none", own_label):
        at_own = _compared(label, own_batch, own_batch, base, curves_at, steps_per_epoch)
        if at_own and at_own[0] == TRAILS:
            return Evidence(TRAILS, what, f"with {label} at global batch {own_batch:,}, {at_own[1]}")
        slower = family_says(label)
        if slower:
            return Evidence(TRAILS, what, slower)
    return Evidence(UNTESTED, what, "no recorded run of it to hold against every-step training at equal epochs")


def _compared(label: str, global_batch: int, own_batch: int, base: list[dict],
              curves_at: Callable[[int], list[dict]],
              steps_per_epoch: Callable[[int], int | None]) -> tuple[str, str] | None:
    """(TESTED or TRAILS, the figures in words) from the curves of `label` at `global_batch` against `base` at
    `own_batch`, epoch by epoch; None where nothing compares."""
    mine = [c for c in curves_at(global_batch) if c.get("compression", "none") == label]
    mine_per = steps_per_epoch(global_batch)
    base_per = steps_per_epoch(own_batch)
    if mine_per is None or base_per is None:  # the data set's size unknown: steps compare at the same batch only
        mine_per = base_per = 1 if global_batch == own_batch else 0
    found = gaps(mine, base, mine_per, base_per) if mine_per else []
    if not found:
        return None
    kept_up = statistics.median(g[0] for g in found) >= -TOLERANCE
    said = ", ".join(f"{a:.1%} against {b:.1%} after epoch {e}" for _, e, a, b in found)
    return (TESTED if kept_up else TRAILS,
            f"its {len(found)} recorded run(s) ended {'within' if kept_up else 'more than'} {TOLERANCE * 100:g} "
            f"point {'of' if kept_up else 'below'} every-step training at global batch {own_batch:,} at equal epochs "
            f"({said})")


def slower_because(cfg, curves: list[dict], family: list[tuple[str, list[dict]]], label: str) -> str | None:
    """Why `label` learns too slowly (accuracy.slower's evidence), in words, saying at which run length where it
    comes from the family's curves; None where the recorded curves do not say so."""
    found = accuracy.slower(curves, family, label)
    if found is None:
        return None
    why, length = found
    if length is None:
        return why
    own = accuracy.run_length(cfg)
    return f"at {length}, not this config's {own} (no recorded run at {own} compares it with uncompressed ones), {why}"
