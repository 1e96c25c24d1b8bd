"""Namespace plumbing for the simulated lab: anchors, nsenter, sshd, process teardown.

A node is three namespaces: network (made by `ip netns add`, so it has a name), mount and UTS
(made by `unshare` inside it). Something must live in the mount and UTS namespaces to keep them,
so each node has an *anchor*: `ip netns exec NS unshare --mount --uts ... sh anchor.sh`, which
mounts the node's own /etc, /root and /home, sets the hostname and then sleeps forever. Every
command that runs "on" a node is `nsenter -t <anchor> -m -u -n`.

Processes started here are detached with `setsid -f` so that they are orphans of PID 1, not
children of the Python process that built the lab (a killed child of a long-lived pytest would
stay a zombie until pytest exits, and teardown waits for processes to be *gone*).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from dscluster.errors import DsclusterError

SSHD = "/usr/sbin/sshd"
REQUIRED_TOOLS = ("ip", "unshare", "nsenter", "setsid", "setpriv", "ssh-keygen", "openssl")


class SimError(DsclusterError):
    """The lab could not be built or removed; the message says which step and why."""

    exit_code = 1


def sh(argv: list[str], *, check: bool = True, timeout: float = 30, input: str | None = None) -> subprocess.CompletedProcess:
    """Run a host-side command; a failure names the command and its stderr."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
    except FileNotFoundError:
        raise SimError(f"{argv[0]}: not installed (the lab needs iproute2, util-linux, openssh-server, openssl)") from None
    except subprocess.TimeoutExpired:
        raise SimError(f"{' '.join(argv)}: no answer after {timeout:.0f} s") from None
    if check and res.returncode != 0:
        raise SimError(f"{' '.join(argv)} failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


def pid_alive(pid: int) -> bool:
    """True while /proc/PID exists, zombies included: a zombie still holds its pid."""
    return Path(f"/proc/{pid}").exists()


def _stat_fields(pid: int) -> list[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat.rsplit(")", 1)[1].split()   # [state, ppid, ...]; the name may contain spaces


def pid_is_zombie(pid: int) -> bool:
    f = _stat_fields(pid)
    return bool(f) and f[0] == "Z"


def _awaiting_reaper(pid: int) -> bool:
    """Alive, or a zombie that PID 1 will reap (slowly, here). A zombie whose parent is some
    other live process (a caller that never waited) has released its namespaces already; only
    its parent can reap it, so waiting for it would be waiting forever."""
    f = _stat_fields(pid)
    if not f:
        return False
    return f[0] != "Z" or f[1] == "1"


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def netns_pids(name: str) -> list[int]:
    """Live processes inside a named network namespace (what `ip netns pids` reports)."""
    if not netns_exists(name):
        return []
    res = sh(["ip", "netns", "pids", name], check=False)
    return sorted({int(p) for p in res.stdout.split() if p.isdigit()})


def kill_and_wait(pids: list[int], *, grace: float = 1.0, timeout: float = 15.0) -> list[int]:
    """SIGTERM, SIGKILL whatever still runs after `grace`, then wait until every pid is gone
    from /proc (reaped, not only dead). Returns the pids still running after `timeout`."""

    def send(sig: int, targets: list[int]) -> None:
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    send(signal.SIGTERM, pids)
    wait_for(lambda: all(not pid_alive(p) or pid_is_zombie(p) for p in pids), grace)
    send(signal.SIGKILL, [p for p in pids if pid_alive(p) and not pid_is_zombie(p)])
    wait_for(lambda: not any(_awaiting_reaper(p) for p in pids), timeout, interval=0.05)
    return [p for p in pids if pid_alive(p) and not pid_is_zombie(p)]


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def anchor_script(*, hostname: str, nodedir: Path) -> str:
    """Shell run inside the node's new namespaces. Overlays, not edits: the host's /etc and
    /root stay untouched; the node sees its own passwd/shadow/hosts/ssh keys on top of them and
    a /root that is mode 711 (a venv's python may live under a pyenv in /root; the lab user must be
    able to traverse /root to run it, as on a workstation where Python was installed there)."""
    n = str(nodedir)
    return f"""#!/bin/sh
set -eu
echo '{hostname}' > /proc/sys/kernel/hostname
mount -t overlay dscluster-etc -o lowerdir=/etc,upperdir={n}/etc-upper,workdir={n}/etc-work /etc
mount -t overlay dscluster-root -o lowerdir=/root,upperdir={n}/root-upper,workdir={n}/root-work /root
mount --bind {n}/home /home
echo $$ > {n}/anchor.pid.tmp
mv {n}/anchor.pid.tmp {n}/anchor.pid
exec sleep infinity
"""


def start_anchor(netns: str, nodedir: Path) -> None:
    """Start the node's anchor detached; `wait_anchor` collects its pid once its mounts are done."""
    script = nodedir / "anchor.sh"
    log = open(nodedir / "anchor.log", "wb")
    try:
        subprocess.run(
            ["setsid", "-f", "ip", "netns", "exec", netns,
             "unshare", "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", str(script)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=10,
        )
    except subprocess.CalledProcessError as e:
        raise SimError(f"{netns}: could not start the node's namespaces (exit {e.returncode})") from None
    finally:
        log.close()


def wait_anchor(nodedir: Path, timeout: float = 10) -> int:
    pidfile = nodedir / "anchor.pid"
    if not wait_for(pidfile.exists, timeout):
        log = (nodedir / "anchor.log").read_text(errors="replace").strip()
        raise SimError(f"{nodedir.name}: namespaces not ready after {timeout:.0f} s: {log or 'no output'}")
    return int(pidfile.read_text().strip())


def nsenter_argv(anchor_pid: int, *, wd: str | None = None) -> list[str]:
    argv = ["nsenter", "-t", str(anchor_pid), "-m", "-u", "-n"]
    if wd:
        argv.append(f"--wd={wd}")
    return argv + ["--"]


def start_sshd(anchor_pid: int, pidfile: Path, log: Path) -> None:
    """Start the node's sshd (it daemonises itself); `wait_sshd` waits for its pid file,
    which sshd writes only after its listening socket is bound."""
    try:
        pidfile.unlink()
    except FileNotFoundError:
        pass
    sh(nsenter_argv(anchor_pid) + [SSHD, "-f", "/etc/ssh/sshd_config", "-E", str(log)])


def wait_sshd(pidfile: Path, log: Path, timeout: float = 10) -> int:
    if not wait_for(lambda: pidfile.exists() and pidfile.read_text().strip().isdigit(), timeout):
        text = log.read_text(errors="replace").strip() if log.exists() else ""
        raise SimError(f"sshd did not start within {timeout:.0f} s: {text[-500:] or 'no log'}")
    return int(pidfile.read_text().strip())


def read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def pid_in_netns(pid: int, netns: str) -> bool:
    """Guards every kill by pid: a pid from a file may have been reused by an unrelated process."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return False


def host_mounts_under(path: str) -> list[str]:
    """Mount points in the host's mount namespace at or below `path`."""
    out = []
    prefix = path.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4]
            if mnt == path or mnt.startswith(prefix):
                out.append(mnt)
    return out


def link_names() -> list[str]:
    res = sh(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in res.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names
