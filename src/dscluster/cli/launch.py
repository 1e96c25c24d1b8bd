"""`dscluster launch`: start the training on every node with the launcher of your choice.

It reads what `dscluster check` wrote (check.json, cluster.env), refuses to go on when that
is missing or was made for another hostfile, builds the command with `dscluster.launch.builders`,
and either prints it (--dry-run) or runs it, streaming its output and returning its result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFile
from dscluster.errors import UsageError
from dscluster.files import paths, redact, state
from dscluster.files.fsutil import atomic_write_text
from dscluster.launch import builders, slurmjob
from dscluster.launch.collect import timed_pull
from dscluster.launch.mpirun import launcher_bin_dir
from dscluster.launch.run import (
    failed_first,
    job_exit_code,
    launcher_env,
    nodes_exit_code,
    run_job,
    run_over_ssh,
    summary_mark,
    summary_since,
)
from dscluster.node.hosts import hostfile_sha256, parse_hostfile
from dscluster.rundir.layout import resolve_run_id, runs_root

EPILOG = """examples:
  dscluster launch --dry-run                              # print the mpirun command
  dscluster launch --hostfile hosts.txt -- --config configs/digits.yaml epochs=5
  dscluster launch --launcher deepspeed                   # DeepSpeed's launcher (openmpi runner)
  dscluster launch --launcher torchrun                    # one torchrun agent per node over SSH
  dscluster launch --launcher slurm                       # write an sbatch script, print how to submit
  dscluster launch --launcher slurm --submit              # ... and submit it, streaming the job's output
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start training on every node (mpirun, deepspeed, torchrun or a Slurm script)",
        description="Build the launch command from the hostfile and what `dscluster check` wrote, "
        "then run it (streaming its output; the exit code is the job's) or print it with --dry-run. "
        "Every launcher runs the same ./entry_cn.sh on each rank. Arguments after `--` go to "
        "`dscluster train` (default: --config configs/digits.yaml).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hostfile", help="OpenMPI hostfile (default: the one `dscluster check` used, else hosts.txt)")
    p.add_argument("--launcher", choices=builders.LAUNCHERS, default="mpirun", help="default: mpirun")
    p.add_argument("--dry-run", action="store_true", help="print the command (or script) and run nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    p.add_argument("--np", type=int, help="ranks to start (default: all hostfile slots; mpirun only)")
    p.add_argument("--bind-to", choices=["none", "core"], default="none",
                   help="rank binding (default none: data loading threads may use every core)")
    p.add_argument("--deepspeed-runner", choices=builders.DEEPSPEED_RUNNERS, default="openmpi",
                   help="how DeepSpeed's launcher reaches the nodes (default openmpi)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra variable for every rank (repeatable), e.g. --env NCCL_DEBUG=INFO")
    p.add_argument("--run-id", help="run directory name under runs/ (default: launch-<date>-<time>)")
    p.add_argument("--script", help="slurm: where to write the sbatch script (default <state>/dscluster-train.sbatch)")
    p.add_argument("--submit", action="store_true",
                   help="slurm: submit the script with sbatch and follow the job (its output streamed, its exit "
                   "code; Ctrl-C cancels it) instead of printing how to submit it")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then arguments for `dscluster train`")
    p.set_defaults(func=launch_command)


# --- reading what `dscluster check` wrote ---------------------------------------------------

@dataclass(frozen=True)
class CheckOutput:
    state_dir: Path
    check: CheckFile
    cluster_env: dict[str, str]
    deepspeed_env: dict[str, str]


def load_check(state_dir: Path) -> CheckFile:
    path = state_dir / "check.json"
    try:
        return checkfile.load(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no check output yet; run `dscluster check --hostfile HOSTFILE` first "
                         "(it writes the per-node environment that launch needs)") from None


def load_check_output(state_dir: Path, hostfile: Path, check: CheckFile) -> CheckOutput:
    """Check output that matches this hostfile, or a UsageError that says to run check."""
    if check.hostfile_sha256 != hostfile_sha256(hostfile):
        made = check.created
        when = time.strftime(" at %Y-%m-%d %H:%M", time.localtime(made)) if made is not None else ""
        raise UsageError(
            f"{hostfile}: does not match the hostfile `dscluster check` ran on{when} "
            f"({check.hostfile or '?'}); run `dscluster check --hostfile {hostfile}` again")
    cluster_env = state.read_env_file(state_dir / "cluster.env")
    ds_path = state.deepspeed_env_path()
    ds_env = state.read_deepspeed_env(ds_path) if ds_path.exists() else {}
    return CheckOutput(state_dir=state_dir, check=check, cluster_env=cluster_env, deepspeed_env=ds_env)


# --- building the plan ----------------------------------------------------------------------

def _bin_dir() -> str | None:
    """This installation's bin, where the pinned mpirun/deepspeed/torchrun live (`launch.mpirun`
    finds it; not resolved: the venv's python is a symlink to the base interpreter)."""
    return launcher_bin_dir()


def _train_args(raw: list[str]) -> tuple[str, ...]:
    return tuple(raw[1:] if raw[:1] == ["--"] else raw)


def build_plan(args: argparse.Namespace) -> tuple[builders.LaunchPlan, CheckOutput]:
    state_dir = state.state_dir().absolute()
    check = load_check(state_dir)
    hostfile_arg = args.hostfile or check.hostfile or "hosts.txt"
    hostfile = Path(hostfile_arg).absolute()
    hf = parse_hostfile(hostfile)
    out = load_check_output(state_dir, hostfile, check)
    if check.ok is False:
        print("dscluster launch: warning: the last `dscluster check` found problems; "
              "the job may fail (see `dscluster check`)", file=sys.stderr)

    np_ = hf.total_slots if args.np is None else args.np
    if not 1 <= np_ <= hf.total_slots:
        raise UsageError(f"--np {np_}: {hostfile} has {hf.total_slots} slots; choose 1..{hf.total_slots} "
                         "or add slots=N to the hostfile")
    exports: dict[str, str] = {}
    for item in args.env:
        key, value = builders.parse_env_assignment(item)
        exports[key] = value
    # One id fixed here and exported, so the run directory is known before any rank starts.
    wanted = args.run_id or os.environ.get("DSCLUSTER_RUN_ID") or time.strftime("launch-%Y%m%d-%H%M%S")
    exports.update({
        "DSCLUSTER_RUN_ID": resolve_run_id({"DSCLUSTER_RUN_ID": wanted}),
        "DSCLUSTER_RUNS": str(runs_root().absolute()),
        "DSCLUSTER_STATE": str(state_dir),
        "DSCLUSTER_HOSTFILE": str(hostfile),
    })
    env = out.cluster_env
    port = env.get("MASTER_PORT") or str(builders.DEFAULT_MASTER_PORT)
    if not port.isdigit():
        raise UsageError(f"{state_dir / 'cluster.env'}: MASTER_PORT={port!r} is not a port; "
                         "run `dscluster check` again")
    plan = builders.LaunchPlan(
        hostfile=str(hostfile),
        hosts=tuple((h.name, h.slots) for h in hf.hosts),
        repo_root=str(paths.assets_root()),
        np=np_,
        train_args=_train_args(args.train_args),
        exports=exports,
        btl_cidr=env.get("DSCLUSTER_BTL_TCP_IF_INCLUDE") or None,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=int(port),
        as_root=os.geteuid() == 0,
        bind_to=args.bind_to,
        bin_dir=_bin_dir(),
        workdir=str(Path.cwd()),
        # None (no node reached): the builders fall back to a GPU per slot.
        gpus=check.has_gpus(),
        node_gpus=node_gpus(check),
        host_lines={h.name: h.line for h in hf.hosts},
    )
    return plan, out


def node_gpus(check: CheckFile) -> dict[str, int]:
    """How many GPUs check found on each node it probed (as the hostfile names it)."""
    found = {}
    for node in check.nodes:
        gpus = (node.facts or {}).get("gpus")
        if node.facts is not None and isinstance(gpus, list):
            found[node.name] = len(gpus)
    return found


# --- the command ---------------------------------------------------------------------------

def launch_command(args: argparse.Namespace) -> int:
    if args.json and not args.dry_run:
        raise UsageError("--json describes the command without running it: add --dry-run")
    if args.submit and args.launcher != "slurm":
        raise UsageError(f"--submit submits a Slurm script: add --launcher slurm (--launcher {args.launcher} "
                         "starts the job itself)")
    plan, out = build_plan(args)
    run_id = plan.exports["DSCLUSTER_RUN_ID"]
    run_dir = Path(plan.exports["DSCLUSTER_RUNS"]) / run_id
    report: dict = {"launcher": args.launcher, "run_id": run_id, "run_dir": str(run_dir), "np": plan.np,
                    "hostfile": plan.hostfile}
    if args.launcher == "mpirun":
        return _run_local(args, report, builders.mpirun_argv(plan), plan, env_extra={},
                          collect=out.check.shared_runs() is False)
    if args.launcher == "deepspeed":
        argv = builders.deepspeed_argv(plan, args.deepspeed_runner)
        env_path = out.state_dir / "launch" / f"{run_id}.deepspeed_env"
        text = builders.deepspeed_env_text(plan, out.deepspeed_env)
        report.update(env_file=str(env_path), env_file_text=text)
        if not args.dry_run:
            atomic_write_text(env_path, text)
        return _run_local(args, report, argv, plan, env_extra={"DS_ENV_FILE": str(env_path)},
                          collect=out.check.shared_runs() is False)
    if args.launcher == "torchrun":
        return _run_torchrun(args, report, plan, out)
    return _write_slurm(args, report, plan, out)


def _run_local(args: argparse.Namespace, report: dict, argv: list[str], plan: builders.LaunchPlan,
               env_extra: dict[str, str], collect: bool = False) -> int:
    report["argv"] = argv
    report["env"] = env_extra
    line = redact.redact_text(builders.display(argv))  # shown, never the secrets `--env` passes on
    prefix = redact.redact_text("".join(f"{k}={shlex.quote(v)} " for k, v in env_extra.items()))
    if args.dry_run:
        if args.json:
            print(json.dumps(redact.redact_doc(report), indent=2))
        else:
            if "env_file_text" in report:
                print(f"# {report['env_file']} (would be written):")
                print("".join(f"#   {l}\n" for l in report["env_file_text"].splitlines()), end="")
            print(prefix + line)
        return 0
    print(f"dscluster launch: run {report['run_id']} -> {report['run_dir']}", file=sys.stderr)
    print(f"+ {prefix}{line}", file=sys.stderr, flush=True)
    outcome = run_job(argv, env=launcher_env(plan.bin_dir, env_extra), run_dir=Path(report["run_dir"]))
    if collect:   # no shared filesystem: every node's part of the run to the head's copy, ended cleanly or not
        got, secs = timed_pull(report["run_dir"], plan.hostfile, show_progress=False)
        print(f"dscluster launch: collected {sum(len(g.files) for g in got)} file(s) of the run from the nodes "
              f"in {secs:.2f} s" + "".join(f"; {g.node}: {g.error}" for g in got if g.error), file=sys.stderr)
    code, message = job_report(args.launcher, outcome, Path(report["run_dir"]))
    print(f"dscluster launch: {message}", file=sys.stderr)
    return code


def job_report(launcher: str, outcome, run_dir: Path) -> tuple[int, str]:
    """Exit code and closing line for a local launcher run (a launch_exec.JobOutcome)."""
    summary = summary_since(run_dir, outcome.started)  # not an earlier attempt's (a resumed run)
    vanished = list(outcome.vanished)
    for host in summary.get("vanished_hosts") or []:
        if host not in vanished:
            vanished.append(host)
    see = (f"per-rank logs and metrics are in {run_dir}; `dscluster diagnose {run_dir}` says more" if run_dir.is_dir()
           else "no run directory was written: the ranks stopped before training started (their messages are above)")
    if vanished:
        # mpirun exits 0 when it loses a daemon (OpenMPI 5.0.11): the job failed all the same.
        code = job_exit_code(outcome.rc) or 1
        return code, (f"{', '.join(vanished)} vanished (stopped answering on the network); the job was ended. "
                      f"Once it is back, run the same command again: training resumes from the last "
                      f"checkpoint. {see}")
    if outcome.interrupted:
        return 130, f"interrupted; every rank was stopped. Run the same command again to resume. {see}"
    if outcome.stopped:
        if summary.get("status") == "complete":
            return 0, f"training completed, but {outcome.stopped}. {see}"
        return job_exit_code(outcome.rc) or 1, f"{outcome.stopped}. {see}"
    if outcome.rc != 0:
        # The job's own code, not a blanket 1: a wrapper script or CI can tell failures apart.
        how = f"was killed by signal {-outcome.rc}" if outcome.rc < 0 else f"exited {outcome.rc}"
        return job_exit_code(outcome.rc), f"{launcher} {how}; {see}"
    return 0, f"done; run directory {run_dir}"


def _run_torchrun(args: argparse.Namespace, report: dict, plan: builders.LaunchPlan, out: CheckOutput) -> int:
    commands = builders.torchrun_node_commands(plan)
    report["nodes"] = [{"host": c.host, "argv": c.argv, "shell": c.shell} for c in commands]
    if args.dry_run:
        if args.json:
            print(json.dumps(redact.redact_doc(report), indent=2))
        else:
            for c in commands:
                print(redact.redact_text(f"ssh {shlex.quote(c.host)} {shlex.quote(c.shell)}"))
        return 0
    key = Path.home() / ".ssh" / "id_ed25519"
    print(f"dscluster launch: run {report['run_id']} -> {report['run_dir']} "
          f"(torchrun on {len(commands)} nodes, rendezvous {plan.master_addr}:{plan.master_port})", file=sys.stderr)
    results = run_over_ssh(commands, known_hosts=out.state_dir / "known_hosts",
                           key_filename=str(key) if key.exists() else None)
    bad = failed_first(results, report["run_dir"])
    for r in bad:
        print(f"dscluster launch: {r.host}: " + (r.error or f"torchrun exited {r.rc}"), file=sys.stderr)
    if bad:
        # Where a rank died (the run directory) or else the first node to fail is where the job broke;
        # torchrun's report above it names the rank.
        then = f" (then {', '.join(r.host for r in bad[1:])})" if bad[1:] else ""
        run_dir = report["run_dir"]
        print(f"dscluster launch: torchrun failed on {bad[0].host} first{then}; "
              f"per-rank logs and metrics are in {run_dir}; `dscluster diagnose {run_dir}` names the rank",
              file=sys.stderr)
    return nodes_exit_code(results, report["run_dir"])


def _write_slurm(args: argparse.Namespace, report: dict, plan: builders.LaunchPlan, out: CheckOutput) -> int:
    # The run id of a Slurm job is its job id: drop the one launch made up.
    exports = {k: v for k, v in plan.exports.items() if k != "DSCLUSTER_RUN_ID"}
    if not args.run_id:
        plan = dataclasses.replace(plan, exports=exports)
        report["run_id"] = "slurm-<job id>"
        report["run_dir"] = str(Path(exports["DSCLUSTER_RUNS"]) / "slurm-<job id>")
    script = builders.slurm_script(plan)
    path = Path(args.script) if args.script else out.state_dir / "dscluster-train.sbatch"
    report.update(script=script, script_path=str(path.absolute()), submit=builders.sbatch_argv(str(path)))
    if args.dry_run:
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(script, end="")
            print(f"# would be written to {path}; submit with: sbatch {shlex.quote(str(path))}", file=sys.stderr)
        return 0
    atomic_write_text(path, script, mode=0o755)
    print(f"wrote {path}")
    if args.submit:
        return _submit_slurm(path, plan, report)
    print(f"submit with: {builders.display(builders.sbatch_argv(str(path)))}")
    return 0


def _submit_slurm(path: Path, plan: builders.LaunchPlan, report: dict) -> int:
    argv = slurmjob.sbatch_submit_argv(str(path))
    print(f"+ {builders.display(argv)}", file=sys.stderr, flush=True)
    mark = summary_mark(Path(report["run_dir"])) if "<job id>" not in report["run_dir"] else 0.0
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        print("dscluster launch: sbatch: command not found (run this on a Slurm login node)", file=sys.stderr)
        return 127
    job_id = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not job_id.isdigit():
        print(f"dscluster launch: sbatch exited {res.returncode}: {res.stderr.strip() or res.stdout.strip()}",
              file=sys.stderr)
        return res.returncode or 1
    run_dir = Path(report["run_dir"].replace("<job id>", job_id))
    print(f"dscluster launch: Slurm job {job_id}, run {run_dir.name} -> {run_dir}", file=sys.stderr, flush=True)
    end, interrupted = slurmjob.follow(job_id, Path(plan.cwd) / slurmjob.OUTPUT.replace("%j", job_id))
    code, message = slurmjob.job_report(end, run_dir, interrupted=interrupted, summary=summary_since(run_dir, mark))
    print(f"dscluster launch: {message}", file=sys.stderr)
    return code
