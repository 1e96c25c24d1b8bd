"""A real Slurm on a simulated lab (test fixture): munged on every node with one shared key,
slurmctld on node1, slurmd on every node, one slurm.conf naming the lab's nodes with their CPUs
(and GPUs as GRES on a GPU lab). Debian's slurm-wlm 22.05 and munge (see .ci/run).

Everything stays inside the lab: the daemons run in the nodes' namespaces (as sshd does) and die
with them at `sim down`; their files lie in the lab's folder, which `sim down` removes. The nodes
see the config at Slurm's own default path (/etc/slurm/slurm.conf in each node's /etc overlay),
so `sbatch`, `srun` and `sinfo` work in a node as on a real cluster, with no variable set.

Why a test helper and not `dscluster sim`: dscluster writes sbatch scripts for a cluster someone
else runs; standing Slurm up is not something its users ask of it, and the daemon configuration
would become a product contract to keep. The lab's GPU sim needs it only for a measurement, which
`PYTHONPATH=tests python tests/cluster/_slurm_lab.py LAB` starts by hand (and `sim down LAB` ends).

    slurm = start_slurm(lab)      # returns once `sinfo` shows every node idle
    slurm = start_slurm(lab, stand_in_gpus={"node1": 2, "node2": 1})   # a CPU lab's nodes with GPUs as GRES
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from _wait import wait_until

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel")
PARTITION = "lab"


def slurm_skip_reason() -> str | None:
    from shutil import which

    missing = [d for d in DAEMONS if which(d) is None and not Path("/usr/sbin", d).exists()]
    return f"Slurm on the lab needs {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None


def gpu_indices(lab, node) -> list[str]:
    """The host GPUs the sim gave this node (its CUDA_VISIBLE_DEVICES), [] on a CPU lab."""
    visible = lab.env("root", node=node.name).get("CUDA_VISIBLE_DEVICES", "")
    return [g for g in visible.split(",") if g.strip()]


def gpu_devices(lab, node, base: Path, stand_in: dict[str, int]) -> list[str]:
    """The device files gres.conf names for a node: its host GPUs (/dev/nvidiaN) on a GPU lab, else
    `stand_in[node]` files made in the lab's folder (stand_in_devices)."""
    if gpu_indices(lab, node):
        return [f"/dev/nvidia{index}" for index in gpu_indices(lab, node)]
    return [f"{base}/{node.hostname}/dev/nvidia{index}" for index in range(stand_in.get(node.name, 0))]


def stand_in_devices(lab, node, paths: list[str]) -> None:
    """Character devices (the null device's numbers) at `paths`, made from inside the node: Slurm counts
    gres/gpu by its files and sets each task's CUDA_VISIBLE_DEVICES from their numbers, as for real GPUs;
    nothing opens them (the ranks train on the CPU)."""
    if paths:
        made = "; ".join(f"mknod -m 666 {shlex.quote(p)} c 1 3" for p in paths)
        lab.run(node.name, f"set -e; mkdir -p {shlex.quote(str(Path(paths[0]).parent))}; {made}", user="root",
                check=True)


def node_line(lab, node, gpus: int) -> str:
    """`NodeName=... CPUs=...` as the node's own slurmd measures it (`slurmd -C`), plus its address
    and GPUs; RealMemory is left out: every node shares one host's memory."""
    out = lab.run(node.name, ["slurmd", "-C"], user="root", check=True).stdout.splitlines()[0]
    words = [w for w in out.split() if not w.startswith(("RealMemory=", "NodeName=", "UpTime="))]
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    return f"NodeName={node.hostname} NodeAddr={node.ip} {' '.join(words)}{gres} State=UNKNOWN"


