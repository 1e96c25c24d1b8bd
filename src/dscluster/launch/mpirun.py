"""OpenMPI's mpirun: which one to run, and its command line. The one owner of both.

Every mpirun dscluster starts goes through here: `dscluster launch`, check's MPI hello and
all-reduce, the benchmarks (several programs in one job, MPMD) and `make demo`. Building is
pure (tests assert the exact argv); `mpirun_path` is the only part that looks at the disk.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from dscluster.files import paths


@dataclass(frozen=True)
class App:
    """One program of the job: `-np N [-x KEY=VALUE | -x KEY] ... argv`."""

    np: int
    argv: list[str]
    env: Mapping[str, str | None] = field(default_factory=dict)
    """Variables for its ranks, in this order: a value sets it, None passes on the launching
    shell's value (`-x KEY`)."""


def network_args(cidr: str | None) -> list[str]:
    """Pin both OpenMPI's byte transfer layer and its runtime's out-of-band channel to the subnet
    every node shares: a decoy docker0 or a second NIC otherwise stalls the job."""
    if not cidr:
        return []
    return ["--mca", "btl_tcp_if_include", cidr, "--mca", "oob_tcp_if_include", cidr]


def _app_args(app: App) -> list[str]:
    out = ["-np", str(app.np)]
    for key, value in app.env.items():
        out += ["-x", key if value is None else f"{key}={value}"]
    return out


def mpirun_argv(mpirun: str, apps: Sequence[App], *, hostfile: str | None = None, host: str | None = None,
                map_by: str | None = None, bind_to: str | None = None, oversubscribe: bool = False,
                cidr: str | None = None, as_root: bool = False) -> list[str]:
    """The mpirun command line.

    One program:     mpirun -np N --hostfile H --map-by M --bind-to B -x ... --mca ... PROGRAM
    Several (MPMD):  mpirun --hostfile H ... --mca ... -np N1 -x ... PROG1 : -np N2 -x ... PROG2
    `host` (e.g. "localhost:4") replaces the hostfile. --allow-run-as-root is added only as root,
    because OpenMPI refuses root otherwise; it comes before the program, whose arguments follow.
    """
    if not apps:
        raise ValueError("mpirun_argv: no program to run")
    placement: list[str] = []
    if hostfile:
        placement += ["--hostfile", hostfile]
    if host:
        placement += ["--host", host]
    if map_by:
        placement += ["--map-by", map_by]
    if bind_to:
        placement += ["--bind-to", bind_to]
    if oversubscribe:
        placement.append("--oversubscribe")
    tail = network_args(cidr) + (["--allow-run-as-root"] if as_root else [])
    if len(apps) == 1:
        np_and_env = _app_args(apps[0])
        return [mpirun, *np_and_env[:2], *placement, *np_and_env[2:], *tail, *apps[0].argv]
    argv = [mpirun, *placement, *tail]
    for i, app in enumerate(apps):
        if i:
            argv.append(":")
        argv += _app_args(app) + app.argv
    return argv


def _installation_bins(python: str, env: Mapping[str, str]) -> list[Path]:
    """Where this installation's launchers live, best first: beside the Python, then
    $DSCLUSTER_VENV or `paths.venv_dir()` (the environment entry_cn.sh uses)."""
    return [Path(python).parent, Path(env.get("DSCLUSTER_VENV") or paths.venv_dir()) / "bin"]


def mpirun_path(python: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """OpenMPI's mpirun of this installation: beside the Python, else in $DSCLUSTER_VENV or the
    environment dscluster runs in (a checkout's .venv), else on PATH. PATH comes last: on a GPU host
    /usr/bin/mpirun can be another MPI (it refused --hostfile), and the ranks must run the OpenMPI
    that launched them."""
    env = os.environ if env is None else env
    for bin_dir in _installation_bins(python or sys.executable, env):
        if (bin_dir / "mpirun").exists():
            return str(bin_dir / "mpirun")
    return shutil.which("mpirun") or "mpirun"


def launcher_bin_dir(python: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The folder of this installation's mpirun, where its deepspeed and torchrun are too; None
    when only PATH has one (then the launchers are run by their bare names)."""
    env = os.environ if env is None else env
    for bin_dir in _installation_bins(python or sys.executable, env):
        if (bin_dir / "mpirun").exists():
            return str(bin_dir)
    return None
