"""`dscluster setup`: passwordless SSH between every pair of nodes, pinned host keys, same toolchain.

Phases, each a parallel fan-out so one dead node costs one timeout, not N:
  1. contact  – connect with the password (host key checked against the project's known_hosts),
                read what the node has (~/.ssh files and their modes, login shell), make sure the
                node has its own ed25519 key (created there by ssh-keygen: the private key never
                leaves the node and is 0600 from its first byte);
  2. install  – every node's public key on every node, the host keys the head verified in every
                node's known_hosts, the managed ~/.ssh/config block, modes, login shell, PATH;
  3. verify   – which python/mpirun a non-interactive ssh command gets on each node;
  4. mesh     – real `ssh -o BatchMode=yes nodeB true` run on every node A for every B.
A node that fails a phase (unreachable, wrong password, changed host key) is left alone from
then on and reported; the others go on. `--dry-run` runs phase 1 read-only and reports what
phase 2 would change.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shlex
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from dscluster import bringup_files as bf
from dscluster import liveness, remote
from dscluster.remote import RemoteError, Target

KEY = ".ssh/id_ed25519"
# Wanted modes: sshd's StrictModes refuses keys when these are group/world-writable.
DIR_MODE = 0o700
SECRET_MODE = 0o600
KNOWN_HOSTS_MODE = 0o644


@dataclass
class SetupOptions:
    targets: list[Target]
    known_hosts: Path
    password: str | None = field(default=None, repr=False)
    key_filename: str | None = None
    trust_new_hosts: bool = False
    shell: str | None = None
    fix_path: bool = False
    timeout: float = 10.0
    dry_run: bool = False
    venv_bin: str = ""
    command_timeout: float = 60.0


@dataclass
class NodeState:
    """What phase 1 learned about one node, plus the open session the later phases reuse."""

    target: Target
    client: paramiko.SSHClient | None = None
    hostname: str = ""
    home: str = ""
    user: str = ""
    login_shell: str = ""
    ip: str = ""
    host_key: paramiko.PKey | None = None
    pubkey: bf.PublicKey | None = None
    files: dict[str, str | None] = field(default_factory=dict)   # relative to $HOME
    modes: dict[str, int | None] = field(default_factory=dict)   # relative to $HOME ("" = $HOME)
    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    toolchain: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def path(self, rel: str) -> str:
        return posixpath.join(self.home, rel) if rel else self.home

    def fail(self, err: BaseException) -> None:
        self.error = str(err)
        self.error_kind = getattr(err, "kind", type(err).__name__)


@dataclass
class SetupResult:
    nodes: list[NodeState]
    mesh: dict[str, dict[str, tuple[bool, str]]]  # mesh[a][b] = (ok, ssh's message)
    problems: list[str]
    dry_run: bool

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0


# --------------------------------------------------------------------------- helpers

def _sh(client: paramiko.SSHClient, script: str, timeout: float, check: bool = True) -> remote.CommandResult:
    """Run a POSIX sh script through the login shell (`sh -s` reads it from stdin), so tcsh or
    fish as login shell cannot misparse it, while PATH is still what the login shell set up."""
    return remote.run(client, "sh -s", timeout=timeout, input=script, check=check)


def _kv(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v
    return out


_GATHER = r"""
u=$(id -un)
printf 'hostname=%s\n' "$(hostname)"
printf 'user=%s\n' "$u"
printf 'home=%s\n' "$HOME"
s=$(getent passwd "$u" 2>/dev/null | cut -d: -f7)
[ -n "$s" ] || s="$SHELL"
printf 'shell=%s\n' "$s"
"""

_TOOLCHAIN = r"""
for c in python mpirun; do printf '%s_path=%s\n' "$c" "$(command -v "$c" 2>/dev/null)"; done
if command -v python >/dev/null 2>&1; then printf 'python_version=%s\n' "$(python --version 2>&1 | head -n 1)"; fi
if command -v mpirun >/dev/null 2>&1; then printf 'mpirun_version=%s\n' "$(mpirun --version 2>&1 | head -n 1)"; fi
printf 'PATH=%s\n' "$PATH"
"""

_FILES = [".ssh/authorized_keys", ".ssh/config", ".ssh/known_hosts", KEY + ".pub", bf.PRTE_PARAMS_FILE]
_MODE_PATHS = ["", ".ssh", ".ssh/authorized_keys", ".ssh/config", KEY, ".ssh/known_hosts"]


def _read(sftp: paramiko.SFTPClient, path: str) -> str | None:
    try:
        with sftp.open(path, "r") as f:
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None


def _mode(sftp: paramiko.SFTPClient, path: str) -> int | None:
    try:
        return stat.S_IMODE(sftp.stat(path).st_mode)
    except FileNotFoundError:
        return None


def write_atomic(sftp: paramiko.SFTPClient, path: str, text: str, mode: int) -> None:
    """Temp file next to the target, chmod before any byte is written, then posix-rename over it:
    a kill at any moment leaves either the old file or the new one, never half of one."""
    d, name = posixpath.split(path)
    tmp = posixpath.join(d, f".{name}.dscluster-{secrets.token_hex(4)}.tmp")
    try:
        with sftp.open(tmp, "wx") as f:
            f.chmod(mode)
            f.write(text.encode("utf-8"))
        sftp.posix_rename(tmp, path)
    except BaseException:
        try:
            sftp.remove(tmp)
        except OSError:
            pass
        raise


def _open_sftp(node: NodeState) -> paramiko.SFTPClient:
    try:
        return node.client.open_sftp()
    except paramiko.SSHException as e:
        raise RemoteError(
            "command_failed", node.target.host,
            f"{node.target.name}: SFTP not available ({e}); enable 'Subsystem sftp' in the node's sshd_config, "
            "and make sure the login shell's startup files print nothing for non-interactive sessions",
        ) from None


# --------------------------------------------------------------------------- phase 1

def contact(node: NodeState, opts: SetupOptions) -> None:
    t = node.target
    client = remote.connect(
        t, known_hosts=opts.known_hosts, password=opts.password, key_filename=opts.key_filename,
        trust_new_hosts=opts.trust_new_hosts, timeout=opts.timeout, pin_new=not opts.dry_run,
    )
    node.client = client
    node.host_key = client.dscluster_host_key
    try:
        node.ip = client.get_transport().getpeername()[0]
    except OSError:
        node.ip = ""
    facts = _kv(_sh(client, _GATHER, opts.command_timeout).stdout)
    node.hostname, node.user, node.home = facts.get("hostname", ""), facts.get("user", ""), facts.get("home", "")
    node.login_shell = facts.get("shell", "")
    if not node.home.startswith("/"):
        raise RemoteError("command_failed", t.host, f"{t.name}: could not determine the home directory")
    if not opts.dry_run:
        # Our own leftovers from an interrupted run, then the node's key (ssh-keygen writes the
        # private key 0600 itself; umask 077 covers the directory and the .pub).
        _sh(client, f"""
