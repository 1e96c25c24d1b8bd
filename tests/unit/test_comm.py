"""Gradient communication on the DDP path: what each comm.compression option sends, the step split it
marks, PowerSGD's per-rank state across a checkpoint, and where the config refuses an option.

The DDP cases run 2 real gloo processes on this machine (a few seconds): the hooks are torch's, and
what matters is that through dscluster's wrapper they still average the gradients of both ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist
from test_bad_input import ISOLATE, snapshot

from _spawn import spawn_ranks
from dscluster.core.comm import CommHook
from dscluster.core.config import ConfigValueError, load_config
from dscluster.core.config_checks import compression_conflict
from dscluster.core.split import StepSplit
from dscluster.errors import UsageError

# --- the step split ------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_split_parts_add_up_to_the_window_and_the_rest_is_other():
    clock = Clock()
    split = StepSplit(torch.device("cpu"), "measured", clock=clock)
    marks = []
    for data, compute, comm, after in ((0.01, 0.20, 0.50, 0.05), (0.02, 0.30, 0.10, 0.04)):
        split.start()
        with split.data():
            clock.now += data
        clock.now += compute          # forward + backward until the last bucket is handed over
        split.bucket_handed()
        clock.now += comm             # waiting for the reductions
        split.reductions_done()
        clock.now += after            # the optimizer step
        marks.append(split.end())
    window_s = 1.5                    # the steps' spans are 0.76 + 0.46; the rest was an evaluation
    records = [{}, {}]
    split.resolve(marks, records, window_s)
    assert records[0]["data_s"] == pytest.approx(0.01) and records[0]["comm_s"] == pytest.approx(0.50)
    assert records[0]["compute_s"] == pytest.approx(0.25)  # forward/backward and the optimizer step
    assert records[1]["comm_s"] == pytest.approx(0.10) and records[1]["compute_s"] == pytest.approx(0.34)
    assert records[0]["other_s"] == pytest.approx((1.5 - 0.76 - 0.46) / 2)
    total = sum(r["data_s"] + r["compute_s"] + r["comm_s"] + r["other_s"] for r in records)
    assert total == pytest.approx(window_s)


def test_one_rank_waits_for_nobody_and_unhooked_ranks_are_not_guessed():
    clock = Clock()
    for mode, expect in (("none", 0.0), ("unmeasured", None)):
        split = StepSplit(torch.device("cpu"), mode, clock=clock)
        split.start()
        clock.now += 0.3
        m = split.end()
        rec: dict = {}
        split.resolve([m], [rec], 0.3)
        assert rec["comm_s"] == expect and rec["compute_s"] == pytest.approx(0.3) and rec["other_s"] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is above)")
def test_split_marks_on_a_gpu_are_events_read_after_the_window_without_a_host_sync():
    dev = torch.device("cuda")
    model = torch.nn.Linear(512, 512).to(dev)
    x = torch.randn(256, 512, device=dev)
    split = StepSplit(dev, "measured")
    torch.cuda.synchronize()
    for _window in range(2):  # the second window reuses the first one's events
        marks = []
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call inside the steps fails here
        try:
            for _ in range(3):
                split.start()
                with split.data():
                    xb = x * 1.0
                model(xb).square().mean().backward()
                split.bucket_handed()
                split.bucket_handed()  # the last hand-off counts
                torch.cuda._sleep(2_000_000)  # the device busy after the hand-off, as with a reduction
                split.reductions_done()
                marks.append(split.end())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # the log window's read-back
        records = [{} for _ in marks]
        split.resolve(marks, records, window_s=10.0)
        assert all(r["comm_s"] > 0 and r["compute_s"] > 0 and r["other_s"] > 0 for r in records), records


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is above)")
def test_on_a_gpu_data_is_only_the_time_the_device_waited_for_the_batch():
    import time

    dev = torch.device("cuda")
    split = StepSplit(dev, "none")
    torch.cuda._sleep(1_000)
    torch.cuda.synchronize()
    cycles = 100_000_000  # some 50 ms of device work, whatever the clock

    def step(device_busy_first: bool) -> dict:
        torch.cuda.synchronize()
        split.start()
        if device_busy_first:
            torch.cuda._sleep(cycles)  # the device works on the last micro-batch ...
        with split.data():
            time.sleep(0.03)  # ... while the host gets the next one: 30 ms of host time
        torch.cuda._sleep(cycles)
        m = split.end()
        torch.cuda.synchronize()
        rec: dict = {}
        split.resolve([m], [rec], window_s=10.0)
        return rec

    overlapped, starved = step(True), step(False)
    # the host's 30 ms ran under the device's work: no wait for data, all of it compute
    assert overlapped["data_s"] < 0.01 and overlapped["compute_s"] > 0.08, overlapped
    # nothing to do on the device meanwhile: it waited the 30 ms
    assert 0.025 < starved["data_s"] < 0.1 and starved["compute_s"] > 0.03, starved


# --- the hooks on 2 gloo ranks ---------------------------------------------------------------------

def _ddp_worker(rank: int, world: int, port: int, tmp: str, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        # gloo itself reduces half floats on CPU (the fp16/bf16 hooks rely on it)
        for dt in (torch.float16, torch.bfloat16):
            t = torch.full((8,), float(rank + 1), dtype=dt)
            tdist.all_reduce(t)
            results[f"allreduce {dt}"] = t.float().tolist()
        torch.manual_seed(0)
        template = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
        for comp in ("none", "fp16", "bf16", "powersgd"):
            model = torch.nn.Sequential(*[torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)])
            model.load_state_dict(template.state_dict())
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
            split = StepSplit(torch.device("cpu"), "measured")
            hook = CommHook(comp, split, powersgd_rank=2, powersgd_start_step=2)
            ddp.register_comm_hook(None, hook.hook)
            grads = []
            for _ in range(4):
                split.start()
                ddp.zero_grad()
                ddp(x).square().mean().backward()
                split.reductions_done()
                m = split.end()
                grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]).clone())
            results[comp] = {"grads": [g.tolist() for g in grads], "handed": m.handed is not None,
                             "comm_s": m.reduced - m.handed}
            if comp == "powersgd":
                hook.save(tmp, rank, world)
                results["psgd_iter"] = hook.state.iter
                results["psgd_buckets"] = sorted(hook.state.error_dict)
                again = CommHook("powersgd", None, powersgd_rank=2, powersgd_start_step=2)
                results["restored"] = again.restore(tmp, rank, world, "cpu", lambda v: _gather(v, world))
                results["restored_iter"] = again.state.iter
                results["restored_error_equal"] = all(torch.equal(again.state.error_dict[k], hook.state.error_dict[k])
                                                     for k in hook.state.error_dict)
                other = CommHook("powersgd", None, powersgd_rank=2, powersgd_start_step=2)
                results["other_world"] = other.restore(tmp, rank, world + 1, "cpu", lambda v: _gather(v, world))
                results["other_world_iter"] = other.state.iter
        # an overflowed step (an fp16 gradient that reached inf) in the middle of PowerSGD
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)])
        model.load_state_dict(template.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        hook = CommHook("powersgd", None, powersgd_rank=2, powersgd_start_step=2)
        ddp.register_comm_hook(None, hook.hook)
        finite = []
        for step in range(7):
            ddp.zero_grad()
            loss = ddp(x).square().mean()
            (loss * float("inf") if step == 3 else loss).backward()
            finite.append(all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()))
        results["overflow_finite"] = finite
        results["overflow_grads"] = torch.cat([p.grad.flatten() for p in ddp.parameters()]).tolist()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()


def _gather(value: str, world: int) -> list[str]:
    got = [None] * world
    tdist.all_gather_object(got, value)
    return got


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("psgd"))
    return spawn_ranks(_ddp_worker, 2, tmp), tmp


def test_gloo_reduces_fp16_and_bf16_on_cpu(two_ranks):
    results, _ = two_ranks
    for dt in ("torch.float16", "torch.bfloat16"):
        assert results[0][f"allreduce {dt}"] == [3.0] * 8 == results[1][f"allreduce {dt}"]


def test_every_option_averages_the_ranks_gradients_and_marks_the_hand_off(two_ranks):
    results, _ = two_ranks
    ref = torch.tensor(results[0]["none"]["grads"][0])
    for comp, tol in (("none", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2)):
        for rank in (0, 1):
            got = torch.tensor(results[rank][comp]["grads"][0])
            # both ranks hold the same, averaged gradient, close to the fp32 average
            assert torch.allclose(got, ref, atol=tol * ref.abs().max().item()), comp
            assert results[rank][comp]["handed"] and results[rank][comp]["comm_s"] >= 0
            assert (comp == "none") == torch.equal(got, ref), f"{comp}: the wire format shows in the result"
    # PowerSGD: the first steps are plain all-reduces, then low-rank approximations (not equal to the
    # exact average, yet identical on both ranks)
    p0, p1 = (torch.tensor(results[r]["powersgd"]["grads"]) for r in (0, 1))
    assert torch.allclose(p0[0], ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(p0[3], p1[3]) and not torch.allclose(p0[3], torch.tensor(results[0]["none"]["grads"][3]))


def test_powersgd_recovers_from_an_overflowed_step_instead_of_overflowing_ever_after(two_ranks):
    # an fp16 step whose gradients overflow is skipped by the loss scaler; the steps after it must
    # be finite again (the error feedback of the overflowed step would otherwise poison them all)
    results, _ = two_ranks
    for rank in (0, 1):
        assert results[rank]["overflow_finite"] == [True, True, True, False, True, True, True]
    assert results[0]["overflow_grads"] == results[1]["overflow_grads"]  # the ranks still agree


def test_powersgd_state_survives_a_checkpoint_per_rank_and_starts_fresh_on_another_rank_count(two_ranks):
    results, tmp = two_ranks
    for rank in (0, 1):
        r = results[rank]
        assert os.path.isfile(os.path.join(tmp, "powersgd", f"rank-{rank}.pt"))
        assert r["psgd_iter"] == 4 and r["psgd_buckets"]
        assert r["restored"].startswith("PowerSGD error feedback restored (step 4")
        assert r["restored_iter"] == 4 and r["restored_error_equal"]
        assert r["other_world"] == ("PowerSGD error feedback starts fresh: the checkpoint was saved by 2 ranks, this "
                                    "run has 3: error feedback is per rank")
        assert r["other_world_iter"] == 0


# --- where the config refuses an option ------------------------------------------------------------

@pytest.mark.parametrize("overrides, key_and_reason", [
    (["comm.compression=fp16", "zero_stage=2"], "comm.compression=fp16 needs zero_stage=0"),
    (["comm.compression=powersgd", "overlap_comm=false"], "comm.compression=powersgd needs overlap_comm=true"),
    (["comm.compression=fp16", "precision=fp16", "amp=false"], "comm.compression=fp16 has no effect"),
    (["comm.compression=bf16", "precision=fp16", "amp=false"], "comm.compression=bf16 sends no fewer bytes"),
    (["optim.name=zerooneadam"], "optim.name=zerooneadam: DeepSpeed's 0/1 Adam cannot run"),
    (["deepspeed.optimizer.type=OneBitAdam"], "deepspeed.optimizer.type=OneBitAdam: DeepSpeed's 1-bit Adam"),
])
def test_options_that_cannot_apply_are_refused_with_key_reason_and_fix(overrides, key_and_reason):
    with pytest.raises(ConfigValueError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert msg.startswith(f"override {overrides[0]!r}: {key_and_reason}"), msg
    assert "set " in msg or "use " in msg  # the fix


def test_compression_that_applies_loads():
    # amp (the default) reduces fp32 gradients: fp16 compression halves them, even at precision fp16
    assert load_config(None, ["comm.compression=fp16", "precision=fp16"]).comm.compression == "fp16"
    cfg = load_config(None, ["comm.compression=powersgd", "precision=fp16", "amp=false"])
    compression_conflict(cfg, "fp16")  # PowerSGD sends low-rank factors in any format


def test_auto_precision_is_judged_with_the_precision_decided_here():
    cfg = load_config(None, ["comm.compression=bf16", "amp=false"])  # precision auto: not known at load
    with pytest.raises(ConfigValueError, match="comm.compression=bf16 has no effect"):
        compression_conflict(cfg, "bf16")
    compression_conflict(cfg, "fp32")


def test_cli_refuses_before_writing_anything(tmp_path):
    (tmp_path / "home").mkdir()
    before = snapshot(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ISOLATE}
    env.update(HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "dscluster", "train", "comm.compression=powersgd", "zero_stage=1"],
                       cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    out = p.stderr + p.stdout
    assert p.returncode == 2 and "comm.compression=powersgd needs zero_stage=0" in out and "Traceback" not in out
    assert snapshot(tmp_path) == before and not (tmp_path / "runs").exists()


def test_unknown_compression_is_a_usage_error():
    with pytest.raises(UsageError, match="comm.compression must be one of none, fp16, bf16, powersgd"):
        load_config(None, ["comm.compression=int8"])
