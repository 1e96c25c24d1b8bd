"""What a plan is made from: the command's options (`PlanOptions`) and everything measured or
built once from them (`PlanInputs`): the bus bandwidth `dscluster check` measured, the model's
parameters and gradient shapes (built on the meta device), the run's shape, and the compute time
of one micro-batch. A calibration run rebuilds the plan from the same `PlanInputs`.
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from dscluster import core
from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFileError
from dscluster.check.netrules import human_bps
from dscluster.errors import UsageError
from dscluster.files import state
from dscluster.node.hosts import Hostfile, parse_hostfile
from dscluster.plan import model, nodes
from dscluster.runmodel import predicted

COMPRESSION_KEY = "comm.compression"
"""The training config key that compresses gradients on the wire (core/comm.py)."""


@dataclass(kw_only=True, slots=True)
class PlanOptions:
    """`dscluster plan`'s options, checked before anything is loaded or measured."""

    config: str
    """Training preset (configs/*.yaml)."""
    overrides: list[str] = field(default_factory=list)
    """KEY=VALUE config overrides, as for `dscluster train`."""
    hostfile: str = "hosts.txt"
    """OpenMPI hostfile of the nodes to plan for."""
    busbw: float | None = None
    """All-reduce bus bandwidth in GB/s; None: what `dscluster check` measured."""
    compute_s: str | None = None
    """`S` or `NODE=S,...`: seconds of one forward+backward of one micro-batch; None: measured here."""
    powersgd_s: float | None = None
    """PowerSGD's own work per optimizer step, seconds; None: measured here when compute is."""
    calibrate: bool = False
    """Run PowerSGD on the nodes first where it is in play and uncalibrated (`plan.calibrate`)."""
    no_calibration: bool = False
    """Ignore what earlier runs measured against their plans."""
    max_global_batch: int | None = None
    """Largest global batch to recommend; None: `batch_limit`'s rule."""
    probe_here: bool = False
    """Measure compute on this machine only and give every node its figure (default: on each node)."""
    every_step: bool = False
    """Recommend no local SGD (model.SYNC_LADDER): only settings that synchronise every step."""

    def __post_init__(self):
        if self.calibrate and self.no_calibration:
            raise UsageError("--calibrate measures a run to correct the plan, --no-calibration ignores such runs: "
                             "pass one of them")
        if self.busbw is not None and not (self.busbw > 0 and math.isfinite(self.busbw)):
            raise UsageError(f"--busbw {self.busbw}: expected the all-reduce bus bandwidth in GB/s, > 0")
        if self.max_global_batch is not None and self.max_global_batch < 1:
            raise UsageError(f"--max-global-batch {self.max_global_batch}: expected at least 1")
        if self.powersgd_s is not None and not (self.powersgd_s >= 0 and math.isfinite(self.powersgd_s)):
            raise UsageError(f"--powersgd-s {self.powersgd_s}: expected seconds >= 0, e.g. --powersgd-s 0.02")


