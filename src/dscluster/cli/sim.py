"""`dscluster sim up|down|status|exec`: the simulated lab (root only)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from rich.table import Table

from dscluster import console
from dscluster.errors import JobFailed, UsageError
from dscluster.sim import lab as sim
from dscluster.sim.netfaults import parse_faults
from dscluster.sim.options import parse_env, parse_gpus, resolve_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim", help="simulated lab: N nodes with sshd in network namespaces (root)",
        description="A lab of N machines on this host for tests and the demo: one network namespace "
        "per node on a private switch, each with its own hostname, sshd, host key, /etc and home, "
        "a non-root account 'lab', and the interface-name and docker0 differences of real labs. "
        "On a host with NVIDIA GPUs each node can own some of them (--gpus), and every node's "
        "link can be shaped (--link). Needs root; nothing on the host is edited.",
        epilog="example: sudo dscluster sim up --nodes 3 --hostfile hosts.txt && "
        "sudo dscluster sim exec node1 -- hostname; GPU lab: sudo dscluster sim up --gpus 1,1,2 --link 1gbit",
    )
    ss = p.add_subparsers(dest="sim_command", metavar="COMMAND", required=True)

    def lab_arg(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--lab", default="dslab", help="lab name; several labs can run at once (default: dslab)")

    u = ss.add_parser(
        "up", help="build the lab (safe to repeat)",
        description="Build the lab and print its nodes. Running it again on a healthy lab with the "
        "same node count changes nothing (it rewrites the hostfile and restarts a dead sshd).",
        epilog="examples: sudo dscluster sim up --nodes 5 --slots 2 --hostfile hosts.txt; "
        "sudo dscluster sim up --gpus 1,1,2 --link 1gbit --hostfile hosts.txt",
    )
    u.add_argument("--nodes", type=int, help="number of nodes (default 3, or as many as --gpus lists)")
    u.add_argument("--slots", type=int, help="slots per node in the hostfile (default 1; with --gpus, "
                   "each node's GPU count)")
    u.add_argument("--gpus", metavar="N,N,...", help="GPUs per node, e.g. 1,1,2: three nodes owning GPUs 0, 1 "
                   "and 2-3 (CUDA_VISIBLE_DEVICES in every process of the node); needs nvidia-smi")
    u.add_argument("--link", action="append", default=[], metavar="[NODE=]RATE",
                   help="shape every node's link, both directions, with tc tbf: 1gbit, 10gbit, <n>mbit or "
                   "none (default); NODE=RATE shapes one node's (repeatable), e.g. --link node2=100mbit")
    _fault_options(u)
    u.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every process of every node (repeatable), e.g. --env NCCL_DEBUG=INFO")
    u.add_argument("--no-shared-fs", action="store_true",
                   help="a lab without NFS: each node its own copy of the checkout (tracked files, at the same "
                   "path), its own shared folder and home; the checkout's .venv stays shared software")
    u.add_argument("--hostfile", help="write the OpenMPI hostfile here (default: inside the lab directory); "
                   "the lab user must be able to read it from node1")
    u.add_argument("--json", action="store_true", help="print the lab as JSON instead of a table")
    lab_arg(u)
    u.set_defaults(func=up_command)

    d = ss.add_parser(
        "down", help="remove the lab completely",
        description="Stop every process in the lab's nodes, delete its namespaces, links and files. "
        "Returns only when nothing is left.",
        epilog="example: sudo dscluster sim down --lab dslab",
    )
    lab_arg(d)
    d.set_defaults(func=down_command)

    s = ss.add_parser(
        "status", help="is the lab up and healthy",
        description="Per node: namespaces alive, sshd running, port 22 reachable. Exit 1 if the lab "
        "is missing or unhealthy.",
        epilog="example: sudo dscluster sim status --json",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--show-password", action="store_true", help="include the lab user's password")
    lab_arg(s)
    s.set_defaults(func=status_command)

    e = ss.add_parser(
        "exec", help="run a command inside a node",
        description="Run CMD inside NODE (its network, hostname and mounts) as the lab user, "
        "cwd = repository root; exits with CMD's exit code.",
        epilog="example: sudo dscluster sim exec node2 -- ip -o addr",
    )
    e.add_argument("node", help="node name, e.g. node1")
    _exec_options(e)
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    e.set_defaults(func=exec_command)


def _fault_options(parser: argparse.ArgumentParser) -> None:
    """Per-node network faults real labs have (sim.netfaults); each repeatable."""
    parser.add_argument("--mtu", action="append", default=[], metavar="NODE=MTU",
                        help="that node's NIC MTU (the switch stays at 1500), e.g. --mtu node2=9000")
    parser.add_argument("--firewall", action="append", default=[], metavar="NODE[=PORT,...]",
                        help="that node drops inbound TCP except ssh and the ports given (default 29500, "
                        "the master port), e.g. --firewall node2")
    parser.add_argument("--second-nic", action="append", default=[], metavar="NODE",
                        help="that node gets a second NIC on the lab subnet and a route through it that "
                        "takes its traffic to the other nodes, e.g. --second-nic node2")


def _exec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", action="store_true", help="run as root instead of the lab user")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before CMD is killed (default 600)")
    parser.add_argument("--lab", default="dslab", help="lab name (default: dslab)")


def _lab_dict(lab: sim.Lab) -> dict:
    return {
        "lab": lab.name, "subnet": lab.subnet, "host_ip": lab.host_ip, "user": lab.user,
        "hostfile": str(lab.hostfile), "shared": str(lab.shared), "link": lab.state.link,
        "env": lab.state.env, "shared_fs": lab.state.shared_fs, "faults": lab.state.faults,
        "nodes": [{"name": n.name, "hostname": n.hostname, "ip": n.ip, "iface": n.iface,
                   "decoys": n.decoys, "netns": n.netns, "gpus": n.gpus} for n in lab.nodes],
    }


def _gpu_cell(gpus: list[int]) -> str:
    return ",".join(map(str, gpus)) if gpus else "-"


def up_command(args: argparse.Namespace) -> int:
    # Every input is checked before anything is built or written (exit 2).
    gpus = parse_gpus(args.gpus) if args.gpus is not None else None
    resolve_size(args.nodes, args.slots, gpus)
    link, faults = parse_faults(mtu=args.mtu, link=args.link, firewall=args.firewall, second_nic=args.second_nic)
    env = parse_env(args.env)
    start = time.monotonic()
    lab = sim.up(nodes=args.nodes, slots=args.slots, lab=args.lab, hostfile=args.hostfile,
                 gpus=gpus, link=link, env=env, shared_fs=not args.no_shared_fs, faults=faults)
    seconds = time.monotonic() - start
    if args.json:
        print(json.dumps(_lab_dict(lab) | {"seconds": round(seconds, 2)}, indent=2))
        return 0
    table = Table(title=f"lab {lab.name}: {len(lab.nodes)} nodes on {lab.subnet}, link "
                  f"{'unshaped' if lab.state.link == 'none' else lab.state.link} (up in {seconds:.1f} s)")
    for col in ("node", "hostname", "ip", "iface", "gpus", "link", "user", "decoys"):
        table.add_column(col)
    for n in lab.nodes:
        rate = lab.state.faults.get("link", {}).get(n.name, lab.state.link)
        table.add_row(n.name, n.hostname, n.ip, n.iface, _gpu_cell(n.gpus), rate, lab.user,
                      " ".join(n.decoys))
    console.out.print(table)
    where = "same path on every node" if lab.state.shared_fs else "same path, each node its own; so is the checkout"
    console.out.print(f"hostfile: {lab.hostfile}\nshared:   {lab.shared} ({where})")
    console.out.print(f"password: `dscluster sim status --lab {lab.name} --show-password`")
    console.out.print(f"try:      dscluster sim exec node1 --lab {lab.name} -- hostname")
    return 0


def down_command(args: argparse.Namespace) -> int:
    start = time.monotonic()
    existed = sim.down(args.lab)
    if existed:
        console.out.print(f"lab {args.lab} removed in {time.monotonic() - start:.1f} s")
    else:
        console.out.print(f"lab {args.lab} was not up; nothing to remove")
    return 0


def status_command(args: argparse.Namespace) -> int:
    sim.require_root()
    st = sim.status(args.lab)
    if st is None:
        if args.json:
            print(json.dumps({"lab": args.lab, "up": False}))
        else:
            console.out.print(f"lab {args.lab} is not up (start it with `dscluster sim up --lab {args.lab}`)")
        return 1
    st["up"] = True
    if args.show_password:
        st["password"] = sim.load(args.lab).password
    if args.json:
        print(json.dumps(st, indent=2))
        return 0 if st["healthy"] else 1
    table = Table(title=f"lab {st['lab']} on {st['subnet']}, link {st['link']}: "
                  f"{'healthy' if st['healthy'] else 'NOT healthy'}")
    for col in ("node", "hostname", "ip", "iface", "gpus", "namespaces", "sshd", "port 22", "link"):
        table.add_column(col)
    for n in st["nodes"]:
        yes = lambda b: "ok" if b else "[red]no[/red]"  # noqa: E731
        table.add_row(n["name"], n["hostname"], n["ip"], n["iface"], _gpu_cell(n["gpus"]), yes(n["anchor_alive"]),
                      yes(n["sshd_running"]), yes(n["ssh_port_open"]), "up" if n["connected"] else "[red]down[/red]")
    console.out.print(table)
    console.out.print(f"user: {st['user']}  hostfile: {st['hostfile']}  shared: {st['shared']}")
    if args.show_password:
        console.out.print(f"password: {st['password']}")
    return 0 if st["healthy"] else 1


def exec_command(args: argparse.Namespace) -> int:
    sim.require_root()
    # argparse hands everything after NODE to `cmd`, options included ("node1 --lab x -- ls"):
    # the options before "--" are ours, the rest is the command.
    rest = list(args.cmd)
    if "--" in rest:
        cut = rest.index("--")
        opts, cmd = rest[:cut], rest[cut + 1:]
        if opts:
            again = argparse.ArgumentParser(prog="dscluster sim exec NODE", add_help=False)
            _exec_options(again)
            again.parse_args(opts, namespace=args)
    else:
        cmd = rest
    if not cmd:
        raise UsageError("no command given: dscluster sim exec NODE -- CMD [ARGS...]")
    lab = sim.load(args.lab)
    if lab is None:
        raise JobFailed(f"lab {args.lab} is not up (start it with `dscluster sim up --lab {args.lab}`)")
    node = lab.node(args.node)
    # Pass our stdin/stdout through (interactive use), so this does not go through Lab.run.
    argv = lab.command(node.name, cmd, user="root" if args.root else None)
    env = lab.env("root" if args.root else None, node=node.name)
    # Its own process group, so a timeout or Ctrl-C stops CMD's children (mpirun, ranks) too.
    proc = subprocess.Popen(argv, env=env, process_group=0)
    try:
        return proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, signal.SIGKILL)
        print(f"dscluster sim exec: {' '.join(cmd)} killed after {args.timeout:.0f} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        _kill_group(proc, signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
        raise


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    if sig == signal.SIGKILL:
        proc.wait()
