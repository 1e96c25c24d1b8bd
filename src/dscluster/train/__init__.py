"""`dscluster train`: the Trainer's loop on every rank (loop.py reads top to bottom), built on the
training core (dscluster.core): checkpointing (checkpoint.py, nodelocal.py), what a run records for
the next plan (records.py), and the run's own progress, traces and stops.

This face imports nothing: `import dscluster.train` stays cheap (no torch).
"""
