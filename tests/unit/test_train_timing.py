"""Step times and images/s come from wall-clock windows closed after the device finished."""

import pytest

from dscluster.core.timing import WARMUP_STEPS, StepWindow, ends_warmup, is_timed, warmup_left_out


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def steps(n, samples=32):
    return [{"step": i, "samples": samples} for i in range(n)]


def test_each_step_of_a_window_gets_its_share_of_the_windows_wall_clock():
    clock = Clock()
    w = StepWindow(clock)
    recs = steps(4)
    clock.now += 2.0  # the host queued 4 steps in no time; the device took 2 s to finish them
    w.close(recs, timed=True)
    assert [r["step_time"] for r in recs] == [0.5] * 4
    assert [r["samples_per_s"] for r in recs] == [64.0] * 4
    assert w.images_per_s(global_batch=128) == pytest.approx(256.0)


def test_warm_up_is_left_out_and_everything_after_it_counts():
    clock = Clock()
    w = StepWindow(clock)
    clock.now += 30.0  # compilation in the warm-up window
    w.close(steps(WARMUP_STEPS), timed=False)
    clock.now += 1.0   # 10 steps...
    clock.now += 9.0   # ...and a checkpoint save before the window's read-back
    w.close(steps(10), timed=True)
    assert w.timed_steps == 10 and w.timed_s == pytest.approx(10.0)
    assert w.images_per_s(global_batch=64) == pytest.approx(64.0)  # images ÷ wall-clock since warm-up


def test_no_timed_window_means_no_figure_rather_than_a_guess():
    w = StepWindow(Clock())
    w.close(steps(3), timed=False)
    assert w.images_per_s(64) is None


def test_warm_up_ends_in_a_window_of_its_own_and_short_runs_are_timed_whole():
    assert not is_timed(WARMUP_STEPS, 100) and is_timed(WARMUP_STEPS + 1, 100)
    assert ends_warmup(WARMUP_STEPS, 100) and not ends_warmup(WARMUP_STEPS - 1, 100)
    assert is_timed(1, WARMUP_STEPS) and not ends_warmup(WARMUP_STEPS, WARMUP_STEPS)


def test_the_whole_run_figure_counts_warm_up_and_what_follows_the_last_step():
    clock = Clock()
    w = StepWindow(clock)
    clock.now += 30.0  # compilation in the warm-up window
    w.close(steps(WARMUP_STEPS), timed=False)
    clock.now += 10.0
    w.close(steps(10), timed=True)
    clock.now += 5.0  # the final evaluation, after the last step's window
    seconds, rate = w.whole_run(images=64 * (WARMUP_STEPS + 10))
    assert seconds == pytest.approx(45.0) and rate == pytest.approx(64 * 15 / 45.0)
    assert w.images_per_s(64) == pytest.approx(64.0)  # the steady figure, which leaves all that out


def test_the_warm_up_is_measured_from_the_first_step_to_the_end_of_its_window():
    clock = Clock()
    w = StepWindow(clock)
    assert w.warmup_s is None
    clock.now += 30.0  # compilation
    w.close(steps(WARMUP_STEPS), timed=False)
    clock.now += 2.0
    w.close(steps(10), timed=True)
    assert w.warmup_s == pytest.approx(30.0)  # timed windows leave it alone


def test_the_process_start_counts_the_interpreter_and_its_imports(tmp_path):
    import os
    import time

    from dscluster.core.timing import process_started

    # stat(5): the command name may hold spaces and parentheses; starttime is field 22, in clock ticks since boot
    tick = os.sysconf("SC_CLK_TCK")
    fields = ["S"] + ["0"] * 18 + [str(1000 * tick)] + ["0"] * 10
    (tmp_path / "stat").write_text(f"4242 (python (my run)) {' '.join(fields)}\n")
    (tmp_path / "uptime").write_text("1060.00 2000.00\n")
    started = process_started(str(tmp_path / "stat"), str(tmp_path / "uptime"))
    assert time.time() - started == pytest.approx(60.0, abs=1.0)  # booted 1,060 s ago, started at 1,000 s
    assert process_started(str(tmp_path / "none"), str(tmp_path / "uptime")) is None
    assert process_started() <= time.time()  # this test's own process, started before now


def test_the_end_line_names_its_figure_by_what_it_left_out():
    from dscluster.cli.train import throughput_words
    from dscluster.train.loop import Outcome

    long = throughput_words(Outcome("complete", images_per_s=4199.06, run_images_per_s=1287.4, steps_this_run=160))
    assert long == "4,199 images/s steady (after 5 warm-up steps), 1,287 over the whole run (first step to end)"
    # A 4-step run left no step out (is_timed): its figure must not claim a warm-up was left out
    short = throughput_words(Outcome("complete", images_per_s=64.2, run_images_per_s=60.1, steps_this_run=4))
    assert short.startswith("64 images/s over all 4 steps (too few to leave out 5 warm-up steps")
    assert "steady" not in short
    assert warmup_left_out(4) == warmup_left_out(WARMUP_STEPS) == 0 and warmup_left_out(160) == WARMUP_STEPS
