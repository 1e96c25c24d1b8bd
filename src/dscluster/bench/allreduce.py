"""All-reduce bandwidth across every rank: NCCL on GPUs, gloo on CPU.

    mpirun -np 4 --hostfile hosts.txt python -m dscluster.bench.allreduce --json   # across nodes
    python -m dscluster.bench.allreduce --json                                     # one host, all its GPUs

Bandwidth follows nccl-tests' definitions (algbw = bytes / time, busbw = algbw * 2 (n - 1) / n), so
figures compare with theirs. Ranks come from the launcher (`dscluster.node.ranks`, training's rule), else
this process spawns one per local GPU (2 on CPU). With MASTER_ADDR set, each rank picks its own
interface on MASTER_ADDR's subnet (GLOO/NCCL_SOCKET_IFNAME): names differ between lab machines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

from dscluster.node.cpus import free_launcher_binding
from dscluster.node.netif import free_port, iface_for_address, merge_interfaces, parse_ip_addr, parse_ip_link
from dscluster.node.ranks import detect_ranks

# 64 KiB: the start-up latency of one all-reduce (plan's latency term; PowerSGD's factors are this
# small). A 1 MiB message is not: a shaper's token bucket lets it burst through above the line rate.
GPU_SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
CPU_SIZES = [64 << 10, 1 << 20, 4 << 20]


def bus_bandwidth(algbw: float, n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth."""
    return algbw * 2 * (n - 1) / n if n > 0 else 0.0


def parse_sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().lower().removesuffix("ib").removesuffix("b")
        mult = units.get(part[-1:], 1)
        out.append(int(float(part[:-1] if mult > 1 else part) * mult))
    return out


def _pick_ifaces(master_addr: str) -> None:
    """Set GLOO/NCCL_SOCKET_IFNAME to this node's interface on MASTER_ADDR's subnet."""
    if os.environ.get("GLOO_SOCKET_IFNAME") and os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    try:
        addr = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
        link = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=5).stdout
        iface = iface_for_address(merge_interfaces(parse_ip_link(link), parse_ip_addr(addr)),
                                  socket.gethostbyname(master_addr))
    except (OSError, subprocess.SubprocessError):
        iface = None
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)


def run_rank(rank: int, world: int, local_rank: int, sizes: list[int] | None, iters: int,
             warmup: int, timeout_s: float) -> dict | None:
    # torch: loads only in a rank that measures, so the size and bandwidth rules stay torch-free
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if world > 1:
        _pick_ifaces(os.environ["MASTER_ADDR"])
    backend = "nccl" if cuda else "gloo"
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    results = []
    try:
        for size in sizes or (GPU_SIZES if cuda else CPU_SIZES):
            x = torch.ones(size // 4, dtype=torch.float32, device=device)
            for _ in range(warmup):
                dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - t0) / iters
            # The slowest rank defines the collective's time, as nccl-tests reports it.
            t = torch.tensor([elapsed], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed = float(t.item())
            algbw = size / elapsed / 1e9
            results.append({"bytes": size, "time_us": round(elapsed * 1e6, 1), "algbw_GBps": round(algbw, 3),
                            "busbw_GBps": round(bus_bandwidth(algbw, world), 3)})
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {"backend": backend, "world_size": world, "hosts": sorted(set(hosts)), "device": device_name,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "torch": torch.__version__, "iters": iters, "results": results,
            "peak_busbw_GBps": max((r["busbw_GBps"] for r in results), default=0.0)}


def _spawned(local_rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = run_rank(local_rank, world, local_rank, args.sizes, args.iters, args.warmup, args.timeout)
    if out is not None:
        _emit(out, args)


def _emit(out: dict, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(out), flush=True)
        return
    print(f"all-reduce {out['backend']} on {out['world_size']} ranks ({', '.join(out['hosts'])}; {out['device']})")
    print(f"{'size':>12} {'time_us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in out["results"]:
        print(f"{r['bytes']:>12} {r['time_us']:>10} {r['algbw_GBps']:>11} {r['busbw_GBps']:>11}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="example: mpirun -np 2 --hostfile hosts.txt "
                                       "python -m dscluster.bench.allreduce --json")
    p.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="e.g. 1M,64M,256M (default: up to 256M on GPU, 4M on CPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn when not launched by mpirun/torchrun")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    note = free_launcher_binding()  # NCCL's socket threads on one core halve the bandwidth measured
    if note:
        print(f"allreduce: {note}", file=sys.stderr)
    info = detect_ranks()
    if info.source != "single":
        out = run_rank(info.rank, info.world_size, info.local_rank, args.sizes, args.iters, args.warmup, args.timeout)
        if out is not None:
            _emit(out, args)
        return 0
    import torch  # torch: loads only when this process spawns the ranks itself
    import torch.multiprocessing as mp

    nprocs = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    mp.spawn(_spawned, args=(nprocs, args, free_port()), nprocs=nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
