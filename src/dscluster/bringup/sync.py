"""`dscluster sync`: the head's checkout (and check's output, and optionally a data folder) to
every node, at the same paths, for a lab without a shared filesystem.

Parts: the checkout (git's tracked files) and check's state (env files, check.json), compared by
sha256; a data folder (--data DIR), compared by size and mtime since a dataset is large. Each node
is scanned first (manifest.SCAN_CODE over the SSH session) so only what differs is copied and a
second run copies nothing. rsync where the head and every node have it, else SFTP (transfer.py).
Nothing is deleted. --dry-run scans and says what would be copied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dscluster.errors import UsageError
from dscluster.files import manifest, paths, state
from dscluster.node.hosts import parse_hostfile
from dscluster.ssh import remote, transfer

STATE_FILES = ("cluster.env", "check.json")


@dataclass
class SyncOptions:
    hostfile: str = "hosts.txt"
    user: str | None = None
    data: str | None = None
    dry_run: bool = False
    timeout: float = 600.0


@dataclass
class Part:
    """One folder to copy: its root (the same path on every node) and the head's scan of it."""

    name: str           # "checkout" | "state" | "data"
    root: str
    by_hash: bool
    head: manifest.Scan


@dataclass
class NodeSync:
    """What one node needed and got."""

    node: str
    method: str = "sftp"
    to_copy: dict[str, list[str]] = field(default_factory=dict)   # part -> relative paths
    bytes_to_copy: int = 0
    copied_files: int = 0
    copied_bytes: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return {"node": self.node, "method": self.method, "files": {k: len(v) for k, v in self.to_copy.items()},
                "bytes": self.bytes_to_copy, "copied_files": self.copied_files, "copied_bytes": self.copied_bytes,
                "first": {k: v[:5] for k, v in self.to_copy.items() if v}, "error": self.error}


def plan_parts(data: str | None) -> list[Part]:
    """The head's side: what each part holds here. Bad input (no checkout, no data folder): exit 2."""
    root = paths.checkout_root()
    files = manifest.checkout_files(root) if root else None
    if root is None or files is None:
        raise UsageError("dscluster sync copies a git checkout's tracked files, but dscluster runs from "
                         f"{root or 'an installed copy'}, which is not a git checkout: "
                         "install it on every node instead")
    parts = [Part("checkout", str(root), True, manifest.scan_here(manifest.request(str(root), files, hash=True)))]
    state_dir = state.state_dir().absolute()
    names = ([f"env/{p.name}" for p in sorted((state_dir / "env").glob("*.env"))]
             + [n for n in STATE_FILES if (state_dir / n).is_file()])
    if names:
        scanned = manifest.scan_here(manifest.request(str(state_dir), names, hash=True))
        parts.append(Part("state", str(state_dir), True, scanned))
    if data is not None:
        data_dir = os.path.abspath(data)
        if not os.path.isdir(data_dir):
            raise UsageError(f"--data {data}: no such folder on this machine (the head)")
        if any(data_dir == p.root or data_dir.startswith(p.root + "/") for p in parts):
            raise UsageError(f"--data {data}: it lies inside {parts[0].root}, which sync copies already")
        parts.append(Part("data", data_dir, False, manifest.scan_here(manifest.request(data_dir, None, hash=False))))
    return parts


def _needs(part: Part, node: manifest.Scan) -> list[str]:
    changed, missing = manifest.differing(part.head, node, by_hash=part.by_hash)
    return sorted(changed + missing)


def run_sync(opts: SyncOptions, on_progress: Callable[[str, int, int, int, int], None] | None = None,
             show_progress: bool = True) -> list[NodeSync]:
    """Scan every node, then copy what differs (unless dry-run). on_progress(node, files done,
    files, bytes done, bytes) after each file."""
    hostfile = parse_hostfile(opts.hostfile)
    known_hosts = state.known_hosts_path()
    if not known_hosts.exists():
        raise UsageError(f"{known_hosts}: no pinned host keys; run `dscluster setup --hostfile {opts.hostfile}` first")
    parts = plan_parts(opts.data)
    head_rsync = shutil.which("rsync") is not None
    python = paths.venv_bin() / "python"
    python = str(python if python.exists() else Path(sys.executable))
    targets = [remote.Target(name=h.name, host=h.name, user=opts.user) for h in hostfile.hosts]
    results = {t.name: NodeSync(t.name) for t in targets}
    sessions: dict[str, object] = {}
    lock = threading.Lock()

    def scan(t: remote.Target) -> bool:
        client = transfer.connect_node(t, known_hosts=known_hosts)
        with lock:
            sessions[t.name] = client
        r = results[t.name]
        for part in parts:
            req = manifest.request(part.root, list(part.head.files), hash=part.by_hash)
            res = remote.run(client, manifest.scan_command(python), timeout=300, input=req, check=True)
            need = _needs(part, manifest.Scan.from_json(res.stdout, t.name))
            r.to_copy[part.name] = need
            r.bytes_to_copy += sum(part.head.files[n][0] for n in need)
        return remote.run(client, "command -v rsync", timeout=30).rc == 0

    try:
        scanned = remote.fan_out(targets, scan, timeout=opts.timeout, description="scanning nodes",
                                 show_progress=show_progress)
        for name, o in scanned.items():
            if not o.ok:
                results[name].error = f"{type(o.error).__name__}: {o.error}"
        use_rsync = head_rsync and all(o.ok and o.value for o in scanned.values())
        if not opts.dry_run:
            ready = [t for t in targets if results[t.name].error is None and any(results[t.name].to_copy.values())]

            def copy(t: remote.Target) -> None:
                _copy_node(t, sessions[t.name], parts, results[t.name], use_rsync, on_progress)

            for name, o in remote.fan_out(ready, copy, timeout=opts.timeout, description="copying",
                                          show_progress=False).items():
                if not o.ok:
                    results[name].error = f"{type(o.error).__name__}: {o.error}"
    finally:
        for c in sessions.values():
            c.close()
    return [results[t.name] for t in targets]


def _copy_node(t: remote.Target, client, parts: list[Part], r: NodeSync, use_rsync: bool,
               on_progress: Callable | None) -> None:
    total_files = sum(len(v) for v in r.to_copy.values())
    last = [0.0]

    def on_file(rel: str, size: int) -> None:
        r.copied_files += 1
        r.copied_bytes += size
        now = time.monotonic()
        if on_progress and (now - last[0] > 1.0 or r.copied_files == total_files):
            last[0] = now
            on_progress(t.name, r.copied_files, total_files, r.copied_bytes, r.bytes_to_copy)

    r.method = "rsync" if use_rsync else "sftp"
    for part in parts:
        rels = r.to_copy.get(part.name) or []
        if not rels:
            continue
        if use_rsync:
            argv = transfer.rsync_argv(part.root, t.login, part.root)
            subprocess.run(argv, input="\0".join(rels), text=True, check=True, capture_output=True, timeout=3600)
            for rel in rels:
                on_file(rel, part.head.files[rel][0])
        else:
            transfer.sftp_put(client, part.root, part.root, rels, on_file)
