"""Whether a hostfile's name is this machine, and a session that runs a command here without SSH.

One rule for "is this host this machine" (`is_this_machine`): `localhost`, a loopback address, this
machine's hostname, or a name whose address belongs to one of its interfaces. `remote.connect` hands
such a host a `LocalClient` instead of a Paramiko session, so `check`, `plan` and `top` probe and
sample one workstation with no sshd and no pinned host key. The client offers the part of Paramiko's
SSHClient the project uses (a transport whose channels run `sh -c COMMAND` as subprocesses), so every
caller of `remote.run` and every channel reader works unchanged.
"""

from __future__ import annotations

import functools
import getpass
import ipaddress
import os
import signal
import socket
import subprocess
import threading
import time

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _bindable(family: int, address: str) -> bool:
    """An address is this machine's when a socket can bind to it (no `ip` command needed)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=256)
def is_this_machine(host: str) -> bool:
    """Whether `host` (a hostfile name or address) is the machine this process runs on."""
    name = host.strip().lower()
    if not name:
        return False
    if name in LOOPBACK_NAMES or name in {socket.gethostname().lower(), socket.getfqdn().lower()}:
        return True
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if ip.is_loopback or _bindable(family, str(sockaddr[0])):
            return True
    return False


def all_this_machine(names) -> bool:
    """Whether every name (a hostfile's nodes) is this machine: nothing needs SSH or pinned host keys."""
    names = list(names)
    return bool(names) and all(is_this_machine(n) for n in names)


def runs_here(host: str, user: str | None) -> bool:
    """Whether a session to `user@host` is this process's own: the same machine and the same account."""
    return (user is None or user == getpass.getuser()) and is_this_machine(host)


class LocalChannel:
    """One command run here, read like a Paramiko channel (recv/recv_stderr, exit status, timeouts)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.timeout: float | None = None
        self._out, self._err = bytearray(), bytearray()
        self._lock = threading.Lock()
        self._eof = {"out": False, "err": False}
        self._pty = False

    def get_pty(self, *_args, **_kwargs) -> None:
        """As a Paramiko pty does: stderr comes on stdout. (Hang-up on close: close ends the process group.)"""
        self._pty = True

    def settimeout(self, seconds: float | None) -> None:
        self.timeout = seconds

    def exec_command(self, command: str) -> None:
        # Its own process group, so closing the channel ends the command and its children (a listener).
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if self._pty else subprocess.PIPE, start_new_session=True)
        self._eof["err"] = self._pty  # merged into stdout: no stream of its own
        for key, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            if pipe is not None:
                threading.Thread(target=self._drain, args=(key, pipe), daemon=True).start()

    def _drain(self, key: str, pipe) -> None:
        buf = self._out if key == "out" else self._err
        for data in iter(lambda: os.read(pipe.fileno(), 65536), b""):
            with self._lock:
                buf += data
        with self._lock:
            self._eof[key] = True

    def sendall(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass

    def shutdown_write(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def _take(self, buf: bytearray, n: int) -> bytes:
        with self._lock:
            data = bytes(buf[:n])
            del buf[:n]
            return data

    def recv_ready(self) -> bool:
        with self._lock:
            return bool(self._out)

    def recv_stderr_ready(self) -> bool:
        with self._lock:
            return bool(self._err)

    def recv(self, n: int) -> bytes:
        """Up to n bytes of stdout; b"" at its end; socket.timeout past the channel's timeout."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            with self._lock:
                if self._out or self._eof["out"]:
                    data = bytes(self._out[:n])
                    del self._out[:n]
                    return data
            if deadline is not None and time.monotonic() > deadline:
                raise socket.timeout("timed out")
            time.sleep(0.01)

    def recv_stderr(self, n: int) -> bytes:
        return self._take(self._err, n)

    def exit_status_ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None and all(self._eof.values())

    def recv_exit_status(self) -> int:
        assert self.proc is not None
        rc = self.proc.wait()
        return rc if rc >= 0 else 128 - rc  # a signal reads as a shell would report it

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class LocalTransport:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def getpeername(self) -> tuple[str, int]:
        return ("127.0.0.1", 0)

    def open_session(self, timeout: float | None = None) -> LocalChannel:
        return LocalChannel()


class LocalClient:
    """What `remote.connect` returns for this machine: commands run here as this user, no SSH."""

    local = True

    def __init__(self, target) -> None:
        self.dscluster_target = target
        self.dscluster_host_key = None
        self._transport = LocalTransport()

    def get_transport(self) -> LocalTransport | None:
        return self._transport if self._transport.active else None

    def close(self) -> None:
        self._transport.active = False
