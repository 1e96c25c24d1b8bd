"""The no-shared-filesystem lab's plan (sim.private): which mounts give each node its own files."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dscluster.sim.ns import anchor_script
from dscluster.sim.private import anchor_lines, host_path, make_private_dirs, plan_private

REPO, SHARED = "/src/repo", "/run/lab/shared"


def test_the_checkout_and_shared_folder_are_private_and_the_venv_is_bound_back_on_top():
    ops = plan_private(REPO, SHARED, [REPO, f"{REPO}/.venv", f"{REPO}/.venv/lib", "/usr", SHARED])
    assert ops == [["keep-sw", f"{REPO}/.venv"], ["private", REPO], ["private", SHARED],
                   ["restore-sw", f"{REPO}/.venv"]]
    lines = anchor_lines(ops, "/lab/nodes/node2")
    # the venv is set aside before the copy hides it, and bound back after
    assert lines == [f"mount --bind {REPO}/.venv /lab/nodes/node2/keep-sw/0",
                     f"mount --bind /lab/nodes/node2/private/0 {REPO}",
                     f"mount --bind /lab/nodes/node2/private/1 {SHARED}",
                     f"mount --bind /lab/nodes/node2/keep-sw/0 {REPO}/.venv"]
    script = anchor_script(hostname="node2", nodedir=Path("/lab/nodes/node2"), private=lines)
    assert script.index(lines[-1]) < script.index("exec sleep infinity")


def test_a_file_a_node_sees_maps_to_its_own_copy_on_the_host():
    ops = plan_private(REPO, SHARED, [f"{REPO}/.venv"])
    nd = "/lab/nodes/node2"
    assert host_path(ops, nd, f"{REPO}/runs/r1/summary.json") == Path(f"{nd}/private/0/runs/r1/summary.json")
    assert host_path(ops, nd, f"{SHARED}/work") == Path(f"{nd}/private/1/work")
    assert host_path(ops, nd, f"{REPO}/.venv/bin/python") == Path(f"{REPO}/.venv/bin/python")
    assert host_path(ops, nd, "/etc/hosts") == Path("/etc/hosts")
    assert host_path([], nd, f"{REPO}/x") == Path(f"{REPO}/x")   # a shared lab: the host's own file


def test_the_copy_holds_the_tracked_files_with_their_mtime_and_a_mount_point_for_the_venv(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    (repo / "untracked.txt").write_text("not copied\n")
    shared = tmp_path / "shared"
    ops = plan_private(str(repo), str(shared), [str(repo / ".venv")])
    nd = tmp_path / "node"
    uid, gid = (repo / "pkg").stat().st_uid, (repo / "pkg").stat().st_gid
    make_private_dirs(ops, str(nd), uid, gid, ["pkg/a.py"])
    copy = nd / "private" / "0"
    assert (copy / "pkg" / "a.py").read_text() == "x = 1\n"
    assert (copy / "pkg" / "a.py").stat().st_mtime == (repo / "pkg" / "a.py").stat().st_mtime
    assert not (copy / "untracked.txt").exists()
    assert (copy / ".venv").is_dir() and (nd / "private" / "1").is_dir() and (nd / "keep-sw" / "0").is_dir()


def test_a_venv_that_is_a_link_is_linked_the_same_way_in_the_copy(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("a = 1\n")
    (tmp_path / "venv").mkdir()
    (repo / ".venv").symlink_to(tmp_path / "venv")
    ops = plan_private(str(repo), str(tmp_path / "shared"), [str(tmp_path / "venv")])
    st = repo.stat()
    make_private_dirs(ops, str(tmp_path / "node"), st.st_uid, st.st_gid, ["a.py"])
    copy = tmp_path / "node" / "private" / "0"
    assert (copy / ".venv").readlink() == tmp_path / "venv"
    tracked = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(copy), "ls-files"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked == ["a.py"]   # one commit of the tree; the link is the node's install, not part of it


def test_up_again_with_another_file_layout_is_refused_with_the_rebuild():
    import pytest

    from dscluster.errors import UsageError
    from dscluster.sim.plan import plan_lab, same_lab_or_refuse

    state = plan_lab("fs", index=9, nodes=2, slots=1, uid=2000, gid=2000, password="x", created=0.0)
    state.private = plan_private(REPO, state.shared, [])
    assert not state.shared_fs
    same_lab_or_refuse(state, 2, None, "none", {}, shared_fs=False)   # the same lab: nothing to say
    with pytest.raises(UsageError, match="already up with no shared filesystem; run `dscluster sim down --lab fs` "
                                         "first to rebuild it with a shared filesystem"):
        same_lab_or_refuse(state, 2, None, "none", {}, shared_fs=True)


def test_a_checkout_without_git_metadata_is_copied_without_its_environment_state_and_runs(tmp_path):
    from dscluster.sim.private import tracked_files

    for rel in ("src/a.py", ".venv/bin/python", "runs/r/x.jsonl", "src/__pycache__/a.pyc", ".dscluster/check.json",
                "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert tracked_files(str(tmp_path)) == ["README.md", "src/a.py"]


def test_carried_tools_in_a_bin_folder_stay_whole_on_top_of_each_nodes_copy(tmp_path):
    """Tools carried into the checkout as a prefix (bin/ wrappers that run ../real/ or ../lib/): without
    a shared filesystem each node still runs them, so the whole prefix is bound back, not bin/ alone."""
    from dscluster.sim.host import shared_targets
    from dscluster.sim.lab import repo_root

    repo = str(repo_root())
    tools = f"{repo}/.tools-prefix/bin"
    software = shared_targets(str(tmp_path), None, [tools])
    assert f"{repo}/.tools-prefix" in software and tools not in software
    ops = plan_private(repo, str(tmp_path), software)
    assert ["restore-sw", f"{repo}/.tools-prefix"] in ops
