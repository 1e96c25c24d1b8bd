"""A user's own script without dscluster.userlog: what the run directory, plot, report and diagnose say
from entry_cn.sh's per-rank records (rankrecord) and DeepSpeed's csv_monitor files."""

from __future__ import annotations

import json

from _analysis_runs import make_plain_run

from dscluster.analysis import analyse, load_run
from dscluster.analysis.diagnose import diagnose
from dscluster.analysis.monitor import by_kind, series_kind
from dscluster.analysis.report import summary_table_rows
from dscluster.analysis.stats import rank_stats, summary_row


def test_a_program_that_exited_0_on_every_rank_is_complete_with_exit_0(tmp_path):
    run = load_run(make_plain_run(tmp_path))
    row = summary_row(run)
    assert row["status"] == "complete (exit 0)" and row["completed"]
    assert row["world_size"] == 2
    assert [s.status for s in rank_stats(run)] == ["complete (exit 0)", "complete (exit 0)"]
    d = diagnose(run)
    assert d["healthy"], d["findings"]
    assert [f["kind"] for f in d["findings"]] == ["no_step_records"]


def test_the_report_and_plots_show_the_monitors_loss_and_lr_not_did_not_complete(tmp_path):
    path = make_plain_run(tmp_path)
    out = analyse([path])[0]
    html = out.report.read_text()
    assert "did not complete" not in html and "complete (exit 0)" in html
    monitor = next(p for p in out.plots if p.name == "monitor")
    assert monitor.path.exists() and set(monitor.series) == {"Train_Samples_train_loss", "Train_Samples_lr"}
    assert monitor.series["Train_Samples_train_loss"]["x"][:2] == [32.0, 64.0]
    loss = next(p for p in out.plots if p.name == "loss")
    assert "no loss records" not in loss.notes and any("monitor.png" in n for n in loss.notes)


def test_a_failing_rank_is_named_with_its_code_and_the_stopped_ranks_are_consequences(tmp_path):
    run = load_run(make_plain_run(tmp_path, exit_codes={0: 143, 1: 3, 2: 143}))
    assert json.loads((run.path / "summary.json").read_text())["failed_rank"] == 1
    row = summary_row(run)
    assert row["status"] == "failed (exit 3) on rank 1"
    assert dict(summary_table_rows(row))["status"] == "failed (exit 3) on rank 1"
    findings = {(f["kind"], f["rank"]): f for f in diagnose(run)["findings"]}
    assert findings[("rank_failed", 1)]["severity"] == "error" and "exit 3" in findings[("rank_failed", 1)]["message"]
    stopped = findings[("rank_failed", 0)]
    assert stopped["severity"] == "warning" and "SIGTERM" in stopped["message"] and "after rank 1" in stopped["message"]


def test_rank_0_finishing_last_does_not_turn_a_failure_into_complete(tmp_path):
    run = load_run(make_plain_run(tmp_path, exit_codes={0: 0, 1: 2}))
    assert summary_row(run)["status"] == "failed (exit 2) on rank 1"


def test_monitor_tags_are_sorted_into_loss_lr_and_loss_scale():
    assert [series_kind(t) for t in ("Train_Samples_train_loss", "Train/Samples/lr", "Train_Samples_loss_scale",
                                     "Train_Samples_elapsed_time_ms_step")] == ["loss", "lr", "loss_scale", None]
    assert set(by_kind({"Train_Samples_lr": [(1.0, 0.1)]})) == {"lr"}


def test_a_torn_csv_row_is_skipped_and_foreign_csv_files_are_ignored(tmp_path):
    path = make_plain_run(tmp_path)
    with (path / "deepspeed" / "Train_Samples_train_loss.csv").open("a") as f:
        f.write("3")  # a row cut off mid-write
    (path / "notes.csv").write_text("a,b,c\n1,2,3\n")
    run = load_run(path)
    assert "notes" not in run.monitor and len(run.monitor["Train_Samples_train_loss"]) == 10


def test_a_rank_the_launcher_killed_before_its_record_is_a_consequence_not_a_cause(tmp_path):
    path = make_plain_run(tmp_path, exit_codes={0: 143, 1: 3})
    rec = json.loads((path / "process" / "rank-0.json").read_text())
    rec.update(exit_code=None, end_t=None, status="running")  # SIGKILL before entry_cn.sh wrote the end
    (path / "process" / "rank-0.json").write_text(json.dumps(rec))
    findings = diagnose(load_run(path))["findings"]
    assert [(f["kind"], f["rank"]) for f in findings if f["severity"] == "error"] == [("rank_failed", 1)]
    no_exit = next(f for f in findings if f["kind"] == "rank_no_exit")
    assert no_exit["rank"] == 0 and "after rank 1 failed" in no_exit["message"]
