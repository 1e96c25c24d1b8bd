"""Benchmarks: dscluster's own training path against a plain PyTorch DDP baseline.

`vit` (throughput, scaling, MFU, baseline ratio) and `balanced` (uniform vs
speed-proportional batches on mixed-speed ranks). Results are JSON files in
bench/results named by date and device, with versions, so figures are only compared
within one machine.
"""
