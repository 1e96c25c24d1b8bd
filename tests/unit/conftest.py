"""Fixtures shared by the unit tests of `dscluster plan`."""

from __future__ import annotations

import json

import pytest

_MEASURED: dict = {}


@pytest.fixture(autouse=True)
def steady_save_rate(monkeypatch):
    """plan times a real checkpoint write (plan/saveprobe.py), whose rate differs from one plan to the next:
    unit tests that set two plans' whole-run figures side by side get a fixed 1 GB/s, said as measured.
    A test sets another rate with `steady_save_rate(gbps)`; test_plan_phases.py times the real one (it keeps
    the function from before this fixture)."""
    from dscluster.plan import saveprobe

    def at(gbps: float) -> None:
        monkeypatch.setattr(saveprobe, "measure", lambda folder, nbytes: saveprobe.SaveRate(
            gbps=gbps, probe_bytes=saveprobe.probe_bytes(nbytes), folder=str(saveprobe.nearest_existing(folder))))

    at(1.0)
    return at


@pytest.fixture
def probes_once(monkeypatch):
    """plan's data probe (a real fill of a sample by loader workers, 0.3-2 s a call) and its count of the
    model's gradients (a timm build on the meta device, 0.2 s for ViT-B), each made for real once per data
    set and model in this process, then reused: for tests of what plan decides, not of the probes."""
    from dscluster.plan import datafeed, inputs

    probe, count = datafeed.data_facts, inputs.gradient_shapes

    def once(key, work):
        if key not in _MEASURED:
            _MEASURED[key] = work()
        return _MEASURED[key]

    monkeypatch.setattr(datafeed, "data_facts", lambda cfg, ranks: once(("data", repr(cfg.data), ranks),
                                                                        lambda: probe(cfg, ranks)))
    monkeypatch.setattr(inputs, "gradient_shapes", lambda cfg, chans, classes: once(
        ("model", repr(cfg.model), cfg.data.img_size, chans, classes), lambda: count(cfg, chans, classes)))


@pytest.fixture
def plan_json(capsys, probes_once):
    """`dscluster plan ARGS --json` in this process (its `main`, as the console script calls it): the
    parsed document. A non-zero exit fails the test with plan's stderr."""
    from dscluster.cli import main

    def run(*argv: str) -> dict:
        rc = main(["plan", *argv, "--json"])
        out = capsys.readouterr()
        assert rc == 0, out.err[-3000:]
        return json.loads(out.out)

    return run
