"""The checkpoint folder of a run: the `latest` pointer, which only ever names a complete checkpoint,
and which checkpoint a run resumes from. train writes the folder; the config's checks and
`dscluster diagnose` read it before any training starts."""

from __future__ import annotations

from pathlib import Path

from dscluster.errors import UsageError

LATEST = "latest"


def find_latest(ckpt_dir: Path) -> str | None:
    """The tag `latest` names, if it and its folder exist."""
    p = Path(ckpt_dir) / LATEST
    try:
        tag = p.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return tag if tag and (Path(ckpt_dir) / tag).is_dir() else None


def resume_decision(mode: str, ckpt_dir: Path) -> str | None:
    """The tag to resume from, None for a fresh start; resume=true with nothing is an error."""
    if mode == "false":
        return None
    tag = find_latest(ckpt_dir)
    if mode == "true" and tag is None:
        raise UsageError(
            f"checkpoint.resume=true but {ckpt_dir} has no complete checkpoint ('{LATEST}' missing or dangling); "
            "use checkpoint.resume=auto to start fresh when there is none, or point checkpoint.dir at the old run "
            "(or set DSCLUSTER_RUN_ID to the old run's id)"
        )
    return tag
