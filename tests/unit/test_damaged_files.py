"""Files dscluster wrote and reads back, damaged: each is validated against its model and reported by
file and field, never taken for missing and never a traceback (summary.json, plans.json)."""

import json
import shutil
from pathlib import Path

import pytest

from dscluster.cli import main
from dscluster.runmodel import predicted
from dscluster.runmodel.predicted import PlansFileError

RECORDED = Path(__file__).resolve().parents[1] / "data" / "runs" / "cpu-2node"


@pytest.fixture
def run_dir(tmp_path):
    dest = tmp_path / "runs" / "cpu-2node"
    shutil.copytree(RECORDED, dest)
    return dest


@pytest.mark.parametrize("text, why", [
    ('{"status": "complete", "world_size": 2', "JSONDecodeError"),
    (json.dumps({"status": "complete", "world_size": "2"}), "field world_size is \"2\", expected a whole number"),
    ("[1, 2]", "a JSON list, not an object"),
], ids=["torn", "world-size-string", "not-an-object"])
def test_plot_and_diagnose_say_summary_is_unreadable_not_missing(run_dir, text, why, tmp_path, capsys):
    (run_dir / "summary.json").write_text(text)

    assert main(["plot", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "summary.json is unreadable (" in out and why in out, out
    assert "did NOT complete" not in out and "no summary.json" not in out

    assert main(["diagnose", str(run_dir), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    [finding] = [f for f in doc["findings"] if f["kind"] == "summary_unreadable"]
    assert "summary.json is unreadable" in finding["message"] and why in finding["message"]
    assert not any("no summary.json" in f["message"] for f in doc["findings"])


def test_a_damaged_plans_json_is_refused_by_file_and_field_and_left_as_it_was(tmp_path):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    bad = json.dumps({"schema": 1, "plans": {"k": {"images_per_s": "fast"}}, "outcomes": []})
    (tmp_path / "plans.json").write_text(bad)
    for call in (lambda: predicted.lookup("k", env), lambda: predicted.save({"k2": {"images_per_s": 1.0}}, env),
                 lambda: predicted.calibration(model="m", precision="fp32", ranks=2, env=env)):
        with pytest.raises(PlansFileError, match=r"plans.json: damaged: field plans.k.images_per_s is \"fast\""
                                                 r", expected a number; delete .* re-run `dscluster plan`"):
            call()
    assert (tmp_path / "plans.json").read_text() == bad  # never replaced silently


def test_a_good_plans_json_round_trips(tmp_path):
    env = {"DSCLUSTER_STATE": str(tmp_path)}
    predicted.save({"k": {"images_per_s": 10.0, "step_s": 0.5, "overrides": ["a=1"]}}, env)
    assert predicted.lookup("k", env)["images_per_s"] == 10.0


@pytest.mark.parametrize("client, field", [
    ({"position": {"epoch": "1", "step_in_epoch": 0, "global_step": 3}}, "position.epoch is \"1\""),
    ({"position": {"epoch": 1, "global_step": 3}}, "position.step_in_epoch is missing"),
    ({"position": [1, 2, 3]}, "position is [1, 2, 3], expected a mapping"),
], ids=["epoch-string", "step-missing", "not-a-mapping"])
def test_damaged_checkpoint_metadata_names_the_checkpoint_and_field(client, field):
    from dscluster.errors import UsageError
    from dscluster.train import checkpoint

    with pytest.raises(UsageError, match="ckpt/epoch0001: damaged checkpoint metadata: field ") as e:
        checkpoint.position_of(client, "ckpt/epoch0001")
    assert field in str(e.value) and "checkpoint.resume=false" in str(e.value)
    assert checkpoint.position_of({"position": {"epoch": 1, "step_in_epoch": 0, "global_step": 3}}, "x") == \
        checkpoint.Position(1, 0, 3)
