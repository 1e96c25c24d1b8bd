"""Loss-scale guard on a recorded overflow sequence, calibration, step-count guard, faults, checkpoint pointer."""

import json
import math
from pathlib import Path

import pytest

from dscluster.core.config import load_config
from dscluster.core.faults import FaultHook, parse_fault
from dscluster.core.guards import LossScaleGuard, TrainingAborted, check_equal_steps
from dscluster.core.losscale import recommend_initial_scale_power, replay_dynamic_scaler, write_initial_scale_power
from dscluster.errors import JobFailed, UsageError
from dscluster.node.ranks import RankInfo
from dscluster.rundir.checkpoints import find_latest, resume_decision
from dscluster.train.checkpoint import Checkpointer, Position, commit_latest, zero_shards

# Recorded by tests/unit/record_loss_scale.py: 60 healthy steps, then lr=5 makes the model diverge.
RECORDED = json.loads((Path(__file__).parent / "data" / "fp16_scale_sequence.json").read_text())["points"]


def guard(**kw):
    args = dict(window=20, max_overflow_rate=0.5, min_scale=1.0, min_scale_steps=10, rank=1, host="node2")
    args.update(kw)
    return LossScaleGuard(**args)


def test_guard_stops_the_recorded_divergence_with_a_clear_message():
    g = guard()
    with pytest.raises(TrainingAborted) as e:
        for p in RECORDED:
            g.observe(p["step"], p["scale"], p["overflow"])
    msg = str(e.value)
    stopped_at = int(msg.split(" at step ")[1].split(":")[0])
    assert 60 < stopped_at < len(RECORDED), "must not fire in the healthy phase, must fire in the divergence"
    assert "rank 1 (node2)" in msg and "overflowed" in msg
    assert "Recent scales" in msg and "!" in msg
    for hint in ("precision=bf16", "lower optim.lr", "precision=fp32", "--calibrate-loss-scale"):
        assert hint in msg
    assert e.value.failed_ranks == [1] and e.value.failed_hosts == ["node2"]


def test_guard_stops_when_the_scale_sits_at_its_minimum():
    g = guard(max_overflow_rate=1.0, min_scale_steps=5)
    with pytest.raises(TrainingAborted, match="sat at its minimum 1 for 5 steps") as e:
        for p in RECORDED:
            g.observe(p["step"], p["scale"], p["overflow"])
    first_at_min = next(p["step"] for p in RECORDED if p["scale"] <= 1.0)
    assert f"at step {first_at_min + 4}:" in str(e.value)


def test_guard_is_quiet_on_a_healthy_run_and_without_fp16():
    g = guard()
    for p in RECORDED[:60]:
        g.observe(p["step"], p["scale"], p["overflow"])
    g.observe(61, None, False)  # bf16/fp32: no scale, nothing to judge


def test_recorded_sequence_is_what_deepspeeds_scaler_does():
    scales = replay_dynamic_scaler([p["overflow"] for p in RECORDED], init_power=16, window=20, hysteresis=2)
    assert scales == [p["scale"] for p in RECORDED]


def test_calibration_recommends_the_scale_that_stopped_overflowing():
    # the field case: from 2^16 the first steps overflow (hysteresis 2), then training is stable
    flags = [True] * 7 + [False] * 30
    scales = replay_dynamic_scaler(flags, init_power=16, window=1000, hysteresis=2)
    power = recommend_initial_scale_power(list(zip(scales, flags, strict=True)))
    assert power == int(math.log2(scales[7])) == 10
    # a later overflow at a lower scale lowers the recommendation
    assert recommend_initial_scale_power([(1024.0, True), (512.0, False), (512.0, True), (256.0, False)]) == 8
    with pytest.raises(JobFailed, match="all 3 steps overflowed"):
        recommend_initial_scale_power([(4.0, True), (2.0, True), (1.0, True)])