@dataclass(kw_only=True, slots=True)
class PlanInputs:
    """Everything the prediction is made from that costs a measurement or a model build, once."""

    cfg: object
    """The training config (core/config.py's TrainConfig), overrides applied."""
    hostfile: Hostfile
    """The nodes, as the hostfile lists them."""
    world: int
    """Ranks: the hostfile's slots."""
    compute: dict[str, float]
    """Seconds of one forward+backward of one micro-batch on one rank, per hostfile node."""
    how: dict
    """Where the compute figure came from: {seconds, source, device, note} (the document's `compute`)."""
    busbw: float
    """All-reduce bus bandwidth, GB/s."""
    source: str
    """Where busbw came from: `--busbw` or check.json's path."""
    check_world: int | None = None
    """Ranks check's all-reduce ran over (None with --busbw)."""
    latency: float = 0.0
    """Start-up of one all-reduce, seconds (`model.startup_latency_s`)."""
    micro: int
    """Per-rank micro-batch."""
    accum: int
    """Gradient accumulation steps."""
    global_batch: int
    """Samples an optimizer step trains: micro × accum × world, or less where the ranks' shares differ
    (64 on 3 ranks: 22, 21, 21)."""
    batch_note: str | None = None
    """Why the batch shape is a guess, where it is."""
    params: int
    """Trainable parameters."""
    matrices: tuple[tuple[int, int], ...]
    """Each gradient as PowerSGD views it."""
    precision: str
    """The precision training will use."""
    precision_note: str | None = None
    """Why the precision is a guess, where it is."""
    grad_format: str
    """What the gradients are: fp32, fp16 or bf16."""
    allowed: dict[str, bool]
    """Which comm.compression values training accepts for this config."""
    refused: list[str] = field(default_factory=list)
    """Why training refuses the others (one line per cause)."""
    powersgd_s: float | None = None
    """PowerSGD's own work per optimizer step; None: not measured."""
    calibration: dict[str, dict] = field(default_factory=dict)
    """What earlier runs measured against their plans, per compression (`predicted.calibration`), those
    made with this plan's compute figure (or with none measured here) only."""
    notes: list[str] = field(default_factory=list)
    """What the reader should know about the compute figure: reused, disturbed, calibrations set aside."""

    def __post_init__(self):
        if set(self.compute) != set(self.hostfile.names):
            raise UsageError(f"compute times for {sorted(self.compute)}, but the hostfile has {self.hostfile.names}")
        if not all(s > 0 and math.isfinite(s) for s in self.compute.values()):
            raise UsageError(f"compute times must be seconds > 0, got {self.compute}")
        if (self.world != self.hostfile.total_slots or self.micro < 1 or self.accum < 1
                or not 0 < self.global_batch <= self.micro * self.accum * self.world):
            raise UsageError(f"run shape out of range: world {self.world}, micro_batch {self.micro}, "
                             f"grad_accum {self.accum}")
        if not (self.busbw > 0 and self.latency >= 0 and self.params > 0):
            raise UsageError(f"busbw {self.busbw}, latency {self.latency}, params {self.params}: out of range")
        if self.grad_format not in model.FORMAT_BYTES:
            raise UsageError(f"grad_format {self.grad_format!r}: expected one of {', '.join(model.FORMAT_BYTES)}")


SLOW_LINK_FRACTION = 0.5
"""check's slowest pair, measured under this fraction of the rate its all-reduce reached and not part of
that all-reduce, is the plan's bandwidth: a ring all-reduce runs at the pace of its slowest link."""


@dataclass(frozen=True, slots=True)
class CheckBandwidth:
    """What a plan takes from check.json for its communication term."""

    busbw: float
    """GB/s: the largest all-reduce's bus bandwidth, or the slowest link's rate (`note` says so)."""
    world: int | None
    """Ranks check's all-reduce ran over (None without one)."""
    latency: float
    """Start-up of one all-reduce, seconds, from its smallest message (0 without one)."""
    note: str | None = None
    """Why the slowest link is used instead of the all-reduce, naming the pair."""
    link: str | None = None
    """The pair whose link is used, `node1 → node3`."""


