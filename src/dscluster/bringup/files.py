"""The text edits `dscluster setup` makes in a user's files, as pure functions.

Kept apart from the SSH plumbing so every edit can be tested on strings: what is kept, what is
replaced, and that running twice changes nothing the second time. The rule for all of them:
the user's own lines survive byte for byte; only our keys and our marked blocks are ours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from dscluster.errors import DsclusterError
from dscluster.node import liveness
from dscluster.ssh.hostkeys import format_line

BEGIN = "# >>> dscluster >>>"
END = "# <<< dscluster <<<"
NOTE = "# managed by `dscluster setup`; edits inside this block are replaced on the next run"

_KEY_RE = re.compile(
    r"(?:^|\s)(?P<type>ssh-ed25519|ssh-rsa|ssh-dss|ecdsa-sha2-nistp\d+|"
    r"sk-ssh-ed25519@openssh\.com|sk-ecdsa-sha2-nistp256@openssh\.com)\s+(?P<blob>[A-Za-z0-9+/]+=*)"
)


class BlockError(DsclusterError):
    """A managed block in a user's file is damaged (begin marker without its end)."""


@dataclass(frozen=True)
class PublicKey:
    type: str
    blob: str
    comment: str = ""

    @property
    def line(self) -> str:
        return f"{self.type} {self.blob}" + (f" {self.comment}" if self.comment else "")


def parse_public_key(text: str) -> PublicKey | None:
    """The key in an id_*.pub or authorized_keys line (options before it are skipped)."""
    line = text.strip()
    if not line or line.startswith("#"):
        return None
    m = _KEY_RE.search(line)
    if not m:
        return None
    comment = line[m.end():].strip()
    return PublicKey(m.group("type"), m.group("blob"), comment)


def merge_authorized_keys(existing: str, keys: list[PublicKey]) -> str:
    """Authorise every key in `keys` exactly once; every other line is kept as it was.

    A key already present (even with options such as from="..." in front) is left alone;
    later duplicates of one of *our* keys are dropped, so re-runs converge to one line per key.
    """
    wanted = {k.blob: k for k in keys}
    seen: set[str] = set()
    out: list[str] = []
    for raw in existing.splitlines():
        key = parse_public_key(raw)
        if key is not None and key.blob in wanted:
            if key.blob in seen:
                continue
            seen.add(key.blob)
        out.append(raw)
    for k in keys:
        if k.blob not in seen:
            seen.add(k.blob)
            out.append(k.line)
    return "\n".join(out) + "\n" if out else ""


def replace_managed_block(text: str, body: str, *, path: str = "<file>", insert_at: int | None = None) -> str:
    """Put `body` between the dscluster markers: in place of an existing block, else at `insert_at`.

    `insert_at` is a line index for a new block (None = append at the end). Extra copies of
    the block (from a hand-merged file) are removed, so there is always exactly one.
    """
    lines = text.splitlines()
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == BEGIN:
            for j in range(i + 1, len(lines)):
                if lines[j].strip() == END:
                    spans.append((i, j))
                    i = j
                    break
            else:
                raise BlockError(
                    f"{path}:{i + 1}: '{BEGIN}' has no matching '{END}'; "
                    "delete the partial block by hand and re-run dscluster setup"
                )
        elif lines[i].strip() == END:
            raise BlockError(f"{path}:{i + 1}: '{END}' without a '{BEGIN}' above it; delete that line and re-run")
        i += 1
    block = [BEGIN, NOTE, *body.rstrip("\n").splitlines(), END]
    if spans:
        pos = spans[0][0]
        for a, b in reversed(spans):
            del lines[a:b + 1]
    else:
        pos = len(lines) if insert_at is None else max(0, min(insert_at, len(lines)))
    lines[pos:pos] = block
    return "\n".join(lines) + "\n"


def remove_managed_block(text: str) -> tuple[str, int | None]:
    """The text without our block(s), and the line index where the first one started."""
    lines = text.splitlines()
    out: list[str] = []
    first: int | None = None
    inside = False
    for line in lines:
        if line.strip() == BEGIN:
            inside = True
            if first is None:
                first = len(out)
            continue
        if inside:
            if line.strip() == END:
                inside = False
            continue
        out.append(line)
    return ("\n".join(out) + "\n" if out else ""), first


@dataclass(frozen=True)
class HostEntry:
    """One cluster node as every other node's ssh should reach it."""

    name: str
    hostname: str
    user: str
    port: int = 22


def ssh_config_body(hosts: list[HostEntry]) -> str:
    """Host stanzas for the cluster: the key, strict host keys, the node's own known_hosts."""
    parts = []
    for h in hosts:
        parts.append(
            f"Host {h.name}\n"
            f"    HostName {h.hostname}\n"
            f"    User {h.user}\n"
            f"    Port {h.port}\n"
            "    IdentityFile ~/.ssh/id_ed25519\n"
            "    IdentitiesOnly yes\n"
            "    StrictHostKeyChecking yes\n"
            "    UserKnownHostsFile ~/.ssh/known_hosts\n"
        )
    return "".join(parts)