def slurm_conf(lab, base: Path, nodes: list[str], has_gpus: bool) -> str:
    head = lab.nodes[0]
    lines = [
        f"ClusterName={lab.name}",
        f"SlurmctldHost={head.hostname}({head.ip})",
        "AuthType=auth/munge",
        f"AuthInfo=socket={base}/munge/munge.socket",
        "SlurmUser=root",
        "SlurmdUser=root",
        # No cgroups inside a namespace lab: processes tracked through /proc, no task binding.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        f"TaskProlog={base}/task_prolog.sh",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        # Heterogeneous jobs (a mixed hostfile's) start only from a backfill pass: every second, not every 30.
        "SchedulerParameters=bf_interval=1",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"StateSaveLocation={base}/ctld",
        f"SlurmctldPidFile={base}/slurmctld.pid",
        f"SlurmctldLogFile={base}/slurmctld.log",
        f"SlurmdSpoolDir={base}/%n/spool",
        f"SlurmdPidFile={base}/%n/slurmd.pid",
        f"SlurmdLogFile={base}/%n/slurmd.log",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        *(["GresTypes=gpu"] if has_gpus else []),
        *nodes,
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


# A node's GPUs are its own through CUDA_VISIBLE_DEVICES (the sim's nodes share one host's devices
# and the lab has no device cgroups): each task gets the value of the node it runs on, never the
# submitting node's that --export=ALL carries. Slurm numbers the GPUs it grants a step by their place
# in the node's gres.conf (0, 1, ...), as device cgroups would show them on a real cluster: the i-th
# of the node's own GPUs stands for Slurm's i.
TASK_PROLOG = """#!/bin/sh
f="{base}/$(hostname)/cuda_visible_devices"
[ -s "$f" ] || exit 0
if [ -n "${{SLURM_STEP_GPUS:-}}" ] && [ -n "${{CUDA_VISIBLE_DEVICES:-}}" ]; then
  mine=""
  for i in $(echo "$CUDA_VISIBLE_DEVICES" | tr , ' '); do
    mine="$mine${{mine:+,}}$(cut -d, -f$((i + 1)) "$f")"
  done
  echo "export CUDA_VISIBLE_DEVICES=$mine"
else
  echo "export CUDA_VISIBLE_DEVICES=$(cat "$f")"
fi
"""


def cgroup_mounts() -> str:
    """Shell that gives a node the cgroup tree slurmd 22.05 needs to start: `ip netns exec` mounted
    the node a fresh /sys with /sys/fs/cgroup empty. A tmpfs with one named v1 hierarchy (no
    controllers) is enough with proctrack/linuxproc and task/none, and it mounts on a cgroup v1,
    hybrid or v2 host alike; it lives in the node's mount namespace and goes with it."""
    return ("mount -t tmpfs -o mode=755 cgroup_root /sys/fs/cgroup; mkdir /sys/fs/cgroup/systemd; "
            "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd")


@dataclass
class Slurm:
    lab: object
    base: Path

    def sh(self, cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm command as the lab user on node1."""
        return self.lab.run("node1", cmd, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        res = self.sh("sinfo -h -N -o '%N %t'")
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def log(self, node: str | None = None) -> str:
        path = self.base / (f"{node}/slurmd.log" if node else "slurmctld.log")
        return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path.name})"


def _daemon(lab, node: str, argv: list[str]) -> None:
    res = lab.run(node, argv, user="root", timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"{node}: {shlex.join(argv)} exited {res.returncode}: {res.stderr[-2000:]}")


def start_slurm(lab, stand_in_gpus: dict[str, int] | None = None) -> Slurm:
    """Start munged, slurmctld and slurmd in the lab's nodes; return once every node is idle.
    `stand_in_gpus` (node name -> count) gives a CPU lab's nodes GPUs as Slurm sees them (GRES)."""
    base = Path(lab.state.labdir) / "slurm"
    (base / "ctld").mkdir(parents=True, exist_ok=True)
    (base / "munge").mkdir(mode=0o755, exist_ok=True)
    os.chmod(base, 0o755)
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))  # one key for the whole lab, as on a real cluster
    os.chmod(key, 0o400)
    prolog = base / "task_prolog.sh"
    prolog.write_text(TASK_PROLOG.format(base=base))
    os.chmod(prolog, 0o755)
    for node in lab.nodes:
        mine = base / node.hostname
        (mine / "munge").mkdir(parents=True, exist_ok=True)
        (mine / "spool").mkdir(exist_ok=True)
        os.chmod(mine / "munge", 0o755)
        (mine / "cuda_visible_devices").write_text(",".join(gpu_indices(lab, node)))
    devices = {node.name: gpu_devices(lab, node, base, stand_in_gpus or {}) for node in lab.nodes}
    conf = slurm_conf(lab, base, [node_line(lab, n, len(devices[n.name])) for n in lab.nodes],
                      has_gpus=any(devices.values()))
    for node in lab.nodes:
        mine = base / node.hostname
        # Each node its own munge socket at the one path slurm.conf names: a bind mount in the
        # node's own mount namespace, so the host's folders stay as they are.
        script = (f"set -e; mount --bind {mine}/munge {base}/munge; {cgroup_mounts()}; mkdir -p /etc/slurm; "
                  "cat > /etc/slurm/slurm.conf")
        lab.run(node.name, script, user="root", input=conf, check=True)
        if devices[node.name]:
            # gres/gpu counts device files (a Count alone registers 0 GPUs and the node goes INVAL).
            if not gpu_indices(lab, node):
                stand_in_devices(lab, node, devices[node.name])
            gres = "".join(f"NodeName={node.hostname} Name=gpu File={path}\n" for path in devices[node.name])
            lab.run(node.name, "cat > /etc/slurm/gres.conf", user="root", input=gres, check=True)
        # --force: munged runs as root here (the node's passwd is the lab's, not the package's).
        _daemon(lab, node.name, ["munged", "--force", f"--key-file={key}", f"--socket={base}/munge/munge.socket",
                                 f"--pid-file={mine}/munged.pid", f"--log-file={mine}/munged.log",
                                 f"--seed-file={mine}/munged.seed"])
    _daemon(lab, "node1", ["slurmctld"])
    for node in lab.nodes:
        _daemon(lab, node.name, ["slurmd"])
    slurm = Slurm(lab, base)
    states: dict[str, str] = {}

    def all_idle() -> bool:
        states.update(slurm.node_states())
        return len(states) == len(lab.nodes) and all(s == "idle" for s in states.values())

    wait_until(all_idle, 60, f"every node of lab {lab.name} idle in sinfo", interval=0.5,
               explain=lambda: f"sinfo: {states}\n--- slurmctld.log\n{slurm.log()}")
    return slurm


if __name__ == "__main__":
    # By hand, e.g. on the GPU lab (as root, the lab up): PYTHONPATH=tests python tests/cluster/_slurm_lab.py LAB
    from dscluster.sim import lab as sim

    running = sim.load(sys.argv[1])
    if running is None:
        sys.exit(f"no lab {sys.argv[1]!r}: `dscluster sim up --lab {sys.argv[1]} ...` first")
    up = start_slurm(running)
    print(f"Slurm up on lab {running.name}: {up.node_states()}; files in {up.base}")
