"""The run comes home: each node's part of runs/<id>/ to the head's copy, where there is no
shared filesystem (each node writes its own ranks' metrics, env records, telemetry and traces
into its own runs/<id>/ at the same path).

Two directions, one rule (`to_bring`): a file the other side lacks, or whose size differs and
whose mtime is not older, is copied; nothing is deleted. Files in a run directory have one
writer each and only grow, so the copy on the writer's node is the one to keep.
- `pull` (`dscluster collect RUN_DIR`, and `dscluster launch` when the job ends): the head
  scans every node's run directory over SSH and fetches what it lacks.
- `push` (entry_cn.sh's local rank 0 on a node other than rank 0's, when its ranks have ended):
  the node sends its part to rank 0's node, the head of the README's hand-typed mpirun.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dscluster.errors import UsageError
from dscluster.files import manifest, paths
from dscluster.node.hosts import parse_hostfile
from dscluster.rundir import agree
from dscluster.ssh import remote, transfer


@dataclass
class Collected:
    node: str
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    error: str | None = None
    split_into: list[str] = field(default_factory=list)
    """Other run directories on the node whose records name this run's launcher job (a split run)."""

    def to_dict(self) -> dict:
        return {"node": self.node, "files": len(self.files), "bytes": self.bytes, "first": self.files[:5],
                "error": self.error, "split_into": self.split_into}


def to_bring(src: manifest.Scan, dst: manifest.Scan) -> list[str]:
    """Files of `src` that `dst` lacks, or that differ in size and are not older there (whole seconds)."""
    out = []
    for rel, (size, mtime, _) in src.files.items():
        theirs = dst.files.get(rel)
        if theirs is None or (theirs[0] != size and int(mtime) >= int(theirs[1])):
            out.append(rel)
    return sorted(out)


def _python() -> str:
    py = paths.venv_bin() / "python"
    return str(py if py.exists() else Path(sys.executable))


def _scan_remote(client, root: str, name: str) -> manifest.Scan:
    res = remote.run(client, manifest.scan_command(_python()), timeout=120,
                     input=manifest.request(root, None, hash=False), check=True)
    return manifest.Scan.from_json(res.stdout, name)


def pull(run_dir: str | Path, hostfile: str, user: str | None = None, timeout: float = 300,
         show_progress: bool = True) -> list[Collected]:
    """Fetch every node's part of `run_dir` (the same absolute path there) into the head's copy."""
    root = os.path.abspath(run_dir)
    hf = parse_hostfile(hostfile)
    results = {h.name: Collected(h.name) for h in hf.hosts}

    job = agree.run_job(Path(root))

    def work(t: remote.Target) -> None:
        client = transfer.connect_node(t)
        try:
            if job:  # a split run: this job's ranks on the node wrote under another run directory
                listing = remote.run(client, agree.split_command(Path(root), job), timeout=60).stdout
                results[t.name].split_into = agree.split_dirs(Path(root), listing)
            theirs = _scan_remote(client, root, t.name)
            if not theirs.exists:
                return
            ours = manifest.scan_here(manifest.request(root, None, hash=False))
            need = to_bring(theirs, ours)
            results[t.name].files = need
            if not need:  # nothing to bring (or the node is this machine: its files are these)
                return
            results[t.name].bytes = transfer.sftp_get(client, root, root, need)
        finally:
            client.close()

    targets = [remote.Target(name=h.name, host=h.name, user=user) for h in hf.hosts]
    for name, o in remote.fan_out(targets, work, timeout=timeout, description="collecting the run",
                                  show_progress=show_progress).items():
        if not o.ok:
            results[name].error = f"{type(o.error).__name__}: {o.error}"
    return [results[h.name] for h in hf.hosts]


def push(run_dir: str | Path, head: str, timeout: float = 120) -> Collected:
    """Send this node's part of `run_dir` to `head` (an address or name in ~/.ssh/known_hosts)."""
    root = os.path.abspath(run_dir)
    if not os.path.isdir(root):
        raise UsageError(f"{run_dir}: no such run directory on this node")
    out = Collected(head)
    client = transfer.connect_node(remote.Target(name=head, host=head),
                                   known_hosts=Path.home() / ".ssh" / "known_hosts", timeout=min(timeout, 30))
    try:
        theirs = _scan_remote(client, root, head)
        ours = manifest.scan_here(manifest.request(root, None, hash=False))
        out.files = to_bring(ours, theirs)
        out.bytes = transfer.sftp_put(client, root, root, out.files)
    finally:
        client.close()
    return out


def timed_pull(run_dir: str | Path, hostfile: str, **kw) -> tuple[list[Collected], float]:
    t0 = time.monotonic()
    got = pull(run_dir, hostfile, **kw)
    return got, time.monotonic() - t0