def update_ssh_config(existing: str, hosts: list[HostEntry], path: str = "~/.ssh/config") -> str:
    """A new block goes first: ssh uses the first value it finds, so a later `Host *` cannot override it."""
    return replace_managed_block(existing, ssh_config_body(hosts), path=path, insert_at=0)


def merge_known_hosts(existing: str, entries: list[tuple[list[str], str, str]]) -> str:
    """Pin (names, key type, blob) entries in place: a plain line naming the same host with the
    same key type becomes the pinned line where it stands, and entries not yet there are appended.
    Everything else (other hosts and key types, hashed lines, comments) is kept in its order, so
    lines that ssh itself appends later (UpdateHostKeys) do not make the next setup a change."""
    pins = [(set(n for n in names if n), ktype, format_line(names, ktype, blob)) for names, ktype, blob in entries]
    out: list[str] = []
    placed: set[int] = set()
    for raw in existing.splitlines():
        fields = raw.split()
        if len(fields) >= 3 and not raw.lstrip().startswith(("#", "@", "|")):
            names = set(fields[0].split(","))
            hits = [i for i, (n, ktype, _) in enumerate(pins) if fields[1] == ktype and names & n]
            if hits:
                out.extend(pins[i][2] for i in hits if i not in placed)
                placed.update(hits)
                continue
        out.append(raw)
    out.extend(line for i, (_, _, line) in enumerate(pins) if i not in placed)
    return "\n".join(out) + "\n" if out else ""


# ------------------------------------------------------------------ login shells and PATH

@dataclass(frozen=True)
class StartupFile:
    """The file a shell reads for a non-interactive `ssh node cmd`, relative to $HOME."""

    shell: str
    path: str
    syntax: str  # "sh" | "csh" | "fish"


def shell_name(login_shell: str) -> str:
    return PurePosixPath(login_shell.strip() or "/bin/sh").name


def startup_file(login_shell: str) -> StartupFile | None:
    """bash: ~/.bashrc (bash reads it when started by sshd); zsh: ~/.zshenv (the only file every
    zsh reads); tcsh: ~/.tcshrc; csh: ~/.cshrc; fish: config.fish. sh/dash read nothing for a
    non-interactive command, so there is no file to fix: change the login shell instead."""
    name = shell_name(login_shell)
    return {
        "bash": StartupFile("bash", ".bashrc", "sh"),
        "zsh": StartupFile("zsh", ".zshenv", "sh"),
        "tcsh": StartupFile("tcsh", ".tcshrc", "csh"),
        "csh": StartupFile("csh", ".cshrc", "csh"),
        "fish": StartupFile("fish", ".config/fish/config.fish", "fish"),
    }.get(name)


def path_block_body(venv_bin: str, syntax: str) -> str:
    if syntax == "csh":
        return f'setenv PATH "{venv_bin}:$PATH"\n'
    if syntax == "fish":
        return f"set -gx PATH {venv_bin} $PATH\n"
    return f'export PATH="{venv_bin}:$PATH"\n'


# Lines that end a startup file early for non-interactive shells: our block must come before.
_GUARDS = {
    "sh": re.compile(r"^\s*(case\s+\$-\s+in|\[\[?\s+-z\s+\"?\$PS1\"?\s+\]\]?|\[\[?\s+\"?\$-\"?\s+!?=|"
                     r"if\s+\[\[?\s+-z\s+\"?\$PS1|\[\[\s+\$-\s+!=|\[\[?\s+-o\s+interactive|"
                     r"\[\[\s+!\s+-o\s+interactive)"),
    "csh": re.compile(r"^\s*if\s*\(\s*!\s*\$\?prompt\s*\)"),
    "fish": re.compile(r"^\s*(if\s+not\s+status\s+(--)?is-interactive"
                       r"|status\s+(--)?is-interactive\s*;?\s*or\s+return)"),
}


def find_guard(text: str, syntax: str) -> int | None:
    """Line index of the first 'return unless interactive' guard, if any."""
    pat = _GUARDS[syntax]
    for i, line in enumerate(text.splitlines()):
        if pat.search(line):
            return i
    return None


def update_startup_file(existing: str, venv_bin: str, startup: StartupFile) -> str:
    """Put the PATH block right before the interactive-only early return (else at the end),
    so it runs for `ssh node cmd` and still wins over PATH edits made earlier in the file."""
    body = path_block_body(venv_bin, startup.syntax)
    without, _ = remove_managed_block(existing)
    guard = find_guard(without, startup.syntax)
    return replace_managed_block(without, body, path=f"~/{startup.path}", insert_at=guard)


# PRRTE (OpenMPI 5's runtime) reads this file in mpirun and in the daemon it starts on every node,
# so a hand-typed `mpirun` gets the settings too, not only `dscluster launch`.
PRTE_PARAMS_FILE = ".prte/mca-params.conf"


def update_prte_params(existing: str, path: str = "~/" + PRTE_PARAMS_FILE) -> str:
    """Our block holds the daemon keepalives that let mpirun notice a vanished node within
    seconds instead of minutes (liveness.PRTE_KEEPALIVE); the user's own lines stay."""
    return replace_managed_block(existing, liveness.prte_params_body(), path=path)
