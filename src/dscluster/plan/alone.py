"""Each node alone where every node was given this machine's GPU figure (`--probe-here`, or a hostfile
of this machine only): the figure again at the micro-batch each node trains at alone (plan/nodes.py
`alone_micros`: micro_batch auto splits the global batch over that node's ranks only, and a GPU is
faster per image at a larger batch), measured here and cached as the lab's figure is (plans.json
`figures`, by core/probe.py's key). The nodes' own probes measure theirs on the nodes (plan/nodes.py);
a CPU figure, or --compute-s, is scaled linearly from the lab's micro-batch, measured once.
"""

from __future__ import annotations

from dscluster import core
from dscluster.plan import nodeprobe, nodes
from dscluster.plan.inputs import PlanInputs, PlanOptions, batch_shape, figure_of
from dscluster.runmodel import predicted

HERE = ("measured", "cached", "calibration")
"""compute.source of a figure measured on this machine (plan/inputs.py `compute_figure`)."""


def measure_here(opts: PlanOptions, inputs: PlanInputs) -> None:
    """Add each node's figure alone to `inputs.how` (the document's compute.nodes: alone_micro and
    alone_seconds) where this machine's GPU figure stands for every node; nothing otherwise."""
    how = inputs.how
    if how["source"] not in HERE or not str(how.get("device") or "").startswith("cuda"):
        return
    alone = nodes.alone_micros(inputs.cfg, inputs.hostfile, inputs.micro, inputs.precision, batch_shape)
    if not alone:
        return
    seconds = {m: figure_at(inputs, m, reuse=not opts.no_calibration) for m in sorted(set(alone.values()))}
    how["nodes"] = {n: {"seconds": inputs.compute[n], "device": how["device"], "source": how["source"],
                        "alone_micro": alone[n] if seconds.get(alone.get(n)) else None,
                        "alone_seconds": seconds.get(alone.get(n))} for n in inputs.hostfile.names}


def figure_at(inputs: PlanInputs, micro: int, *, reuse: bool) -> float | None:
    """Seconds per micro-batch of `micro` here: cached for this host, device and config, else measured
    (nodeprobe.measure_alone) and cached; None where it does not fit the GPU, with a note."""

    key = core.probe_key(inputs.cfg, micro, inputs.precision)
    kept = predicted.figure(key) if reuse else None
    if kept is not None:
        return kept["seconds"]
    found = nodeprobe.measure_alone(inputs.cfg, *core.data_shape(inputs.cfg), [micro])
    if not found:
        inputs.notes.append(f"micro_batch {micro}, a node's alone, does not fit this GPU for the measurement: "
                            f"that node alone is priced at the lab's micro-batch {inputs.micro}")
        return None
    f = {**found[0], "probe": key}
    if f["disturbed"]:
        inputs.notes.append(f"the compute probe at micro_batch {micro} (a node alone) was disturbed: its samples "
                            f"spread {f['spread']:.0%}; that node's figure alone is uncertain")
    else:
        try:
            predicted.save_figure(key, figure_of(f))
        except OSError:
            pass  # a read-only state directory costs the next plan a measurement, not this one
    return f["seconds"]
