"""check's file-layout findings (check/layout.py) and the scanner they rest on (manifest)."""

from __future__ import annotations

import json
import os

from dscluster.check.layout import describe, layout_findings
from dscluster.files import manifest


def _node(checkout="copy", same=True, runs="own", **extra) -> dict:
    return {"checkout": checkout, "same_as_head": same, "commit": "b" * 40, "differs": [] if same else ["a.py"],
            "differs_count": 0 if same else 1, "missing": [], "missing_count": 0, "runs": runs, **extra}


LAYOUT = {"checkout": "/src/repo", "commit": "a" * 40, "files": 3, "runs": "/src/repo/runs",
          "data": {"path": "/data/d", "present": True, "files": 10, "bytes": 1000}}


def test_a_differing_copy_is_an_error_naming_the_node_the_file_the_commits_and_sync():
    layout = {**LAYOUT, "nodes": {"node1": _node("shared", runs="shared"), "node2": _node(same=False)}}
    errors = [f for f in layout_findings(layout, "hosts.txt") if f.severity == "error"]
    assert [(f.node, f.check) for f in errors] == [("node2", "files")]
    assert "a.py" in errors[0].what and "bbbbbbbbbbbb" in errors[0].what and "aaaaaaaaaaaa" in errors[0].what
    assert errors[0].fix == "run `dscluster sync --hostfile hosts.txt` to copy the head's checkout to every node"


def test_missing_data_and_a_missing_checkout_are_errors_with_the_sync_that_fixes_them():
    data = {"present": False, "files": 0, "bytes": 0, "same_as_head": False}
    layout = {**LAYOUT, "nodes": {"node3": _node("missing", same=False, data=data)}}
    fixes = {f.what.split(":")[0]: f.fix for f in layout_findings(layout, "h.txt") if f.severity == "error"}
    assert fixes["no checkout at /src/repo (no shared filesystem)"].startswith("run `dscluster sync --hostfile h.txt`")
    assert fixes["data /data/d"] == "run `dscluster sync --hostfile h.txt --data /data/d`"


def test_the_layout_line_says_shared_or_own_per_folder():
    shared = {**LAYOUT, "nodes": {"node1": _node("shared", runs="shared"), "node2": _node("shared", runs="shared")}}
    assert describe(shared) == "file layout: checkout shared by every node; run directory shared by every node"
    mixed = {**LAYOUT, "nodes": {"node1": _node("shared", runs="shared"), "node2": _node()}}
    line = describe(mixed)
    assert "checkout a copy on node2, shared by the others" in line and "dscluster collect" in line
    assert not [f for f in layout_findings(mixed, "h") if f.severity == "error"]
    untested = {**LAYOUT, "nodes": {"node1": _node("unknown", runs="shared"), "node2": _node("unknown", runs="shared")}}
    assert describe(untested).startswith("file layout: checkout not tested for sharing (the head cannot write in it);")


def test_the_scanner_finds_a_changed_and_a_missing_file_by_content(tmp_path):
    for side in ("head", "node"):
        (tmp_path / side / "pkg").mkdir(parents=True)
        (tmp_path / side / "pkg" / "a.py").write_text("a = 1\n")
        (tmp_path / side / "b.py").write_text("b = 1\n")
    (tmp_path / "node" / "b.py").write_text("b = 2\n")
    os.remove(tmp_path / "node" / "pkg" / "a.py")
    files = ["pkg/a.py", "b.py"]
    marker = str(tmp_path / "head" / "marker")
    open(marker, "w").close()
    head = manifest.scan_here(manifest.request(str(tmp_path / "head"), files, hash=True, markers=[marker]))
    node = manifest.scan_here(manifest.request(str(tmp_path / "node"), files, hash=True))
    assert head.markers == {marker: True}
    assert manifest.differing(head, node, by_hash=True) == (["b.py"], ["pkg/a.py"])
    assert manifest.tree_digest(head) != manifest.tree_digest(node)
    walked = manifest.scan_here(manifest.request(str(tmp_path / "head"), None, hash=False))
    assert sorted(walked.files) == ["b.py", "marker", "pkg/a.py"] and walked.total_bytes == 12
    assert json.loads(manifest.request("/r", None, hash=False))["files"] is None


def test_check_compares_the_data_folder_a_preset_names_unless_data_is_given(tmp_path):
    from dscluster.cli.check import data_folder

    preset = tmp_path / "p.yaml"
    preset.write_text("data:\n  dataset: cifar10\n  path: /data/cifar-10-batches-py\n")
    assert data_folder(None, str(preset)) == "/data/cifar-10-batches-py"
    assert data_folder("/other", str(preset)) == "/other"
    assert data_folder(None, None) is None
