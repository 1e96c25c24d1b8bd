"""plan's advice (plan/advice.py, plan/evidence.py, plan/weigh.py): a setting is advised only where its whole
run beats the fastest node alone's on the same epochs, and only where what it learns is kept or shown by
recorded curves; a faster setting without them is listed apart with the command that measures it (issue 55)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dscluster.cli import main
from dscluster.core.config import load_config
from dscluster.plan import advice, evidence, model, recommend
from dscluster.runmodel import accuracy

REPO = Path(__file__).resolve().parents[2]
VIT_B = str(REPO / "configs/vit_base.yaml")
SYNTHETIC = ["data.dataset=synthetic", "data.synthetic_samples=50000"]


def keep_up(state: Path, config: str, words: list[str], compression: str, batches=(512,), base: int = 512,
            train_n: int = 50000, behind: float = 0.005) -> None:
    """Held-out curves as runs would leave them: every-step training at the config's `base` batch, and
    `compression` at each of `batches` (their pasted lines scale the learning rate from `base`), `behind` points
    below it at every epoch: the evidence plan needs before it advises that setting."""
    env = {"DSCLUSTER_STATE": str(state)}
    cfg = load_config(config, words)
    points = [(train_n // base * e, 0.5 + 0.04 * e) for e in range(1, cfg.epochs + 1)]
    accuracy.record_curve(cfg, base, points, compression="none", ranks=1, run_id="every-step", env=env)
    for gb in batches:
        scaled = cfg if gb == base else load_config(config, [*words, f"optim.lr_reference_batch={base}"])
        points = [(train_n // gb * e, 0.5 + 0.04 * e - behind) for e in range(1, cfg.epochs + 1)]
        accuracy.record_curve(scaled, gb, points, compression=compression, ranks=2, run_id=f"{compression}-{gb}",
                              env=env)


def option(accum: int, compression: str, step_s: float, efficiency: float, global_batch: int = 64) -> recommend.Option:
    p = model.Prediction(compute_s=step_s, hook_s=0.0, comm_s=0.0, hidden_s=0.0, exposed_s=0.0, step_s=step_s,
                         model_step_s=step_s, calibration_s=0.0, images_per_s=global_batch / step_s,
                         global_batch=global_batch, node_images_per_s={"node1": 1.0, "node2": 1.0},
                         fastest_node="node1", speedup=efficiency * 2, efficiency=efficiency, slower=False, verdict="")
    return recommend.Option(grad_accum=accum, compression=compression, prediction=p)


def judged(o: recommend.Option, seconds: float, kind: str = evidence.UNTESTED, steps: int = 440) -> advice.Judged:
    return advice.Judged(option=o, run={"total_steps": steps}, seconds=seconds, evidence=evidence.Evidence(
        kind, "" if kind == evidence.KEPT else "something", "why"))


def test_a_setting_is_advised_by_its_whole_run_against_the_node_alone_not_by_its_step():
    # issue 55's case: the step said 1.7x node2 alone, the whole run (18.1 s) was slower than node2's (16 s)
    now = judged(option(1, "none", 0.38, 0.03), 167.0, evidence.KEPT)
    fast_step = judged(option(4, "local_sgd:64", 0.08, 0.87, 256), 18.1, evidence.TESTED, steps=100)
    a = advice.advise(now, [fast_step], alone_node="node2", alone_s=16.2, several_nodes=True, target_efficiency=0.8,
                      judged_by="whole run")
    assert a.train_alone and a.choice is None
    text = advice.summary(a)
    assert text.startswith("train on node2 alone:") and "1.7" not in text and "(0.10×, later)" in text
    # where its whole run beats the node alone, it is the advice, and the headline ratio is the whole run's
    a = advice.advise(now, [fast_step], alone_node="node2", alone_s=24.0, several_nodes=True, target_efficiency=0.8,
                      judged_by="whole run")
    assert a.choice is fast_step and a.ratio == pytest.approx(24.0 / 18.1)
    assert "whole run 18.1 s, 1.33× sooner than node2 alone (24.0 s)" in advice.summary(a)


def test_a_faster_setting_without_evidence_is_listed_apart_never_advised():
    now = judged(option(1, "none", 0.38, 0.03), 167.0, evidence.KEPT)
    same_batch = judged(option(1, "local_sgd:8", 0.03, 0.5), 11.0)
    larger = judged(option(8, "fp16", 0.1, 0.9, 512), 9.0)
    short = judged(option(16, "fp16", 0.1, 0.95, 1024), 5.0, steps=20)  # over before the 30-step warm-up
    a = advice.advise(now, [same_batch, larger, short], alone_node="node1", alone_s=12.0, several_nodes=True,
                      target_efficiency=0.8, judged_by="whole run", warmup_steps=30)
    assert a.train_alone
    # the smallest change first (the config's global batch), then the soonest; never a run inside the warm-up
    assert [j.option.compression for j in a.untested] == ["local_sgd:8", "fp16"]
    line = advice.untested_line(larger, a)
    assert line.startswith("faster, accuracy untested: grad_accum 8 (global batch 512) with fp16 gradient compression:")
    assert "whole run 9.0 s, 1.33× sooner than node1 alone" in line
    # shown to learn as the config does: advised, and the untested ones are those sooner still
    a = advice.advise(now, [judged(same_batch.option, 11.0, evidence.TESTED), larger], alone_node="node1",
                      alone_s=16.0, several_nodes=True, target_efficiency=0.8, judged_by="whole run")
    assert a.choice.option.compression == "local_sgd:8" and [j.option.compression for j in a.untested] == ["fp16"]


def test_curves_are_held_against_every_step_training_at_equal_epochs():
    # global batch 256 takes 5 steps an epoch of digits' 1,438 images, 64 takes 22: epoch 20 ends at 100 and 440
    base = [{"points": [[22, 0.3], [440, 0.947]], "compression": "none"}]
    larger = [{"points": [[5, 0.2], [100, 0.836]], "compression": "local_sgd:64"}]
    curves = {64: base, 256: larger}
    kw = dict(own_label="none", own_batch=64, lr_scaled=True, curves_at=curves.__getitem__,
              steps_per_epoch=lambda gb: 1438 // gb, family_says=lambda label: None)
    found = evidence.judge("local_sgd:64", 256, **kw)
    assert found.kind == evidence.TRAILS and "83.6% against 94.7% after epoch 20" in found.why
    assert found.changes == ("global batch 64 → 256 with the learning rate scaled to it, the models averaged every "
                             "64 steps")
    curves[256] = [{"points": [[100, 0.941]], "compression": "local_sgd:64"}]
    assert evidence.judge("local_sgd:64", 256, **kw).kind == evidence.TESTED  # 0.6 point below: within 1
    assert evidence.judge("local_sgd:64", 128, **{**kw, "curves_at": lambda gb: base}).kind == evidence.UNTESTED
    assert evidence.judge("none", 64, **kw).kind == evidence.KEPT
    # a label that trails at the config's batch trails at any batch: a larger one only adds a change
    curves[64] = base + [{"points": [[440, 0.90]], "compression": "fp16"}]
    assert evidence.judge("fp16", 512, **{**kw, "curves_at": lambda gb: curves.get(gb, [])}).kind == evidence.TRAILS


def test_a_tested_setting_is_pasted_and_saved_under_the_key_train_looks_up(tmp_path, monkeypatch, capsys):
    from dscluster.cli.train import check_batch_arithmetic
    from dscluster.runmodel import predicted

    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    (tmp_path / "hosts.txt").write_text("node1 slots=1\nnode2 slots=1\nnode3 slots=2\n")
    words = [*SYNTHETIC, "precision=bf16"]
    argv = ["plan", "--config", VIT_B, "--hostfile", str(tmp_path / "hosts.txt"), "--busbw", "1.19", "--compute-s",
            "0.0427", "--powersgd-s", "0.02", *words, "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)["recommendation"]
    # at 10 Gbit PowerSGD finishes sooner than node3 alone, but nothing says it learns as well: listed apart
    assert first["train_alone"] and first["overrides"] == []
    untested = {(u["grad_accum"], u["compression"]) for u in first["untested"]}
    assert (1, "powersgd") in untested
    u = next(u for u in first["untested"] if (u["grad_accum"], u["compression"]) == (1, "powersgd"))
    assert u["command"].startswith(f"mpirun -np 4 --hostfile {tmp_path / 'hosts.txt'} ./entry_cn.sh --config {VIT_B}")
    assert u["command"].endswith("comm.compression=powersgd comm.powersgd_start_step=30")
    # its run's curve kept up with every-step training: the next plan advises it
    keep_up(tmp_path / "state", VIT_B, words, "powersgd")
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rec = doc["recommendation"]
    assert (rec["choice"]["grad_accum"], rec["choice"]["compression"]) == (1, "powersgd") and not rec["train_alone"]
    assert rec["ratio"] == pytest.approx(rec["alone_s"] / rec["choice_s"]) and rec["ratio"] > 1
    assert f"whole run {advice.clock(rec['choice_s'])}, {rec['ratio']:.2f}× sooner than node3 alone" in rec["summary"]
    assert "within 1 point of every-step training at global batch 512 at equal epochs" in rec["summary"]
    pasted = rec["overrides"]
    cfg = load_config(VIT_B, [*words, *pasted], world=True)  # the overrides load as they are
    check_batch_arithmetic(cfg, doc["world_size"])
    key = predicted.key(model=cfg.model.name, micro_batch=128, global_batch=cfg.global_batch, precision="bf16",
                        compression=cfg.comm.compression, ranks=4)
    entry = predicted.lookup(key)
    assert entry["setting"] == "choice" and entry["overrides"] == pasted
    assert entry["images_per_s"] == pytest.approx(rec["choice"]["prediction"]["images_per_s"])
    now = predicted.lookup(key.replace("compression=powersgd", "compression=none"))
    assert now["setting"] == "now"


def test_piped_the_table_keeps_every_figure_whole(tmp_path, monkeypatch, capsys):
    # rich takes a pipe for 80 columns and cut cells to '…' ("bat…", "compu…", "3,4…"); plan widens them instead
    monkeypatch.setenv("DSCLUSTER_STATE", str(tmp_path / "state"))
    monkeypatch.delenv("COLUMNS", raising=False)
    (tmp_path / "hosts.txt").write_text("node1 slots=1\nnode2 slots=1\nnode3 slots=2\n")
    assert main(["plan", "--config", VIT_B, "--hostfile", str(tmp_path / "hosts.txt"), "--busbw", "1.19",
                 "--compute-s", "0.0427", "--powersgd-s", "0.02", *SYNTHETIC, "precision=bf16"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("setting"))
    assert header.split() == ["setting", "batch", "compute", "comm", "hidden", "step", "img/s", "speed-up", "eff",
                              "whole", "run"] and len(header) > 80
    row = next(line for line in out.splitlines() if line.lstrip().startswith("untested: accum 1+powersgd"))
    assert row.split()[3:9] == ["512", "0.043", "0.004", "0.003", "0.064", "7,994"]
    assert "faster, accuracy untested: grad_accum 1 (global batch 512) with powersgd" in out
