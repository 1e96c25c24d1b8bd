"""plan's advice: the setting to paste, judged by the whole run and by what it learns (docs/advisor.md).

recommend.py searches the settings by their step; the advice takes one only where
- its predicted whole run (the data cache to the last step, epoch ends in), or with target_accuracy and
  recorded curves its time to that accuracy, beats the fastest node alone's on the same epochs: a step
  can be faster while the run is not (the epoch ends' averages and held-out passes); else train alone;
- what it learns is kept, or recorded curves show it learns as well (plan/evidence.py). A faster setting
  without them is listed apart, "faster, accuracy untested", with the command that measures it.
Pure: plan/weigh.py prices each setting and gathers its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

from dscluster.plan import evidence, recommend


@dataclass(frozen=True, kw_only=True, slots=True)
class Judged:
    """One setting, as the advice weighs it."""

    option: recommend.Option
    run: dict | None
    """Its whole run (phases.whole_run's dict); None where the data set's size is unknown."""
    seconds: float | None
    """What it is judged by: its whole run, or its time to the target accuracy (`Advice.judged_by`)."""
    evidence: evidence.Evidence
    overrides: tuple[str, ...] = ()
    """What to paste after ./entry_cn.sh for it."""

    def sooner_than(self, seconds: float | None) -> bool:
        """Sooner than `seconds` (the node alone's, or the advice's); by the step where a whole run is unknown."""
        if self.seconds is not None and seconds is not None:
            return self.seconds < seconds
        return self.option.prediction.speedup > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    now: Judged
    choice: Judged | None
    """The setting to paste (`now`: nothing to change); None: train on the fastest node alone."""
    alone_node: str
    alone_s: float | None
    """The fastest node alone's whole run (or time to the target) on the same epochs; None with one node."""
    judged_by: str
    """"whole run" or "time to 90.0%"."""
    untested: tuple[Judged, ...] = ()
    """Sooner than the advice, but what they learn is untested: the smallest change and the soonest."""
    left_out: tuple[Judged, ...] = ()
    """Settings whose recorded curves trail every-step training: the first of each sync label."""

    @property
    def train_alone(self) -> bool:
        return self.choice is None

    @property
    def ratio(self) -> float | None:
        """How many times sooner than the node alone the advice finishes (>1: sooner)."""
        seconds = self.choice.seconds if self.choice else self.now.seconds
        return self.alone_s / seconds if self.alone_s and seconds else None


def advise(now: Judged, options: list[Judged], *, alone_node: str, alone_s: float | None, several_nodes: bool,
           target_efficiency: float, judged_by: str, warmup_steps: int = 0) -> Advice:
    """The first setting (the config as given, then `options` in recommend's order of preference) that learns as
    the config does, or was shown to, beats the node alone and reaches `target_efficiency`; else the soonest such
    setting; None where none beats the node alone on several nodes. An untested setting is offered only where
    its run outlasts the learning rate's `warmup_steps` (else it never trains at its rate)."""
    same = (now.option.grad_accum, now.option.compression, now.option.prediction.global_batch)
    others = [j for j in options if j.overrides or (j.option.grad_accum, j.option.compression,
                                                    j.option.prediction.global_batch) != same]
    shown = [j for j in [now, *others] if j.evidence.kind in (evidence.KEPT, evidence.TESTED)]
    eligible = [j for j in shown if not several_nodes or j.sooner_than(alone_s)]
    if eligible and eligible[0] is now:  # a change must pay for itself: sooner than the config as it is
        eligible = [now, *(j for j in eligible[1:] if _sooner(j, now))]
    choice = next((j for j in eligible if j.option.prediction.efficiency >= target_efficiency), None)
    choice = choice or (min(eligible, key=_sort_key) if eligible else None)
    bar = choice.seconds if choice else alone_s
    untested: list[Judged] = []
    left_out: dict[str, Judged] = {}
    if several_nodes:
        faster = [j for j in others if (j.sooner_than(bar) if choice is None else _sooner(j, choice))]
        untried = [j for j in faster if j.evidence.kind == evidence.UNTESTED
                   and (j.run is None or j.run["total_steps"] > warmup_steps)]
        soonest = sorted(untried, key=_sort_key)[:1]
        untested = untried[:1] + [j for j in soonest if j is not untried[0]]
        for j in others:
            if j.evidence.kind == evidence.TRAILS:
                left_out.setdefault(j.option.compression, j)
    return Advice(now=now, choice=choice, alone_node=alone_node, alone_s=alone_s if several_nodes else None,
                  judged_by=judged_by, untested=tuple(untested), left_out=tuple(left_out.values()))


def _sort_key(j: Judged) -> float:
    return j.seconds if j.seconds is not None else j.option.prediction.global_batch / j.option.prediction.images_per_s


def _sooner(j: Judged, than: Judged) -> bool:
    return _sort_key(j) < _sort_key(than)


def clock(seconds: float) -> str:
    """3 h 05 min, 12 min 40 s, 41.0 s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{seconds:.1f} s"


def times(ratio: float) -> str:
    """1.35× sooner, 0.07× (later)."""
    return f"{ratio:.2f}× sooner" if ratio >= 1 else f"{ratio:.2f}×, later"


def summary(a: Advice) -> str:
    """The headline: every ratio in it is the whole run's (or the time to the target's), never a step's."""
    alone_s = a.alone_s
    if a.train_alone:
        now_s = a.now.seconds
        now = (f"; as configured the lab's {a.judged_by} is {clock(now_s)} ({times(alone_s / now_s)})"
               if now_s and alone_s else "")
        why = ("no setting shown to learn as the config does finishes sooner than it" if alone_s else
               "no setting shown to learn as the config does is faster than it")
        return f"train on {a.alone_node} alone: {why}{now}"
    c = a.choice
    assert c is not None
    seconds = c.seconds
    verdict = (f", {times(alone_s / seconds)} than {a.alone_node} alone ({clock(alone_s)})"
               if alone_s and seconds else "")
    figure = f"{a.judged_by} {clock(seconds)}" if seconds else f"{c.option.prediction.images_per_s:,.0f} img/s"
    if c is a.now:
        return f"keep the config as it is: {figure}{verdict}"
    shown = f"; {c.evidence.changes}: {c.evidence.why}" if c.evidence.kind == evidence.TESTED else ""
    return f"{recommend.setting_words(c.option)}: {figure}{verdict}{shown}"