def test_write_initial_scale_power_keeps_comments(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("# preset\nepochs: 2\nfp16:\n  initial_scale_power: 16  # was the default\n  hysteresis: 2\n")
    write_initial_scale_power(p, 11)
    text = p.read_text()
    assert "initial_scale_power: 11  # was the default" in text and text.startswith("# preset")
    assert load_config(p).fp16.initial_scale_power == 11
    p.write_text("fp16:\n    hysteresis: 3\nepochs: 2\n")
    write_initial_scale_power(p, 9)
    cfg = load_config(p)
    assert cfg.fp16.initial_scale_power == 9 and cfg.fp16.hysteresis == 3 and cfg.epochs == 2
    p.write_text("epochs: 2")
    write_initial_scale_power(p, 12)
    assert load_config(p).fp16.initial_scale_power == 12


def test_equal_steps_guard_names_ranks_hosts_and_counts():
    check_equal_steps([22, 22, 22], ["a", "b", "c"], 0)
    with pytest.raises(TrainingAborted) as e:
        check_equal_steps([22, 23, 22], ["node1", "node2", "node3"], 4)
    msg = str(e.value)
    assert "epoch 4" in msg and "rank 1 on node2: 23" in msg and "rank(s) 1 differ" in msg
    assert e.value.failed_ranks == [1] and e.value.failed_hosts == ["node2"]
    with pytest.raises(TrainingAborted) as e:
        check_equal_steps([22, 23], ["node1", "node2"], 0)
    assert e.value.failed_ranks == [1]


def test_fault_injection_parsing():
    assert parse_fault(None) is None
    f = parse_fault("exit:rank=1,step=5")
    assert (f.kind, f.rank, f.step) == ("exit", 1, 5)
    assert parse_fault("mismatch_steps:rank=0").step is None
    for bad in ("explode:rank=1", "exit:rank=1", "exit:step=3", "skip_collective:rank=x,step=1"):
        with pytest.raises(UsageError, match="DSCLUSTER_FAULT"):
            parse_fault(bad)


def test_the_fault_hook_does_nothing_unless_a_fault_names_this_rank():
    env = {"DSCLUSTER_FAULT": "disk_full:rank=0,step=20;mismatch_steps:rank=0;slow_comm:rank=1,ms=200"}
    for quiet in (FaultHook(0, {}), FaultHook(2, env)):
        assert not quiet and not quiet.fails_save(20) and quiet.extra_steps_per_epoch() == 0
        assert quiet.comm_delay_s() == 0.0
        quiet.before_step(20, log=None, timeout_s=1.0)  # nothing to inject: returns at once
    rank0, rank1 = FaultHook(0, env), FaultHook(1, env)
    assert rank0 and [s for s in (19, 20, 21) if rank0.fails_save(s)] == [20]
    assert rank0.extra_steps_per_epoch() == 1 and rank1.extra_steps_per_epoch() == 0
    assert rank1.comm_delay_s() == 0.2 and not rank1.fails_save(20)


def checkpointer(run_dir, *overrides: str, calibrate: bool = False, steps_per_epoch: int = 7) -> Checkpointer:
    ckpt = Checkpointer(load_config(None, list(overrides)), run_dir, RankInfo(0, 0, 1, 1, "single"), hosts=["node1"],
                        device=None, primary=True, calibrate=calibrate, faults=FaultHook(0, {}))
    sampler = type("Sampler", (), {"steps_per_epoch": steps_per_epoch})()
    ckpt.attach(type("Built", (), {"engine": None, "comm": None, "sampler": sampler})(), boundary=None)
    return ckpt


def saves_of_a_run(run_dir, *overrides: str, epochs: int = 2, calibrate: bool = False) -> list[tuple[int, int, int]]:
    """Where the Checkpointer saves over a run of 7 steps an epoch, driven as train/loop.py drives it."""
    ckpt = checkpointer(run_dir, *overrides, calibrate=calibrate)
    saved = []
    ckpt.save = lambda pos: saved.append((pos.epoch, pos.step_in_epoch, pos.global_step))
    step = 0
    for epoch in range(epochs):
        for s in range(7):
            step += 1
            ckpt.maybe_save(Position(epoch, s + 1, step))
        ckpt.maybe_save(Position(epoch, 7, step), epoch_end=True, last=epoch + 1 == epochs)
    return saved


def test_the_checkpointer_saves_where_the_rules_say(tmp_path):
    assert checkpointer(tmp_path).dir == tmp_path / "checkpoints"
    assert checkpointer(tmp_path, f"checkpoint.dir={tmp_path / 'elsewhere'}").dir == tmp_path / "elsewhere"
    # every epoch (the default), and mid-epoch every 5 steps but never on an epoch's last step
    assert saves_of_a_run(tmp_path, "checkpoint.every_steps=5") == [(0, 5, 5), (0, 7, 7), (1, 3, 10), (1, 7, 14)]
    # every 3rd epoch: the run's last epoch still saves
    assert saves_of_a_run(tmp_path, "checkpoint.every_epochs=3", epochs=4) == [(2, 7, 21), (3, 7, 28)]
    assert saves_of_a_run(tmp_path, "checkpoint.every_epochs=0") == []
    assert saves_of_a_run(tmp_path, "checkpoint.every_steps=5", calibrate=True) == []  # calibration never saves
    assert checkpointer(tmp_path, "checkpoint.resume=true", calibrate=True).resume() == Position(0, 0, 0)


def test_resume_decision_and_latest_pointer(tmp_path):
    assert resume_decision("auto", tmp_path) is None
    with pytest.raises(UsageError, match="checkpoint.resume=true but .* has no complete checkpoint"):
        resume_decision("true", tmp_path)
    commit_latest(tmp_path, "epoch0001-step00000044")
    assert find_latest(tmp_path) is None  # dangling: the folder is not there
    (tmp_path / "epoch0001-step00000044").mkdir()
    assert resume_decision("true", tmp_path) == "epoch0001-step00000044"
    assert resume_decision("false", tmp_path) is None
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")], "temp file left behind"


def zero3_tag(ckpt: Checkpointer, *ranks: int) -> Path:
    """A checkpoint holding these ranks' ZeRO-3 files, named as DeepSpeed names them (cluster/test_zero_local.py
    lists a real run's), with `latest` naming it."""
    tag = ckpt.dir / "epoch0001-step00000008"
    tag.mkdir(parents=True)
    for r in ranks:
        (tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").touch()
        (tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
    commit_latest(ckpt.dir, tag.name)
    return tag


def test_a_rank_with_no_zero_shard_of_its_own_refuses_with_what_to_run(tmp_path):
    assert zero_shards(tmp_path / "nowhere") == set()
    (tmp_path / "mp_rank_00_model_states.pt").touch()  # ZeRO stage 0: one file, any rank count loads it
    assert zero_shards(tmp_path) == set()
    # a 2-rank ZeRO-3 run's node2 (rank 1's shards), resumed there alone: this one rank (rank 0) has nothing of
    # its own, where DeepSpeed would only find nothing to load
    ckpt = checkpointer(tmp_path / "run")
    assert zero_shards(zero3_tag(ckpt, 1)) == {1}
    with pytest.raises(UsageError, match="step00000008 holds ZeRO state partitioned over 2 ranks and this job has 1"
                       ) as refused:
        ckpt.resume()  # before DeepSpeed is asked (this checkpointer has no engine)
    assert "mpirun -np 2" in str(refused.value) and "train afresh with another DSCLUSTER_RUN_ID" in str(refused.value)
    # a checkpoint folder of the user's own: a new run id would not leave it, so the advice is another folder
    own = checkpointer(tmp_path / "run", f"checkpoint.dir={ckpt.dir}")
    with pytest.raises(UsageError, match="train afresh with checkpoint.dir pointing at another folder"):
        own.resume()


def test_deepspeeds_own_refusal_of_another_rank_count_becomes_the_same_advice(tmp_path):
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    class Engine:  # DeepSpeed 0.19's words (runtime/engine.py, _load_zero_checkpoint)
        def load_checkpoint(self, *_a, **_k):
            raise ZeRORuntimeException("The checkpoint being loaded used a DP world size of 2 but the current world "
                                       "size is 1. Automatic adjustment of ZeRO's optimizer state partitioning with "
                                       "a new world size is not currently supported.")

    ckpt = checkpointer(tmp_path)
    zero3_tag(ckpt, 0, 1)  # rank 0 has its shard: DeepSpeed decides, from the rank count it recorded
    ckpt.engine = Engine()
    with pytest.raises(UsageError, match="partitioned over 2 ranks and this job has 1: DeepSpeed cannot load it"):
        ckpt.resume()
    ckpt.engine.load_checkpoint = lambda *_a, **_k: (_ for _ in ()).throw(ZeRORuntimeException("another problem"))
    with pytest.raises(ZeRORuntimeException, match="another problem"):  # anything else is DeepSpeed's to say
        ckpt.resume()


# Recorded from a real DeepSpeed fp16 run on an H100 (see the file's "source").
H100 = json.loads((Path(__file__).parent / "data" / "fp16_calibration_h100.json").read_text())["points"]


def test_real_fp16_calibration_run_matches_deepspeed_and_gives_a_recommendation():
    flags = [p["overflow"] for p in H100]
    assert sum(flags) == 3
    assert replay_dynamic_scaler(flags, init_power=16, window=500, hysteresis=2) == [p["scale"] for p in H100]
    assert recommend_initial_scale_power([(p["scale"], p["overflow"]) for p in H100]) == 14
    g = guard(window=20, max_overflow_rate=0.5)
    for p in H100:  # a few overflows while the scale settles must not stop a run
        g.observe(p["step"], p["scale"], p["overflow"])
