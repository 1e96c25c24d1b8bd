"""How often the ranks' models meet (`sync.mode`, `sync.period`): the rules training and plan share.

Pure: no torch. train/localsgd.py runs them, plan prices them (plan/model.py) and prints them to paste.

- The label: one word for a run's communication setting, where plan keys its predictions and curves:
  comm.compression on the every-step path (none, fp16, bf16, powersgd), `MODE:H` (local_sgd:8,
  diloco:16) for a setting that averages every H steps.
- The sync points: global step numbers, the same on every rank.
- The weights: a rank's share of its node's samples, and of all.
"""

from __future__ import annotations

MODES = ("every_step", "local_sgd", "diloco")
PERIODS = (4, 8, 16, 32, 64)
"""The periods plan tries, the shortest (closest to every-step training) first."""


def label(cfg) -> str:
    """The run's setting as one word: comm.compression, or MODE:H when synchronising every H steps."""
    if cfg.sync.mode == "every_step":
        return cfg.comm.compression
    return f"{cfg.sync.mode}:{cfg.sync.period}"


def parse_label(text: str) -> tuple[str, int]:
    """(mode, period) of a label; ("every_step", 1) for a compression."""
    mode, _, h = text.partition(":")
    if mode in MODES[1:] and h.isdigit() and int(h) >= 2:
        return mode, int(h)
    return "every_step", 1


def paste_args(text: str, current: str = "none") -> list[str]:
    """The overrides that turn a run of label `current` into one of label `text` (what plan prints)."""
    mode, h = parse_label(text)
    now_mode, _ = parse_label(current)
    if mode == "every_step":
        return [f"comm.compression={text}"] + (["sync.mode=every_step"] if now_mode != "every_step" else [])
    compression_now = current if now_mode == "every_step" else "none"
    return ([f"sync.mode={mode}", f"sync.period={h}"]
            + (["comm.compression=none"] if compression_now != "none" else []))


def is_sync_point(step: int, *, period: int, step_in_epoch: int, steps_per_epoch: int, total: int,
                  every_steps: int = 0) -> bool:
    """Whether global `step` (1-based; `step_in_epoch` 0-based) ends with an average across ranks:
    every `period` steps, at an epoch's last step, at a checkpoint.every_steps save and at the last step."""
    return (step % period == 0 or step_in_epoch + 1 >= steps_per_epoch or step >= total
            or bool(every_steps and step % every_steps == 0))


def node_groups(hosts: list[str]) -> list[list[int]]:
    """Ranks grouped by host (hosts by rank), in the order the hosts first appear."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


def weights(shares: list[int], hosts: list[str]) -> tuple[list[float], list[float]]:
    """(each rank's weight inside its node, each rank's weight in the whole job): its share of the
    samples of its node, and of all. Uniform batching: 1/ranks of the node, 1/world."""
    total = sum(shares)
    node_total: dict[str, int] = {}
    for s, h in zip(shares, hosts, strict=True):
        node_total[h] = node_total.get(h, 0) + s
    return [s / node_total[h] for s, h in zip(shares, hosts, strict=True)], [s / total for s in shares]
