"""How often the ranks' models meet (`sync.mode`, `sync.period`): the rules training and plan share.

Pure: no torch. core/localsgd.py runs them, plan prices them (plan/model.py) and prints them to paste.

- The label: one word for a run's communication setting, where plan keys its predictions and curves:
  comm.compression on the every-step path (none, fp16, bf16, powersgd), `MODE:H` (local_sgd:8,
  diloco:16) averaging every H steps, `MODE:H:τ[:WIRE]` streamed τ steps behind (16 bits on the wire).
- The sync points: global step numbers, the same on every rank; with a delay (streamed), where an
  average starts and the step, `delay` later, where it is applied.
- The nodes: ranks grouped by machine identity (core/dist.py `node_identity`), never by host name alone.
- The weights: a rank's share of its node's samples, and of all.
- The held-out pass: shared by every rank where their weights are equal at an epoch end.
"""

from __future__ import annotations

MODES = ("every_step", "local_sgd", "diloco")
WIRES = ("none", "fp16", "bf16")
"""sync.compression: what the period's change crosses the network in (core/localsgd.py WIRE)."""
PERIODS = (4, 8, 16, 32, 64)
"""The periods plan tries, the shortest (closest to every-step training) first."""


def label(cfg) -> str:
    """The run's setting as one word: comm.compression, or MODE:H[:τ[:WIRE]] when synchronising every H steps."""
    if cfg.sync.mode == "every_step":
        return cfg.comm.compression
    return stream_label(cfg.sync.mode, cfg.sync.period, cfg.sync.delay_steps, cfg.sync.compression)


def stream_label(mode: str, period: int, delay: int = 0, wire: str = "none") -> str:
    """MODE:H, with :τ where the average streams behind and :WIRE where it crosses in 16 bits; a blocking
    fp32 average keeps the plain MODE:H its recorded curves are keyed by."""
    tail = f":{delay}" if delay or wire != "none" else ""
    return f"{mode}:{period}{tail}" + (f":{wire}" if wire != "none" else "")


def _fields(text: str) -> tuple[str, int, int, str] | None:
    """(mode, H, τ, wire) of a sync label; None for a compression or anything malformed."""
    mode, *rest = text.split(":")
    if mode not in MODES[1:] or not 1 <= len(rest) <= 3:
        return None
    period = rest[0]
    delay = rest[1] if len(rest) > 1 else "0"
    wire = rest[2] if len(rest) > 2 else "none"
    if not (period.isdigit() and delay.isdigit() and wire in WIRES) or int(period) < 2 or int(delay) >= int(period):
        return None
    return mode, int(period), int(delay), wire


def parse_label(text: str) -> tuple[str, int]:
    """(mode, period) of a label; ("every_step", 1) for a compression."""
    fields = _fields(text)
    return (fields[0], fields[1]) if fields else ("every_step", 1)


def parse_stream(text: str) -> tuple[int, str]:
    """(τ, wire) of a label: the steps its average streams behind and what the change crosses in; (0, "none")
    for a blocking fp32 average or every-step training."""
    fields = _fields(text)
    return (fields[2], fields[3]) if fields else (0, "none")


def paste_args(text: str, current: str = "none") -> list[str]:
    """The overrides that turn a run of label `current` into one of label `text` (what plan prints)."""
    mode, h = parse_label(text)
    now_mode, _ = parse_label(current)
    if mode == "every_step":
        return [f"comm.compression={text}"] + (["sync.mode=every_step"] if now_mode != "every_step" else [])
    compression_now = current if now_mode == "every_step" else "none"
    delay, wire = parse_stream(text)
    delay_now, wire_now = parse_stream(current)
    # the pasted line does what was priced: a delay or wire the config sets is overridden too
    return ([f"sync.mode={mode}", f"sync.period={h}"]
            + ([f"sync.delay_steps={delay}"] if delay or delay_now else [])
            + ([f"sync.compression={wire}"] if wire != "none" or wire_now != "none" else [])
            + (["comm.compression=none"] if compression_now != "none" else []))


def is_sync_point(step: int, *, period: int, step_in_epoch: int, steps_per_epoch: int, total: int,
                  every_steps: int = 0, delay: int = 0) -> bool:
    """Whether global `step` (1-based; `step_in_epoch` 0-based) starts an average across ranks: every
    `period` steps and at the last step; blocking (`delay` 0) also at an epoch's last step and at a
    checkpoint.every_steps save. Streamed, those use the last completed average instead: a checkpoint
    keeps each rank's own state (core/localsgd.py), so nothing there needs the ranks equal."""
    if step % period == 0 or step >= total:
        return True
    if delay:
        return False
    return step_in_epoch + 1 >= steps_per_epoch or bool(every_steps and step % every_steps == 0)


def evaluation_sharded(mode: str, delay_steps: int) -> bool:
    """Whether every rank holds the same weights at an epoch end, so that each can evaluate its share of the
    held-out split (core/evaluation.py) and plan prices that share: every-step training, or an average
    applied at once there (delay 0: an epoch end is a sync point). Streamed, each rank keeps what it trained
    since it sent, so the ranks' weights differ there."""
    return mode == "every_step" or delay_steps == 0


def node_groups(nodes: list[str]) -> list[list[int]]:
    """Ranks grouped by node (each rank's node identity), in the order the nodes first appear."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def weights(shares: list[int], nodes: list[str]) -> tuple[list[float], list[float]]:
    """(each rank's weight inside its node, each rank's weight in the whole job): its share of the
    samples of its node, and of all. Uniform batching: 1/ranks of the node, 1/world."""
    total = sum(shares)
    node_total: dict[str, int] = {}
    for share, node in zip(shares, nodes, strict=True):
        node_total[node] = node_total.get(node, 0) + share
    inside = [share / node_total[node] for share, node in zip(shares, nodes, strict=True)]
    return inside, [share / total for share in shares]
