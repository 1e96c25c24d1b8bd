"""Running launch commands: a local launcher process, or one torchrun agent per node over SSH.

Separate from `launch` (pure builders) so the builders stay testable without running
anything. Output is streamed as it comes, never buffered, so a long training shows progress,
and the exit code of the job becomes the exit code of `dscluster launch`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster.launch import NodeCommand


def run_streaming(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
                  grace_s: float = 10.0) -> int:
    """Run argv with inherited stdout/stderr and return its exit code.

    Ctrl-C is passed on as SIGINT, and then SIGTERM if the launcher has not stopped within
    `grace_s`: mpirun and DeepSpeed's launcher tear their ranks down on those signals,
    so nothing is left running on the nodes.
    """
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd)
    except FileNotFoundError:
        print(f"dscluster launch: {argv[0]}: command not found", file=sys.stderr)
        return 127
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                return proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()


def job_exit_code(rc: int) -> int:
    """What `dscluster launch` returns for a launcher's wait status, as a shell would report it:
    the job's own code, or 128+N when signal N killed it (Popen gives -N)."""
    return 128 - rc if rc < 0 else rc


@dataclass
class NodeResult:
    host: str
    rc: int | None
    error: str | None = None


def run_over_ssh(commands: list[NodeCommand], *, known_hosts: Path, key_filename: str | None,
                 user: str | None = None, connect_timeout: float = 10.0) -> list[NodeResult]:
    """Start one command per node over SSH at once, prefix their output with the host, wait.

    A pty is requested so that closing the session hangs up the remote command: when one
    node fails, the others are closed instead of waiting forever for a rendezvous.
    """
    from dscluster import remote

    results: dict[str, NodeResult] = {}
    channels: dict[str, object] = {}
    clients = []
    failed = threading.Event()
    lock = threading.Lock()

    def pump(cmd: NodeCommand) -> None:
        try:
            client = remote.connect(remote.Target(name=cmd.host, host=cmd.host, user=user),
                                    known_hosts=known_hosts, key_filename=key_filename,
                                    timeout=connect_timeout)
        except Exception as e:  # noqa: BLE001 - reported per node
            with lock:
                results[cmd.host] = NodeResult(cmd.host, None, str(e))
            failed.set()
            return
        clients.append(client)
        chan = client.get_transport().open_session()
        chan.get_pty()
        # The pty is only for hang-up on close: TERM=dumb keeps progress bars from redrawing
        # into the prefixed log.
        chan.exec_command("export TERM=dumb; " + cmd.shell)
        with lock:
            channels[cmd.host] = chan
        buf = b""
        while True:
            data = chan.recv(65536)
            if not data:
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                sys.stdout.write(f"[{cmd.host}] {line.decode('utf-8', 'replace').rstrip()}\n")
            sys.stdout.flush()
        if buf:
            sys.stdout.write(f"[{cmd.host}] {buf.decode('utf-8', 'replace').rstrip()}\n")
        rc = chan.recv_exit_status()
        with lock:
            results[cmd.host] = NodeResult(cmd.host, rc)
        if rc != 0:
            failed.set()

    threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c in commands]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            if failed.is_set():
                time.sleep(5.0)  # let the others notice and report on their own first
                with lock:
                    for host, chan in channels.items():
                        if host not in results:
                            chan.close()  # type: ignore[attr-defined]
                break
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=15)
    except KeyboardInterrupt:
        with lock:
            for chan in channels.values():
                chan.close()  # type: ignore[attr-defined]
    finally:
        for c in clients:
            c.close()
    return [results.get(c.host, NodeResult(c.host, None, "stopped: another node failed")) for c in commands]


def nodes_exit_code(results: list[NodeResult]) -> int:
    """The first failed node's own exit code; 1 when a node failed without one (no connection,
    stopped, or an SSH server that sent no status: Paramiko's -1)."""
    for r in results:
        if r.rc:
            return r.rc if r.rc > 0 else 1
    return 1 if any(r.rc is None for r in results) else 0


def launcher_env(bin_dir: str | None, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with the venv's bin first (mpirun, ompi_info, deepspeed)."""
    env = dict(os.environ)
    if bin_dir:
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env
