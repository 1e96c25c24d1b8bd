"""What a checkout (or a data folder) holds, file by file: what `check` compares and `sync` copies.

The checkout's files are git's tracked files as in the head's working tree (`git ls-files`). One
scanner, `SCAN_CODE`, runs on the head and, through the SSH session, on every node (one Python
start; the request on stdin, JSON on stdout), so both sides measure the same way:
    request  {"root": DIR, "files": [REL, ...] | null (walk DIR), "hash": bool, "markers": [PATH, ...]}
    answer   {"exists": bool, "commit": SHA | null, "files": {REL: [size, mtime, sha256 | null]},
              "markers": {PATH: bool}}
A file absent from the answer is missing there; a marker the head just made that the node sees
means the folder is shared (NFS), not a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

SCAN_CODE = r'''
import hashlib, json, os, subprocess, sys
req = json.load(sys.stdin)
root = req["root"]
def digest(path):
    if os.path.islink(path):
        return "link:" + os.readlink(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
names = req["files"]
if names is None:
    names = []
    for top, dirs, files in os.walk(root):
        dirs.sort()
        names += [os.path.relpath(os.path.join(top, f), root) for f in sorted(files)]
out = {}
for rel in names:
    p = os.path.join(root, rel)
    try:
        st = os.lstat(p)
        out[rel] = [st.st_size, st.st_mtime, digest(p) if req["hash"] else None]
    except OSError:
        pass
commit = None
try:
    r = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
    commit = r.stdout.strip() if r.returncode == 0 else None
except (OSError, subprocess.SubprocessError):
    pass
print(json.dumps({"exists": os.path.isdir(root), "commit": commit, "files": out,
                  "markers": {m: os.path.exists(m) for m in req.get("markers", [])}}))
'''


@dataclass
class Scan:
    """One side's answer to a scan request."""

    exists: bool
    commit: str | None
    files: dict[str, list]          # rel -> [size, mtime, sha256 | None]
    markers: dict[str, bool]

    @classmethod
    def from_json(cls, text: str, where: str) -> "Scan":
        try:
            doc = json.loads(text.strip().splitlines()[-1])
            return cls(bool(doc["exists"]), doc.get("commit"), dict(doc["files"]), dict(doc.get("markers") or {}))
        except (IndexError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: unreadable scan answer ({e}): {text[-300:]!r}") from None

    @property
    def total_bytes(self) -> int:
        return sum(v[0] for v in self.files.values())


def request(root: str, files: list[str] | None, *, hash: bool, markers: list[str] = ()) -> str:
    return json.dumps({"root": root, "files": files, "hash": hash, "markers": list(markers)})


def scan_command(python: str) -> str:
    """The shell command a session runs to scan (the request goes to its stdin)."""
    return f"{shlex.quote(python)} -c {shlex.quote(SCAN_CODE)}"


def scan_here(req: str) -> Scan:
    """The same scan on this machine (the head)."""
    res = subprocess.run([sys.executable, "-c", SCAN_CODE], input=req, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise ValueError(f"scan failed here: {res.stderr.strip()[-300:]}")
    return Scan.from_json(res.stdout, "this machine")


def checkout_files(root: str | os.PathLike) -> list[str] | None:
    """The checkout's tracked files present in its working tree; None when it is not a git
    checkout (or git is missing): there is then no list of what belongs to it."""
    try:
        res = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return [p for p in res.stdout.split("\0") if p and os.path.lexists(os.path.join(root, p))]


def differing(head: Scan, node: Scan, *, by_hash: bool) -> tuple[list[str], list[str]]:
    """(files whose content differs, files missing on the node), by sha256 or by size and mtime in
    whole seconds (SFTP, version 3, carries whole seconds)."""
    changed, missing = [], []
    for rel, (size, mtime, sha) in head.files.items():
        theirs = node.files.get(rel)
        if theirs is None:
            missing.append(rel)
        elif (theirs[2] != sha) if by_hash else (theirs[0] != size or int(theirs[1]) != int(mtime)):
            changed.append(rel)
    return changed, missing


def tree_digest(scan: Scan) -> str:
    """One sha256 for a scan's files and contents (a short name for 'the same tree')."""
    h = hashlib.sha256()
    for rel in sorted(scan.files):
        h.update(f"{rel}\0{scan.files[rel][2]}\n".encode())
    return h.hexdigest()
