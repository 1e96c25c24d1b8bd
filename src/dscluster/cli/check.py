"""`dscluster check`: probe every node, report what would hang or crash the run, write the env.

The result, printed with --json and written to <state>/check.json, is `check.checkfile.CheckFile`;
its schema is described in docs/schemas.md.

Check names (table columns): reach hostname network versions gpu precision p2p shm clock
disk mesh port mtu speed nic mpi allreduce files. Exit status: 0 no errors (warnings allowed), 1 errors,
2 bad input (hostfile, flags, no state from `dscluster setup`).
"""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from dscluster import console, core
from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFile, NodeResult
from dscluster.check.rules import CHECKS, cell_status, deepspeed_env
from dscluster.check.run import CheckOptions, CheckRun, envs, ok, run_check
from dscluster.errors import UsageError
from dscluster.files import paths, state

MARK = {"ok": "[green]✓[/]", "warning": "[yellow]![/]", "error": "[red]✗[/]"}
SEVERITY_STYLE = {"error": "red", "warning": "yellow", "info": "cyan"}
# Short column headers: the table must fit an 80-column terminal with 14 checks.
HEADER = {"reach": "ssh", "hostname": "name", "network": "net", "versions": "vers", "gpu": "gpu",
          "precision": "prec", "p2p": "p2p", "shm": "shm", "clock": "clock", "disk": "disk",
          "mesh": "mesh", "port": "port", "mtu": "mtu", "speed": "speed", "nic": "nic", "mpi": "mpi",
          "allreduce": "allred", "files": "files"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="preflight every node: what would hang or crash the run, and the fix",
        description="Probe every node of the hostfile in parallel over SSH (versions, GPUs, interfaces, "
        "/dev/shm, clocks, disk), test the passwordless mesh and the master port, test every pair of "
        "nodes (ephemeral ports, MTU, speed, the NIC the bytes leave by), run an MPI hello "
        "and an all-reduce (on GPU nodes with 10 GbE or faster, also over a small grid of NCCL's socket threads; "
        "--no-tune skips it), then write the per-node environment launch needs "
        "(<state>/env/<hostname>.env, <state>/cluster.env, .deepspeed_env, <state>/check.json) and the "
        "cluster subnet into each node's ~/.openmpi and ~/.prte mca-params.conf for a hand-typed mpirun "
        "(two nodes or more). "
        "Exit 0 no errors, 1 errors found, 2 bad input.",
        epilog="example: dscluster check --hostfile hosts.txt --skip-active --json",
    )
    p.add_argument("--hostfile", default="hosts.txt", help="OpenMPI hostfile (default: hosts.txt)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (schema: docs/schemas.md)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per node for each phase (default: 30)")
    p.add_argument("--skip-active", action="store_true", help="skip the MPI hello and all-reduce tests")
    p.add_argument("--no-tune", action="store_true",
                   help="skip NCCL's socket tuning. On GPU nodes whose slowest link measures 5 Gbit/s of TCP "
                   "or more, check runs its all-reduce 4 more times (NCCL_SOCKET_NTHREADS x "
                   "NCCL_NSOCKS_PERTHREAD: 1x1 4x2 4x4 8x2), the largest message only: each run costs "
                   "about one mpirun start (torch import, NCCL set-up) "
                   "plus 13 all-reduces of 256 MiB, about 4.5 s on 10 GbE with 4 ranks")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port to test and write (default: 29500)")
    p.add_argument("--allow-deprecated-fp16", action="store_true",
                   help="use fp16 on GPUs below compute capability 7.0 (sets DS_ALLOW_DEPRECATED_FP16=1; slow)")
    p.add_argument("--user", default=None, help="login name on the nodes (default: yours)")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="a dataset folder (data.path) every node must hold too: compared by file count and bytes")
    p.add_argument("--config", metavar="YAML", default=None,
                   help="a training preset whose data.path every node must hold (as --data; --data wins)")
    p.set_defaults(func=check_command)


def build_document(run: CheckRun, master_port: int, files: dict) -> CheckFile:
    per_node, _ = envs(run, master_port)
    evaluation = run.evaluation
    nodes = []
    for h in run.hostfile.hosts:
        f = run.facts.get(h.name)
        nodes.append(NodeResult(
            name=h.name,
            reachable=f is not None,
            hostname=f.hostname if f else None,
            checks={c: cell_status(run.findings, h.name, c) for c in CHECKS},
            env=per_node.get(h.name, {}),
            facts=f.to_dict() if f else None,
        ))
    return CheckFile(
        ok=ok(run),
        created=run.created,
        wall_s=round(run.wall_s, 3),
        hostfile=run.hostfile.path,
        hostfile_sha256=run.hostfile_sha256,
        np=run.hostfile.total_slots,
        head=evaluation.head,
        precision={"value": evaluation.precision.value, "reason": evaluation.precision.reason,
                   "deprecated_fp16": evaluation.precision.deprecated_fp16},
        batching={"value": evaluation.batching.value, "reason": evaluation.batching.reason},
        network=evaluation.network.to_dict(),
        master={"addr": evaluation.network.address.get(evaluation.head), "port": master_port},
        nodes=nodes,
        findings=[x.to_dict() for x in run.findings],
        active=run.active,
        files=files,
        layout=run.layout,
    )


