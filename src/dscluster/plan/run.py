"""Making a plan: measure the inputs once, predict with what earlier runs measured, and with
--calibrate first measure PowerSGD on the nodes where it is in play and uncalibrated, then predict
again from the same inputs. `dscluster plan` (cli/plan.py) parses, calls `run`, renders.
"""

from __future__ import annotations

from dataclasses import replace

from dscluster.plan import alone, model, recommend
from dscluster.plan import calibrate as calibration_run
from dscluster.plan.document import build, run_key, save, saved_entry, scenario_of, uses_powersgd
from dscluster.plan.inputs import PlanInputs, PlanOptions, calibrations_with, measure
from dscluster.runmodel import accuracy, predicted


def run(opts: PlanOptions) -> dict:
    """The plan document (docs/schemas.md); `calibration_runs` holds any --calibrate run and its exit code."""
    accuracy.check_file()  # a damaged curves file stops the plan before its probes run
    inputs = measure(opts)
    alone.measure_here(opts, inputs)  # each node's micro-batch alone, where this machine's GPU stands for them
    doc, rec = build(opts, inputs, inputs.calibration)
    if opts.calibrate:
        doc, rec = calibrate(opts, inputs, doc, rec)
    return doc


def calibration_of(opts: PlanOptions, inputs: PlanInputs) -> dict[str, dict]:
    """The calibration as it stands now, for this plan's compute figure (`inputs.calibrations_with`)."""
    if opts.no_calibration:
        return {}
    found = predicted.calibration(model=inputs.cfg.model.name, precision=inputs.precision, ranks=inputs.world)
    return calibrations_with(found, inputs.how, [])


def calibrate(opts: PlanOptions, inputs: PlanInputs, doc: dict,
              rec: recommend.Recommendation) -> tuple[dict, recommend.Recommendation]:
    """--calibrate: where PowerSGD is in play on several ranks and no run here has measured it yet,
    one short PowerSGD run of this config on the hostfile's nodes (the README's mpirun of
    entry_cn.sh); `train` records it against the model's step like any run,
    and the plan is made again with that outcome. Its output goes to stderr."""
    cfg, world = inputs.cfg, inputs.world
    if not uses_powersgd(cfg, rec, world) or "powersgd" in doc["calibration"]:
        why = ("PowerSGD is already calibrated on these ranks" if "powersgd" in doc["calibration"] else
               "neither the config nor the recommendation uses PowerSGD across several ranks")
        doc["notes"].append(f"--calibrate: nothing to measure ({why}); the model alone is within about 7 % for "
                            "the other settings")
        return doc, rec
    # the PowerSGD setting at the config's own batch, saved so that train finds its model step
    scenario = replace(scenario_of(inputs, {}), compression="powersgd")
    p = model.predict(scenario)
    save(doc, {run_key(doc, cfg, None, "powersgd"):
               saved_entry(doc, opts, "calibration", p.to_dict(), calibration_run.overrides())})
    outcome = calibration_run.run(opts.hostfile, opts.config, opts.overrides, world)
    outcome.update(global_batch=p.global_batch, model_images_per_s=p.images_per_s)
    calibration = calibration_of(opts, inputs)
    rc, run_dir = outcome["exit_code"], outcome["run_dir"]
    if rc != 0 or "powersgd" not in calibration:
        doc["calibration_runs"] = [outcome]
        doc["notes"].append(f"--calibrate: the PowerSGD run {run_dir} " + (f"exited {rc}" if rc else
                            "recorded no outcome") + ": the plan above is not calibrated; its output is above")
        return doc, rec
    doc, rec = build(opts, inputs, calibration, [outcome])
    doc["notes"].append(f"--calibrate: PowerSGD measured {outcome['images_per_s']:,.0f} img/s at global batch "
                        f"{p.global_batch} in {run_dir} ({outcome['seconds']:.0f} s), where the model alone gave "
                        f"{p.images_per_s:,.0f}")
    return doc, rec
