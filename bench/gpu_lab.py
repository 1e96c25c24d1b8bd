#!/usr/bin/env python3
"""The Ethernet journey on one host: `dscluster plan` against the README command, run by run, on a
simulated lab with shaped links (GPU nodes with --gpus, CPU nodes with --nodes).

    sudo .venv/bin/python bench/gpu_lab.py --link 1gbit --nodes 2 \
        'd1:1:--config configs/digits.yaml max_steps=12' 'd2:2:--config configs/digits.yaml max_steps=12'

Each RUN is NAME:NODES:OVERRIDES: on the first NODES hosts, `dscluster plan`, then the README command
as a user types it. The runs go one after another, so the one-node runs are the baseline of the same
invocation. Every mode (--tta, --no-shared-fs, --observe, --calibrate) and the results file are in
docs/gpu-lab.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster.bench import tta
from dscluster.bench.labruns import (
    accuracy_by_compression,
    config_of,
    parse_run,
    run_entry,
    whole_run,
    with_recommendation,
)
from dscluster.core.timing import WARMUP_STEPS
from dscluster.files import paths
from dscluster.files.fsutil import atomic_write_json, read_jsonl
from dscluster.node.hosts import format_hostfile, parse_hostfile
from dscluster.sim import lab as sim_lab

ROOT = Path(__file__).resolve().parents[1]
LAB = "benchlab"


class Lab:
    def __init__(self, log, lab: str):
        self.log, self.lab = log, lab

    def sh(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run `argv`, its output streamed into the log line by line (a run cut short by a limit still
        leaves what it printed), and returned whole; rc 124 when `timeout` passed and it was killed."""
        print(f"$ {shlex.join(argv)}", file=self.log, flush=True)
        lines: list[str] = []
        killed = threading.Event()
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace") as proc:
            timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
            timer.start()
            try:
                for line in proc.stdout or ():
                    lines.append(line)
                    self.log.write(line)
                    self.log.flush()
            finally:
                timer.cancel()
            rc = proc.wait()
        out = "".join(lines)
        if killed.is_set():
            rc, out = 124, out + f"\n(timed out after {timeout:.0f} s)"
        print(f"-> rc={rc}", file=self.log, flush=True)
        return subprocess.CompletedProcess(argv, rc, out)

    def dsc(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.sh([sys.executable, "-m", "dscluster", *args], timeout)

    def node1(self, cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return self.dsc("sim", "exec", "--lab", self.lab, "--timeout", str(int(timeout)), "node1", "--",
                        "bash", "-c", cmd, timeout=timeout + 30)


def print_tta_runs(args) -> int:
    """--tta --dry-run: the runs, in order, with the nodes each takes (node names as `sim up` makes them)."""
    if not args.tta:
        raise SystemExit("--dry-run is for --tta")
    slots = [int(g) for g in args.gpus.split(",")] if args.gpus else [1] * args.nodes
    fastest = tta.fastest_node(slots)
    print(f"plan: dscluster plan --hostfile hosts{len(slots)}.txt --config {args.tta} target_accuracy={args.target} "
          f"{' '.join(args.set)} (its recommendation stands for @rec)".rstrip())
    for name, role, overrides in tta.runs_for(args.tta, [int(x) for x in args.seeds.split(",")], args.target,
                                              args.set, len(slots), tuple(args.tta_roles.split(","))):
        where = (f"node{fastest + 1} alone ({slots[fastest]} rank(s))" if role == tta.ALONE
                 else f"all {len(slots)} nodes ({sum(slots)} ranks)")
        print(f"{name}: {where}: {overrides}")
    return 0


def observe_during(lab: Lab, cd: str, hwork: Path, name: str, hostfile: str) -> threading.Thread:
    """While run `name` trains: once rank 0 has timed steps, `dscluster top --once` as JSON and as SVG."""

    def watch() -> None:
        metrics = hwork / "runs" / name / "metrics" / "rank-0.jsonl"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            steps = [r for r in read_jsonl(metrics) if r.get("kind") == "step"] if metrics.exists() else []
            if len(steps) > WARMUP_STEPS + 3:
                break
            time.sleep(0.5)
        else:
            return
        lab.node1(cd + f"dscluster top --hostfile {hostfile} --run-dir runs/{name} --once --json > top-{name}.json"
                  f" && dscluster top --hostfile {hostfile} --run-dir runs/{name} --once --svg top-{name}.svg", 120)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def after_run(lab: Lab, cd: str, hwork: Path, name: str, output: str, args, several: bool) -> dict:
    """--no-shared-fs: each node's push line and a timed `dscluster collect`; --observe: plot and diagnose,
    their files (and top's) kept in --keep DIR/observe-<name>."""
    out: dict = {}
    if args.no_shared_fs and several:
        out["push_lines"] = [ln.strip() for ln in output.splitlines() if "dscluster collect: sent" in ln]
        r = lab.node1(cd + f"dscluster collect runs/{name} --json > collect-{name}.json", 300)
        try:
            out["collect"] = {"rc": r.returncode, **json.loads((hwork / f"collect-{name}.json").read_text())}
        except (OSError, ValueError):
            out["collect"] = {"rc": r.returncode}
    if args.observe and several:
        lab.node1(cd + f"python {shlex.quote(str(ROOT / 'analysis' / 'plot.py'))} runs/{name} --json "
                  f"> plot-{name}.json", 300)
        lab.node1(cd + f"dscluster diagnose runs/{name} --json > diagnose-{name}.json", 120)
        if args.keep:
            dest = args.keep / f"observe-{name}"
            dest.mkdir(parents=True, exist_ok=True)
            for f in (f"top-{name}.json", f"top-{name}.svg", f"plot-{name}.json", f"diagnose-{name}.json"):
                if (hwork / f).exists():
                    shutil.copy2(hwork / f, dest / f)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="RUN: NAME:NODES:OVERRIDES (see the module docstring)")
    p.add_argument("--link", required=True, help="1gbit, 10gbit, <n>mbit (sim up --link)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", help="GPUs per node, e.g. 1,1 (sim up --gpus)")
    where.add_argument("--nodes", type=int, help="CPU nodes (sim up --nodes)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="sim up --env (repeatable)")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds per training run (default 600)")
    p.add_argument("--out", type=Path, help="results file (default bench/results/<date>-<card>-lab-<link>.json)")
    p.add_argument("--log", type=Path, help="every command and its output (default gpu_lab-<link>.log here)")
    p.add_argument("--note", default="", help="what this invocation is for, kept in the results file")
    p.add_argument("--calibrate", action="store_true",
                   help="plan every multi-node run with `dscluster plan --calibrate` (a short PowerSGD run first "
                   "where PowerSGD is in play and not yet measured on those ranks)")
    p.add_argument("--no-plan", action="store_true",
                   help="run the README command only, without `dscluster plan` before it (accuracy runs: "
                   "the prediction is not what they measure)")
    p.add_argument("--keep", type=Path, help="copy each run directory here (checkpoints left out) before the lab "
                   "comes down: the per-rank metrics behind every figure")
    p.add_argument("--tta", metavar="CONFIG", help="time-to-accuracy mode: the fastest node alone against the lab "
                   "with plan's recommendation, per seed (instead of RUNs)")
    p.add_argument("--target", type=float, help="--tta: the held-out accuracy to reach (target_accuracy)")
    p.add_argument("--seeds", default="1,2", help="--tta: training seeds, e.g. 1,2 (default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--tta: an override of every run")
    p.add_argument("--tta-roles", default="alone,lab", help="--tta: which runs, alone and/or lab (default both; the "
                   "node alone does not depend on the link, so a second link's invocation can run lab only)")
    p.add_argument("--no-shared-fs", action="store_true", help="a lab without NFS (sim up --no-shared-fs); "
                   "sync after check, collect after each run, both timed")
    p.add_argument("--observe", action="store_true", help="top (json and svg) during each multi-node run, "
                   "plot and diagnose after it, into --keep DIR")
    p.add_argument("--check-args", default="", help="more arguments of `dscluster check` (e.g. --no-tune where "
                   "an earlier invocation recorded the NCCL socket grid)")
    p.add_argument("--dry-run", action="store_true", help="--tta: print the runs it would make, build nothing "
                   "(no root needed)")
    p.add_argument("runs", nargs="*", metavar="RUN")
    return p


@dataclass
class Bench:
    """The lab as the runs see it, once `bring_up` has set it up and checked it."""

    lab: Lab
    args: argparse.Namespace
    doc: dict
    hostfile: str
    """The lab's whole hostfile, as node1 sees it."""
    hwork: Path
    """The working directory (node1's `work`) where it lies on this host."""
    hosts: list
    ranks: dict
    """{hostfile's node count or "fastest": mpirun's -np}; hosts<k>.txt and hosts-fastest.txt lie in hwork."""
    fastest: object
    cd: str
    """The shell prefix of every node1 command: into `work`, the venv's bin on PATH."""


def bring_up(lab: Lab, args, doc: dict, log_path: Path) -> Bench:
    """`sim up`, the hostfiles of the first k nodes and of the fastest, `dscluster setup` and `check` (and
    `sync` without a shared filesystem), as the lab user on node1; check's figures go into `doc`."""
    up = ["sim", "up", "--lab", LAB, "--link", args.link]
    up += ["--gpus", args.gpus] if args.gpus else ["--nodes", str(args.nodes)]
    for e in args.env:
        up += ["--env", e]
    if args.no_shared_fs:
        up.append("--no-shared-fs")
    if lab.dsc(*up).returncode:
        raise SystemExit(f"sim up failed: see {log_path}")
    st = json.loads(lab.dsc("sim", "status", "--lab", LAB, "--json", "--show-password").stdout)
    st = st if "shared" in st else st.get(LAB, st)
    work = Path(st["shared"]) / "work"  # as node1 sees it; hwork: where it lies on this host
    simlab = sim_lab.load(LAB)
    hwork = simlab.path_on("node1", work) if args.no_shared_fs and simlab else work
    hwork.mkdir(parents=True, exist_ok=True)
    hosts = parse_hostfile(st["hostfile"]).hosts
    ranks: dict = {}
    for k in range(1, len(hosts) + 1):
        (hwork / f"hosts{k}.txt").write_text(format_hostfile([(h.name, h.slots) for h in hosts[:k]]))
        ranks[k] = sum(h.slots for h in hosts[:k])
    fastest = hosts[tta.fastest_node([h.slots for h in hosts])]
    (hwork / "hosts-fastest.txt").write_text(format_hostfile([(fastest.name, fastest.slots)]))
    ranks["fastest"] = fastest.slots
    subprocess.run(["chown", "-R", str(st.get("uid", 2000)), str(hwork)], check=False)
    cd = f"cd {shlex.quote(str(work))} && export PATH={shlex.quote(str(paths.venv_bin()))}:$PATH && "
    pw = shlex.quote(st.get("password", ""))
    lab.node1(cd + f"DSCLUSTER_SSH_PASSWORD={pw} dscluster setup --hostfile {st['hostfile']} "
              "--trust-new-hosts --fix-path", 600)
    lab.node1(cd + f"dscluster check --hostfile {st['hostfile']} --json {args.check_args} > check-out.json", 600)
    try:
        check_doc = json.loads((hwork / "check-out.json").read_text())
        layout = dict(check_doc.get("layout") or {})
        if "checkout" in layout:   # a path of the machine the call ran on: not part of the result
            layout["checkout"] = "<the checkout on node1>"
        doc["check_layout"] = layout
        doc["check_nccl_socket"] = (check_doc.get("active") or {}).get("nccl_socket")
        result = check_doc["active"]["allreduce"]["result"]
        doc["check_allreduce"] = {"device": result.get("device"), "world_size": result.get("world_size"),
                                  "rows": result.get("results")}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if args.no_shared_fs:
        t_sync = time.time()
        r = lab.node1(cd + f"dscluster sync --hostfile {st['hostfile']} --json", 600)
        doc["sync"] = {"rc": r.returncode, "seconds": round(time.time() - t_sync, 2)}
    doc["card"] = (doc["check_allreduce"] or {}).get("device") or ("cpu" if args.nodes else "gpu")
    return Bench(lab=lab, args=args, doc=doc, hostfile=st["hostfile"], hwork=hwork, hosts=hosts, ranks=ranks,
                 fastest=fastest, cd=cd)


def tta_recommendation(b: Bench) -> dict[str, str]:
    """--tta: plan's recommendation for the whole lab, from the preset as the lab runs it ({config: the
    overrides, pasted as printed after the run's own; nothing recommended: the preset as is})."""
    args = b.args
    base = " ".join(["--config", args.tta, f"target_accuracy={args.target}", *args.set])
    b.lab.node1(b.cd + f"dscluster plan --hostfile hosts{len(b.hosts)}.txt --json {base} > plan-tta.json", 900)
    try:
        b.doc["tta_plan"] = json.loads((b.hwork / "plan-tta.json").read_text())
        return {args.tta: " ".join(b.doc["tta_plan"]["recommendation"].get("overrides") or [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        b.doc["tta_plan"] = None
        return {}


def run_one(b: Bench, name: str, nodes, overrides: str, rec: dict[str, str], planned: bool) -> dict | None:
    """One RUN: `dscluster plan` (where `planned`), then the README command as typed; its record into
    the results (`labruns.run_entry`, returned; None for a run skipped), its run directory into --keep."""
    args, hwork = b.args, b.hwork
    cfg = config_of(overrides)
    if "@rec" in overrides:
        if cfg not in rec:
            b.doc["runs"].append({"name": name, "nodes": nodes, "skipped": f"no recommendation for {cfg} yet"})
            return None
        overrides = overrides.replace("@rec", rec[cfg])
    plan_file = hwork / f"plan-{name}.json"
    hostfile = "hosts-fastest.txt" if nodes == "fastest" else f"hosts{nodes}.txt"
    several = nodes != "fastest" and nodes > 1
    calibrate = "--calibrate " if args.calibrate and several else ""
    plan = None
    if planned:
        b.lab.node1(b.cd + f"dscluster plan --hostfile {hostfile} --json {calibrate}{overrides} > {plan_file.name}",
                    900)
        try:
            plan = json.loads(plan_file.read_text())
        except (OSError, ValueError):
            plan = None
    if plan and several and plan["recommendation"].get("overrides") and not args.tta:
        rec[cfg] = " ".join(with_recommendation(overrides, plan["recommendation"]["overrides"]))
    t0 = time.time()
    watch = observe_during(b.lab, b.cd, hwork, name, hostfile) if args.observe and several else None
    r = b.lab.node1(b.cd + f"DSCLUSTER_RUN_ID={name} mpirun -np {b.ranks[nodes]} --hostfile {hostfile} "
                    f"-x DSCLUSTER_RUN_ID {shlex.quote(str(paths.entry_script()))} {overrides} progress=false",
                    args.run_timeout)
    if watch is not None:
        watch.join(timeout=150)
    extra = after_run(b.lab, b.cd, hwork, name, r.stdout, args, several)
    run_dir = hwork / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    entry = {**run_entry(name, nodes, b.ranks[nodes], overrides, r.returncode, time.time() - t0, run_dir, summary,
                         plan), **extra}
    b.doc["runs"].append(entry)
    if args.keep and run_dir.is_dir():
        shutil.copytree(run_dir, args.keep / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("checkpoints"))
    pred = (plan or {}).get("prediction") or {}
    print(f"{name}: {nodes} node(s), {b.ranks[nodes]} rank(s), rc {r.returncode}, "
          f"{summary.get('images_per_s') or 0:,.1f} img/s steady, {summary.get('run_images_per_s') or 0:,.1f} "
          f"whole run, plan {pred.get('images_per_s') or 0:,.1f}", flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    runs = [parse_run(r) for r in args.runs]
    if not (args.tta or runs) or (args.tta and args.target is None):
        raise SystemExit("give RUNs, or --tta CONFIG --target ACCURACY (RUNs given with it run first, without plan)")
    if args.dry_run:
        return print_tta_runs(args)
    if os.geteuid() != 0:
        raise SystemExit("the simulated lab needs root (network namespaces): run it with sudo")
    date = dt.date.today().isoformat()
    log_path = args.log or Path(f"gpu_lab-{args.link}.log")
    log = open(log_path, "w", encoding="utf-8")
    lab = Lab(log, LAB)
    doc = {"bench": "gpu_lab", "date": date, "link": args.link, "gpus": args.gpus, "nodes": args.nodes,
           "command": "mpirun -np N --hostfile hostsN.txt entry_cn.sh OVERRIDES (as typed, no --bind-to)",
           "images_per_s": "summary.json images_per_s: images / wall-clock of the timed steps (steady, after the "
                           "warm-up); run_images_per_s: images / wall-clock from the first step to the end",
           "baseline": "the one-node and plain runs of this same invocation",
           "note": args.note, "check_allreduce": None, "runs": []}
    out = args.out
    try:
        b = bring_up(lab, args, doc, log_path)
        tta_names: set[str] = set()
        if args.tta:
            tta_runs = [(name, "fastest" if role == tta.ALONE else len(b.hosts), o)
                        for name, role, o in tta.runs_for(args.tta, [int(x) for x in args.seeds.split(",")],
                                                          args.target, args.set, len(b.hosts),
                                                          tuple(args.tta_roles.split(",")))]
            tta_names = {name for name, _, _ in tta_runs}
            runs = runs + tta_runs
        if max((n for _, n, _ in runs if n != "fastest"), default=0) > len(b.hosts):
            raise SystemExit(f"a run asks for more nodes than the lab's {len(b.hosts)} ({b.hostfile})")
        kind = "tta" if args.tta else "lab"
        card = doc["card"].lower().replace(" ", "-")
        out = out or ROOT / "bench" / "results" / f"{date}-{card}-{kind}-{args.link}.json"
        rec = tta_recommendation(b) if args.tta else {}
        for name, nodes, overrides in runs:
            counted = name in tta_names  # RUNs given beside --tta run first, without plan, and are not counted
            entry = run_one(b, name, nodes, overrides, rec, planned=not args.no_plan and (counted or not args.tta))
            if entry is not None and counted:
                entry.update(role=tta.ALONE if nodes == "fastest" else tta.LAB,
                             host=b.fastest.name if nodes == "fastest" else None,
                             **tta.run_record(b.hwork / "runs" / name))
            doc["accuracy_by_compression"] = accuracy_by_compression(doc["runs"])
            if args.tta:
                summary = tta.summarise(doc["runs"])
                doc["time_to_accuracy"] = {"config": args.tta, "target": args.target, "seeds": args.seeds, **summary,
                                           "advice": tta.advice(doc.get("tta_plan"), summary),
                                           "plan_lab_whole_run": whole_run(doc.get("tta_plan") or {}, "choice"),
                                           "plan_time_to_accuracy": (doc.get("tta_plan") or {}).get("time_to_accuracy")}
            atomic_write_json(out, doc)
    finally:
        lab.dsc("sim", "down", "--lab", LAB)
        if out is not None:
            atomic_write_json(out, doc)
        log.close()
    print(f"wrote {out}")
    return 0 if all(r.get("rc", 0) == 0 for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
