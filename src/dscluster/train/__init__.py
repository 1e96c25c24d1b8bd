"""`dscluster train`: DeepSpeed ViT training on every rank (loop.py reads top to bottom).

The modules by role:
- config: config.py (the typed config), config_checks.py (its limits), ds_config.py;
- batching: shape.py (the one run-shape resolver plan also calls), sampler.py, balanced.py,
  autofit.py, loader.py, data.py, fractal.py;
- step: step.py, optstep.py, comm.py, losscale.py, precision.py, guards.py, split.py, timing.py,
  syncwatch.py;
- record: logwindow.py, progress.py, traces.py, evaluation.py, memory.py (the run directory itself:
  dscluster.rundir);
- dist: dist.py, nodelocal.py;
- components of the loop: checkpoint.py (the Checkpointer), faults.py (the test-only fault hook),
  model.py, setup_engine.py.

This face imports nothing: `import dscluster.train` must stay cheap (no torch).
"""
