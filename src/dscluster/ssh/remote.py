"""Paramiko sessions to cluster nodes: pinned host keys, one error class, parallel fan-out.

Why this module exists rather than plain `ssh` subprocesses: the head has to talk to nodes
before passwordless SSH exists (password auth), has to decide itself what a host key means
(the project's own known_hosts, never ~/.ssh/known_hosts implicitly), and has to report a
precise reason per node when something fails. Every failure becomes a `RemoteError` whose
`.kind` says what to fix; nothing here retries, so a wrong password is tried once per node
(no lock-out by retry storm) and a dead node costs one timeout.
"""

from __future__ import annotations

import errno
import getpass
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import paramiko
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from dscluster import console
from dscluster.errors import DsclusterError
from dscluster.ssh import thishost
from dscluster.ssh.hostkeys import fingerprint, known_hosts_name, load_known_hosts, pin_host_key

KINDS = (
    "unreachable",
    "refused",
    "timeout",
    "auth_failed",
    "host_key_unknown",
    "host_key_changed",
    "command_failed",
)


@dataclass(frozen=True)
class Target:
    """One machine to reach: `name` is how the user calls it (hostfile), `host` where to connect."""

    name: str
    host: str
    port: int = 22
    user: str | None = None

    @property
    def login(self) -> str:
        return f"{self.user or getpass.getuser()}@{self.host}"