umask 077
mkdir -p "$HOME/.ssh"
rm -f "$HOME"/.ssh/.*.dscluster-*.tmp
if [ ! -f "$HOME/{KEY}" ]; then
  ssh-keygen -q -t ed25519 -N '' -C "dscluster $(id -un)@$(hostname)" -f "$HOME/{KEY}" </dev/null && echo created
elif [ ! -f "$HOME/{KEY}.pub" ]; then
  ssh-keygen -y -f "$HOME/{KEY}" > "$HOME/{KEY}.pub" && echo derived
fi
""", opts.command_timeout)
    sftp = _open_sftp(node)
    try:
        for rel in _FILES:
            node.files[rel] = _read(sftp, node.path(rel))
        for rel in _MODE_PATHS:
            node.modes[rel] = _mode(sftp, node.path(rel))
        if opts.fix_path or opts.shell:
            for sh in ("bash", "zsh", "tcsh", "csh", "fish"):
                sf = bf.startup_file(sh)
                node.files[sf.path] = _read(sftp, node.path(sf.path))
    finally:
        sftp.close()
    pub = node.files.get(KEY + ".pub")
    node.pubkey = bf.parse_public_key(pub) if pub else None
    if node.pubkey is None:
        if opts.dry_run:
            node.changes.append(f"create ~/{KEY} (ed25519, 0600)")
        else:
            raise RemoteError("command_failed", t.host, f"{t.name}: ~/{KEY}.pub missing or unreadable after ssh-keygen")


# --------------------------------------------------------------------------- phase 2

@dataclass
class FileChange:
    rel: str
    text: str
    mode: int
    reason: str


def plan_files(node: NodeState, keys: list[bf.PublicKey], hosts: list[bf.HostEntry],
               known: list[tuple[list[str], str, str]], opts: SetupOptions,
               new_shell: str | None = None) -> list[FileChange]:
    """What the node's files should become; a change only where the text would differ."""
    out: list[FileChange] = []

    def want(rel: str, new: str, mode: int, what: str) -> None:
        old = node.files.get(rel)
        if (old or "") != new:
            out.append(FileChange(rel, new, mode, what if old is not None else f"create ({what})"))

    old_ak = node.files.get(".ssh/authorized_keys") or ""
    new_ak = bf.merge_authorized_keys(old_ak, keys)
    added = len([k for k in keys if k.blob not in {p.blob for p in map(bf.parse_public_key, old_ak.splitlines()) if p}])
    want(".ssh/authorized_keys", new_ak, SECRET_MODE, f"authorize {added} key(s), one line per key")
    want(".ssh/known_hosts", bf.merge_known_hosts(node.files.get(".ssh/known_hosts") or "", known),
         KNOWN_HOSTS_MODE, "pin the host keys the head verified")
    want(".ssh/config", bf.update_ssh_config(node.files.get(".ssh/config") or "", hosts, "~/.ssh/config"),
         SECRET_MODE, "managed Host block for the cluster")
    want(bf.PRTE_PARAMS_FILE, bf.update_prte_params(node.files.get(bf.PRTE_PARAMS_FILE) or ""), 0o644,
         f"mpirun notices a vanished node within {liveness.KEEPALIVE_DETECT_S} s")
    if opts.fix_path:
        sf = bf.startup_file(new_shell or node.login_shell)
        if sf is None:
            node.warnings.append(
                f"login shell {node.login_shell} reads no startup file for 'ssh node cmd'; "
                "re-run with --shell bash to change it, then --fix-path")
        else:
            want(sf.path, bf.update_startup_file(node.files.get(sf.path) or "", opts.venv_bin, sf),
                 0o644,
                 f"PATH block ({opts.venv_bin} first) for non-interactive {sf.shell}")
    return out


