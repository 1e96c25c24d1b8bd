"""Namespace plumbing for the simulated lab: anchors, nsenter, sshd, process teardown.

A node is a named network namespace plus mount and UTS namespaces that its *anchor* keeps alive:
`ip netns exec NS unshare --mount --uts ... sh anchor.sh` mounts the node's /etc, /root and /home,
sets the hostname and sleeps; a command "on" a node is `nsenter -t <anchor> -m -u -n`. Processes
are detached with `setsid -f`, orphans of PID 1 rather than children of the builder: a killed
child of a long-lived pytest would stay a zombie, and teardown waits for processes to be *gone*.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from dscluster.errors import DsclusterError
from dscluster.sim.reach import HOME_BIND, OVERLAY, REBIND

# Found on PATH, never at a fixed place: a host without them (a GPU server) is given a folder of
# carried binaries whose bin/ goes first on PATH. ssh: OpenMPI starts its daemons through it.
REQUIRED_TOOLS = ("ip", "unshare", "nsenter", "setsid", "setpriv", "ssh", "ssh-keygen", "openssl", "sshd")
LINK_TOOLS = ("tc",)
TOOL_PACKAGES = "iproute2 util-linux openssh-server openssh-client openssl"


def find_tool(name: str) -> str | None:
    """Absolute path of a tool on PATH. Not resolved through links: a carried `sshd` is a small
    wrapper script that finds its real binary relative to its own path, and sshd re-executes
    itself by the path it was started with."""
    found = shutil.which(name)
    return os.path.abspath(found) if found else None


class SimError(DsclusterError):
    """The lab could not be built or removed; the message says which step and why."""

    exit_code = 1


def sh(argv: list[str], *, check: bool = True, timeout: float = 30,
       input: str | None = None) -> subprocess.CompletedProcess:
    """Run a host-side command; a failure names the command and its stderr."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
    except FileNotFoundError:
        raise SimError(f"{argv[0]}: not on PATH (the lab needs {TOOL_PACKAGES}, or a folder of carried "
                       "binaries first on PATH)") from None
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


def anchor_script(*, hostname: str, nodedir: Path, mounts: list[list[str]] = (), private: list[str] = ()) -> str:
    """Shell run inside the node's new namespaces. Overlays, not edits: the host's /etc and
    /root stay untouched; the node sees its own passwd/shadow/hosts/ssh keys on top of them and
    a /root that is mode 711 (a venv's python may live under a pyenv in /root; the lab user must be
    able to traverse /root to run it, as on a workstation where Python was installed there).
    `mounts` (sim_reach.plan_reach) make the rest of what the nodes share reachable: the host
    directories to bind back are set aside first, before overlays and /home hide them. `private`:
    mount lines run after those (sim.private: the node's own copies, in a lab without NFS)."""
    n = str(nodedir)
    q = shlex.quote
    keep = {i: f"{n}/keep/{i}" for i, (kind, _) in enumerate(mounts) if kind in (REBIND, HOME_BIND)}
    lines = [
        "#!/bin/sh",
        "set -eu",
        f"echo {q(hostname)} > /proc/sys/kernel/hostname",
        *(f"mount --bind {q(mounts[i][1])} {q(k)}" for i, k in keep.items()),
        f"mount -t overlay dscluster-etc -o lowerdir=/etc,upperdir={n}/etc-upper,workdir={n}/etc-work /etc",
        f"mount -t overlay dscluster-root -o lowerdir=/root,upperdir={n}/root-upper,workdir={n}/root-work /root",
        f"mount --bind {n}/home /home",
    ]
    for i, (kind, path) in enumerate(mounts):
        if kind == OVERLAY:
            opts = f"lowerdir={path},upperdir={n}/reach/{i}/upper,workdir={n}/reach/{i}/work"
            lines.append(f"mount -t overlay dscluster-reach -o {q(opts)} {q(path)}")
        else:
            lines.append(f"mount --bind {q(keep[i])} {q(path)}")
    lines += [
        *private,
        f"echo $$ > {n}/anchor.pid.tmp",
        f"mv {n}/anchor.pid.tmp {n}/anchor.pid",
        "exec sleep infinity",
    ]
    return "\n".join(lines) + "\n"


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


def nsenter_argv(anchor_pid: int) -> list[str]:
    return ["nsenter", "-t", str(anchor_pid), "-m", "-u", "-n", "--"]


def start_sshd(anchor_pid: int, sshd: str, pidfile: Path, log: Path) -> None:
    """Start the node's sshd (it daemonises itself) by absolute path, which it needs to
    re-execute itself; `wait_sshd` waits for its pid file, which sshd writes only after its
    listening socket is bound."""
    try:
        pidfile.unlink()
    except FileNotFoundError:
        pass
    sh(nsenter_argv(anchor_pid) + [sshd, "-f", "/etc/ssh/sshd_config", "-E", str(log)])


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


def link_names(netns: str | None = None) -> list[str]:
    """Interface names in the host's namespace, or in `netns`."""
    if netns is not None and not netns_exists(netns):
        return []
    res = sh(["ip", *(["-n", netns] if netns else []), "-o", "link", "show"], check=False)
    names = []
    for line in res.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def tbf_available(probe_netns: str) -> str | None:
    """Why `tc ... tbf` cannot shape a link here (None if it can): tried on the loopback of a
    throwaway namespace, so nothing of the host is touched."""
    if find_tool("tc") is None:
        return "`tc` is not on PATH (apt-get install iproute2, or put carried binaries first on PATH)"
    sh(["ip", "netns", "add", probe_netns])
    try:
        res = sh(["tc", "-n", probe_netns, "qdisc", "replace", "dev", "lo", "root", "tbf",
                  "rate", "1gbit", "burst", "500000", "latency", "50ms"], check=False)
    finally:
        sh(["ip", "netns", "del", probe_netns], check=False)
    if res.returncode != 0:
        return (f"this kernel cannot shape links with tbf ({res.stderr.strip() or 'tc failed'}): "
                "`modprobe sch_tbf`, or leave out --link")
    return None
