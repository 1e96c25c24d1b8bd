"""A lab without a shared filesystem (`sim up --no-shared-fs`): each node its own files.

Like workstations without NFS, every node gets in its own mount namespace: its own clone of the
checkout at its path (the host's tracked files, mode and mtime kept, in one commit that is the same
on every node, owned by the lab user so `dscluster sync` can update it); its own `Lab.shared`; and
the checkout's .venv bound back from the host, software installed the same way on every machine.
Plan first (pure), then the anchor's mount lines, then the host-side files. The ops are stored in
the lab state, and all they use lies in the node's directory, which `sim down` removes.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import shutil
import subprocess
from pathlib import Path

from dscluster.sim.ns import SimError

PRIVATE = "private"        # bind the node's own copy (nodedir/private/<i>) over the path
KEEP_SOFTWARE = "keep-sw"  # set a shared software folder aside before the copy hides it
RESTORE_SOFTWARE = "restore-sw"  # bind it back on top of the copy


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def plan_private(repo: str, shared: str, software: list[str]) -> list[list[str]]:
    """Mount ops [kind, path] in the order the anchor makes them. `software`: folders the nodes
    share at the host's path; those inside the checkout stay shared on top of the copy."""
    inside = sorted({posixpath.normpath(d) for d in software if _under(d, repo) and d != repo})
    inside = [d for d in inside if not any(d != o and _under(d, o) for o in inside)]
    return ([[KEEP_SOFTWARE, d] for d in inside] + [[PRIVATE, repo], [PRIVATE, shared]]
            + [[RESTORE_SOFTWARE, d] for d in inside])


def anchor_lines(ops: list[list[str]], nodedir: str) -> list[str]:
    """Shell lines (after the reach mounts) that give the node its own files."""
    q = shlex.quote
    lines, private = [], 0
    for i, (kind, path) in enumerate(ops):
        if kind == KEEP_SOFTWARE:
            lines.append(f"mount --bind {q(path)} {q(f'{nodedir}/keep-sw/{i}')}")
        elif kind == PRIVATE:
            lines.append(f"mount --bind {q(f'{nodedir}/private/{private}')} {q(path)}")
            private += 1
        elif kind == RESTORE_SOFTWARE:
            keep = next(j for j, op in enumerate(ops) if op == [KEEP_SOFTWARE, path])
            lines.append(f"mount --bind {q(f'{nodedir}/keep-sw/{keep}')} {q(path)}")
    return lines


# Not part of the tree where a checkout arrives without its git metadata (a copy of a working tree).
_NOT_TREE = {".git", ".venv", ".dscluster", "runs", "__pycache__", ".pytest_cache", ".cache", ".whl", ".nettools",
             ".gl"}


def tracked_files(repo: str) -> list[str]:
    """The checkout's tracked files that exist in its working tree (git's own list); for a copy
    without git metadata, every file but environments, caches, state and runs."""
    try:
        res = subprocess.run(["git", "-C", repo, "ls-files", "-z"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        res = None
    if res is not None and res.returncode == 0:
        return [p for p in res.stdout.split("\0") if p and os.path.lexists(os.path.join(repo, p))]
    out = []
    for top, dirs, names in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_TREE and not d.endswith(".egg-info"))
        out += [os.path.relpath(os.path.join(top, n), repo) for n in sorted(names)]
    return out


def make_private_dirs(ops: list[list[str]], nodedir: str, uid: int, gid: int, files: list[str],
                      git_from: str | None = None) -> None:
    """The node's copies (the checkout's `files` as a one-commit clone, an empty shared folder) and
    the set-aside points. `git_from`: a node directory whose clone's .git to copy (the same commit)."""
    node_dir = Path(nodedir)
    private = 0
    for i, (kind, path) in enumerate(ops):
        if kind == KEEP_SOFTWARE:
            (node_dir / "keep-sw" / str(i)).mkdir(parents=True, exist_ok=True)
        elif kind == PRIVATE:
            dest = node_dir / "private" / str(private)
            private += 1
            dest.mkdir(parents=True, exist_ok=True)
            if private == 1:   # the checkout
                _copy_files(path, dest, files)
                if git_from is None:
                    _commit_snapshot(dest)
                else:
                    shutil.copytree(Path(git_from) / "private" / "0" / ".git", dest / ".git", symlinks=True)
                _link_venv(path, dest)   # after the commit: the link is the node's install, not the tree
            _chown_tree(dest, uid, gid)
            os.chmod(dest, 0o755)
        elif kind == RESTORE_SOFTWARE:
            point = node_dir / "private" / "0" / os.path.relpath(path, ops_checkout(ops))
            point.mkdir(parents=True, exist_ok=True)   # the mount point, inside the copy


def ops_checkout(ops: list[list[str]]) -> str:
    return next(path for kind, path in ops if kind == PRIVATE)


def _copy_files(src: str, dest: Path, files: list[str]) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(src, rel), target, follow_symlinks=False)


# A fixed author and date: the snapshot commit is the same object on every node and every `sim up`
# of the same tree, so `git rev-parse HEAD` agrees where the files do.
_GIT_DATE = "946684800 +0000"  # git's raw form: seconds since the epoch, and the zone
_GIT_ENV = {"GIT_AUTHOR_NAME": "dscluster sim", "GIT_AUTHOR_EMAIL": "sim@dscluster.invalid",
            "GIT_COMMITTER_NAME": "dscluster sim", "GIT_COMMITTER_EMAIL": "sim@dscluster.invalid",
            "GIT_AUTHOR_DATE": _GIT_DATE, "GIT_COMMITTER_DATE": _GIT_DATE}


def _commit_snapshot(dest: Path) -> None:
    if shutil.which("git") is None:
        return   # a host without git: plain copies (check and sync then have no file list to compare)
    env = {**os.environ, **_GIT_ENV}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "checkout as sim up found it"]):
        res = subprocess.run(["git", "-c", "safe.directory=*", "-c", "init.defaultBranch=main", "-C", str(dest), *argv],
                             capture_output=True, text=True, timeout=120, env=env)
        if res.returncode != 0:
            raise SimError(f"--no-shared-fs: `git {' '.join(argv)}` in the node's copy failed: {res.stderr.strip()}")


def _link_venv(repo: str, dest: Path) -> None:
    """A checkout whose .venv is a link to an environment elsewhere (a GPU host's shared venv): the
    copy links to the same place, as `make venv` on every machine would give the same path."""
    venv = Path(repo) / ".venv"
    if venv.is_symlink() and not (dest / ".venv").exists():
        os.symlink(os.readlink(venv), dest / ".venv")


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    for root, dirs, names in os.walk(top):
        for name in [*dirs, *names]:
            os.lchown(os.path.join(root, name), uid, gid)
    os.lchown(top, uid, gid)


def host_path(ops: list[list[str]], nodedir: str, path: str | os.PathLike) -> Path:
    """Where a file a node sees at `path` lies on the host: in the node's own copy when `path`
    is under one of its private folders (and not under software bound back), else `path`."""
    p = posixpath.normpath(os.fspath(path))
    if any(kind == RESTORE_SOFTWARE and _under(p, d) for kind, d in ops):
        return Path(p)
    private = [d for kind, d in ops if kind == PRIVATE]
    for i, d in enumerate(private):
        if _under(p, d):
            return Path(nodedir) / "private" / str(i) / os.path.relpath(p, d)
    return Path(p)
