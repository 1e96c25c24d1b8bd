"""`dscluster setup`: passwordless SSH between every pair of nodes, pinned host keys, same toolchain.

Four phases, each a parallel fan-out so one dead node costs one timeout, not N: contact (password
login, host key checked, the node's own ed25519 key made there so the private key never leaves it),
install (every public key and verified host key on every node, the ~/.ssh/config block, modes,
login shell, PATH), verify (the python/mpirun a non-interactive ssh gets) and mesh (a real
`ssh -o BatchMode=yes nodeB true` from every A to every B). A node that fails a phase is left
alone from then on and reported; the others go on. `--dry-run` runs contact read-only and reports
what install would change.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscluster.bringup import files as bf
from dscluster.bringup.node import (  # noqa: F401  (SetupOptions: the command's input, imported from here)
    DIR_MODE,
    KEY,
    KNOWN_HOSTS_MODE,
    SECRET_MODE,
    NodeState,
    SetupOptions,
    contact,
    install,
    run_sh,
    verify_toolchain,
)
from dscluster.files.fsutil import atomic_write_text
from dscluster.ssh import hostkeys, remote
from dscluster.ssh.remote import Target


@dataclass
class SetupResult:
    nodes: list[NodeState]
    mesh: dict[str, dict[str, tuple[bool, str]]]  # mesh[a][b] = (ok, ssh's message)
    problems: list[str]
    dry_run: bool

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0


def mesh_script(names: list[str], connect_timeout: int = 5) -> str:
    lines = ["for b in " + " ".join(shlex.quote(n) for n in names) + "; do",
             f'  ( err=$(ssh -o BatchMode=yes -o ConnectTimeout={connect_timeout} "$b" true 2>&1 </dev/null); '
             "rc=$?; printf 'mesh %s %s %s\\n' \"$b\" \"$rc\" "
             "\"$(printf %s \"$err\" | tr '\\n' ' ' | cut -c1-300)\" ) &",
             "done", "wait", ""]
    return "\n".join(lines)


def parse_mesh(text: str) -> dict[str, tuple[bool, str]]:
    out: dict[str, tuple[bool, str]] = {}
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == "mesh":
            out[parts[1]] = (parts[2] == "0", parts[3].strip() if len(parts) > 3 else "")
    return out


def toolchain_problems(nodes: list[NodeState], venv_bin: str) -> list[str]:
    """Every node must resolve python and mpirun, to the same versions as each other."""
    problems = []
    fix = f"re-run with --fix-path (puts {venv_bin} first in PATH for non-interactive ssh)"
    for n in nodes:
        for tool in ("python", "mpirun"):
            if not n.toolchain.get(f"{tool}_path"):
                problems.append(f"{n.target.name}: `ssh {n.target.name} {tool}` finds no {tool} "
                                f"(PATH={n.toolchain.get('PATH', '?')}); {fix}")
    for tool in ("python_version", "mpirun_version"):
        seen: dict[str, list[str]] = {}
        for n in nodes:
            v = n.toolchain.get(tool)
            if v:
                seen.setdefault(v, []).append(n.target.name)
        if len(seen) > 1:
            detail = "; ".join(f"{v} on {', '.join(ns)}" for v, ns in seen.items())
            problems.append(f"{tool.split('_')[0]} differs between nodes: {detail}; {fix}")
    return problems


# --------------------------------------------------------------------------- the whole run

def head_hostname() -> str:
    return socket.gethostname()


def ensure_local_key(home: Path) -> bf.PublicKey:
    """The head's own key when the head is not one of the nodes (created 0600 by ssh-keygen)."""
    key = home / KEY
    if not key.exists():
        key.parent.mkdir(mode=DIR_MODE, exist_ok=True)
        old = os.umask(0o077)
        try:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                            f"dscluster {os.environ.get('USER', '')}@{head_hostname()}", "-f", str(key)],
                           check=True, stdin=subprocess.DEVNULL)
        finally:
            os.umask(old)
    pub = bf.parse_public_key(Path(str(key) + ".pub").read_text())
    assert pub is not None
    return pub