def busbw_from_check(path: Path, names: list[str] | None = None) -> CheckBandwidth:
    """The bus bandwidth of check's largest all-reduce, closest to DDP's 100 MB buckets, its rank count and
    the start-up latency of one all-reduce (from its smallest message); or the rate of check's slowest link
    between two of `names` (the plan's nodes; None: any) where the all-reduce is missing, or did not run
    through that link and reached more than twice its rate (`slowest_link_busbw`)."""
    fix = "run `dscluster check` (without --skip-active) on this hostfile, or pass --busbw GBps"
    try:
        doc = checkfile.load(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no all-reduce measurement yet: {fix}") from None
    except CheckFileError as e:
        raise UsageError(f"{e}; or pass --busbw GBps") from None
    result = doc.allreduce_result()
    rows = [r for r in (result or {}).get("results") or [] if r.get("busbw_GBps", 0) > 0]
    measured = None
    if rows:
        world = result.get("world_size")
        measured = CheckBandwidth(busbw=float(max(rows, key=lambda r: r.get("bytes") or 0)["busbw_GBps"]),
                                  world=world, latency=model.startup_latency_s(rows, world or 1))
    slow = slowest_link_busbw(doc, measured, names)
    if slow is None and measured is None:
        raise UsageError(f"{path}: holds no all-reduce result (skipped or failed) and no link speed: {fix}")
    return slow or measured


def slowest_link_busbw(doc: checkfile.CheckFile, measured: CheckBandwidth | None,
                       names: list[str] | None) -> CheckBandwidth | None:
    """check's slowest link as the plan's bandwidth (module constant `SLOW_LINK_FRACTION`), or None."""
    slow = doc.slowest_link()
    if slow is None or (names is not None and not {slow.get("from"), slow.get("to")} <= set(names)):
        return None
    pair = f"{slow.get('from')} → {slow.get('to')}"
    gbps = slow["bps"] / 8e9
    rate = human_bps(slow["bps"])
    if measured is None:
        return CheckBandwidth(busbw=gbps, world=None, latency=0.0, link=pair, note=(
            f"check's all-reduce did not run (--skip-active, or it failed): planned with check's slowest link, {pair} "
            f"at {rate} = {gbps:.3g} GB/s, as the bus bandwidth (a ring all-reduce runs at its slowest link's pace) "
            "and no start-up time; run `dscluster check` without --skip-active for a measured all-reduce"))
    hostname = {n.name: n.hostname for n in doc.nodes}
    result = doc.allreduce_result() or {}
    hosts = result.get("hosts")
    through = (hostname.get(slow.get("from")) in hosts and hostname.get(slow.get("to")) in hosts
               if isinstance(hosts, list) else measured.world == doc.np)
    if through or gbps >= SLOW_LINK_FRACTION * measured.busbw:
        return None   # the all-reduce ran through that link: its figure already holds it
    return CheckBandwidth(busbw=gbps, world=measured.world, latency=measured.latency, link=pair, note=(
        f"check's slowest link, {pair}, measured {rate} = {gbps:.3g} GB/s, under half the {measured.busbw:.3f} GB/s "
        f"its all-reduce reached over {measured.world} ranks without that link: planned with the slowest link, "
        "whose pace every step runs at; fix that cable (`dscluster check` names the node in its `speed` column) "
        "or leave the node out of the hostfile"))


def parse_compute(text: str, names: list[str]) -> dict[str, float]:
    """`0.05` for every node, or `node1=0.05,node2=0.2` naming every hostfile node."""
    def seconds(value: str, where: str) -> float:
        try:
            s = float(value)
        except ValueError:
            s = math.nan
        if not (s > 0 and math.isfinite(s)):
            raise UsageError(f"--compute-s {where}: expected seconds > 0, e.g. --compute-s 0.05")
        return s

    if "=" not in text:
        return dict.fromkeys(names, seconds(text, repr(text)))
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in names:
            raise UsageError(f"--compute-s: {name!r} is not a host of the hostfile ({', '.join(names)})")
        if name in out:
            raise UsageError(f"--compute-s: {name!r} given twice; give each node once, e.g. --compute-s "
                             + ",".join(f"{n}=0.05" for n in names))
        out[name] = seconds(value, repr(part))
    missing = [n for n in names if n not in out]
    if missing:
        raise UsageError(f"--compute-s: no time for {', '.join(missing)}; give NODE=S for every node, or one number")
    return out


def batch_shape(cfg, world: int, precision: str = "fp32") -> tuple[core.RunShape, str | None]:
    """The run's shape on `world` ranks by training's own resolver (core/shape.py), with what a plan
    cannot know left out (no GPU memory fit, no measured balanced shares), and a note where that
    makes it a guess. Bad batch arithmetic is refused as `dscluster train` refuses it."""

    cfg.batching = core.resolve_batching(cfg.batching)  # as `dscluster train` does first
    shape = core.resolve_shape(cfg, world, core.DeviceFacts(precision=precision))
    note = None
    if cfg.micro_batch == "auto" and cfg.global_batch is None:
        note = f"micro_batch auto without global_batch: assumed {shape.micro_batch} (pass micro_batch=N)"
    elif cfg.micro_batch == "auto":
        note = (f"micro_batch auto: assumed global_batch {cfg.global_batch} ÷ {world} ranks = {shape.micro_batch} "
                "(auto-fit may take less on small GPUs and accumulate: pass micro_batch=N)")
    return shape, note


def gradient_shapes(cfg, in_chans: int, num_classes: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(parameters, each gradient as PowerSGD views it: shape[0] × the rest), built on the meta
    device: shapes only, no memory, so ViT-B costs nothing to count."""
    import torch  # heavy: only a real plan builds the model, never `plan --help`

    with torch.device("meta"):
        net = core.build_model(cfg.model, in_chans=in_chans, num_classes=num_classes, img_size=cfg.data.img_size)
    matrices = tuple((p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1)
                     for p in net.parameters() if p.requires_grad)
    return core.count_params(net), matrices


def planned_precision(cfg) -> tuple[str, str | None]:
    """(the precision training will use, a note when guessed): the config's, else `dscluster check`'s
    (DSCLUSTER_PRECISION, <state>/cluster.env), else this machine's GPU's, else fp32 with a note."""
    if cfg.precision != "auto":
        return cfg.precision, None
    cluster = os.environ.get("DSCLUSTER_PRECISION")
    if not cluster and state.cluster_env_path().exists():
        # a damaged cluster.env is bad input (exit 2, as launch says), not a reason to plan for fp32
        cluster = state.read_env_file(state.cluster_env_path()).get("DSCLUSTER_PRECISION")
    if cluster and cluster.strip().lower() in core.FORMATS:
        return cluster.strip().lower(), None
    decided = core.decide_here("auto").precision
    return decided, (None if decided != "fp32" else "precision auto and no `dscluster check` result here: planned "
                     "for fp32 (pass precision=... for the GPUs' format)")


def allowed_compressions(cfg, precision: str) -> tuple[dict[str, bool], list[str]]:
    """Which comm.compression values and local SGD settings training accepts here, by its rules, and why not."""
    ok: dict[str, bool] = {}
    why: dict[str, str] = {}
    for comp in (*model.COMPRESSIONS, *model.SYNC_LADDER):
        mode, period = core.parse_sync_label(comp)
        trial = copy.deepcopy(cfg)
        trial.comm.compression = comp if period == 1 else "none"
        trial.sync.mode = mode
        trial.sync.period = max(2, period)
        try:
            core.compression_conflict(trial, precision)
            core.sync_conflict(trial, precision)
            ok[comp] = True
        except core.ConfigValueError as e:
            ok[comp] = False
            if comp in model.LADDER:
                why.setdefault(e.also, str(e))  # one line per cause (ZeRO refuses every compression alike)
    return ok, list(why.values())


INSIDE_NODE_BUSBW_GBps = 1e4
"""One node's ranks all-reduce inside it (NVLink, PCIe or shared memory), never over the network that
check measured: priced as free, as every plan prices `each node alone`. Not measured."""
INSIDE_NODE_SOURCE = ("one node: its ranks all-reduce inside it, not over the network; priced as free, as "
                      "'each node alone' is (not measured)")


def measure(opts: PlanOptions) -> PlanInputs:
    """Everything the prediction is made from that costs a measurement or a model build, once: a
    calibration run rebuilds the plan from the same inputs."""
    cfg = core.load_config(opts.config, opts.overrides)
    hostfile = parse_hostfile(opts.hostfile)
    names = hostfile.names
    compute = parse_compute(opts.compute_s, names) if opts.compute_s is not None else None
    # cheap inputs first: a missing bandwidth says so before any model is built or measured
    alone = opts.busbw is None and hostfile.total_slots == 1  # one rank sends no gradients: no bandwidth needed
    one_node = opts.busbw is None and len(hostfile.hosts) == 1 and not alone
    checked = (CheckBandwidth(busbw=opts.busbw or 1.0, world=None, latency=0.0) if opts.busbw is not None or alone
               else CheckBandwidth(busbw=INSIDE_NODE_BUSBW_GBps, world=None, latency=0.0) if one_node
               else busbw_from_check(state.check_json_path(), names))
    source = ("--busbw" if opts.busbw is not None else "one rank: no all-reduce, this figure is not used" if alone
              else INSIDE_NODE_SOURCE if one_node
              else str(state.check_json_path()) + (f" (slowest link {checked.link})" if checked.link else ""))
    world = hostfile.total_slots
    precision, precision_note = planned_precision(cfg)
    shape, batch_note = batch_shape(cfg, world, precision)
    micro = shape.micro_batch
    in_chans = shape.in_chans
    num_classes = shape.num_classes
    params, matrices = gradient_shapes(cfg, in_chans, num_classes)
    allowed, refused = allowed_compressions(cfg, precision)
    calibration = {} if opts.no_calibration else predicted.calibration(model=cfg.model.name, precision=precision,
                                                                       ranks=world)
    notes: list[str] = [checked.note] if checked.note else []
    how = None
    if compute is not None:
        how = {"seconds": max(compute.values()), "source": "--compute-s", "device": None, "note": None,
               **dict.fromkeys(FIGURE_KEYS[1:])}
    elif not (opts.probe_here or nodes.is_here(names)):
        compute, how, failed = nodes.node_compute(opts, cfg, hostfile, micro, precision, batch_shape,
                                                  reuse=not opts.no_calibration, check_json=state.check_json_path())
        if failed:  # those nodes get this machine's figure, said in a note
            notes.append(f"could not measure compute on {', '.join(failed)} ({next(iter(failed.values()))}): "
                         "given this machine's figure; pass --compute-s NODE=S,... or --probe-here")
    if compute is None or len(compute) < len(names):
        local = compute_figure(cfg, in_chans, num_classes, micro, precision, calibration, notes,
                               reuse=not opts.no_calibration)
        how = how if compute else local
        compute = {**dict.fromkeys(names, local["seconds"]), **(compute or {})}
    calibration = calibrations_with(calibration, how, notes)
    powersgd_s = opts.powersgd_s if opts.powersgd_s is not None else how["powersgd_s"]
    if powersgd_s is None and allowed.get("powersgd") and world > 1 and how["source"] in ("measured", "cached",
                                                                                            nodes.MEASURED):
        powersgd_s = how["powersgd_s"] = core.measure_powersgd(cfg, in_chans, num_classes, micro)
    if how["source"] in ("measured", "cached") and not how.get("disturbed"):
        try:  # cached per host, device and config (plans.json `figures`)
            predicted.save_figure(how["probe"], figure_of(how))
        except OSError:
            pass  # a read-only state directory costs the next plan a measurement, not this one
    return PlanInputs(cfg=cfg, hostfile=hostfile, compute=compute, how=how, source=source, busbw=checked.busbw,
                      check_world=checked.world, latency=checked.latency, world=world, micro=micro,
                      accum=shape.grad_accum,
                      global_batch=shape.global_batch, batch_note=batch_note, params=params, matrices=matrices,
                      precision=precision,
                      precision_note=precision_note, grad_format=core.gradient_format(cfg, precision), allowed=allowed,
                      refused=refused, powersgd_s=powersgd_s, calibration=calibration, notes=list(shape.notes) + notes)


def compute_figure(cfg, in_chans: int, num_classes: int, micro: int, precision: str, calibration: dict[str, dict],
                   notes: list[str], reuse: bool = True) -> dict:
    """The compute figure of a plan without --compute-s (the document's `compute`): the one kept with a
    calibration made on this host, device and config (`probe_key`), else measured now. A calibration
    is measured − modelled step with the figure its plan had; a figure measured now, under another
    load, would move the prediction by the difference (a busy head node made one 26x too slow)."""
    key = core.probe_key(cfg, micro, precision)
    kept = [c["compute"] for c in calibration.values() if (c.get("compute") or {}).get("probe") == key]
    if kept:
        figure = max(kept, key=lambda f: f["measured_at"])
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(figure["measured_at"]))
        how = {**figure, "source": "calibration",
               "note": f"compute figure {figure['seconds']:.4f} s per micro-batch ({figure['device']}), measured at "
                       f"{when} for the plan the calibration's runs were measured against: used again, not measured "
                       "now (plan measures again when the host, GPU or config change, or with --no-calibration)"}
    elif reuse and predicted.figure(key) is not None:
        figure = predicted.figure(key)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(figure["measured_at"]))
        how = {**figure, "source": "cached",
               "note": f"compute figure {figure['seconds']:.4f} s per micro-batch ({figure['device']}), measured at "
                       f"{when} for this host, device and config: used again (--no-calibration measures again)"}
    else:
        f = core.measure_steady_compute(cfg, in_chans, num_classes, micro)
        how = {"seconds": f.seconds, "source": "measured", "device": f.device, "note": f.note, "probe": key,
               "measured_at": time.time(), "spread": round(f.spread, 4), "samples": f.samples,
               "disturbed": f.disturbed, "powersgd_s": None, "warmup_extra_s": round(f.warmup_extra_s, 4),
               "compiled": f.compiled, "eval_s_per_image": f.eval_s_per_image}
        if f.disturbed:
            notes.append(f"the compute probe was disturbed: its {f.samples} samples spread {f.spread:.0%} around "
                         f"their median{' twice' if f.tries > 1 else ''} ({core.host_load()}); its figure "
                         f"{f.seconds:.4f} s is uncertain: plan again when the machine is idle, or pass --compute-s")
    if how.get("disturbed") and how["source"] == "calibration":
        notes.append(f"that compute figure was disturbed when measured (samples spread {how['spread']:.0%}): "
                     "--no-calibration measures it again")
    return how


FIGURE_KEYS = ("seconds", "device", "probe", "measured_at", "spread", "samples", "disturbed", "powersgd_s",
               "warmup_extra_s", "compiled", "eval_s_per_image")
"""A compute figure as plans.json keeps it with each saved setting (`figure_of`)."""


def figure_of(how: dict) -> dict:
    """The compute figure a plan's settings are saved with; a run's outcome keeps it (runmodel/predicted.py)."""
    return {k: how.get(k) for k in FIGURE_KEYS}


def calibrations_with(calibration: dict[str, dict], how: dict, notes: list[str]) -> dict[str, dict]:
    """The calibrations this plan applies: those whose runs were measured against a plan with this
    compute figure, or with one not measured here (--compute-s, plans older than this rule), or
    measured for another host, GPU or config (their correction applies, with a note). Those measured
    here for the same config against another figure are set aside: their correction belongs to it."""
    figure, out = figure_of(how), {}
    for comp, c in calibration.items():
        theirs = c.get("compute") or {}
        if theirs.get("probe") is None or how["source"] == "--compute-s" or theirs == figure:
            out[comp] = c
        elif theirs.get("probe") != figure["probe"]:
            out[comp] = c
            notes.append(f"{comp}: the {c['runs']} earlier run(s) calibrating it were planned with a compute figure "
                         f"taken for another host, GPU or config ({theirs['probe']}): their correction is applied "
                         "to this one's")
        else:
            notes.append(f"{comp}: {c['runs']} earlier run(s) were measured against another compute figure of this "
                         f"config ({theirs.get('seconds')} s, measured at {theirs.get('measured_at')}): not used")
    return out
