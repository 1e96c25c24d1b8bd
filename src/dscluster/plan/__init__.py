"""`dscluster plan`: predict a data-parallel run before it runs, and advise only what holds as printed.

- `model`, `wholerun`: the step and the whole run (runmodel/phases.py has the phases), pure arithmetic;
- `inputs`, `nodes`, `nodeprobe`, `alone`, `datafeed`, `saveprobe`: what they are made of, measured;
- `recommend`: the search over settings; `weigh`: each priced by its whole run and weighed for evidence
  (`evidence`: does it learn as the config does); `advice`: the rule, what is recommended; `paste`: what to paste;
- `document`: the plan document and the entries saved for `train` (runmodel/predicted.py);
- `calibrate`: `plan --calibrate`'s PowerSGD run; `run`: making a plan (`run.run`); `render`: the terminal table.

docs/plan.md is the reference; docs/advisor.md says how far to trust it.
"""
