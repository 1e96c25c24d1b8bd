"""Every node measured on itself: plan's compute probe run on the hostfile's nodes over SSH, in
parallel (remote.fan_out, as `dscluster check` probes them), one probe per distinct GPU model (per
node where the models are unknown, and for any node a test fault slows), each figure cached.

A node's probe is `<python> -m dscluster plan --config C --measure-node FIRST:COUNT OVERRIDES`
(`node_command`, run by plan/nodeprobe.py), which prints one JSON line (`parse_node_output`): the
head's interpreter path and config, the planned micro-batch and precision pinned, DSCLUSTER_FAULT and
OMP_NUM_THREADS passed on as mpirun's -x does for training. The details: docs/plan.md, "Every node
measured on itself".
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from dscluster import core
from dscluster.check import checkfile
from dscluster.check.probe import ProbeSettings, default_key, open_session
from dscluster.errors import UsageError
from dscluster.files import paths, state
from dscluster.node import cpus
from dscluster.plan import model
from dscluster.runmodel import predicted
from dscluster.ssh import remote, thishost

MEASURED = "measured on the nodes"
"""The document's compute.source for figures measured on each node."""
PROBE_TIMEOUT_S = 600.0
"""Seconds one node's probe may take (a first torch.compile of ViT-B takes about a minute)."""


def rank_ranges(hostfile) -> dict[str, tuple[int, int]]:
    """(first rank, ranks) of each node: mpirun --hostfile places ranks node by node in file order."""
    out, first = {}, 0
    for h in hostfile.hosts:
        out[h.name] = (first, h.slots)
        first += h.slots
    return out


def faulted(ranks: tuple[int, int], env=None) -> bool:
    """Whether DSCLUSTER_FAULT slows one of these ranks (test-only, core/faults.py)."""
    return any("slow_gpu" in core.faults_for_rank(r, env) for r in range(ranks[0], ranks[0] + ranks[1]))


def probe_groups(hostfile, models: dict[str, str | None], env=None) -> dict[str, list[str]]:
    """{node to probe: the nodes given its figure}: one node per distinct GPU model, in hostfile order;
    a node whose model is unknown, or whose ranks a fault slows, is probed alone."""
    ranges = rank_ranges(hostfile)
    groups: dict[str, list[str]] = {}
    by_model: dict[str, str] = {}
    for name in hostfile.names:
        gpu_model = models.get(name)
        if gpu_model is None or faulted(ranges[name], env):
            groups[name] = [name]
        elif gpu_model in by_model:
            groups[by_model[gpu_model]].append(name)
        else:
            by_model[gpu_model] = name
            groups[name] = [name]
    return groups


def gpu_models(check_json: Path) -> dict[str, str | None]:
    """Each node's first GPU model as `dscluster check` saw it; {} when there is no check result."""
    try:
        doc = checkfile.load(check_json)
    except (OSError, checkfile.CheckFileError, UsageError):
        return {}
    out = {}
    for n in doc.nodes:
        gpus = (n.facts or {}).get("gpus") or []
        first = gpus[0] if gpus and isinstance(gpus[0], dict) else {}
        out[n.name] = first.get("name") if isinstance(first.get("name"), str) else None
    return out


def node_command(python: str, config: str, overrides: list[str], micro: int, precision: str,
                 ranks: tuple[int, int], fault: str | None, threads: str | None = None,
                 alone: list[int] | None = None) -> str:
    """The shell command that measures compute on a node (module docstring); `threads`, the head's
    OMP_NUM_THREADS, travels with it as DSCLUSTER_FAULT does; `alone`: the micro-batches to measure
    at as well."""
    argv = [python, "-m", "dscluster", "plan", "--config", config, "--measure-node", f"{ranks[0]}:{ranks[1]}",
            *(["--alone-micro", ",".join(map(str, alone))] if alone else []),
            *overrides, f"micro_batch={micro}", f"precision={precision}"]
    env = f"DSCLUSTER_FAULT={shlex.quote(fault)} " if fault else ""
    if threads:
        env += f"{cpus.THREADS_ENV}={shlex.quote(threads)} "
    return env + " ".join(shlex.quote(a) for a in argv)


def parse_node_output(stdout: str, node: str) -> dict:
    """The node probe's figure from its output: the last line that is a JSON object with `seconds`;
    its `alone` (the figures at other micro-batches, [{micro, seconds, ...}]) keeps well-formed entries
    only, [] where the line has none (a probe that measured none, or one older than them)."""
    def good(e) -> bool:
        return (isinstance(e, dict) and type(e.get("micro")) is int and e["micro"] >= 1
                and isinstance(e.get("seconds"), (int, float)) and e["seconds"] > 0)

    for line in reversed(stdout.strip().splitlines()):
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("seconds"), (int, float)) and doc["seconds"] > 0:
            alone = doc.get("alone")
            return {**doc, "alone": [e for e in alone if good(e)] if isinstance(alone, list) else []}
    tail = stdout.strip().splitlines()[-1:] or ["no output"]
    raise UsageError(f"{node}: the compute probe printed no figure ({tail[0][:200]})")