def mode_fixes(node: NodeState) -> list[tuple[str, int, int]]:
    """(rel, current, wanted) for each path whose mode is looser than sshd accepts."""
    fixes = []
    home = node.modes.get("")
    if home is not None and home & 0o022:
        fixes.append(("", home, home & ~0o022))
    for rel, want in ((".ssh", DIR_MODE), (".ssh/authorized_keys", SECRET_MODE),
                      (".ssh/config", SECRET_MODE), (KEY, SECRET_MODE)):
        cur = node.modes.get(rel)
        if cur is not None and cur != want:
            fixes.append((rel, cur, want))
    return fixes


def _change_shell(node: NodeState, opts: SetupOptions) -> str | None:
    """chsh to the wanted shell; returns the new shell path, or None (reported as a warning)."""
    res = _sh(node.client, f'command -v {shlex.quote(opts.shell)}', opts.command_timeout, check=False)
    path = res.stdout.strip()
    if res.rc != 0 or not path.startswith("/"):
        node.warnings.append(f"--shell {opts.shell}: not installed on this node (install it, or pick another)")
        return None
    if path == node.login_shell:
        return path
    if opts.dry_run:
        node.changes.append(f"chsh -s {path} (now {node.login_shell})")
        return path
    ok, msg = _chsh(node.client, path, opts.password, opts.command_timeout)
    if ok:
        node.changes.append(f"login shell {node.login_shell} → {path}")
        node.login_shell = path
        return path
    node.warnings.append(f"could not change login shell to {path}: {msg}; ask an admin: sudo chsh -s {path} {node.user}")
    return None


