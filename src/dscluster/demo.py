"""`make demo`: the whole journey, timed step by step.

As root, on a simulated three-node lab (a GPU lab with `--gpus 1,1,2 --link 1gbit`):
    sim up -> dscluster setup -> dscluster check -> mpirun entry_cn.sh -> analysis/plot.py
    -> dscluster diagnose -> sim down (always)
Not root, on this machine's own slots: dscluster check (if it can) -> mpirun -np 2 -> plots.
Cluster commands run inside node1 as the lab user, from a working directory on the lab's shared
disk (like an NFS home): check's state and the run directory are there and mpirun starts every
rank there, so the ranks find both without an exported variable. The run directory is copied
into the repository's runs/ before the lab is torn down.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from dscluster import console
from dscluster.errors import UsageError
from dscluster.files import paths
from dscluster.launch.mpirun import App, mpirun_argv, mpirun_path
from dscluster.rundir import layout
from dscluster.sim import lab as sim
from dscluster.sim.options import parse_gpus

LAB = "dslab"
NODES = 3
TRAIN_TIMEOUT_S = 900


def repo_root() -> Path:
    """The checkout (the demo's runs/ and analysis/plot.py live there), else the working directory."""
    return paths.checkout_root() or Path.cwd()


@dataclass(frozen=True)
class Options:
    lab: str = LAB
    """Simulated lab name (root mode)."""
    runs_dir: Path | None = None
    """Where the run directory ends up (default: the repository's runs/)."""
    train_args: tuple[str, ...] = ()
    """Passed to entry_cn.sh (empty: the digits preset)."""
    gpus: tuple[int, ...] = ()
    """GPUs per node of a GPU lab (empty: the CPU lab of NODES nodes)."""
    link: str = "none"
    """Shaped link rate of every node (1gbit, 10gbit, none)."""
    env: tuple[tuple[str, str], ...] = ()
    """NAME=VALUE set in every node (e.g. the library path of a GPU driver)."""

    @property
    def nodes(self) -> int:
        return len(self.gpus) or NODES

    @property
    def ranks(self) -> int:
        return sum(self.gpus) or NODES

    @property
    def runs(self) -> Path:
        return self.runs_dir or repo_root() / "runs"


@dataclass
class Step:
    name: str
    status: str = "pending"   # ok | failed | skipped
    seconds: float = 0.0
    note: str = ""


@dataclass
class Journey:
    """The steps so far, printed as they finish and as a table at the end."""

    mode: str
    steps: list[Step] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def start(self, name: str) -> Step:
        step = Step(name)
        self.steps.append(step)
        console.out.print(f"\n[bold]== {name}[/bold]  [dim](+{time.monotonic() - self.t0:.0f} s)[/dim]")
        step._t = time.monotonic()  # type: ignore[attr-defined]
        return step

    def done(self, step: Step, status: str, note: str = "") -> None:
        step.status, step.note = status, note
        step.seconds = time.monotonic() - step._t  # type: ignore[attr-defined]
        colour = {"ok": "green", "failed": "red", "skipped": "yellow"}[status]
        console.out.print(f"[{colour}]{status}[/{colour}] {step.name} in {step.seconds:.1f} s"
                          + (f": {note}" if note else ""))

    def skip(self, name: str, why: str) -> None:
        self.done(self.start(name), "skipped", why)

    def summary(self) -> None:
        table = Table(title=f"dscluster demo ({self.mode}) in {time.monotonic() - self.t0:.0f} s")
        for col in ("step", "result", "seconds", "note"):
            table.add_column(col, justify="right" if col == "seconds" else "left")
        for s in self.steps:
            table.add_row(s.name, s.status, f"{s.seconds:.1f}", s.note)
        console.out.print(table)

    @property
    def ok(self) -> bool:
        return all(s.status != "failed" for s in self.steps)


def stream(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
           timeout: float = TRAIN_TIMEOUT_S, prefix: str = "  ") -> int:
    """Run argv, echoing its output as it comes (training takes minutes: show progress)."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv, timeout)
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, 9)
        raise


def show(result: subprocess.CompletedProcess, tail: int = 40) -> None:
    text = (result.stdout or "") + (result.stderr or "")
    for line in text.rstrip().splitlines()[-tail:]:
        console.out.print("  " + line, markup=False)


def newest_run(runs: Path, before: set[str]) -> Path | None:
    if not runs.is_dir():
        return None
    new = [p for p in runs.iterdir() if p.is_dir() and p.name not in before]
    return max(new, key=lambda p: p.stat().st_mtime) if new else None


def copy_run(src: Path, dest_root: Path) -> Path:
    """Copy a run directory out of the lab, without checkpoints (the plots do not need them)."""
    dest = dest_root / src.name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(layout.CHECKPOINT_DIR))
    return dest


def plot(journey: Journey, run_dir: Path | None) -> Path | None:
    script = repo_root() / "analysis" / "plot.py"
    step = journey.start(f"python analysis/plot.py {run_dir}")
    if run_dir is None:
        journey.done(step, "skipped", "no run directory")
        return None
    rc = stream([sys.executable, str(script), str(run_dir)], timeout=300)
    pictures = run_dir / layout.PLOTS_DIR
    journey.done(step, "ok" if rc == 0 else "failed", f"{pictures}" if rc == 0 else f"exit {rc}")
    return pictures if rc == 0 else None


# --- root: the simulated lab ------------------------------------------------------------------

class _Stop(Exception):
    """A step failed in a way that makes the next ones pointless."""


def lab_env(lab) -> dict[str, str]:
    """What a login on node1 gives the lab user (its GPUs, --env); used to stream commands run there."""
    return lab.env(node="node1")


def lab_demo(journey: Journey, opts: Options) -> int:
    dscluster = paths.venv_bin() / "dscluster"
    run_dir_local: Path | None = None
    what = f"--gpus {','.join(map(str, opts.gpus))}" if opts.gpus else f"--nodes {NODES}"
    step = journey.start(f"sim up {what} --link {opts.link}")
    lab = sim.up(nodes=None if opts.gpus else NODES, slots=None if opts.gpus else 1, lab=opts.lab,
                 gpus=list(opts.gpus) or None, link=opts.link, env=dict(opts.env))
    journey.done(step, "ok", ", ".join(f"{n.name}={n.ip} ({n.iface})" for n in lab.nodes))
    try:
        work = lab.shared / "work"
        work.mkdir(parents=True, exist_ok=True)
        os.chown(work, lab.uid, lab.gid)
        hostfile = str(lab.hostfile)
        in_work = f"cd {work} && "

        step = journey.start("dscluster setup --trust-new-hosts (as the lab user in node1)")
        r = lab.run("node1", in_work + f"{dscluster} setup --hostfile {hostfile} --trust-new-hosts --fix-path",
                    env={"DSCLUSTER_SSH_PASSWORD": lab.password}, timeout=300)
        show(r, tail=8)
        journey.done(step, "ok" if r.returncode == 0 else "failed", f"exit {r.returncode}")
        if r.returncode != 0:
            raise _Stop()

        step = journey.start("dscluster check")
        r = lab.run("node1", in_work + f"{dscluster} check --hostfile {hostfile}", timeout=300)
        show(r, tail=25)
        journey.done(step, "ok" if r.returncode == 0 else "failed", f"exit {r.returncode}")

        runs = work / "runs"
        before = {p.name for p in runs.iterdir()} if runs.is_dir() else set()
        # The nodes share the software at the head's paths (like NFS): the head's mpirun is theirs.
        cmd = shlex.join(mpirun_argv(mpirun_path(), [App(opts.ranks, [str(paths.entry_script()), *opts.train_args])],
                                     hostfile=hostfile))
        step = journey.start(f"{cmd}  (in node1, cwd {work})")
        rc = stream(lab.command("node1", in_work + cmd), env=lab_env(lab))
        found = newest_run(runs, before)
        if found is not None:
            run_dir_local = copy_run(found, opts.runs)
        journey.done(step, "ok" if rc == 0 else "failed",
                     f"exit {rc}; run directory {run_dir_local or 'not created'}")
    except _Stop:
        pass  # the failed step says why; still tear the lab down and show the table
    finally:
        step = journey.start(f"sim down {opts.lab}")
        sim.down(opts.lab)
        journey.done(step, "ok")
    pictures = plot(journey, run_dir_local)
    diagnose(journey, run_dir_local)
    return finish(journey, run_dir_local, pictures)


def diagnose(journey: Journey, run_dir: Path | None) -> None:
    if run_dir is None:
        return
    step = journey.start(f"dscluster diagnose {run_dir}")
    rc = stream([sys.executable, "-m", "dscluster", "diagnose", str(run_dir)], timeout=300)
    journey.done(step, "ok" if rc in (0, 1) else "failed", f"exit {rc}" + (" (found problems)" if rc == 1 else ""))


# --- not root: this machine's own slots -------------------------------------------------------

def local_demo(journey: Journey, opts: Options) -> int:
    repo = repo_root()
    bin_dir = Path(sys.executable).parent
    hostfile = opts.runs / "demo-localhost.txt"
    hostfile.parent.mkdir(parents=True, exist_ok=True)
    hostfile.write_text("localhost slots=2\n")
    journey.skip("sim up / dscluster setup", "need root: running on localhost slots instead")
    step = journey.start(f"dscluster check --hostfile {hostfile}")
    rc = stream([str(bin_dir / "dscluster"), "check", "--hostfile", str(hostfile)], cwd=str(repo), timeout=300)
    # A failed check is not fatal here: two ranks on one host meet over loopback.
    journey.done(step, "ok" if rc == 0 else "skipped",
                 "" if rc == 0 else f"exit {rc}; continuing, both ranks are on this host")
    runs = opts.runs
    before = {p.name for p in runs.iterdir()}
    argv = mpirun_argv(mpirun_path(), [App(2, [str(paths.entry_script()), *opts.train_args], {"DSCLUSTER_RUNS": None})],
                       oversubscribe=True)
    step = journey.start(shlex.join(argv))
    rc = stream(argv, cwd=str(repo), env={**os.environ, "DSCLUSTER_RUNS": str(runs)})
    run_dir = newest_run(runs, before)
    journey.done(step, "ok" if rc == 0 else "failed", f"exit {rc}; run directory {run_dir}")
    pictures = plot(journey, run_dir)
    return finish(journey, run_dir, pictures)


def finish(journey: Journey, run_dir: Path | None, pictures: Path | None) -> int:
    journey.summary()
    if run_dir is not None:
        console.out.print(f"run directory: {run_dir}")
        summary = run_dir / layout.SUMMARY_FILE
        if summary.exists():
            s = json.loads(summary.read_text())
            acc = s.get("accuracy")
            console.out.print(f"result: {s.get('status')}, world size {s.get('world_size')}, "
                              f"held-out accuracy {acc:.1%}" if isinstance(acc, float) else f"result: {s}")
    if pictures is not None:
        console.out.print(f"pictures: {pictures}" + (f"  report: {pictures.parent / 'report.html'}"
                                                    if (pictures.parent / layout.REPORT_FILE).exists() else ""))
    return 0 if journey.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dscluster.demo", description=__doc__.split("\n")[0],
                                     epilog="example: make demo")
    parser.add_argument("--lab", default=LAB, help=f"simulated lab name (default {LAB})")
    parser.add_argument("--runs-dir", type=Path, help="where to put the run directory (default: runs/)")
    parser.add_argument("--gpus", help="GPU lab: GPUs per node, e.g. 1,1,2 (root, NVIDIA GPUs)")
    parser.add_argument("--link", default="none", help="GPU or CPU lab: shape every node's link (1gbit, 10gbit)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in every node of the lab (repeatable)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then arguments for dscluster train")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args

    try:
        gpus = tuple(parse_gpus(args.gpus)) if args.gpus else ()
    except UsageError as e:
        parser.error(str(e))
    env = tuple(tuple(e.split("=", 1)) for e in args.env if "=" in e)
    if len(env) != len(args.env):
        parser.error("--env takes NAME=VALUE")
    opts = Options(lab=args.lab, runs_dir=args.runs_dir.absolute() if args.runs_dir else None,
                   train_args=tuple(train_args), gpus=gpus, link=args.link, env=env)
    if os.geteuid() == 0:
        journey = Journey(mode=f"simulated {opts.nodes}-node lab" + (f" with GPUs {','.join(map(str, opts.gpus))}"
                          if opts.gpus else "") + (f", {opts.link} links" if opts.link != "none" else "") + ", as root")
        console.out.print(f"dscluster demo: {journey.mode}")
        return lab_demo(journey, opts)
    journey = Journey(mode="localhost slots (not root)")
    console.out.print(f"dscluster demo: {journey.mode}")
    return local_demo(journey, opts)


if __name__ == "__main__":
    sys.exit(main())