def run_setup(opts: SetupOptions, *, show_progress: bool = True) -> SetupResult:
    nodes = [NodeState(t) for t in opts.targets]
    phase_timeout = opts.timeout + 2 * opts.command_timeout
    try:
        _phase(nodes, lambda n: contact(n, opts), phase_timeout, "contacting nodes", show_progress)
        live = [n for n in nodes if n.ok]
        keys = [n.pubkey for n in live if n.pubkey is not None]
        head_in_cluster = any(n.hostname == head_hostname() for n in live)
        if not head_in_cluster and not opts.dry_run and live:
            keys.append(ensure_local_key(Path.home()))
        hosts = [bf.HostEntry(n.target.name, n.target.host, n.target.user or n.user, n.target.port) for n in live]
        known = []
        for n in live:
            names = [hostkeys.known_hosts_name(n.target.host, n.target.port)]
            if n.target.name != n.target.host:
                names.insert(0, hostkeys.known_hosts_name(n.target.name, n.target.port))
            if n.ip:
                names.append(hostkeys.known_hosts_name(n.ip, n.target.port))
            known.append((names, n.host_key.get_name(), n.host_key.get_base64()))
        if live:
            _phase(live, lambda n: install(n, keys, hosts, known, opts), phase_timeout,
                   "dry run: planning" if opts.dry_run else "installing keys and config", show_progress)
        if not head_in_cluster and not opts.dry_run and live:
            _install_local(Path.home(), hosts, known)
        live = [n for n in nodes if n.ok]
        if live:
            _phase(live, lambda n: verify_toolchain(n, opts), phase_timeout, "checking python/mpirun", show_progress)
        live = [n for n in nodes if n.ok]
        mesh: dict[str, dict[str, tuple[bool, str]]] = {}
        if live and not opts.dry_run:
            names = [n.target.name for n in live]

            def probe(n: NodeState) -> None:
                mesh[n.target.name] = parse_mesh(run_sh(n.client, mesh_script(names), opts.command_timeout).stdout)

            _phase(live, probe, phase_timeout, "testing ssh between every pair", show_progress)
    finally:
        for n in nodes:
            if n.client is not None:
                n.client.close()
    problems = [f"{n.target.name}: {n.error}" if not n.error.startswith(n.target.name + ":") else n.error
                for n in nodes if not n.ok]
    if not opts.dry_run:
        problems += toolchain_problems([n for n in nodes if n.ok], opts.venv_bin)
        for a, row in mesh.items():
            for b in [n.target.name for n in nodes if n.ok]:
                ok, msg = row.get(b, (False, "no result"))
                if not ok:
                    problems.append(f"ssh {a} → {b} failed: {msg or 'no output'}")
    return SetupResult(nodes=nodes, mesh=mesh, problems=problems, dry_run=opts.dry_run)


def _phase(nodes: list[NodeState], fn, timeout: float, description: str, show_progress: bool) -> None:
    outcomes = remote.fan_out([n.target for n in nodes], lambda t: fn(_find(nodes, t)),
                              timeout=timeout, description=description, show_progress=show_progress)
    for n in nodes:
        o = outcomes[n.target.name]
        if not o.ok:
            n.fail(o.error)


def _find(nodes: list[NodeState], t: Target) -> NodeState:
    return next(n for n in nodes if n.target.name == t.name)


def _install_local(home: Path, hosts: list[bf.HostEntry], known: list[tuple[list[str], str, str]]) -> None:
    """The head outside the cluster still needs `ssh nodeN` (and mpirun, with its keepalives) to work from here."""
    ssh = home / ".ssh"
    config_file, known_hosts_file = ssh / "config", ssh / "known_hosts"
    old_config = config_file.read_text() if config_file.exists() else ""
    old_known_hosts = known_hosts_file.read_text() if known_hosts_file.exists() else ""
    atomic_write_text(config_file, bf.update_ssh_config(old_config, hosts, str(config_file)), mode=SECRET_MODE)
    atomic_write_text(known_hosts_file, bf.merge_known_hosts(old_known_hosts, known), mode=KNOWN_HOSTS_MODE)
    prte = home / bf.PRTE_PARAMS_FILE
    old_prte = prte.read_text() if prte.exists() else ""
    atomic_write_text(prte, bf.update_prte_params(old_prte, str(prte)), mode=0o644)


def result_to_dict(res: SetupResult) -> dict[str, Any]:
    """The --json document (stable keys; see setup/CHECKLIST.md)."""
    return {
        "ok": not res.problems,
        "dry_run": res.dry_run,
        "nodes": [
            {
                "name": n.target.name, "host": n.target.host, "hostname": n.hostname, "ip": n.ip,
                "ok": n.ok, "error_kind": n.error_kind, "error": n.error,
                "host_key": hostkeys.fingerprint(n.host_key) if n.host_key is not None else None,
                "login_shell": n.login_shell, "changes": n.changes, "warnings": n.warnings,
                "python": n.toolchain.get("python_version"), "python_path": n.toolchain.get("python_path"),
                "mpirun": n.toolchain.get("mpirun_version"), "mpirun_path": n.toolchain.get("mpirun_path"),
            }
            for n in res.nodes
        ],
        "mesh": {a: {b: ok for b, (ok, _) in row.items()} for a, row in res.mesh.items()},
        "problems": res.problems,
    }
