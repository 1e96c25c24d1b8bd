"""`dscluster plan --calibrate`'s run: a few PowerSGD steps of the user's config on the hostfile's
nodes, with the README's command, before the plan is made again from what they measured.

Why: PowerSGD costs more across ranks than plan's one-rank probe shows, by an amount that moves with
the machine (docs/plan.md), so plan measures it. `train` records the run against the model step
plan saved for it (runmodel/predicted.py), like any run; plan/run.py decides when to run it and what
to save first.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from dscluster.files import paths
from dscluster.launch.mpirun import App, mpirun_argv, mpirun_path
from dscluster.rundir import layout

STEPS = 12
"""Steps of a calibration run: train's warm-up steps (core/timing.py), then the timed ones."""


def overrides() -> list[str]:
    """What a calibration run adds to the user's overrides: PowerSGD from step 2 (its default start,
    after the warm-up, would leave every timed step uncompressed), a short run, no checkpoint."""
    return ["comm.compression=powersgd", "comm.powersgd_start_step=2", f"max_steps={STEPS}",
            "checkpoint.every_epochs=0", "progress=false"]


def argv(hostfile: str, config: str, user_overrides: list[str], run_id: str, world: int) -> list[str]:
    """The README's command for this config, PowerSGD on: `mpirun -np N --hostfile H entry_cn.sh
    --config C OVERRIDES` (launch/mpirun.py builds it), the run named `run_id` on every rank. Not
    `dscluster launch`: that insists on the hostfile check ran on, and a plan for the first two
    nodes of a lab is a fair question."""
    program = [str(paths.entry_script()), "--config", config, *user_overrides, *overrides()]
    return mpirun_argv(mpirun_path(), [App(world, program, {"DSCLUSTER_RUN_ID": run_id})],
                       hostfile=hostfile, as_root=os.geteuid() == 0)


def run(hostfile: str, config: str, user_overrides: list[str], world: int) -> dict:
    """Run it, its output passed on to stderr as it comes (a minute of training should not look
    like a hang, and plan's --json keeps stdout); {compression, run_id, run_dir, exit_code,
    seconds, images_per_s (summary.json's, None without one)}."""
    run_id = f"calibrate-powersgd-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = argv(hostfile, config, user_overrides, run_id, world)
    print(f"dscluster plan: measuring PowerSGD on {world} ranks with a {STEPS}-step run (runs/{run_id}): "
          f"{shlex.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace") as proc:
            for line in proc.stdout or ():
                sys.stderr.write(line)
                sys.stderr.flush()
        rc = proc.returncode
    except OSError as e:  # no mpirun to start
        print(f"dscluster plan: could not start {cmd[0]}: {e}", file=sys.stderr)
        rc = 127
    run_dir = layout.runs_root() / run_id
    try:
        summary = json.loads((run_dir / layout.SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    return {"compression": "powersgd", "run_id": run_id, "run_dir": str(run_dir), "exit_code": rc,
            "seconds": round(time.monotonic() - t0, 1), "images_per_s": summary.get("images_per_s")}
