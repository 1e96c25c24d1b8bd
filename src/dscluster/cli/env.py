"""`dscluster env`: this machine's versions, GPUs, launcher and distributed settings, locally.

Paste its output into a bug report. Nothing goes over SSH (for every node at once, run
`dscluster check`); secrets (dscluster.files.redact's rule) show "***".

The `--json` document's schema (version 1, keys only ever added) is in docs/schemas.md.
Exit status: 0 (a missing piece is reported, not an error); 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import time

from rich.markup import escape
from rich.table import Table

from dscluster import console
from dscluster.cli import envreport
from dscluster.files import redact

NOT_INSTALLED = "[red]not installed[/]"
STATUS_STYLE = {"ok": "green", "warning": "yellow", "error": "red", "unreachable": "red"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        help="this machine's versions, GPUs, mpirun and distributed settings (for bug reports)",
        description="Report, locally and without SSH, what a bug report needs: dscluster, Python, torch "
        "(CUDA build, CUDA available, NCCL), DeepSpeed (and its ops, as ds_report), mpirun, the GPUs, "
        "the NCCL/gloo/OpenMPI/DeepSpeed environment variables (secrets hidden) and the last "
        "`dscluster check`. Exit 0.",
        epilog="example: dscluster env --json > env.json",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/schemas.md)")
    p.add_argument("--no-ops", action="store_true", help="skip DeepSpeed's op compatibility probe")
    p.set_defaults(func=env_command)


def _ago(created: float, now: float) -> str:
    minutes = max(0, int((now - created) / 60))
    if minutes < 120:
        return f"{minutes} min ago"
    hours = minutes // 60
    return f"{hours} h ago" if hours < 48 else f"{hours // 24} days ago"


def _software_table(doc: dict) -> Table:
    torch = doc["torch"]
    ds = doc["deepspeed"]
    mpi = doc["mpi"]
    py = doc["python"]
    table = Table(title="software", title_justify="left")
    table.add_column("component", no_wrap=True)
    table.add_column("version")
    table.add_column("detail")
    table.add_row("dscluster", doc["versions"]["dscluster"], "")
    table.add_row("python", py["version"], escape(py["executable"]))
    cuda = "yes" if torch["cuda_available"] else "[yellow]no[/]"
    torch_detail = (f"CUDA build {torch['cuda_build'] or 'none (CPU-only)'}, CUDA available {cuda}"
                    if torch["version"] else "")
    table.add_row("torch", escape(torch["version"]) if torch["version"] else NOT_INSTALLED,
                  torch_detail + (f"  [red]{escape(torch['error'])}[/]" if torch["error"] else ""))
    table.add_row("NCCL", torch["nccl"] or "-", "torch's own NCCL" if torch["nccl"] else "")
    ds_detail = f"accelerator {ds['accelerator'] or '-'}"
    if ds["ops"] is not None:
        ops = ds["ops"].values()
        ds_detail += (f"; ops compatible {sum(o['compatible'] for o in ops)}/{len(ds['ops'])}, "
                      f"prebuilt {sum(o['installed'] for o in ops)}/{len(ds['ops'])}")
    if ds["error"]:
        ds_detail += f"  [yellow]{escape(ds['error'])}[/]"
    table.add_row("deepspeed", escape(ds["version"]) if ds["version"] else NOT_INSTALLED, ds_detail)
    table.add_row("mpirun", escape(mpi["version"] or "-"),
                  escape(mpi["mpirun"] or "") + (f"  [yellow]{escape(mpi['error'])}[/]" if mpi["error"] else ""))
    return table


def _render_check(check: dict | None) -> None:
    out = console.out
    if check is None:
        out.print("last check: none in this state directory (run `dscluster check`)")
        return
    if check["error"]:
        out.print(f"last check: {escape(check['path'])}: [red]{escape(check['error'])}[/]")
        return
    created = check["created"]
    when = (time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) + f" ({_ago(created, time.time())})"
            if created is not None else "unknown time")
    verdict = {True: "[green]ok[/]", False: "[red]problems[/]", None: "?"}[check["ok"]]
    out.print(f"last check: {when}, {verdict} ({check['errors']} error(s), {check['warnings']} warning(s)) "
              f"on {escape(str(check['hostfile']))}")
    for node in check["nodes"]:
        style = STATUS_STYLE.get(node["status"], "red")
        problems = f": {', '.join(node['problems'])}" if node["problems"] and node["status"] != "unreachable" else ""
        out.print(f"  {escape(str(node['name']))} [{style}]{node['status']}[/]{escape(problems)}")


def render(doc: dict) -> None:
    out = console.out
    out.print(escape(doc["summary"]), style="bold")
    out.print(_software_table(doc))
    if doc["gpus"]:
        gpus = Table(title="GPUs (as torch sees them)", title_justify="left")
        for col in ("index", "name", "capability", "memory"):
            gpus.add_column(col, justify="right" if col in ("index", "memory") else "left")
        for g in doc["gpus"]:
            gpus.add_row(str(g["index"]), escape(g["name"]), g["capability"], f"{g['memory_gib']:.1f} GiB")
        out.print(gpus)
    else:
        out.print("GPUs: none visible to torch" + ("" if doc["torch"]["cuda_available"] else " (CUDA not available)"))
    ops = doc["deepspeed"]["ops"]
    if ops:
        bad = [name for name, o in ops.items() if not o["compatible"]]
        out.print("DeepSpeed ops this machine cannot build: " + (", ".join(bad) if bad else "none"))
    needed = doc["deepspeed"].get("ops_needed")
    if needed:
        out.print(("" if needed["ok"] else "[yellow]warning[/] ") + escape(needed["line"]))
        if needed["fix"]:
            out.print(f"  fix: {escape(needed['fix'])}")
    if doc["env"]:
        env = Table(title="environment (secrets hidden)", title_justify="left")
        env.add_column("variable", no_wrap=True)
        env.add_column("value")
        for name, value in doc["env"].items():
            env.add_row(name, escape(value))
        out.print(env)
    else:
        out.print("environment: no NCCL_/GLOO_/MASTER_/OMPI_/DS_/DSCLUSTER_ variables set")
    _render_check(doc["check"])


def env_command(args: argparse.Namespace) -> int:
    doc = redact.redact_doc(envreport.collect(probe_ops=not args.no_ops))  # also a message quoting a secret
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        render(doc)
    return 0