def untested_line(j: Judged, a: Advice) -> str:
    """`faster, accuracy untested: grad_accum 4 (global batch 256) …: whole run 14.7 s, 1.20× sooner than …`."""
    alone_s = a.alone_s
    seconds = j.seconds
    than = f", {times(alone_s / seconds)} than {a.alone_node} alone" if alone_s and seconds else ""
    figure = f"{a.judged_by} {clock(seconds)}" if seconds else f"{j.option.prediction.images_per_s:,.0f} img/s"
    return (f"faster, accuracy untested: {recommend.setting_words(j.option)}: {figure}{than}; it changes "
            f"{j.evidence.changes}, and {j.evidence.why}")


def to_dict(a: Advice) -> dict:
    """The document's recommendation fields the advice owns (docs/schemas.md)."""
    def entry(j: Judged) -> dict:
        return {**j.option.to_dict(), "seconds": j.seconds, "overrides": list(j.overrides),
                "evidence": j.evidence.kind, "changes": j.evidence.changes, "why": j.evidence.why}

    return {"judged_by": a.judged_by, "alone_node": a.alone_node, "alone_s": a.alone_s, "now_s": a.now.seconds,
            "choice_s": a.choice.seconds if a.choice else None, "ratio": a.ratio,
            "untested": [{**entry(j), "summary": untested_line(j, a)} for j in a.untested],
            "left_out": [entry(j) for j in a.left_out]}
