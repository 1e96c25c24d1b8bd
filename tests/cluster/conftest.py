"""Fixtures for cluster tests: simulated labs (real namespaces, real sshd; root only).

    def test_x(lab_factory):
        lab = lab_factory("mylab", nodes=3)          # one lab name per test module
        gpu = lab_factory("mygpus", gpus=[1, 1], link="10gbit")   # sim.up's options pass through

    def test_y(keyed_lab_factory):
        lab = keyed_lab_factory("mympi", nodes=3)    # + TEST-ONLY ssh key mesh, mpirun works

    def test_z(no_shared_fs_lab_factory):
        lab = no_shared_fs_lab_factory("mynfs", nodes=3)   # keyed, and no NFS: each node its own
        lab.path_on("node2", some_path)                     # checkout copy and lab.shared

Labs are module-scoped: the first call builds the lab, later calls with the same name return it,
and every lab a module made is removed when the module ends. Use a lab name of your own per
module: several modules (and several people) may have labs up at the same time.

Put run directories and state under `lab.shared` (same path on every node, writable by the lab
user); pytest's tmp_path is mode 0700 and owned by root, so the lab user cannot use it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from _wait import wait_until
from dscluster.sim import lab as sim
from dscluster.sim.ns import REQUIRED_TOOLS

# What the lab itself needs (sim_ns.REQUIRED_TOOLS, found on PATH as `sim up` finds them) and
# what the fixtures below use.
NEEDED = REQUIRED_TOOLS + ("ssh-keyscan",)


def lab_skip_reason() -> str | None:
    """Why a lab cannot be built here, or None. (On CI a skipped cluster test fails.)"""
    if os.geteuid() != 0:
        return "cluster tests build a simulated lab: run them as root"
    missing = [t for t in NEEDED if shutil.which(t) is None]
    if missing:
        return f"simulated lab needs {', '.join(missing)} on PATH (see .ci/run for the packages)"
    return None


def install_test_mesh(lab: sim.Lab) -> None:
    """TEST FIXTURE ONLY, not how a cluster is set up (`dscluster setup` does that, with the
    user's password and pinned host keys): give the lab user on every node one shared key pair,
    authorize it everywhere and fill known_hosts by ssh-keyscan from inside the lab, so that
    node-to-node ssh, and so OpenMPI's tree launch, work without a prompt."""
    with tempfile.TemporaryDirectory() as d:
        key = Path(d) / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dscluster-test-mesh@{lab.name}",
                        "-f", str(key)], check=True)
        private, public = key.read_bytes(), key.with_suffix(".pub").read_bytes()
    names = [n.name for n in lab.nodes] + [n.ip for n in lab.nodes]
    keys: dict[str, str] = {}

    def scan_all() -> bool:
        # ssh-keyscan leaves out a host that did not answer within -T (one sshd slow to fork
        # on a loaded machine) and still exits 0: scan again for those until every name has keys.
        missing = [n for n in names if n not in keys]
        out = lab.run(lab.nodes[0].name, ["ssh-keyscan", "-T", "10", *missing], timeout=120).stdout
        for line in out.splitlines():
            host = line.split(" ", 1)[0]
            if host in missing and not line.startswith("#"):
                keys[host] = keys.get(host, "") + line + "\n"
        return len(keys) == len(names)

    wait_until(scan_all, 60, f"host keys of every node of lab {lab.name} by ssh-keyscan",
               interval=1.0, explain=lambda: f"keys for {sorted(keys)} of {names}")
    known_hosts = "".join(keys[n] for n in names)
    for node in lab.nodes:
        ssh = Path(node.home) / ".ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        files = {"id_ed25519": (private, 0o600), "id_ed25519.pub": (public, 0o644),
                 "authorized_keys": (public, 0o600), "known_hosts": (known_hosts.encode(), 0o644)}
        for name, (data, mode) in files.items():
            (ssh / name).write_bytes(data)
            os.chmod(ssh / name, mode)
            os.chown(ssh / name, lab.uid, lab.gid)
        os.chown(ssh, lab.uid, lab.gid)


@pytest.fixture(scope="module")
def lab_factory():
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    made: dict[str, sim.Lab] = {}

    def make(name: str, nodes: int | None = None, slots: int | None = None, **options) -> sim.Lab:
        if name not in made:
            sim.down(name)  # a lab left over from an interrupted run: start clean
            made[name] = sim.up(nodes=nodes, slots=slots, lab=name, **options)  # options: gpus, link, env
        return made[name]

    yield make
    for name in made:
        sim.down(name)


@pytest.fixture(scope="module")
def keyed_lab_factory(lab_factory):
    keyed: set[str] = set()

    def make(name: str, nodes: int | None = None, slots: int | None = None, **options) -> sim.Lab:
        lab = lab_factory(name, nodes=nodes, slots=slots, **options)
        if name not in keyed:
            install_test_mesh(lab)
            keyed.add(name)
        return lab

    return make


@pytest.fixture(scope="module")
def no_shared_fs_lab_factory(keyed_lab_factory):
    """A keyed lab whose nodes share no files (sim up --no-shared-fs): each has its own copy of the
    checkout at its path, its own `lab.shared` and home; only the checkout's .venv is shared.
    Read a node's files from the host with `lab.path_on(node, path)`."""

    def make(name: str, nodes: int | None = None, slots: int | None = None, **options) -> sim.Lab:
        return keyed_lab_factory(name, nodes=nodes, slots=slots, shared_fs=False, **options)

    return make


@pytest.fixture(scope="module")
def mesh_installer():
    """The key-mesh installer itself, for a lab made some other way."""
    return install_test_mesh
