"""bench/zero_memory.py on a CPU: the README commands it would run (--dry-run), and its comparison with stage 0."""

from __future__ import annotations

import shlex

from dscluster.bench import zero_memory
from dscluster.core.config import load_config
from dscluster.files import paths


def test_dry_run_prints_the_readme_command_for_every_stage_and_gpu_count_and_writes_nothing(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.chdir(tmp_path)
    assert zero_memory.main(["--dry-run", "--gpus", "1,2"]) == 0
    assert list(tmp_path.iterdir()) == []
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 10
    seen = []
    for argv in commands:
        env = dict(a.split("=", 1) for a in argv[:2])
        mpirun = argv[2:]
        n = int(mpirun[mpirun.index("-np") + 1])
        assert mpirun[mpirun.index("--hostfile") + 1].endswith(f"hosts{n}.txt")
        entry = mpirun.index(str(paths.entry_script()))
        train = mpirun[entry + 1:]
        assert train[:4] == ["--config", "configs/vit_base.yaml", "precision=fp16", train[3]]
        assert f"global_batch={32 * n}" in train and "max_steps=30" in train and "compile=false" in train
        cfg = load_config(paths.preset("vit_base.yaml"), train[2:])  # a command train itself accepts
        assert cfg.data.dataset == "synthetic" and cfg.checkpoint.every_epochs == 0  # no evaluation, no saves
        assert env["DSCLUSTER_RUN_ID"].endswith(f"-{n}gpu")
        seen.append((n, cfg.zero_stage, cfg.offload_optimizer))
    assert seen == [
        (1, 0, "none"), (1, 1, "none"), (1, 2, "none"), (1, 3, "none"), (1, 3, "cpu"),
        (2, 0, "none"), (2, 1, "none"), (2, 2, "none"), (2, 3, "none"), (2, 3, "cpu")]


def test_every_run_is_compared_with_stage_0_on_as_many_gpus_and_the_table_shows_it():
    runs = [{"name": "zero0", "gpus": 1, "zero_stage": 0, "offload": "none", "peak_mem_mb": 8000.0,
             "images_per_s": 400.0, "peak_host_mb": 3000.0},
            {"name": "zero3-offload", "gpus": 1, "zero_stage": 3, "offload": "cpu", "peak_mem_mb": 6000.0,
             "images_per_s": 300.0, "peak_host_mb": 5000.0},
            {"name": "zero3", "gpus": 2, "zero_stage": 3, "offload": "none", "peak_mem_mb": 5000.0,
             "images_per_s": 700.0},
            {"name": "zero1", "gpus": 1, "zero_stage": 1, "offload": "none", "status": "timeout",
             "peak_mem_mb": None, "images_per_s": None}]
    zero_memory.against_baseline(runs)
    assert (runs[1]["saved_mb"], runs[1]["saved_percent"], runs[1]["images_per_s_vs_zero0"]) == (2000.0, 25.0, 0.75)
    assert runs[0]["saved_percent"] == 0.0
    assert runs[2]["saved_mb"] is None  # no stage-0 run on 2 GPUs in this call: no baseline from elsewhere
    assert runs[3]["saved_mb"] is None
    lines = zero_memory.table({"runs": runs}).splitlines()
    assert lines[0] == "| GPUs | zero0 | zero1 | zero2 | zero3 | zero3-offload |"
    assert lines[2] == ("| 1 | 8,000 MiB, 400 img/s | timeout | - | - | 6,000 MiB (-25 %), 300 img/s |")
    assert lines[3] == "| 2 | - | - | - | 5,000 MiB, 700 img/s | - |"


def test_more_gpus_than_the_host_has_is_refused(capsys):
    assert zero_memory.main(["--gpus", "1,64", "--timeout", "5"]) == 2
    assert "--gpus 1,64: this host has" in capsys.readouterr().err
