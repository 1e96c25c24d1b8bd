#!/usr/bin/env python3
"""Held-out accuracy of each gradient compression at equal epochs: digits, CPU ranks, a local mpirun.

    python bench/compression_accuracy.py                    # 3 ranks: none, fp16, bf16, powersgd
    python bench/compression_accuracy.py --seeds 0,1,2 --options none,powersgd,powersgd:comm.powersgd_rank=8

Every option trains the digits preset with `comm.compression=<option>` once per seed, one after the
other in this invocation, so `none` is the baseline of the same machine, load and seeds. Writes
bench/results/<date>-cpu-digits-compression.json (its fields: docs/performance.md). Exit 1 when an
option's mean ends more than --max-drop points below `none`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dscluster.bench.runner import as_node_argv, free_port
from dscluster.files import paths
from dscluster.files.fsutil import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]


def run_option(runs: Path, run_id: str, option: str, seed: int, ranks: int, extra: list[str], timeout: float,
               as_nodes: bool = False) -> dict:
    """One run of `option` ("powersgd", or "powersgd:comm.powersgd_rank=8+..." with overrides) with `seed`."""
    name, _, more = option.partition(":")
    env = {**os.environ, "DSCLUSTER_RUNS": str(runs), "DSCLUSTER_RUN_ID": run_id, "MASTER_PORT": str(free_port()),
           "PYTHONUNBUFFERED": "1"}
    env.pop("DSCLUSTER_FAULT", None)
    cmd = [str(paths.venv_bin() / "mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)]
    if as_nodes:  # the ranks meet on loopback, which every one of them still shares
        env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    for var in ("DSCLUSTER_RUNS", "DSCLUSTER_RUN_ID", "MASTER_PORT", "PYTHONUNBUFFERED",
                *(("GLOO_SOCKET_IFNAME", "MASTER_ADDR") if as_nodes else ())):
        cmd += ["-x", var]
    cmd += [*(as_node_argv() if as_nodes else []),
            str(paths.venv_bin() / "dscluster"), "train", "--config", str(paths.preset("digits.yaml")),
            "progress=false", "checkpoint.every_epochs=0", f"comm.compression={name}", f"seed={seed}",
            *[o for o in more.split("+") if o], *extra]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit(f"{option}: training exited {p.returncode}")
    summary = json.loads((runs / run_id / "summary.json").read_text())
    comm = [json.loads(line) for line in (runs / run_id / "metrics" / "rank-0.jsonl").read_text().splitlines()]
    waits = [r["comm_s"] / r["step_time"] for r in comm if r["kind"] == "step" and r.get("comm_s") is not None]
    return {"accuracy": summary["accuracy"], "images_per_s": round(summary["images_per_s"], 1),
            "steps": summary["steps"], "wall_s": round(wall, 1),
            "comm_share_rank0": round(sum(waits) / len(waits), 3) if waits else None}


def source_version() -> dict:
    """The commit the ranks ran, and whether src/ differed from it (None outside a git checkout)."""
    def git(*a: str) -> str | None:
        try:
            p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except OSError:
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "src_modified": None if git("rev-parse", "HEAD") is None
            else bool(git("status", "--porcelain", "--", "src"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=3, help="ranks (default 3)")
    ap.add_argument("--options", default="none,fp16,bf16,powersgd",
                    help="comm.compression values, comma-separated; overrides of one after ':', joined by '+'")
    ap.add_argument("--seeds", default="0", help="training seeds, e.g. 0,1,2 (default 0)")
    ap.add_argument("--epochs", type=int, default=None, help="default: the preset's")
    ap.add_argument("--max-drop", type=float, default=1.0, help="points below none that fail (default 1)")
    ap.add_argument("--out", default=None,
                    help="result file (default bench/results/<date>-cpu-digits-compression.json)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per option")
    ap.add_argument("--as-nodes", action="store_true",
                    help="each rank its own host name (root: a UTS namespace per rank), so that sync.mode "
                         "local_sgd or diloco averages across 'nodes'; e.g. "
                         "--options none,none:sync.mode=local_sgd+sync.period=4")
    args = ap.parse_args()
    options = [o.strip() for o in args.options.split(",") if o.strip()]
    if "none" not in options:
        options.insert(0, "none")  # the baseline of this invocation
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    extra = [f"epochs={args.epochs}"] if args.epochs else []
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{date}-cpu-digits-compression.json"
    runs: dict[str, list[dict]] = {o: [] for o in options}
    with tempfile.TemporaryDirectory(prefix="compression-") as tmp:
        for seed in seeds:  # seed by seed: a change of load over the hours hits every option alike
            for i, option in enumerate(options):
                r = run_option(Path(tmp), f"{i}-{option.partition(':')[0]}-s{seed}", option, seed, args.np, extra,
                               args.timeout, as_nodes=args.as_nodes)
                runs[option].append({"seed": seed, **r})
                print(f"{option} seed {seed}: held-out accuracy {r['accuracy']:.1%}, {r['images_per_s']:.0f} img/s, "
                      f"{r['wall_s']:.0f} s", flush=True)
    results = {}
    for option, rs in runs.items():
        accs = [r["accuracy"] for r in rs]
        results[option] = {"accuracy": round(sum(accs) / len(accs), 4), "accuracies": accs, "runs": rs,
                           "images_per_s": round(sum(r["images_per_s"] for r in rs) / len(rs), 1),
                           "wall_s": round(sum(r["wall_s"] for r in rs) / len(rs), 1)}
    base = results["none"]["accuracy"]
    for r in results.values():
        r["points_vs_none"] = round(100 * (r["accuracy"] - base), 2)
    import torch  # torch: its version for the results file; the ranks load it themselves

    doc = {"bench": "compression_accuracy", "date": date, "card": "cpu",
           "link": "loopback" + (", each rank its own host name (UTS namespace)" if args.as_nodes else ""),
           "device_name": "cpu", "cpu_count": os.cpu_count(), "torch": torch.__version__, "ranks": args.np,
           "config": "configs/digits.yaml", "overrides": extra + ["checkpoint.every_epochs=0"], "seeds": seeds,
           **source_version(), "baseline": "none (same invocation)", "max_drop_points": args.max_drop,
           "results": results}
    atomic_write_json(out, doc)
    print(f"wrote {out}")
    worst = min(r["points_vs_none"] for r in results.values())
    return 1 if worst < -args.max_drop else 0


if __name__ == "__main__":
    sys.exit(main())
