"""Can this host carry the lab `sim up` was asked for? Checked before anything is built.

Each refusal is exit 2 (UsageError) naming what is missing and the fix: not root, a tool not
on PATH, no NVIDIA GPUs (or fewer than `--gpus` asks for), GPU device files the lab user
cannot open, no tbf in the kernel for `--link`, or a directory the nodes share that the lab
user cannot reach (sim_reach).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dscluster.errors import UsageError
from dscluster.files import paths
from dscluster.sim.netfaults import NetFaults, fault_tools
from dscluster.sim.ns import LINK_TOOLS, REQUIRED_TOOLS, TOOL_PACKAGES, find_tool, tbf_available
from dscluster.sim.options import LINK_NONE, check_gpu_supply, count_listed_gpus
from dscluster.sim.plan import SIM_ROOT, USER_PATH
from dscluster.sim.reach import host_stat, plan_reach


def repo_root() -> Path:
    """dscluster's own files (entry_cn.sh, presets): a checkout or an installed copy; visible on every node."""
    return paths.assets_root()


def require_root() -> None:
    if os.geteuid() != 0:
        raise UsageError(
            "the simulated lab needs root (network namespaces, mounts, sshd): run it as root, "
            "e.g. `sudo .venv/bin/dscluster sim up`"
        )


def require_tools(link: str = LINK_NONE, faults: NetFaults | None = None) -> dict[str, str]:
    """{tool: absolute path} of every tool the lab runs, found on PATH."""
    wanted = REQUIRED_TOOLS + (LINK_TOOLS if link != LINK_NONE else ())
    wanted += tuple(t for t in fault_tools(faults or NetFaults()) if t not in wanted)
    found = {t: find_tool(t) for t in wanted}
    missing = [t for t, path in found.items() if path is None]
    if missing:
        raise UsageError(
            f"not on PATH: {', '.join(missing)}. Install them (`apt-get install {TOOL_PACKAGES}"
            f"{' nftables' if 'nft' in missing else ''}`), "
            "or, on a host without them, put a folder of carried binaries first on PATH"
        )
    return found


def extra_path_dirs(tools: dict[str, str]) -> list[str]:
    """Directories of tools found outside the standard PATH: the nodes need them on theirs too
    (OpenMPI's daemons call `ssh` from inside a node's sshd session)."""
    std = set(USER_PATH.split(":")) | {"/usr/sbin", "/sbin", "/usr/local/sbin"}
    return list(dict.fromkeys(str(Path(p).parent) for p in tools.values() if str(Path(p).parent) not in std))


def check_gpus(counts: list[int]) -> None:
    """`--gpus` needs that many NVIDIA GPUs here, and device files the lab user can open."""
    shown = ",".join(map(str, counts))
    smi = find_tool("nvidia-smi")
    if smi is None:
        raise UsageError(
            f"--gpus {shown}: `nvidia-smi` is not on PATH, so this host shows no NVIDIA GPU. Install the "
            "NVIDIA driver (it brings nvidia-smi) or put it on PATH; for a lab without GPUs leave out --gpus"
        )
    try:
        res = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise UsageError(f"--gpus {shown}: `nvidia-smi -L` gave no answer in 60 s (is the driver hung?)") from None
    if res.returncode != 0:
        raise UsageError(f"--gpus {shown}: `nvidia-smi -L` failed (exit {res.returncode}): "
                         f"{(res.stderr or res.stdout).strip()[-300:]} (is the NVIDIA driver loaded?)")
    check_gpu_supply(counts, count_listed_gpus(res.stdout))
    closed = []
    for dev in sorted(Path("/dev").glob("nvidia*")):
        if dev.is_char_device() and os.stat(dev).st_mode & 0o006 != 0o006:
            closed.append(f"{dev} (mode {os.stat(dev).st_mode & 0o777:04o})")
    if closed:
        raise UsageError(
            "the lab user (not root) must open the GPU device files, and cannot open "
            f"{', '.join(closed)}; fix: `chmod 0666 /dev/nvidia*` now, and the driver option "
            "NVreg_DeviceFileMode=0666 to keep it after a reboot"
        )


def check_link(link: str, faults: NetFaults | None = None) -> None:
    if link == LINK_NONE and faults and faults.link:
        link = next(iter(faults.link.values()))
    if link == LINK_NONE:
        return
    reason = tbf_available(f"dscluster-tbfprobe-{os.getpid()}")
    if reason:
        raise UsageError(f"--link {link}: {reason}")


def shared_targets(shared: str, hostfile: str | None, extra_path: list[str] = ()) -> list[str]:
    """Directories every node uses at the host's path: the checkout, the Python that runs
    dscluster (its venv and the installation the venv links to), the checkout's own .venv and
    its Python, the lab's shared folder, the hostfile's folder, and folders of carried tools (a
    tool folder named bin is part of a prefix, as wrappers in bin/ that run ../real/ or ../lib/
    are: the whole prefix)."""
    pythons = [sys.executable, paths.venv_bin() / "python"]
    tools = [os.path.dirname(os.path.normpath(t)) if os.path.basename(os.path.normpath(t)) == "bin" else t
             for t in extra_path]
    dirs = [repo_root(), sys.prefix, sys.base_prefix, shared, *tools]
    for py in pythons:
        if os.path.exists(py):
            real = Path(os.path.realpath(py))
            dirs += [Path(py).parent.parent, real.parent.parent]
    if hostfile:
        dirs.append(Path(hostfile).absolute().parent)
    return list(dict.fromkeys(os.path.realpath(d) for d in dirs))


def plan_shared_reach(shared: str, hostfile: str | None, extra_path: list[str], uid: int,
                      gid: int) -> list[list[str]]:
    """The reach mounts (sim_reach) for this host, or exit 2 naming what cannot be reached."""
    return plan_reach(shared_targets(shared, hostfile, extra_path), host_stat, uid=uid, gid=gid,
                      keep_clear=(str(SIM_ROOT),))
