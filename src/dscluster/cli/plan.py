"""`dscluster plan`: predict the scaling of a training config on the hostfile's nodes, before the run.

Parse → `dscluster.plan.run.run(PlanOptions)` → render. The inputs, the model and its assumptions:
dscluster.plan and docs/plan.md. The `--json` document is described in docs/schemas.md.

Exit status: 0 the prediction was made (whatever it says), 1 a --calibrate run failed (the plan is
printed uncalibrated), 2 bad input (config, hostfile, no bandwidth: run `dscluster check` or pass
--busbw).
"""

from __future__ import annotations

import argparse
import json

from dscluster import core
from dscluster.plan import calibrate, model
from dscluster.plan.inputs import PlanOptions
from dscluster.plan.nodeprobe import measure_here
from dscluster.plan.render import render
from dscluster.plan.run import run


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict step time, img/s and speed-up on the hostfile's nodes before the run, and what scales",
        description="Predict one optimizer step of data-parallel training (compute, all-reduce, overlap), the "
        "images/s, the speed-up over the fastest node alone and a verdict; recommend the smallest gradient "
        "accumulation and compression that reach 80% scaling efficiency. Needs the all-reduce bandwidth of "
        "`dscluster check` (or --busbw). Exit 0 predicted, 1 a --calibrate run failed, 2 bad input.",
        epilog="examples:\n"
        "  dscluster plan --config configs/vit_base.yaml\n"
        "  dscluster plan --config configs/vit_base.yaml --busbw 0.119 --compute-s 0.043 micro_batch=128\n"
        "  dscluster plan --config configs/vit_base.yaml --compute-s node1=0.2,node2=0.2,node3=0.45 --json\n"
        "  dscluster plan --config configs/vit_base.yaml --calibrate comm.compression=powersgd",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="YAML", required=True, help="training preset (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for `dscluster train`")
    p.add_argument("--hostfile", default="hosts.txt", help="OpenMPI hostfile (default: hosts.txt)")
    p.add_argument("--busbw", type=float, metavar="GBps",
                   help="all-reduce bus bandwidth in GB/s (default: what `dscluster check` measured)")
    p.add_argument("--compute-s", metavar="S|NODE=S,...",
                   help="seconds of one forward+backward of one micro-batch on one rank, for every node or "
                   "per node (default: measured on each node)")
    p.add_argument("--powersgd-s", type=float, metavar="S",
                   help="PowerSGD's own work per optimizer step on one rank, seconds (default: measured here "
                   "when compute is)")
    p.add_argument("--calibrate", action="store_true",
                   help=f"where PowerSGD is in play and no run on these ranks has measured it, first run "
                   f"{calibrate.STEPS} PowerSGD steps of this config on the hostfile's nodes (the README's mpirun "
                   "of entry_cn.sh, about a minute) and correct the plan by what they measure")
    p.add_argument("--no-calibration", action="store_true",
                   help="ignore what earlier runs measured against their plans (<state>/plans.json outcomes)")
    p.add_argument("--max-global-batch", type=int, default=None, metavar="N",
                   help=f"largest global batch to recommend (default: {model.MAX_GLOBAL_BATCH}; with target_accuracy "
                   "set, the config's own global batch)")
    p.add_argument("--every-step", action="store_true",
                   help="recommend only settings that synchronise every step (no sync.mode=local_sgd: for a model "
                   "whose accuracy you have seen suffer from averaging)")
    p.add_argument("--probe-here", action="store_true",
                   help="measure compute on this machine only and give every node its figure (default: a probe "
                   "on each node over SSH, one per distinct GPU model, cached)")
    p.add_argument("--measure-node", metavar="FIRST:RANKS", help=argparse.SUPPRESS)  # the probe plan runs on a node
    p.add_argument("--alone-micro", metavar="M,...", help=argparse.SUPPRESS)  # and the micro-batches alone, on a GPU
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema: docs/schemas.md)")
    p.set_defaults(func=plan_command)


def options(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(config=args.config, overrides=list(args.overrides), hostfile=args.hostfile, busbw=args.busbw,
                       compute_s=args.compute_s, powersgd_s=args.powersgd_s, calibrate=args.calibrate,
                       no_calibration=args.no_calibration, max_global_batch=args.max_global_batch,
                       probe_here=args.probe_here, every_step=args.every_step)


def plan_command(args: argparse.Namespace) -> int:
    with core.start_up_gc():  # the collector off until a compute probe's first step (core/startgc.py)
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    if args.measure_node:  # on a node, for the head's plan (plan/nodes.py)
        print(json.dumps(measure_here(args.config, list(args.overrides), args.measure_node, args.alone_micro)))
        return 0
    doc = run(options(args))
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        render(doc)
    return 1 if any(r["exit_code"] for r in doc["calibration_runs"]) else 0
