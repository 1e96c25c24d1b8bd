"""`dscluster setup`, node by node: what each phase does on one node over its SSH session.

Phase 1 (`contact`) reads the node (~/.ssh files, modes, login shell) and makes sure it has its
own key; phase 2 (`plan_files`, `mode_fixes`, `install`) writes what is missing; phase 3
(`verify_toolchain`) asks which python/mpirun a non-interactive ssh command gets. `setup.run_setup`
runs them on every node in parallel. Every file is written atomically (`write_atomic`).
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from dscluster.bringup import files as bf
from dscluster.node import liveness
from dscluster.ssh import remote
from dscluster.ssh.remote import RemoteError, Target

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



# --------------------------------------------------------------------------- helpers

def run_sh(client: paramiko.SSHClient, script: str, timeout: float, check: bool = True) -> remote.CommandResult:
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
        here=False,  # this machine too: the other nodes reach it over SSH with the keys set up here
    )
    node.client = client
    node.host_key = client.dscluster_host_key
    try:
        node.ip = client.get_transport().getpeername()[0]
    except OSError:
        node.ip = ""
    facts = _kv(run_sh(client, _GATHER, opts.command_timeout).stdout)
    node.hostname = facts.get("hostname", "")
    node.user = facts.get("user", "")
    node.home = facts.get("home", "")
    node.login_shell = facts.get("shell", "")
    if not node.home.startswith("/"):
        raise RemoteError("command_failed", t.host, f"{t.name}: could not determine the home directory")
    if not opts.dry_run:
        # Our own leftovers from an interrupted run, then the node's key (ssh-keygen writes the
        # private key 0600 itself; umask 077 covers the directory and the .pub).
        run_sh(client, f"""
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
                startup = bf.startup_file(sh)
                node.files[startup.path] = _read(sftp, node.path(startup.path))
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
        startup = bf.startup_file(new_shell or node.login_shell)
        if startup is None:
            node.warnings.append(
                f"login shell {node.login_shell} reads no startup file for 'ssh node cmd'; "
                "re-run with --shell bash to change it, then --fix-path")
        else:
            want(startup.path, bf.update_startup_file(node.files.get(startup.path) or "", opts.venv_bin, startup),
                 0o644,
                 f"PATH block ({opts.venv_bin} first) for non-interactive {startup.shell}")
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
    res = run_sh(node.client, f'command -v {shlex.quote(opts.shell)}', opts.command_timeout, check=False)
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
    node.warnings.append(f"could not change login shell to {path}: {msg}; "
                         f"ask an admin: sudo chsh -s {path} {node.user}")
    return None


def _chsh(client: paramiko.SSHClient, path: str, password: str | None, timeout: float) -> tuple[bool, str]:
    """chsh asks for the account password on a terminal, so give it one and answer the prompt."""
    chan = client.get_transport().open_session(timeout=timeout)
    chan.get_pty()
    chan.settimeout(timeout)
    chan.exec_command(f"chsh -s {shlex.quote(path)}")
    buf = b""
    sent = False
    deadline = time.monotonic() + timeout
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
                run_sh(node.client, f"mkdir -p {shlex.quote(parent)}", opts.command_timeout)
            # ~/.ssh files get the modes sshd wants; a shell startup file keeps its own.
            mode = c.mode if c.rel.startswith(".ssh/") else (_mode(sftp, node.path(c.rel)) or c.mode)
            write_atomic(sftp, node.path(c.rel), c.text, mode)
    finally:
        sftp.close()


def verify_toolchain(node: NodeState, opts: SetupOptions) -> None:
    node.toolchain = _kv(run_sh(node.client, _TOOLCHAIN, opts.command_timeout).stdout)
