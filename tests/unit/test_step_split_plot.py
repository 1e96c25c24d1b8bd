"""The step split in pictures and words: a run that waits for the network says so in one picture and
in `diagnose`; one that does not, does not."""

from __future__ import annotations

import json

from _analysis_runs import make_run

from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.load import load_run
from dscluster.analysis.plots import HOST_FAMILIES, plot_step_split, shade
from dscluster.analysis.stats import step_split


def with_split(run_dir, comm_s: float | None, compute_s: float = 0.08, data_s: float = 0.002):
    """Give every step record of a run directory a measured split that adds up to its step_time."""
    for path in (run_dir / "metrics").glob("rank-*.jsonl"):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for r in recs:
            if r["kind"] == "step":
                comm = comm_s
                r.update(compute_s=compute_s, comm_s=comm, data_s=data_s,
                         step_time=compute_s + (comm or 0.0) + data_s + 0.001, other_s=0.001)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run_dir


def test_a_comm_bound_run_shows_the_wait_per_rank_and_diagnose_names_it(tmp_path):
    run = load_run(with_split(make_run(tmp_path, world=3, hosts=["node1", "node1", "node2"], steps=20), comm_s=0.4))
    plot = plot_step_split(run, tmp_path / "plots")
    assert plot.path.is_file() and plot.path.stat().st_size > 10_000
    bars = {k: v for k, v in plot.series.items() if k.startswith("split ")}
    assert sorted(bars) == ["split rank 0 (node1)", "split rank 1 (node1)", "split rank 2 (node2)"]
    compute, comm, data, other = bars["split rank 2 (node2)"]["y"]
    assert (compute, comm, data, other) == (0.08, 0.4, 0.002, 0.001)
    assert plot.notes == ["communication-bound: 83% of step time waiting for the network"]
    share = plot.series["comm_share rank 0 (node1)"]["y"]
    assert len(share) == 20 and min(share) > 80
    finding = [f for f in diagnose(run)["findings"] if f["kind"] == "comm_bound"]
    assert len(finding) == 1 and finding[0]["severity"] == "warning"
    assert finding[0]["message"].startswith("communication-bound: 83% of step time waiting for the network")
    assert "dscluster plan --config" in finding[0]["message"]


def test_a_compute_bound_run_has_no_finding_and_says_its_share(tmp_path):
    run = load_run(with_split(make_run(tmp_path, steps=20), comm_s=0.005))
    plot = plot_step_split(run, tmp_path / "plots")
    assert plot.notes == ["6% of step time waiting for the network"]
    assert not [f for f in diagnose(run)["findings"] if f["kind"] == "comm_bound"]


def test_unmeasured_communication_is_not_drawn_as_none(tmp_path):
    run = load_run(with_split(make_run(tmp_path, steps=10), comm_s=None))
    splits = step_split(run)
    assert [s.seconds["comm_s"] for s in splits] == [None, None]
    plot = plot_step_split(run, tmp_path / "plots")
    assert plot.notes == ["communication not measured (one rank, or DeepSpeed reduced without DDP hooks)"]
    assert not [f for f in diagnose(run)["findings"] if f["kind"] == "comm_bound"]


def test_runs_without_a_split_say_so_instead_of_an_empty_panel(tmp_path):
    plot = plot_step_split(load_run(make_run(tmp_path, steps=5)), tmp_path / "plots")
    assert plot.notes[0] == "no step split recorded" and plot.path.is_file()


def test_ranks_of_one_node_take_shades_of_its_colour_family(tmp_path):
    run = load_run(with_split(make_run(tmp_path, world=3, hosts=["node1", "node1", "node2"], steps=8), comm_s=0.1))
    series = plot_step_split(run, tmp_path / "plots").series
    colour = {r: series[f"split rank {r} ({h})"]["colour"][0] for r, h in ((0, "node1"), (1, "node1"), (2, "node2"))}
    # as in the run's other plots: node1's two ranks two shades of its family, node2 another family
    assert colour[0] == shade(HOST_FAMILIES[0], 0, 2) and colour[1] == shade(HOST_FAMILIES[0], 1, 2)
    assert colour[2] == shade(HOST_FAMILIES[1], 0, 1) and len(set(colour.values())) == 3


def test_local_sgd_shows_the_models_average_apart_from_compute(tmp_path):
    """sync.mode local_sgd: average_s is part of comm_s; the split keeps it apart, never inside compute."""
    run_dir = with_split(make_run(tmp_path, world=2, hosts=["node1", "node2"], steps=16), comm_s=0.01)
    for path in (run_dir / "metrics").glob("rank-*.jsonl"):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for r in recs:
            if r["kind"] == "step":
                r["average_s"] = 0.01 if r["step"] % 4 == 0 else 0.0
                r["comm_s"] = r["average_s"]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(run_dir)
    plot = plot_step_split(run, tmp_path / "plots")
    for label in ("rank 0 (node1)", "rank 1 (node2)"):
        compute, comm, _, _ = plot.series[f"split {label}"]["y"]
        average = plot.series[f"split {label}"]["average_s"]
        assert compute == 0.08 and 0 < average == comm  # every wait was the average, none went to compute
