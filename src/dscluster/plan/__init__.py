"""`dscluster plan`: predict a data-parallel run's step before it runs, and what would make it scale.

- `model`: the prediction itself, pure arithmetic (no torch);
- `inputs`: the command's options and what the prediction is made from (`PlanOptions`, `PlanInputs`);
- `probe`: what is measured on this machine (compute per micro-batch, PowerSGD's own work);
- `document`: the plan document and the entries saved for `train`;
- `predicted`: plans.json, the saved predictions `train` compares its run with, and their outcomes;
- `calibrate`: the short PowerSGD run of `plan --calibrate`;
- `run`: making a plan from options (`run.run`);
- `render`: the terminal table.

docs/plan.md is the reference.
"""