class RemoteError(DsclusterError):
    """A node could not be reached or a command on it failed.

    `kind` is one of KINDS; `host` the node. The message is built here from facts we chose to
    show, never from the credentials used, so it is safe to print and to log.
    """

    exit_code = 1

    def __init__(self, kind: str, host: str, message: str):
        if kind not in KINDS:
            raise ValueError(f"unknown RemoteError kind {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.host = host

    def __reduce__(self):  # keep kind/host when pickled (e.g. across processes)
        return (RemoteError, (self.kind, self.host, str(self)))


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str


@dataclass
class Outcome:
    """What fan_out got for one node: a value, or the error and how long it took to fail."""

    ok: bool
    value: Any
    error: RemoteError | Exception | None
    seconds: float


# --------------------------------------------------------------------------- host keys
# The known_hosts file itself is `hostkeys`; here is what a session does with an unknown key.

class PinningPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown host keys, or pin them when the user said --trust-new-hosts.

    A *changed* key never reaches this policy: Paramiko raises BadHostKeyException itself,
    which `classify` turns into a fatal "host_key_changed".
    """

    def __init__(self, known_hosts: Path, trust_new_hosts: bool, target: Target,
                 on_pin: Callable[..., None] | None = None,
                 pin_new: bool = True):
        self.known_hosts = Path(known_hosts)
        self.trust_new_hosts = trust_new_hosts
        self.target = target
        self.on_pin = on_pin
        self.pin_new = pin_new  # False for --dry-run: accept for this session, write nothing
        self.pinned: paramiko.PKey | None = None

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        fp = fingerprint(key)
        if not self.trust_new_hosts:
            raise RemoteError(
                "host_key_unknown",
                self.target.host,
                f"{self.target.name}: unknown host key {key.get_name()} {fp} "
                f"(not in {self.known_hosts}); check it on the machine with "
                "'ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub', then "
                "re-run with --trust-new-hosts to pin it",
            )
        ip = None
        transport = client.get_transport()
        if transport is not None:
            try:
                ip = transport.getpeername()[0]
            except OSError:
                ip = None
        names = [hostname]
        if ip and ip != self.target.host:
            names.append(known_hosts_name(ip, self.target.port))
        if self.pin_new:
            pin_host_key(self.known_hosts, names, key)
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.pinned = key
        if self.on_pin is not None:
            self.on_pin(self.target, key, ip, self.pin_new)


def _default_on_pin(target: Target, key: paramiko.PKey, ip: str | None, pinned: bool = True) -> None:
    where = f" ({ip})" if ip and ip != target.host else ""
    verb = "pinned new host key" if pinned else "would pin new host key"
    console.err.print(f"{verb} for {target.name}{where}: {key.get_name()} {fingerprint(key)}")


# --------------------------------------------------------------------------- errors

_UNREACHABLE_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def classify(exc: BaseException, target: Target, timeout: float | None = None) -> RemoteError:
    """Map a Paramiko/socket exception onto one RemoteError kind with a message saying what to do."""
    if isinstance(exc, RemoteError):
        return exc
    name = target.name
    host = target.host
    port = target.port
    if isinstance(exc, paramiko.BadHostKeyException):
        return RemoteError(
            "host_key_changed",
            host,
            f"{name}: HOST KEY CHANGED for {exc.hostname}: pinned {exc.expected_key.get_name()} "
            f"{fingerprint(exc.expected_key)}, server now offers {exc.key.get_name()} {fingerprint(exc.key)}. "
            "Either the machine was reinstalled or someone is in the middle. If the new key is "
            f"genuine, remove the old line with 'ssh-keygen -R {exc.hostname} -f <known_hosts>' "
            "and re-run with --trust-new-hosts; this node was not touched",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return RemoteError(
            "auth_failed",
            host,
            f"{name}: authentication failed for {target.login} (wrong password, or password "
            "login disabled: check 'PasswordAuthentication yes' in the node's sshd_config)",
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        if (errors := list(exc.errors.values())) and all(isinstance(e, ConnectionRefusedError) for e in errors):
            return RemoteError(
                "refused", host,
                f"{name}: connection refused by {host}:{port} (is sshd running and listening on port {port}?)",
            )
        if errors:
            return classify(errors[0], target, timeout)
        return RemoteError("unreachable", host, f"{name}: cannot connect to {host}:{port}")
    if isinstance(exc, ConnectionRefusedError):
        return RemoteError(
            "refused", host,
            f"{name}: connection refused by {host}:{port} (is sshd running and listening on port {port}?)",
        )
    if isinstance(exc, socket.gaierror):
        return RemoteError(
            "unreachable", host,
            f"{name}: cannot resolve {host!r} ({exc.strerror}); add it to /etc/hosts or DNS, or use its IP",
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        within = f" within {timeout:g} s" if timeout else ""
        return RemoteError(
            "timeout", host,
            f"{name}: no answer from {host}:{port}{within} "
            f"(machine off, cable out, or a firewall dropping port {port})",
        )
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS:
        return RemoteError(
            "unreachable", host,
            f"{name}: {host} is unreachable ({os.strerror(exc.errno)}); check the machine is on and its network link",
        )
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc).lower():
        return RemoteError(
            "timeout", host,
            f"{name}: {host}:{port} accepted the connection but sent no SSH banner in time (is it an SSH server?)",
        )
    if isinstance(exc, (paramiko.SSHException, EOFError, OSError)):
        return RemoteError("unreachable", host, f"{name}: SSH to {host}:{port} failed: {type(exc).__name__}: {exc}")
    return RemoteError("unreachable", host, f"{name}: {type(exc).__name__}: {exc}")


def _scrub(err: RemoteError, secret: str | None) -> RemoteError:
    if secret and secret in str(err):
        return RemoteError(err.kind, err.host, str(err).replace(secret, "***"))
    return err


# --------------------------------------------------------------------------- sessions

def connect(
    target: Target,
    *,
    known_hosts: Path,
    password: str | None = None,
    key_filename: str | None = None,
    trust_new_hosts: bool = False,
    timeout: float = 10, pin_new: bool = True, here: bool = True,
) -> paramiko.SSHClient:
    """Open one authenticated session, verifying the host key against the project's known_hosts.

    No retries and no agent/default keys: the credentials used are exactly the ones given, so
    an auth failure means what it says. With trust_new_hosts an unknown key is pinned in
    `known_hosts` (pin_new=False: accepted for this session only, for dry runs). Raises RemoteError.
    This machine on port 22, as this user, gets a `thishost.LocalClient` instead (no sshd, no pinned
    key) unless here=False (setup, which installs this machine's own keys over SSH).
    """
    if here and target.port == 22 and thishost.runs_here(target.host, target.user):
        return thishost.LocalClient(target)  # type: ignore[return-value]  # Paramiko's part we use
    client = paramiko.SSHClient()
    # Only the project's own known_hosts, never ~/.ssh/known_hosts implicitly.
    client.get_host_keys().update(load_known_hosts(known_hosts))
    policy = PinningPolicy(known_hosts, trust_new_hosts, target, on_pin=_default_on_pin, pin_new=pin_new)
    client.set_missing_host_key_policy(policy)
    try:
        client.connect(
            hostname=target.host,
            port=target.port,
            username=target.user or getpass.getuser(),
            password=password,
            key_filename=key_filename,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
            allow_agent=False,
            look_for_keys=False,
        )
    except BaseException as e:  # noqa: BLE001 - every failure becomes one error class
        client.close()
        if isinstance(e, KeyboardInterrupt):
            raise
        raise _scrub(classify(e, target, timeout), password) from None
    client.dscluster_target = target  # type: ignore[attr-defined]  # for error messages in run()
    client.dscluster_host_key = client.get_transport().get_remote_server_key()  # type: ignore[attr-defined]
    return client


def _target_of(client: paramiko.SSHClient) -> Target:
    if (t := getattr(client, "dscluster_target", None)) is not None:
        return t
    transport = client.get_transport()
    host = transport.getpeername()[0] if transport is not None else "?"
    return Target(name=host, host=host)


def run(
    client: paramiko.SSHClient,
    command: str,
    timeout: float = 30,
    *,
    input: str | None = None,
    check: bool = False,
) -> CommandResult:
    """Run one command; stdout and stderr are drained together so neither pipe can fill and stall.

    Raises RemoteError("timeout") past `timeout`, and RemoteError("command_failed") for a
    non-zero exit when check=True.
    """
    target = _target_of(client)
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise RemoteError("unreachable", target.host, f"{target.name}: SSH session is closed")
    deadline = time.monotonic() + timeout
    try:
        chan = transport.open_session(timeout=timeout)
        chan.settimeout(0.2)
        chan.exec_command(command)
        if input is not None:
            chan.sendall(input.encode("utf-8"))
        chan.shutdown_write()
        out, err = bytearray(), bytearray()
        while True:
            got = False
            while chan.recv_ready():
                out += chan.recv(65536)
                got = True
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                got = True
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if time.monotonic() > deadline:
                chan.close()
                raise RemoteError(
                    "timeout", target.host,
                    f"{target.name}: command did not finish within {timeout:g} s: {_short(command)}",
                )
            if not got:
                time.sleep(0.01)
        rc = chan.recv_exit_status()
        chan.close()
    except RemoteError:
        raise
    except (paramiko.SSHException, OSError, EOFError) as e:
        raise classify(e, target, timeout) from None
    result = CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
    if check and rc != 0:
        detail = (result.stderr.strip() or result.stdout.strip())[-500:]
        raise RemoteError(
            "command_failed", target.host,
            f"{target.name}: '{_short(command)}' exited {rc}" + (f": {detail}" if detail else ""),
        )
    return result


def _short(command: str, limit: int = 120) -> str:
    one = " ".join(command.split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


# --------------------------------------------------------------------------- fan-out

class _FanOutBooks:
    """One fan-out's shared books: when each node's call started and its outcome, under one lock."""

    def __init__(self, targets: list[Target], fn: Callable[[Target], Any], *, timeout: float, description: str,
                 max_workers: int) -> None:
        self.targets = targets
        self.fn = fn
        self.timeout = timeout
        self.description = description
        self.slots = threading.Semaphore(max(1, max_workers))
        self.lock = threading.Lock()
        self.started: dict[str, float] = {}
        self.results: dict[str, Outcome] = {}
        self.done = threading.Event()

    def work(self, t: Target) -> None:
        """One node's call, run in its own daemon thread; its clock starts when it gets a slot."""
        with self.slots:
            t0 = time.monotonic()
            with self.lock:
                if t.name in self.results:  # already timed out while it waited for a slot
                    return
                self.started[t.name] = t0
            try:
                value = self.fn(t)
                outcome = Outcome(True, value, None, time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - reported per node
                if isinstance(e, (paramiko.SSHException, OSError, EOFError)) and not isinstance(e, RemoteError):
                    e = classify(e, t, self.timeout)
                outcome = Outcome(False, None, e, time.monotonic() - t0)
            with self.lock:  # the first outcome wins: a late return never replaces a timeout already shown
                self.results.setdefault(t.name, outcome)
                if len(self.results) == len(self.targets):
                    self.done.set()

    def expire_overdue(self) -> list[str]:
        """Mark every node whose call has run past the timeout as timed out; return the names still pending."""
        now = time.monotonic()
        with self.lock:
            for t in self.targets:
                t0 = self.started.get(t.name)
                if t.name not in self.results and t0 is not None and now - t0 > self.timeout:
                    self.results[t.name] = Outcome(
                        False, None,
                        RemoteError("timeout", t.host,
                                    f"{t.name}: no result within {self.timeout:g} s ({self.description})"),
                        now - t0,
                    )
            return [t.name for t in self.targets if t.name not in self.results]


def _start_progress(description: str, total: int) -> tuple[Any, Any]:
    """A transient progress bar on stderr (stdout stays clean for --json)."""
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("[dim]{task.fields[pending]}"),
        console=console.err, transient=True,
    )
    progress.start()
    return progress, progress.add_task(description, total=total, pending="")


def _waiting_for(pending: list[str]) -> str:
    return ("waiting for " + ", ".join(pending[:6]) + (" …" if len(pending) > 6 else "")) if pending else ""


def fan_out(
    targets: Iterable[Target],
    fn: Callable[[Target], Any],
    *,
    timeout: float,
    description: str,
    max_workers: int = 16,
    show_progress: bool = True,
) -> dict[str, Outcome]:
    """Run fn(target) for every target in parallel threads; one slow or dead node cannot stall the rest.

    Each node gets `timeout` seconds from the moment its call starts; past that its Outcome is
    a RemoteError("timeout") and the others go on. Threads are daemons, so a node stuck in a
    system call never keeps the command from exiting. Returns {target.name: Outcome} in input order.
    """
    targets = list(targets)
    if not targets:
        return {}
    books = _FanOutBooks(targets, fn, timeout=timeout, description=description, max_workers=max_workers)
    for t in targets:
        threading.Thread(target=books.work, args=(t,), daemon=True, name=f"fan-out-{t.name}").start()

    progress, task = _start_progress(description, len(targets)) if show_progress else (None, None)
    try:
        # The main thread only watches: it enforces the per-node timeout (a stuck thread cannot)
        # and redraws the bar, waking as soon as the last node reports.
        while True:
            pending = books.expire_overdue()
            if progress is not None:
                progress.update(task, completed=len(targets) - len(pending), pending=_waiting_for(pending))
            if not pending:
                break
            books.done.wait(0.1)
    finally:
        if progress is not None:
            progress.stop()
    return {t.name: books.results[t.name] for t in targets}
