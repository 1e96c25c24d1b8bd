"""Checkpoints on a lab without a shared filesystem: every node keeps what its ranks need.

At start-up the ranks find out whether they share the run directory (`run_dir_shared`). Without one,
DeepSpeed saves node-locally and every node commits its own `latest`, so every node can resume on
its own. The rules here decide where a resume starts: the newer checkpoint every node holds after a
stop between two nodes' commits (`interrupted_commit`, `newest_held`), and a stop naming the node
where the nodes disagree otherwise (`resume_agreement`): never step 0 on some ranks and step N on
others. The whole story, ZeRO included: docs/file-layouts.md."""

from __future__ import annotations

import secrets
from pathlib import Path

from dscluster.core import dist
from dscluster.errors import UsageError


def run_dir_shared(rdir: Path, rank: int) -> bool:
    """Collective: True when every rank sees the run directory rank 0 sees (NFS)."""
    token = dist.all_gather_strings(secrets.token_hex(8) if rank == 0 else "")[0]
    marker = Path(rdir) / f".shared-probe-{token}"
    if rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("a rank that sees this file shares rank 0's run directory\n")
    dist.all_gather_strings("")   # rank 0's marker is written before anyone looks
    seen = dist.all_gather_strings("1" if marker.exists() else "0")
    if rank == 0:
        marker.unlink(missing_ok=True)
    return all(s == "1" for s in seen)


def writes_latest(rank: int, local_rank: int, shared: bool) -> bool:
    """Who commits `latest`: rank 0 on shared storage, every node's local rank 0 without it."""
    return rank == 0 if shared else local_rank == 0


def interrupted_commit(tags: list[str]) -> tuple[str, str] | None:
    """(newer, older) when every rank names a checkpoint and they name exactly two: what a run stopped
    between one node's commit of `latest` and another's leaves behind. None otherwise."""
    named = sorted(set(tags))
    if len(named) != 2 or "" in named:
        return None
    return named[1], named[0]


def newest_held(pair: tuple[str, str], held: list[str]) -> str | None:
    """Of `pair` (newer, older), the first whose folder every rank holds; `held[r]` is rank r's answer,
    one "1" or "0" per tag of the pair. A node commits `latest` only after every rank's save of it
    succeeded, so a tag one node committed is complete wherever its folder is."""
    for i, tag in enumerate(pair):
        if all(len(h) == len(pair) and h[i] == "1" for h in held):
            return tag
    return None


def resume_agreement(tags: list[str], hosts: list[str], ckpt_dir: Path, shared: bool) -> str | None:
    """The tag every rank resumes from, or a UsageError naming the nodes that see another one."""
    if len(set(tags)) <= 1:
        return tags[0] if tags and tags[0] else None
    best = max(t for t in tags if t)   # tags sort by epoch then step
    have = sorted({hosts[r] for r, t in enumerate(tags) if t == best})
    other = {}
    for r, t in enumerate(tags):
        if t != best:
            other.setdefault(hosts[r], t or "no checkpoint ('latest' missing)")
    lacking = "; ".join(f"{h} has {t}" for h, t in sorted(other.items()))
    if shared:
        fix = "checkpoint.dir must be storage every rank sees the same (like NFS)"
    else:
        fix = (f"no shared filesystem: copy {ckpt_dir}/{best} and {ckpt_dir}/latest from {have[0]} to "
               f"{', '.join(sorted(other))} at the same path (e.g. scp -r), "
               "or start fresh with checkpoint.resume=false")
    raise UsageError(f"the nodes would resume from different checkpoints in {ckpt_dir}: {', '.join(have)} "
                     f"{'has' if len(have) == 1 else 'have'} {best}; {lacking}. Training did not start: {fix}")
