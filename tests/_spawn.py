"""Real process groups in unit tests: `spawn_ranks(target, world, *args)` starts `world` spawned processes
running target(rank, world, port, *args, out) and returns {rank: what each put on `out`}; each must put
one (rank, value) pair, and exit 0."""

from __future__ import annotations

import torch.multiprocessing as mp

from dscluster.bench.runner import free_port


def spawn_ranks(target, world: int, *args, timeout: float = 180) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited {p.exitcode}"
    return results
