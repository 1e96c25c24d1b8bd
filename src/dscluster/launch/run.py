"""Running launch commands: a local launcher process, or one torchrun agent per node over SSH.

Separate from `launch` (pure builders) so the builders stay testable without running
anything. Output is streamed as it comes, never buffered, so a long training shows progress,
and the exit code of the job becomes the exit code of `dscluster launch`. A local launcher is
also watched (`run_job`): a node that vanished, or Ctrl-C, ends the job within the process-group
timeout plus a grace, with nothing of it left running on this machine.
"""

from __future__ import annotations

import codecs
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dscluster.analysis.load import load_run
from dscluster.errors import UsageError
from dscluster.launch.builders import NodeCommand
from dscluster.node import liveness
from dscluster.rundir import layout
from dscluster.ssh import remote

# After the run's summary.json is written (the job's outcome is known), or after mpirun exited
# leaving ranks of this node behind, how long the job gets to end by itself before it is stopped.
GRACE_S = 30.0
# From SIGINT/SIGTERM to SIGKILL: mpirun and entry_cn.sh stop their ranks within a few seconds.
TERM_S = 10.0
DEFAULT_PG_TIMEOUT_S = 120.0


@dataclass
class JobOutcome:
    """How a launcher run ended. `rc` is the launcher's wait status as Popen gives it (-N: signal N)."""

    rc: int
    # Where the run's summary.json stood when the launcher was started, as summary_since takes
    # it: the mtime of an earlier attempt's (a resumed run), 0.0 when there was none.
    started: float = 0.0
    vanished: list[str] = field(default_factory=list)   # nodes mpirun said it lost, in its order
    stopped: str | None = None     # why dscluster stopped the job itself, else None
    interrupted: bool = False      # Ctrl-C


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid`: mpirun (started as its leader) and what it started on
    this machine, including ranks it left behind when it exited. Zombies are not counted."""
    pids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.getsid(int(name)) != sid:
                continue
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            pids.append(int(name))
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _stop(proc: subprocess.Popen, sig: int) -> None:
    """Signal the launcher's session: every member found in /proc, and the launcher and its
    process group by id as well, so that a /proc that does not show them (mounted for another
    PID namespace) cannot leave a launcher that ignores SIGTERM running after SIGKILL. The group
    is signalled only while the launcher is unreaped: until then its id cannot be reused."""
    _signal_all(session_members(proc.pid), sig)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass


def _pump(fd: int, dst, vanished: list[str]) -> None:
    """Copy a launcher pipe to our own stream as it comes, reading PRTE's lost-daemon lines."""
    decode = codecs.getincrementaldecoder("utf-8")("replace")  # a chunk may end mid-character
    line = ""
    try:
        while chunk := os.read(fd, 65536):
            text = decode.decode(chunk)
            dst.write(text)
            dst.flush()
            *lines, line = (line + text).split("\n")
            for host in filter(None, map(liveness.lost_daemon_host, lines)):
                if host not in vanished:
                    vanished.append(host)
    finally:
        os.close(fd)


def summary_mark(run_dir: Path | None) -> float:
    """What `summary_since` compares with, taken before the launcher starts: the mtime of the
    summary.json already in the run directory (an earlier attempt's), else 0.0.

    Not the clock: a file's time lags time.time() by up to a kernel tick (the kernel stamps
    files from a coarse clock; a summary written within that tick of the start looked older
    than the launch, the watcher never saw it and waited for a hung mpirun forever), and a
    run directory on a file server takes its times from the server's clock. The earlier
    summary was stamped by the same clock as this attempt's will be."""
    if run_dir is None:
        return 0.0
    try:
        return (run_dir / layout.SUMMARY_FILE).stat().st_mtime
    except OSError:
        return 0.0


def summary_since(run_dir: Path | None, mark: float) -> dict:
    """The run's summary.json if it was written after `mark` (`summary_mark` before the launch:
    a resumed run's directory holds the earlier attempt's), else {}."""
    if run_dir is None:
        return {}
    path = run_dir / layout.SUMMARY_FILE
    try:
        if path.stat().st_mtime <= mark:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_pg_timeout(run_dir: Path | None) -> float:
    """dist.timeout_s of the run (its config.yaml, written when training starts), else the preset's."""
    try:
        cfg = yaml.safe_load((run_dir / layout.CONFIG_FILE).read_text(encoding="utf-8"))
        return float(cfg["dist"]["timeout_s"])
    except Exception:  # noqa: BLE001 - not started yet, or unreadable: the default bound
        return DEFAULT_PG_TIMEOUT_S


def run_job(argv: list[str], env: dict[str, str] | None = None, *, run_dir: Path | None = None,
            grace_s: float | None = None, term_s: float | None = None) -> JobOutcome:
    """Run a launcher (mpirun, deepspeed) with its output streamed, and make sure it ends.

    The launcher leads a session of its own, so everything it starts on this machine can be
    found and stopped. It ends by itself in the usual cases; dscluster steps in where it
    does not (all measured with OpenMPI 5.0.11 on the simulated lab):
    - a node vanished and mpirun lost its daemon there: mpirun says so and exits 0, leaving
      this node's ranks to fail on their own; those get until the process-group timeout plus
      `grace_s` (the first rank to fail writes summary.json, naming the node);
    - the run's summary.json was written but mpirun still waits for a node that is gone (no
      keepalive in effect): after `grace_s` the session is stopped;
    - Ctrl-C: SIGINT to the launcher (mpirun forwards it to every rank), then SIGTERM and
      SIGKILL to the whole session `term_s` apart.
    """
    grace_s = GRACE_S if grace_s is None else grace_s
    term_s = TERM_S if term_s is None else term_s
    out = JobOutcome(0, summary_mark(run_dir))
    # The pumps run before the launcher does, so that from its start to the watch below there
    # is nothing a Ctrl-C could interrupt: the launcher leads its own session, the terminal's
    # SIGINT reaches only this process, and a KeyboardInterrupt outside the watch would leave
    # the launcher running with nobody to stop it.
    pipes = [os.pipe(), os.pipe()]
    pumps = [threading.Thread(target=_pump, args=(r, dst, out.vanished), daemon=True)
             for (r, _), dst in zip(pipes, (sys.stdout, sys.stderr), strict=True)]
    for t in pumps:
        t.start()
    try:
        proc = subprocess.Popen(argv, env=env, stdout=pipes[0][1], stderr=pipes[1][1], start_new_session=True)
    except FileNotFoundError:
        print(f"dscluster launch: {argv[0]}: command not found", file=sys.stderr)
        out.rc = 127
        return out
    finally:
        for _, w in pipes:
            os.close(w)  # the launcher holds its own copies; the pumps end when it and its children close them
    summary_at = exited_at = stop_at = None
    escalation = [signal.SIGTERM, signal.SIGKILL]
    while True:
        try:
            now = time.monotonic()
            members = session_members(proc.pid)
            if proc.poll() is not None:
                if exited_at is None:
                    exited_at, leftover_s = now, run_pg_timeout(run_dir) + grace_s
                if not members:
                    break
            if summary_at is None and summary_since(run_dir, out.started):
                summary_at = now
            if stop_at is None:
                why, name = None, os.path.basename(argv[0])
                if summary_at is not None and now - summary_at > grace_s:
                    why = (f"the job's processes on this machine ({name} or ranks) were still running {grace_s:.0f} s "
                           "after the run's summary.json was written: dscluster stopped them")
                elif exited_at is not None and now - exited_at > leftover_s:
                    why = (f"{name} exited but left ranks running on this machine for {leftover_s:.0f} s "
                           f"(process-group timeout + {grace_s:.0f} s): dscluster stopped them")
                if why:
                    out.stopped, stop_at = why, now
                    _stop(proc, escalation.pop(0))
            elif now - stop_at > term_s and escalation:
                stop_at = now
                _stop(proc, escalation.pop(0))
            elif now - stop_at > term_s:
                break  # SIGKILLed: nothing more to wait for (PID 1 reaps them)
            time.sleep(0.5)
        except KeyboardInterrupt:
            out.interrupted = True
            if stop_at is None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                out.stopped, stop_at = "interrupted (Ctrl-C)", time.monotonic()
            elif escalation:  # a second Ctrl-C: do not wait any longer
                stop_at = time.monotonic()
                _stop(proc, escalation.pop(0))
    out.rc = proc.wait()
    for t in pumps:
        t.join(timeout=2.0)  # a killed rank's grandchild may still hold the pipe
    return out


def job_exit_code(rc: int) -> int:
    """What `dscluster launch` returns for a launcher's wait status, as a shell would report it:
    the job's own code, or 128+N when signal N killed it (Popen gives -N)."""
    return 128 - rc if rc < 0 else rc


@dataclass
class NodeResult:
    host: str
    rc: int | None
    error: str | None = None
    ended: float = float("inf")
    """time.monotonic() when the node's command ended: the first to fail is where the job broke
    (the other nodes' ranks fail after it, when their collective times out or is torn down)."""


def run_over_ssh(commands: list[NodeCommand], *, known_hosts: Path, key_filename: str | None,
                 user: str | None = None, connect_timeout: float = 10.0) -> list[NodeResult]:
    """Start one command per node over SSH at once, prefix their output with the host, wait.

    A pty is requested so that closing the session hangs up the remote command: when one
    node fails, the others are closed instead of waiting forever for a rendezvous.
    """
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
                results[cmd.host] = NodeResult(cmd.host, None, str(e), time.monotonic())
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
            results[cmd.host] = NodeResult(cmd.host, rc, ended=time.monotonic())
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


def died_on(run_dir: str | Path | None) -> set[str]:
    """Hosts of the ranks whose metrics stop without an end record (a SIGKILL, the OOM killer, a crash), as the
    run directory says here; empty where it cannot be read (no shared filesystem, no run yet)."""
    if not run_dir:
        return set()
    try:
        run = load_run(run_dir)
    except (UsageError, OSError, ValueError):
        return set()
    return {rm.host for rm in run.ranks.values() if rm.end is None and rm.host}


def failed_first(results: list[NodeResult], run_dir: str | Path | None = None) -> list[NodeResult]:
    """The nodes whose command failed: where a rank died first (`died_on`, by host name), then the first to end
    first (stopped ones last). When a rank dies, the rank that only waited for it can end first (a closed
    connection fails its collective at once), so the order of the nodes' ends alone named the wrong node."""
    died = died_on(run_dir)
    return sorted((r for r in results if r.rc != 0), key=lambda r: (r.host not in died, r.ended))


def nodes_exit_code(results: list[NodeResult], run_dir: str | Path | None = None) -> int:
    """The first failed node's own exit code (`failed_first`); 1 when a node failed without one (no connection,
    stopped, or an SSH server that sent no status: Paramiko's -1)."""
    for r in failed_first(results, run_dir):
        if r.rc:
            return r.rc if r.rc > 0 else 1
    return 1 if any(r.rc is None for r in results) else 0


def launcher_env(bin_dir: str | None, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with the venv's bin first (mpirun, ompi_info, deepspeed), and
    PRRTE's daemon keepalives short enough to notice a vanished node (liveness.py) unless the
    user set them: mpirun passes them on to its daemons."""
    env = {**liveness.prte_env(), **os.environ}
    if bin_dir:
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env
