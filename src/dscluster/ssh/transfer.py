"""Copying files between the head and a node over the SSH that `dscluster setup` configured.

Two ways, one contract (a root folder, a list of relative paths, the same root path on the
other side): rsync where the head and the node both have it, else SFTP through the Paramiko
session (a lab may have no rsync). Every SFTP copy lands atomically: written to a temporary
name beside the target, given the source's mode and mtime, then renamed over the target, so a
reader (or an interrupted copy) never sees half a file. Nothing is ever deleted: a file is only
replaced by its new version, and only at a path inside the root it was asked for.

`dscluster sync` pushes the checkout to the nodes; `dscluster collect` pulls a run's files home.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import stat
from pathlib import Path
from typing import Callable

import paramiko

from dscluster.errors import UsageError
from dscluster.files import state
from dscluster.ssh import remote

OnFile = Callable[[str, int], None]   # (relative path, bytes) after each file


def connect_node(target: remote.Target, *, known_hosts: Path | None = None, timeout: float = 30) -> paramiko.SSHClient:
    """A session as `dscluster setup` configured it: the pinned host keys (the project's, or a
    node's own ~/.ssh/known_hosts that setup filled), the key setup left at ~/.ssh/id_ed25519, and
    $DSCLUSTER_SSH_PASSWORD only where it is set."""
    key = Path.home() / ".ssh" / "id_ed25519"
    return remote.connect(target, known_hosts=known_hosts or state.known_hosts_path(),
                          password=os.environ.get("DSCLUSTER_SSH_PASSWORD"),
                          key_filename=str(key) if key.exists() else None, timeout=timeout)


def safe_rel(rel: str) -> str:
    """A relative path that stays inside its root (no '..', not absolute)."""
    norm = posixpath.normpath(rel)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise UsageError(f"{rel!r}: not a path inside the folder being copied")
    return norm


def _mkdirs(sftp: paramiko.SFTPClient, path: str, made: set[str]) -> None:
    if path in made or path in ("", "/"):
        return
    try:
        if stat.S_ISDIR(sftp.stat(path).st_mode):
            made.add(path)
            return
    except FileNotFoundError:
        pass
    _mkdirs(sftp, posixpath.dirname(path), made)
    try:
        sftp.mkdir(path)
    except OSError:
        if not stat.S_ISDIR(sftp.stat(path).st_mode):
            raise
    made.add(path)


def sftp_put(client: paramiko.SSHClient, local_root: str, remote_root: str, rels: list[str],
             on_file: OnFile | None = None) -> int:
    """Copy `rels` from local_root to the same paths under remote_root; returns bytes sent."""
    sftp = client.open_sftp()
    made: set[str] = set()
    sent = 0
    try:
        for rel in rels:
            rel = safe_rel(rel)
            src, dest = os.path.join(local_root, rel), posixpath.join(remote_root, rel)
            _mkdirs(sftp, posixpath.dirname(dest), made)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                try:
                    sftp.remove(dest)   # a link is replaced, as rsync replaces it
                except FileNotFoundError:
                    pass
                sftp.symlink(os.readlink(src), dest)
            else:
                part = f".{posixpath.basename(dest)}.{secrets.token_hex(4)}.part"
                tmp = posixpath.join(posixpath.dirname(dest), part)
                sftp.put(src, tmp, confirm=True)
                sftp.chmod(tmp, stat.S_IMODE(st.st_mode))
                sftp.utime(tmp, (st.st_atime, st.st_mtime))
                sftp.posix_rename(tmp, dest)
            sent += st.st_size
            if on_file:
                on_file(rel, st.st_size)
    finally:
        sftp.close()
    return sent


def sftp_get(client: paramiko.SSHClient, remote_root: str, local_root: str, rels: list[str],
             on_file: OnFile | None = None) -> int:
    """Copy `rels` from remote_root on the node to the same paths under local_root; returns bytes."""
    sftp = client.open_sftp()
    got = 0
    try:
        for rel in rels:
            rel = safe_rel(rel)
            src, dest = posixpath.join(remote_root, rel), Path(local_root) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            st = sftp.stat(src)
            tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
            sftp.get(src, str(tmp))
            os.chmod(tmp, stat.S_IMODE(st.st_mode or 0o644))
            os.utime(tmp, (st.st_atime or st.st_mtime, st.st_mtime))
            os.replace(tmp, dest)
            got += st.st_size or 0
            if on_file:
                on_file(rel, st.st_size or 0)
    finally:
        sftp.close()
    return got


def rsync_argv(local_root: str, login: str, remote_root: str, *, push: bool = True) -> list[str]:
    """rsync of the files listed on its stdin (NUL-separated) between the same root on both sides,
    over ssh in batch mode (the keys and pinned host keys setup installed). Never --delete."""
    there = f"{login}:{remote_root.rstrip('/')}/"
    here = local_root.rstrip("/") + "/"
    return ["rsync", "-a", "--from0", "--files-from=-", "-e", "ssh -o BatchMode=yes",
            *((here, there) if push else (there, here))]
