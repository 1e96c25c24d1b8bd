"""What the lab user must reach inside the nodes, and the mounts that make it reachable.

Nodes share the host's files at the same paths but run as a non-root lab user, who cannot reach a
clone in a 0700 `mktemp -d`, a 0750 home or a pyenv Python in /root, and the failures (exit 126,
PermissionError) name none of them. So per target directory: an ancestor the user cannot traverse
is overlaid in the nodes with a 0711 top layer (the host's directory is never chmod'ed); a target
under it is bind-mounted back so writes land on the host; a target under /home is bind-mounted into
the node's own /home. A directory inside a target that the user cannot enter, or above the lab's
state directory, is refused with the fix (docs/simulated-lab.md). Pure: modes come from `stat`.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import Callable

from dscluster.errors import UsageError

OVERLAY = "overlay"      # show the directory as 0711, contents from the host
REBIND = "bind"         # bind the host's directory back over its path (after overlays above it)
HOME_BIND = "home-bind"  # bind the host's directory into the node's own /home
# Characters overlayfs options or the anchor's mount lines cannot carry safely.
_UNSAFE = set(",:\\\n\t\"'")


@dataclass(frozen=True)
class DirInfo:
    mode: int
    uid: int
    gid: int


def can_traverse(info: DirInfo, uid: int, gid: int) -> bool:
    if uid == info.uid:
        return bool(info.mode & 0o100)
    if gid == info.gid:
        return bool(info.mode & 0o010)
    return bool(info.mode & 0o001)


def can_list(info: DirInfo, uid: int, gid: int) -> bool:
    """Enter and list (Python's import system lists package directories)."""
    if uid == info.uid:
        return info.mode & 0o500 == 0o500
    if gid == info.gid:
        return info.mode & 0o050 == 0o050
    return info.mode & 0o005 == 0o005


def ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/', '/a', '/a/b'] (shallowest first, the path itself excluded)."""
    out, cur = [], posixpath.dirname(path)
    while True:
        out.append(cur)
        if cur == "/":
            break
        cur = posixpath.dirname(cur)
    return out[::-1]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _depth(path: str) -> int:
    return 0 if path == "/" else path.count("/")


def plan_reach(
    targets: list[str],
    stat: Callable[[str], DirInfo | None],
    *,
    uid: int,
    gid: int,
    always_overlaid: tuple[str, ...] = ("/root",),
    node_home: str = "/home",
    keep_clear: tuple[str, ...] = (),
) -> list[list[str]]:
    """Mount operations [kind, path], in the order the node must make them (shallowest first).

    `always_overlaid` directories are overlaid by the node anyway (its own /root); `keep_clear`
    paths (the lab's own directory) must stay off every overlay: overlayfs refuses a layer
    inside its own lower directory."""
    norm = sorted({posixpath.normpath(t) for t in targets})
    outer = [t for t in norm if not any(t != o and _under(t, o) for o in norm)]
    problems: list[str] = []
    overlays: set[str] = set()
    for t in norm:
        inside = next((o for o in outer if _under(t, o)), t)
        for d in ancestors(t) + [t]:
            info = stat(d)
            if info is None:
                continue
            if _under(d, inside):
                # Part of what the nodes share: it must work as it is on the host.
                ok = can_list(info, uid, gid) if d == t else can_traverse(info, uid, gid)
                if not ok:
                    need = "o+rx" if d == t else "o+x"
                    problems.append(
                        f"{d} (mode {info.mode & 0o7777:04o}): the nodes use it as it is on the host and "
                        f"the lab user (uid {uid}) cannot {'read' if d == t else 'enter'} it; fix: "
                        f"`chmod {need} {d}`, or put the checkout where others can read it"
                    )
            elif _under(d, node_home) or d in always_overlaid or can_traverse(info, uid, gid):
                continue
            elif any(_under(k, d) for k in keep_clear):
                problems.append(
                    f"{d} (mode {info.mode & 0o7777:04o}): the lab user cannot enter it and the lab's own "
                    f"directory lies below it, so it cannot be overlaid; fix: `chmod o+x {d}`"
                )
            elif _UNSAFE & set(d):
                problems.append(f"{d}: the lab user cannot enter it and its name has characters a mount "
                                f"option cannot carry; fix: `chmod o+x {d}` or rename it")
            else:
                overlays.add(d)
    if problems:
        raise UsageError("the lab user cannot reach what the nodes share:\n  " + "\n  ".join(problems))

    ops = [[OVERLAY, d] for d in overlays]
    covered = tuple(overlays) + tuple(always_overlaid)
    for t in outer:
        if _under(t, node_home) and t != node_home:
            ops.append([HOME_BIND, t])
        elif any(_under(t, c) for c in covered):
            if _UNSAFE & set(t):
                raise UsageError(f"{t}: its name has characters a mount option cannot carry; rename it")
            ops.append([REBIND, t])
    ops.sort(key=lambda op: (_depth(op[1]), op[1]))
    return ops


def host_stat(path: str) -> DirInfo | None:
    """The host's mode and owner of a directory (None if it is not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return DirInfo(st.st_mode, st.st_uid, st.st_gid)
