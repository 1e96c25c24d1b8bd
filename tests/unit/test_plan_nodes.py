"""plan's per-node compute probe (plan/nodes.py): which nodes are probed, the command each runs, its
output read back, the fault it honours, and what mixed speeds do to the prediction."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.core import probe
from dscluster.errors import UsageError
from dscluster.node.hosts import parse_hostfile_text
from dscluster.plan import model, nodes

LAB = parse_hostfile_text("node1 slots=1\nnode2 slots=1\nnode3 slots=2\n", "hosts.txt")

# what `python -m dscluster plan --measure-node 1:1 ...` printed on a lab node (a warning line first)
RECORDED = """\
/usr/lib/python3/dist-packages/torch/cuda/__init__.py:61: UserWarning: something about a driver
{"seconds": 1.6112, "device": "cpu", "note": "measured on CPU (no GPU here), median of 7 steps of 4 scaled to 16", \
"spread": 0.08, "samples": 7, "disturbed": false, "warmup_extra_s": 0.0, "compiled": false, "host": "node2", \
"fault_ms": 1500, "measured_at": 1795779401.17, "probe": "host=node2 device=cpu model=vit_small_image"}
"""


def test_ranks_follow_the_hostfile_order():
    assert nodes.rank_ranges(LAB) == {"node1": (0, 1), "node2": (1, 1), "node3": (2, 2)}


def test_one_probe_per_gpu_model_and_alone_where_unknown_or_slowed():
    models = {"node1": "NVIDIA H100", "node2": "NVIDIA H100", "node3": "NVIDIA RTX 3070"}
    assert nodes.probe_groups(LAB, models, env={}) == {"node1": ["node1", "node2"], "node3": ["node3"]}
    # a fault on rank 1 (node2's) makes node2 its own group; node1 stands for nobody else
    assert nodes.probe_groups(LAB, models, env={"DSCLUSTER_FAULT": "slow_gpu:rank=1,ms=80"}) == {
        "node1": ["node1"], "node2": ["node2"], "node3": ["node3"]}
    assert nodes.probe_groups(LAB, {}, env={}) == {"node1": ["node1"], "node2": ["node2"], "node3": ["node3"]}


def test_node_command_pins_the_planned_shape_and_passes_the_fault_on():
    cmd = nodes.node_command("/opt/venv/bin/python", "/lab/configs/vit base.yaml", ["epochs=2"], 128, "fp16", (2, 2),
                             "slow_gpu:rank=2,ms=80")
    env, _, rest = cmd.partition(" ")
    assert env == "DSCLUSTER_FAULT=slow_gpu:rank=2,ms=80"
    assert shlex.split(rest) == ["/opt/venv/bin/python", "-m", "dscluster", "plan", "--config",
                                 "/lab/configs/vit base.yaml", "--measure-node", "2:2", "epochs=2", "micro_batch=128",
                                 "precision=fp16"]
    assert not nodes.node_command("python", "c.yaml", [], 8, "fp32", (0, 1), None).startswith("DSCLUSTER_FAULT")


def test_the_node_side_of_the_probe_prints_the_figure_the_head_reads_with_its_ranks_threads():
    # what a node runs for the head's plan, the node command's own argv, on this machine: training's CPU ranks split
    # the node's cores (cpus.share_cores), so the probe for 2 ranks times a step with that many threads. (The head's
    # OMP_NUM_THREADS travelling over SSH and winning: tests/cluster/test_plan_lab.py, on real nodes.)
    config = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    argv = shlex.split(nodes.node_command(sys.executable, str(config), [], 4, "fp32", (0, 2), None, alone=[8]))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    fig = nodes.parse_node_output(out.stdout, "here")
    assert fig["seconds"] > 0 and "micro_batch=4 precision=fp32" in fig["probe"]
    assert fig["threads"] == max(1, (os.cpu_count() or 1) // 2)
    # the micro-batch alone is measured on a GPU only (a CPU figure is scaled linearly)
    assert fig["alone"] == []
    cmd = nodes.node_command(sys.executable, str(config), [], 4, "fp32", (0, 2), None, threads="1")
    assert cmd.startswith("OMP_NUM_THREADS=1 ")


def test_a_nodes_output_is_read_from_its_last_json_line():
    fig = nodes.parse_node_output(RECORDED, "node2")
    assert fig["seconds"] == 1.6112 and fig["host"] == "node2" and fig["fault_ms"] == 1500
    with pytest.raises(UsageError, match="node3: the compute probe printed no figure .*No module named"):
        nodes.parse_node_output("Traceback (most recent call last):\nModuleNotFoundError: No module named 'x'", "node3")


def test_the_probe_honours_the_fault_of_its_nodes_ranks():
    env = {"DSCLUSTER_FAULT": "slow_gpu:rank=3,ms=80;exit:rank=0,step=5"}
    assert probe.fault_ms(2, 2, env) == 80  # node3 holds ranks 2 and 3
    assert probe.fault_ms(0, 1, env) == 0 and probe.fault_ms(0, 1, {}) == 0


def scenario(compute, balanced=False):
    return model.Scenario(nodes=tuple(model.Node(name=n, ranks=r, compute_s=c) for n, r, c in compute),
                          micro_batch=64, grad_bytes=4e6, busbw_GBps=10.0, balanced=balanced)


def test_balanced_batching_gives_the_slow_node_a_smaller_share():
    mixed = [("node1", 1, 0.1), ("node2", 1, 0.3)]
    uniform, balanced = model.micro_step_s(scenario(mixed)), model.micro_step_s(scenario(mixed, balanced=True))
    assert uniform == 0.3
    # shares 96 and 32 of 128: each micro-step about 96 × 0.1/64 = 0.15 s
    assert balanced == pytest.approx(0.15, rel=0.02)


def test_the_slowest_node_is_named_with_its_cost_and_balanced_batching_recommended():
    s = scenario([("node1", 1, 0.1), ("node2", 1, 0.3), ("node3", 2, 0.1)])
    notes, balance = nodes.mixed_notes(s, model.predict(s), balanced_in_use=False)
    assert notes[0].startswith("slowest node: node2, 300.0 ms per micro-batch against 100.0 on node1 (3.0x)")
    assert "it costs 6" in notes[0]  # about two thirds of the img/s equal nodes would give
    assert balance and "batching=balanced" in notes[1]
    same = scenario([("node1", 1, 0.1), ("node2", 1, 0.1)])
    assert nodes.mixed_notes(same, model.predict(same), balanced_in_use=False) == ([], False)


def test_a_node_probes_the_preset_the_head_loaded_wherever_plan_was_started(tmp_path, monkeypatch):
    """`dscluster plan --config configs/x.yaml` in a work folder without configs/ loads the checkout's
    preset; the node's probe must get that file, not <work folder>/configs/x.yaml (every node's probe
    failed that way on the GPU lab, and plan fell back to the head's figure)."""
    from dscluster.plan.nodes import node_config

    monkeypatch.chdir(tmp_path)
    got = Path(node_config("configs/digits.yaml"))
    assert got.is_absolute() and got.is_file()
    assert got == (Path(__file__).resolve().parents[2] / "configs" / "digits.yaml")