def write_outputs(run: CheckRun, master_port: int) -> dict:
    """Env files for every reachable node, cluster.env, .deepspeed_env; check.json last, so a
    reader that sees check.json sees the env files it describes. Written even with errors:
    check.json's "ok" says whether they can be trusted."""
    per_node, cluster = envs(run, master_port)
    header = f"written by `dscluster check` from {run.hostfile.path}; sourced by entry_cn.sh"
    files = {"node_env": {}}
    for name, env in per_node.items():
        hostname = run.facts[name].hostname
        if not hostname:
            continue
        path = state.node_env_path(hostname)
        state.write_env_file(path, env, header=f"{header}\nnode {name} (hostname {hostname})")
        files["node_env"][name] = str(path)
    files["cluster_env"] = str(state.write_env_file(state.cluster_env_path(), cluster, header=header))
    # Merged, not overwritten: .deepspeed_env is DeepSpeed's file, and yours (state.merge_deepspeed_env).
    ds_path, notes = state.update_deepspeed_env(state.deepspeed_env_path(), deepspeed_env(cluster, per_node))
    files["deepspeed_env"] = str(ds_path)
    for note in notes:
        console.err.print(f"dscluster check: {note}", markup=False)
    files["check_json"] = str(state.check_json_path())
    checkfile.write(state.check_json_path(), build_document(run, master_port, files))
    return files


def render(doc: dict) -> None:
    out = console.out
    used = [c for c in CHECKS if any(n["checks"][c] != "ok" for n in doc["nodes"])
            or c in ("reach", "hostname", "network", "versions", "gpu", "mesh", "port")]
    table = Table(title=f"dscluster check: {len(doc['nodes'])} nodes from {doc['hostfile']}")
    table.add_column("node", no_wrap=True)
    table.add_column("hostname", no_wrap=True)
    table.add_column("iface", no_wrap=True)
    for c in used:
        table.add_column(HEADER[c], justify="center", no_wrap=True)
    iface = doc["network"]["iface"]
    for n in doc["nodes"]:
        table.add_row(n["name"], n["hostname"] or "-", iface.get(n["name"], "-"),
                      *[MARK[n["checks"][c]] if n["reachable"] or c == "reach" else "[dim]·[/]" for c in used])
    out.print(table)
    out.print("columns: " + ", ".join(f"{HEADER[c]}={c}" for c in used if HEADER[c] != c), style="dim")
    net, p = doc["network"], doc["precision"]
    out.print(f"subnet {net['subnet'] or 'none'}  master {doc['master']['addr'] or '-'}:{doc['master']['port']}  "
              f"precision {p['value']}  batching {doc['batching']['value']}")
    for sev in ("error", "warning", "info"):
        for f in (x for x in doc["findings"] if x["severity"] == sev):
            where = f["node"] or "cluster"
            style = SEVERITY_STYLE[sev]
            out.print(f"[{style}]{sev:7}[/] {escape(where)} {escape('[' + f['check'] + ']')} {escape(f['what'])}")
            if f["fix"] and not f["fix"].startswith("nothing to do"):
                out.print(f"        fix: {f['fix']}", markup=False)
    files = doc["files"]
    out.print(f"wrote {files['check_json']}, {files['cluster_env']}, {files['deepspeed_env']} and "
              f"{len(files['node_env'])} node env file(s) in {doc['wall_s']:.1f} s")
    total = sum(1 for _ in doc["nodes"])
    if doc["ok"]:
        out.print(f"Next: step 5 of setup/CHECKLIST.md — mpirun -np {doc['np']} --hostfile {doc['hostfile']} "
                  "./entry_cn.sh")
    else:
        out.print(f"[red]{sum(1 for f in doc['findings'] if f['severity'] == 'error')} error(s) on "
                  f"{total} node(s)[/]: fix them and re-run `dscluster check`; then step 5 of setup/CHECKLIST.md")


def data_folder(data: str | None, config: str | None) -> str | None:
    """The folder to compare on every node: --data, else the preset's data.path (None: none named)."""
    if data is not None or config is None:
        return data
    return core.load_config(paths.config_path(config)).data.path or None


def check_command(args: argparse.Namespace) -> int:
    opts = CheckOptions(hostfile=args.hostfile, user=args.user, timeout=args.timeout, skip_active=args.skip_active,
                        master_port=args.master_port, allow_deprecated_fp16=args.allow_deprecated_fp16,
                        show_progress=not args.json, data_dir=data_folder(args.data, args.config),
                        no_tune=args.no_tune)
    if opts.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout}: expected a positive number of seconds")
    run = run_check(opts)
    files = write_outputs(run, opts.master_port)
    doc = build_document(run, opts.master_port, files)
    if args.json:
        print(json.dumps(doc.to_dict(), indent=2, sort_keys=True))
    else:
        render(doc.to_dict())
    return 0 if doc.ok else 1
