"""Small run directories written per the run-dir contract, for pure logic tests.

The real recorded run lives in tests/data/runs/; these cover shapes a real run rarely
shows on demand (a straggler, fp16 overflows, GPU telemetry with throttling, a dead rank).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path


def _jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def make_run(
    root: Path,
    name: str = "run-a",
    *,
    world: int = 2,
    hosts: list[str] | None = None,
    steps: int = 12,
    precision: str = "bf16",
    slow_rank: int | None = None,
    dead_rank: int | None = None,
    stop_at: dict[int, int] | None = None,
    overflow_steps: tuple[int, ...] = (),
    gpus: bool = False,
    throttle_at: tuple[int, ...] = (),
    summary: bool = True,
    env_overrides: dict[int, dict] | None = None,
    rate: float = 100.0,
) -> Path:
    """A run with `world` ranks over `hosts` (round robin)."""
    run = root / name
    hosts = hosts or [f"node{i + 1}" for i in range(world)]
    t0 = 1_700_000_000.0
    stop_at = dict(stop_at or {})
    if dead_rank is not None:
        stop_at.setdefault(dead_rank, steps // 2)
    for r in range(world):
        host = hosts[r % len(hosts)]
        recs = [{"kind": "start", "t": t0, "rank": r, "host": host, "world_size": world, "local_rank": 0,
                 "device": "cpu", "precision": precision, "micro_batch": 8, "grad_accum": 1,
                 "global_batch": 8 * world, "pid": 1000 + r}]
        scale = 2.0 ** 16
        last = stop_at.get(r, steps)
        for s in range(1, last + 1):
            st = 0.1 * (1.5 if r == slow_rank else 1.0) * (1.0 + 0.01 * (s % 3))
            overflow = s in overflow_steps
            if overflow:
                scale /= 2
            recs.append({"kind": "step", "t": t0 + s * 0.1, "rank": r, "host": host, "step": s, "epoch": s // 6,
                         "loss": 2.3 / s ** 0.5, "lr": 1e-3, "loss_scale": scale if precision == "fp16" else None,
                         "overflow": overflow, "step_time": st, "samples": 8, "samples_per_s": 8 / st,
                         "grad_norm": None})
            if r == 0 and s % 6 == 0:
                recs.append({"kind": "eval", "t": t0 + s * 0.1, "rank": 0, "host": host, "epoch": s // 6,
                             "step": s, "accuracy": 0.5 + 0.03 * s, "loss": 1.0 / s, "samples": 100})
        if r != dead_rank and r not in stop_at:
            recs.append({"kind": "end", "t": t0 + steps * 0.1 + 1, "rank": r, "host": host,
                         "status": "complete", "error": None})
        _jsonl(run / "metrics" / f"rank-{r}.jsonl", recs)
        env = {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "10.77.1.11", "MASTER_PORT": "29500",
               "GLOO_SOCKET_IFNAME": ["eth0", "enp3s0", "ens4f0"][r % 3], "host": host, "pid": 1000 + r,
               "versions": {"torch": "2.14.1", "deepspeed": "0.19.8"}}
        env.update((env_overrides or {}).get(r, {}))
        (run / "env").mkdir(parents=True, exist_ok=True)
        (run / "env" / f"rank-{r}.json").write_text(json.dumps(env))
    for i, host in enumerate(sorted(set(hosts[:world]))):
        recs = [{"kind": "meta", "t": t0, "host": host, "backend": "nvml" if gpus else "none", "period": 1.0}]
        for k in range(int(steps * 0.1) + 3):
            g = []
            if gpus:
                g = [{"index": 0, "uuid": f"GPU-{i}", "name": "NVIDIA GeForce RTX 3070", "util_percent": 90.0 - k,
                      "mem_used_mb": 4000.0 + 10 * k, "mem_total_mb": 8192.0, "temp_c": 60 + k, "power_w": 180.0,
                      "sm_clock_mhz": 1800, "throttle_reasons": ["sw_power_cap"] if k in throttle_at else [],
                      "ecc_errors": None, "pcie_tx_kbps": 1000, "pcie_rx_kbps": 2000}]
            recs.append({"kind": "sample", "t": t0 + k, "host": host, "backend": "nvml" if gpus else "none",
                         "cpu_percent": 50.0 + i, "ram_used_mb": 3000.0 + k, "ram_total_mb": 16000.0,
                         "proc_cpu_percent": 0.1, "gpus": g})
        _jsonl(run / "telemetry" / f"{host}.jsonl", recs)
    if summary and dead_rank is None and not stop_at:
        (run / "summary.json").write_text(json.dumps({
            "status": "complete", "run_id": name, "world_size": world, "hosts": sorted(set(hosts[:world])),
            "precision": precision, "model": "vit-tiny", "dataset": "digits", "epochs": 2, "steps": steps,
            "global_batch": 8 * world, "images_per_s": rate * world * (0.9 if world > 1 else 1.0),
            "accuracy": 0.5 + 0.03 * steps, "wall_s": 3.0, "overflow_steps": len(overflow_steps),
            "failed_rank": None, "failed_host": None, "error": None}))
    return run


def write_flight_recorder(run: Path, seqs: dict[int, int], fmt: str = "pickle") -> None:
    """Per-rank dumps like torch's flight recorder: entries with collective_seq_id and state."""
    for rank, top in seqs.items():
        entries = [{"record_id": i, "pg_id": 0, "collective_seq_id": i, "p2p_seq_id": 0,
                    "profiling_name": "gloo:all_reduce", "state": "completed" if i < top else "scheduled",
                    "is_p2p": False, "frames": []} for i in range(1, top + 1)]
        dump = {"version": "2.10", "rank": rank, "entries": entries}
        path = run / f"nccl_trace_rank_{rank}"
        if fmt == "pickle":
            path.write_bytes(pickle.dumps(dump))
        else:
            path.write_text(json.dumps(dump))


def make_plain_run(root: Path, name: str = "plain", *, exit_codes: dict[int, int] | None = None,
                   monitor: bool = True, gpus: bool = False) -> Path:
    """A user's own script run through entry_cn.sh without userlog: process/rank-R.json per rank,
    each node's telemetry, DeepSpeed's csv_monitor files, and summary.json as rankrecord writes it."""
    from dscluster.rundir import rankrecord

    exit_codes = {0: 0, 1: 0} if exit_codes is None else exit_codes
    world = len(exit_codes)
    run = make_run(root, name, world=world, steps=0, gpus=gpus, summary=False)
    for sub in ("metrics", "env"):
        for f in (run / sub).iterdir():
            f.unlink()
    t0 = 1_700_000_000.0
    order = sorted(exit_codes, key=lambda r: (exit_codes[r] in (0, 143), r))  # the failing rank ends first
    for k, rank in enumerate(order):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "DSCLUSTER_RUN_DIR": str(run)}
        rankrecord.start(run, ["python", "train.py"], env, now=t0)
        rankrecord.end(run, exit_codes[rank], env, now=t0 + 5 + k)
    if monitor:
        mon = run / "deepspeed"
        mon.mkdir()
        (mon / "Train_Samples_train_loss.csv").write_text(
            "step,train_loss\n" + "".join(f"{32 * s},{2.3 / s ** 0.5}\n" for s in range(1, 11)))
        (mon / "Train_Samples_lr.csv").write_text("step,lr\n" + "".join(f"{32 * s},0.01\n" for s in range(1, 11)))
    return run
