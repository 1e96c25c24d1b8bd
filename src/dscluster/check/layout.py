"""Which file layout the lab has, node by node: is the checkout shared (NFS) or a copy, is the copy
the head's tree, is the run directory shared, is the data there.

Run over the check's SSH sessions after the probe. The head drops a marker file into its checkout
and its run directory; a node that sees the marker shares that folder with the head. Every node
scans the head's tracked files (manifest.SCAN_CODE: size, mtime, sha256) so a copy that differs
by one file is found and named. The findings are pure (`layout_findings`), the I/O is `probe_layout`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from dscluster.check.rules import Finding
from dscluster.files import manifest, paths
from dscluster.ssh import remote

MARKER_PREFIX = ".dscluster-layout-"
SHOW_FILES = 5


def _node_entry(head: manifest.Scan, node: manifest.Scan, co_marker: str | None, runs_marker: str | None) -> dict:
    changed, missing = manifest.differing(head, node, by_hash=True)
    # "unknown": the head could not drop its marker there (a checkout this user cannot write in)
    shared = node.markers.get(co_marker) if co_marker else None
    return {
        "checkout": ("unknown" if shared is None else "shared" if shared else "copy") if node.exists else "missing",
        "same_as_head": not changed and not missing,
        "commit": node.commit,
        "tree": manifest.tree_digest(node),
        "differs": changed[:SHOW_FILES], "differs_count": len(changed),
        "missing": missing[:SHOW_FILES], "missing_count": len(missing),
        "runs": (None if runs_marker is None else "shared" if node.markers.get(runs_marker) else "own"),
    }


def _data_entry(head: manifest.Scan, node: manifest.Scan) -> dict:
    changed, missing = manifest.differing(head, node, by_hash=False)
    return {"present": node.exists, "files": len(node.files), "bytes": node.total_bytes,
            "same_as_head": node.exists and not changed and not missing and len(node.files) == len(head.files)}


def probe_layout(targets, sessions: dict, facts: dict, python: str, timeout: float, runs_dir: str,
                 data_dir: str | None = None, show_progress: bool = True) -> dict:
    """The layout document (check.json's "layout"): the head's side and one entry per reached node."""
    root = paths.checkout_root()
    files = manifest.checkout_files(root) if root else None
    if root is None or files is None:
        return {"checkout": str(root) if root else None, "files": None,
                "note": "not a git checkout: nothing to compare", "nodes": {}}
    token = MARKER_PREFIX + secrets.token_hex(6)
    co_marker, runs_marker = _make_marker(str(root), token), _make_marker(runs_dir, token)
    try:
        req = manifest.request(str(root), files, hash=True, markers=[m for m in (co_marker, runs_marker) if m])
        head = manifest.scan_here(req)
        data_req = manifest.request(data_dir, None, hash=False) if data_dir else None
        head_data = manifest.scan_here(data_req) if data_req else None

        def work(t: remote.Target) -> tuple[manifest.Scan, manifest.Scan | None]:
            def scan(r: str) -> manifest.Scan:
                res = remote.run(sessions[t.name], manifest.scan_command(python), timeout=timeout, input=r, check=True)
                return manifest.Scan.from_json(res.stdout, t.name)
            return scan(req), (scan(data_req) if data_req else None)

        outcomes = remote.fan_out([t for t in targets if t.name in facts and t.name in sessions], work,
                                  timeout=timeout + 5, description="checkout and run directory",
                                  show_progress=show_progress)
    finally:
        for m in (co_marker, runs_marker):
            if m:
                Path(m).unlink(missing_ok=True)
    nodes = {}
    for name, o in outcomes.items():
        if not o.ok:
            nodes[name] = {"error": f"{type(o.error).__name__}: {o.error}"}
            continue
        scan, data = o.value
        nodes[name] = _node_entry(head, scan, co_marker, runs_marker)
        if data is not None:
            nodes[name]["data"] = _data_entry(head_data, data)
    return {"checkout": str(root), "commit": head.commit, "tree": manifest.tree_digest(head), "files": len(files),
            "runs": runs_dir, "data": None if head_data is None else {
                "path": data_dir, "present": head_data.exists, "files": len(head_data.files),
                "bytes": head_data.total_bytes},
            "nodes": nodes}


def _make_marker(folder: str, token: str) -> str | None:
    """A marker file in `folder` (made if missing), or None where the head cannot write there."""
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, token)
        with open(path, "w") as f:
            f.write("dscluster check: a node that sees this file shares this folder with the head\n")
        return path
    except OSError:
        return None


def layout_findings(layout: dict, hostfile: str) -> list[Finding]:
    """Errors for a copy that differs from the head's checkout or data; one info line for the layout."""
    out: list[Finding] = []
    sync = f"dscluster sync --hostfile {hostfile}"
    for name, n in layout.get("nodes", {}).items():
        if "error" in n:
            out.append(Finding("warning", name, "files", f"could not compare its files: {n['error']}",
                               "re-run check; if it persists, compare the checkout by hand"))
            continue
        if n["checkout"] == "missing":
            out.append(Finding("error", name, "files", f"no checkout at {layout['checkout']} (no shared filesystem)",
                               f"run `{sync}`: it copies the head's checkout to every node at the same path"))
        elif not n["same_as_head"]:
            shown = ", ".join(n["differs"] + n["missing"])
            more = n["differs_count"] + n["missing_count"] - len(n["differs"]) - len(n["missing"])
            commit = (f"; its commit {n['commit'][:12]}, the head's {layout['commit'][:12]}"
                      if n.get("commit") and layout.get("commit") and n["commit"] != layout["commit"] else "")
            out.append(Finding(
                "error", name, "files",
                f"its checkout at {layout['checkout']} differs from the head's: {n['differs_count']} file(s) differ, "
                f"{n['missing_count']} missing ({shown}{f', +{more} more' if more > 0 else ''}){commit}; the ranks "
                "would run different code", f"run `{sync}` to copy the head's checkout to every node"))
        data = n.get("data")
        if data is not None and not data["same_as_head"]:
            head = layout["data"]
            what = "missing" if not data["present"] else (f"{data['files']} files, {data['bytes']} bytes; the head "
                                                          f"has {head['files']} files, {head['bytes']} bytes")
            out.append(Finding("error", name, "files", f"data {layout['data']['path']}: {what}",
                               f"run `{sync} --data {layout['data']['path']}`"))
    if layout.get("nodes"):
        out.append(Finding("info", None, "files", describe(layout), "nothing to do"))
    return out


def describe(layout: dict) -> str:
    """One line: which layout check found ("checkout shared on every node; runs/ each node's own")."""
    nodes = {k: v for k, v in layout["nodes"].items() if "error" not in v}

    def part(key: str, label: str, shared: str, other: str) -> str:
        if all(v.get(key) in ("unknown", None) for v in nodes.values()):
            return f"{label} not tested for sharing (the head cannot write in it)"
        mine = sorted(k for k, v in nodes.items() if v.get(key) not in ("shared", "unknown", None))
        if not mine:
            return f"{label} shared by every node"
        if len(mine) == len(nodes):
            return f"{label} {other} on every node"
        return f"{label} {other} on {', '.join(mine)}, shared by the others"

    return (f"file layout: {part('checkout', 'checkout', 'shared', 'a copy')}; "
            f"{part('runs', 'run directory', 'shared', 'its own')}"
            + ("" if not any(v.get("runs") == "own" for v in nodes.values()) else
               " (no shared filesystem: `dscluster collect RUN_DIR` brings each node's part of a run to the head)"))