def node_config(config: str) -> str:
    """The config path a node's probe loads: the file the head's plan loaded (a preset named relative
    to the checkout, `configs/x.yaml`, resolves there, not in the directory plan runs in), at the same
    path on every node, where the checkout sits on all of them."""
    return str(paths.config_path(config).resolve())


def measure_nodes(hostfile, config: str, overrides: list[str], micro: int, precision: str, *, user: str | None = None,
                  check_json: Path | None = None, env=None, only: set[str] | None = None,
                  alone: dict[str, int] | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """({node: figure}, {node: why it could not be measured}) for the hostfile's nodes (those in `only`),
    one probe per group (`probe_groups`), in parallel over SSH; a node in `alone` ({node: its micro-batch
    alone}) gets `alone_micro` and `alone_seconds` where its group's probe measured that micro-batch."""
    env = os.environ if env is None else env
    groups = probe_groups(hostfile, gpu_models(check_json) if check_json else {}, env)
    if only is not None:
        groups = {n: [m for m in g if m in only] for n, g in groups.items() if set(g) & only}
        groups = {(n if n in g else g[0]): g for n, g in groups.items()}
    ranges = rank_ranges(hostfile)
    fault = env.get("DSCLUSTER_FAULT") or None
    settings = ProbeSettings(known_hosts=state.known_hosts_path(), key_filename=default_key(),
                             password=env.get("DSCLUSTER_SSH_PASSWORD"), timeout=PROBE_TIMEOUT_S)
    config = node_config(config)
    alone = alone or {}

    def work(target: remote.Target) -> dict:
        client = open_session(target, settings)
        try:
            at = sorted({alone[m] for m in groups[target.name] if m in alone})  # its members' micro-batches alone
            cmd = node_command(sys.executable, config, overrides, micro, precision, ranges[target.name], fault,
                               env.get(cpus.THREADS_ENV) or None, at)
            result = remote.run(client, f"cd {shlex.quote(os.getcwd())} 2>/dev/null; {cmd}", timeout=PROBE_TIMEOUT_S)
            return parse_node_output(result.stdout if result.rc == 0 else result.stderr or result.stdout, target.name)
        finally:
            client.close()

    targets = [remote.Target(name=n, host=n, user=user) for n in groups]
    outcomes = remote.fan_out(targets, work, timeout=PROBE_TIMEOUT_S + 30, description="measuring compute on the nodes",
                              show_progress=False)
    figures: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for name, outcome in outcomes.items():
        for member in groups[name]:
            if outcome.ok:
                figures[member] = member_figure(outcome.value, name, alone.get(member))
            else:
                failed[member] = f"{type(outcome.error).__name__}: {outcome.error}"
    return figures, failed


def member_figure(probed: dict, probed_on: str, alone: int | None) -> dict:
    """A node's figure from its group's probe (`parse_node_output`'s dict, taken on `probed_on`), with
    `alone_micro` and `alone_seconds` where that probe measured the node's micro-batch alone (`alone`)."""
    at = {e["micro"]: e["seconds"] for e in probed.get("alone") or []}
    return {**{k: v for k, v in probed.items() if k != "alone"}, "measured_on": probed_on,
            **({"alone_micro": alone, "alone_seconds": at[alone]} if alone in at else {})}


def is_here(names: list[str]) -> bool:
    """Whether the hostfile's nodes are all this machine (a one-machine plan measures in-process)."""
    return thishost.all_this_machine(names)


def cache_key(cfg, node: str, micro: int, precision: str, fault: int, alone: int | None = None) -> str:
    """A node figure's key in plans.json `figures`: the node, the config part of core/probe.py's key, any fault,
    the micro-batch it trains at alone where that is another (`alone_micros`)."""
    return (f"node={node} model={cfg.model.name} micro_batch={micro} precision={precision} "
            f"dataset={cfg.data.dataset} img_size={cfg.data.img_size} channels_last={cfg.channels_last} "
            f"compile={cfg.compile}" + (f" fault_ms={fault}" if fault else "")
            + (f" alone_micro={alone}" if alone else ""))


def alone_micros(cfg, hostfile, micro: int, precision: str, shape_of) -> dict[str, int]:
    """{node: the micro-batch `dscluster train` would take on that node's ranks alone} where it is not the
    lab's `micro`, by the resolver the lab's shape came from (`shape_of`: plan/inputs.py `batch_shape`).
    Only with micro_batch auto, which splits the global batch over fewer ranks: a fixed micro-batch
    stays, and accumulation keeps the global batch at the same speed per image."""
    if cfg.micro_batch != "auto":
        return {}
    out = {}
    for h in hostfile.hosts:
        try:
            alone = shape_of(copy.deepcopy(cfg), h.slots, precision)[0].micro_batch
        except UsageError:
            continue  # training refuses that shape on these ranks: priced at the lab's micro-batch
        if alone != micro:
            out[h.name] = alone
    return out


def alone_of(how: dict, node: str) -> dict:
    """model.Node's alone fields from the document's compute.nodes, {} where not measured."""
    f = (how.get("nodes") or {}).get(node) or {}
    return ({"alone_micro": f["alone_micro"], "alone_compute_s": f["alone_seconds"]}
            if f.get("alone_micro") and f.get("alone_seconds") else {})


def node_compute(opts, cfg, hostfile, micro: int, precision: str, shape_of, *, reuse: bool,
                 check_json: Path | None) -> tuple[dict[str, float], dict, dict[str, str]]:
    """({node: seconds per micro-batch}, the document's `compute`, {node: why not measured}) from a
    probe on each node (cached per node and config; `reuse` false measures again), which on a GPU also
    measures each node's micro-batch alone (`alone_micros`, by `shape_of`)."""
    ranges = rank_ranges(hostfile)
    alone = alone_micros(cfg, hostfile, micro, precision, shape_of)
    keys = {n: cache_key(cfg, n, micro, precision, core.fault_ms(*ranges[n]), alone.get(n)) for n in hostfile.names}
    figures = {n: predicted.figure(k) for n, k in keys.items()} if reuse else {}
    figures = {n: {**f, "source": "cached"} for n, f in figures.items() if f}
    missing = [h for h in hostfile.hosts if h.name not in figures]
    failed: dict[str, str] = {}
    if missing:
        measured, failed = measure_nodes(hostfile, opts.config, opts.overrides, micro, precision, check_json=check_json,
                                         only={h.name for h in missing}, alone=alone)
        for n, f in measured.items():
            figures[n] = {**f, "source": "measured"}
            try:
                predicted.save_figure(keys[n], {k: v for k, v in f.items() if k != "source"})
            except OSError:
                pass
    compute = {n: f["seconds"] for n, f in figures.items()}
    slowest = max(compute, key=compute.get) if compute else None
    how = {"seconds": compute[slowest] if slowest else None, "source": MEASURED,
           "device": ", ".join(sorted({f["device"] for f in figures.values()})) or None,
           "note": None, "probe": None, "measured_at": max((f.get("measured_at") or 0 for f in figures.values()),
                                                             default=None),
           "spread": None, "samples": None, "disturbed": any(f.get("disturbed") for f in figures.values()),
           "powersgd_s": None, "warmup_extra_s": max((f.get("warmup_extra_s") or 0 for f in figures.values()),
                                                     default=0.0),
           "compiled": any(f.get("compiled") for f in figures.values()),
           # rank 0's figure (the first node): wholerun.held_out_s scales it to the slowest where ranks share the pass
           "eval_s_per_image": (figures.get(hostfile.names[0]) or {}).get("eval_s_per_image"),
           "nodes": {n: {k: f.get(k) for k in ("seconds", "device", "source", "measured_on", "host", "fault_ms",
                                                     "threads", "alone_micro", "alone_seconds")}
                     for n, f in figures.items()}}
    return compute, how, failed


def uses_balanced(cfg) -> bool:
    """Whether training will balance the batch (core/balanced.py `resolve_batching`: the config's
    batching, or for auto DSCLUSTER_BATCHING from the environment or check's <state>/cluster.env)."""
    try:
        cluster = state.read_env_file(state.cluster_env_path())
    except (OSError, UsageError):
        cluster = {}
    try:
        return core.resolve_batching(cfg.batching, {**cluster, **os.environ}) == "balanced"
    except UsageError:
        return False


def mixed_notes(s, p, balanced_in_use: bool) -> tuple[list[str], bool]:
    """(notes naming the slowest node and what it costs, whether balanced batching would be faster)
    for a scenario `s` predicted as `p`; nothing where every node measured the same."""
    seconds = {n.name: n.compute_s for n in s.nodes}
    if len(set(seconds.values())) <= 1:
        return [], False
    slow, fast = max(seconds, key=seconds.get), min(seconds, key=seconds.get)
    even = model.predict(replace(s, nodes=tuple(replace(n, compute_s=seconds[fast]) for n in s.nodes)))
    cost = 1 - p.images_per_s / even.images_per_s
    how = "balanced batching gives its ranks smaller shares" if balanced_in_use else "every rank waits for it"
    notes = [f"slowest node: {slow}, {seconds[slow] * 1e3:.1f} ms per micro-batch against {seconds[fast] * 1e3:.1f} "
             f"on {fast} ({seconds[slow] / seconds[fast]:.1f}x); {how}: it costs {cost:.0%} of the img/s that "
             f"nodes as fast as {fast} would give ({p.images_per_s:,.0f} against {even.images_per_s:,.0f})"]
    if balanced_in_use:
        return notes, False
    balanced = model.predict(replace(s, balanced=True))
    faster = balanced.images_per_s > p.images_per_s * 1.02
    if faster:
        notes.append(f"balanced batching (batching=balanced: shares proportional to each rank's speed) is faster here: "
                     f"{balanced.images_per_s:,.0f} img/s against {p.images_per_s:,.0f} with equal shares; "
                     "the recommendation uses it")
    return notes, faster