def test_each_node_alone_takes_the_micro_batch_training_would_give_its_own_ranks():
    from dscluster.core.config import load_config
    from dscluster.plan.inputs import batch_shape

    config = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"  # micro_batch auto, global_batch 64
    cfg = load_config(config)
    assert nodes.alone_micros(cfg, LAB, 16, "fp32", batch_shape) == {"node1": 64, "node2": 64, "node3": 32}
    # a fixed micro-batch stays alone too (more accumulation, the same speed per image): nothing to measure
    fixed = load_config(config, ["micro_batch=8"])
    assert nodes.alone_micros(fixed, LAB, 8, "fp32", batch_shape) == {}
    # each node alone asks its probe for its micro-batch; a node's key names it, so a figure cached
    # without it is not taken for one with it
    cmd = nodes.node_command("python", "c.yaml", [], 16, "fp32", (0, 1), None, alone=[64, 32])
    assert "--measure-node 0:1 --alone-micro 64,32 micro_batch=16" in cmd
    assert nodes.cache_key(cfg, "node1", 16, "fp32", 0, 64).endswith(" alone_micro=64")
    assert "alone" not in nodes.cache_key(cfg, "node1", 16, "fp32", 0)


def gpu_stand_in(monkeypatch, device="cuda (Stand-in H100)"):
    """core/probe.py's measurement replaced by one that is faster per image at a larger batch, as a GPU
    is (0.0226 s at 128 and 0.0316 s at 256 on an H100 for fractal ViT-S), on `device`."""
    taken = []

    def measure(cfg, in_chans, num_classes, micro, slow_ms=0):
        taken.append(micro)
        return probe.ComputeFigure(seconds=0.0136 + 0.00007 * micro, device=device, note="stand-in", samples=10,
                                   spread=0.02)

    monkeypatch.setattr(probe, "measure_compute", measure)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the node side leaves this process's threads as they are
    return taken


def test_a_gpu_node_probe_measures_at_the_micro_batch_alone_and_the_head_reads_it_back(monkeypatch):
    from dscluster.plan import nodeprobe

    config = str(Path(__file__).resolve().parents[2] / "configs" / "digits.yaml")
    taken = gpu_stand_in(monkeypatch)
    line = nodeprobe.measure_here(config, ["micro_batch=16", "precision=fp32"], "2:2", "32")
    assert taken == [16, 32]  # the lab's micro-batch, then node3's alone, in the same process
    fig = nodes.parse_node_output("a warning first\n" + json.dumps(line), "node3")
    assert fig["seconds"] == pytest.approx(0.0136 + 0.00007 * 16)
    assert [(e["micro"], e["seconds"]) for e in fig["alone"]] == [(32, pytest.approx(0.0136 + 0.00007 * 32))]
    # each member of the probe's group takes its own micro-batch alone, where the probe measured it
    member = nodes.member_figure(fig, "node3", 32)
    assert (member["alone_micro"], member["measured_on"]) == (32, "node3") and "alone" not in member
    assert "alone_micro" not in nodes.member_figure(fig, "node3", 64)
    # an older probe's line, without `alone`, still reads: its nodes alone are priced at the lab's micro-batch
    old = nodes.parse_node_output(RECORDED, "node2")
    assert old["alone"] == [] and "alone_micro" not in nodes.member_figure(old, "node2", 64)


def test_a_cpu_node_probe_measures_once(monkeypatch):
    """CI's 2-core machine: a CPU figure stands in for the GPUs and is scaled linearly; plan must not
    take longer there."""
    from dscluster.plan import nodeprobe

    config = str(Path(__file__).resolve().parents[2] / "configs" / "digits.yaml")
    taken = gpu_stand_in(monkeypatch, device="cpu")
    line = nodeprobe.measure_here(config, ["micro_batch=16", "precision=fp32"], "0:1", "64")
    assert taken == [16] and line["alone"] == []
    with pytest.raises(UsageError, match="--alone-micro"):
        nodeprobe.measure_here(config, ["micro_batch=16", "precision=fp32"], "0:1", "64,x")
