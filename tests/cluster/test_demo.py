"""`make demo` end to end on its own lab: every step runs, the lab is gone afterwards, and the
run directory (with plots) is where the demo says. One short epoch keeps it lean; the full
preset is what `make demo` itself runs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dscluster.sim import lab as sim

# Slow, and must stay so: the whole `make demo` journey on a 3-node lab it builds (one digits epoch here).
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LAB = "demotest"


def test_demo_runs_the_whole_journey_and_removes_its_lab(lab_factory, tmp_path):
    # lab_factory is requested for its root/tools skip only: the demo builds and removes its own lab.
    sim.down(LAB)  # one left by an interrupted run would be reused as it is
    runs = tmp_path / "runs"
    out = subprocess.run(
        [sys.executable, "-m", "dscluster.demo", "--lab", LAB, "--runs-dir", str(runs), "--", "epochs=1"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    text = out.stdout + out.stderr
    # a failing step's own output comes early (check's findings), the demo's table at the end: show both
    assert out.returncode == 0, text[:6000] + "\n[...]\n" + text[-4000:] if len(text) > 10000 else text
    order = ["== sim up", "== dscluster setup", "== dscluster check", "entry_cn.sh", "== sim down"]
    positions = [text.find(marker) for marker in order]
    assert all(p >= 0 for p in positions), list(zip(order, positions, strict=True))
    assert positions == sorted(positions)
    assert not re.search(r"^failed ", text, re.M)

    assert sim.load(LAB) is None
    assert not list(Path("/run/netns").glob(f"*{LAB}*")), "the demo left network namespaces behind"

    run_dirs = [p for p in runs.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1
    run = run_dirs[0]
    assert f"run directory: {run}" in text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["world_size"] == 3
    assert len(list((run / "telemetry").glob("*.jsonl"))) == 3
    if (REPO / "analysis" / "plot.py").exists():
        assert list((run / "plots").glob("*.png")), "analysis/plot.py made no pictures"
        assert f"pictures: {run / 'plots'}" in text