def _chsh(client: paramiko.SSHClient, path: str, password: str | None, timeout: float) -> tuple[bool, str]:
    """chsh asks for the account password on a terminal, so give it one and answer the prompt."""
    chan = client.get_transport().open_session(timeout=timeout)
    chan.get_pty()
    chan.settimeout(timeout)
    chan.exec_command(f"chsh -s {shlex.quote(path)}")
    buf, sent, deadline = b"", False, time.monotonic() + timeout
    while time.monotonic() < deadline and not chan.exit_status_ready():
        if chan.recv_ready():
            buf += chan.recv(4096)
            if not sent and b"assword" in buf and password:
                chan.sendall((password + "\n").encode())
                sent = True
        else:
            time.sleep(0.05)
    while chan.recv_ready():
        buf += chan.recv(4096)
    rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
    chan.close()
    text = buf.decode("utf-8", "replace")
    if password:
        text = text.replace(password, "***")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "assword" not in ln]
    return rc == 0, (lines[-1] if lines else f"chsh exited {rc}")


def install(node: NodeState, keys: list[bf.PublicKey], hosts: list[bf.HostEntry],
            known: list[tuple[list[str], str, str]], opts: SetupOptions) -> None:
    new_shell = _change_shell(node, opts) if opts.shell else None
    changes = plan_files(node, keys, hosts, known, opts, new_shell)
    fixes = mode_fixes(node)
    for c in changes:
        node.changes.append(f"~/{c.rel}: {c.reason}")
    for rel, cur, want in fixes:
        node.changes.append(f"chmod {want:o} ~/{rel} (was {cur:o})")
    if opts.dry_run or not (changes or fixes):
        return
    sftp = _open_sftp(node)
    try:
        for rel, _, want in fixes:
            sftp.chmod(node.path(rel), want)
        for c in changes:
            parent = posixpath.dirname(node.path(c.rel))
            if _mode(sftp, parent) is None:
                _sh(node.client, f"mkdir -p {shlex.quote(parent)}", opts.command_timeout)
            # ~/.ssh files get the modes sshd wants; a shell startup file keeps its own.
            mode = c.mode if c.rel.startswith(".ssh/") else (_mode(sftp, node.path(c.rel)) or c.mode)
            write_atomic(sftp, node.path(c.rel), c.text, mode)
    finally:
        sftp.close()


# --------------------------------------------------------------------------- phases 3 and 4

def verify_toolchain(node: NodeState, opts: SetupOptions) -> None:
    node.toolchain = _kv(_sh(node.client, _TOOLCHAIN, opts.command_timeout).stdout)


def mesh_script(names: list[str], connect_timeout: int = 5) -> str:
    lines = ["for b in " + " ".join(shlex.quote(n) for n in names) + "; do",
             f'  ( err=$(ssh -o BatchMode=yes -o ConnectTimeout={connect_timeout} "$b" true 2>&1 </dev/null); '
             "rc=$?; printf 'mesh %s %s %s\\n' \"$b\" \"$rc\" \"$(printf %s \"$err\" | tr '\\n' ' ' | cut -c1-300)\" ) &",
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
            names = [remote.known_hosts_name(n.target.host, n.target.port)]
            if n.target.name != n.target.host:
                names.insert(0, remote.known_hosts_name(n.target.name, n.target.port))
            if n.ip:
                names.append(remote.known_hosts_name(n.ip, n.target.port))
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
                mesh[n.target.name] = parse_mesh(_sh(n.client, mesh_script(names), opts.command_timeout).stdout)

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
    from dscluster.fsutil import atomic_write_text

    ssh = home / ".ssh"
    cfg, kh = ssh / "config", ssh / "known_hosts"
    old_cfg = cfg.read_text() if cfg.exists() else ""
    old_kh = kh.read_text() if kh.exists() else ""
    atomic_write_text(cfg, bf.update_ssh_config(old_cfg, hosts, str(cfg)), mode=SECRET_MODE)
    atomic_write_text(kh, bf.merge_known_hosts(old_kh, known), mode=KNOWN_HOSTS_MODE)
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
                "host_key": remote.fingerprint(n.host_key) if n.host_key is not None else None,
                "login_shell": n.login_shell, "changes": n.changes, "warnings": n.warnings,
                "python": n.toolchain.get("python_version"), "python_path": n.toolchain.get("python_path"),
                "mpirun": n.toolchain.get("mpirun_version"), "mpirun_path": n.toolchain.get("mpirun_path"),
            }
            for n in res.nodes
        ],
        "mesh": {a: {b: ok for b, (ok, _) in row.items()} for a, row in res.mesh.items()},
        "problems": res.problems,
    }
