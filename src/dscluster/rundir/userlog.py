"""Your own training script's metrics in a dscluster run directory, so `plot` and `diagnose` read it.

`open_run()` gives a rank's `UserRun`: `step()` per step, `end()` at the end (rank 0 writes
summary.json), or use it as a context manager. Under entry_cn.sh every rank writes into the job's
run directory (DSCLUSTER_RUN_DIR); outside it, runs/<id> by the rule of docs/run-directory.md.
`python -m dscluster.userlog --exports` prints the rank exports entry_cn.sh gives a user's program.
Usage and how to keep the timing honest: docs/byo-script.md."""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from pathlib import Path

from dscluster.errors import DsclusterError
from dscluster.files.fsutil import atomic_write_json
from dscluster.node import ranks
from dscluster.rundir import layout
from dscluster.rundir.writer import RunLog, effective_env, software_versions, summary_record

RUN_DIR_ENV = "DSCLUSTER_RUN_DIR"
LAUNCHER_ENV = "DSCLUSTER_LAUNCHER"
"""Which launcher variables placed the rank (node/ranks.py's names: openmpi, slurm, ...), kept by
entry_cn.sh before it exports RANK etc., which would otherwise make every rank look torch-launched."""


def run_dir(env: dict[str, str] | None = None) -> Path:
    """DSCLUSTER_RUN_DIR (entry_cn.sh sets it, absolute), else runs/<id> by layout.py's rule."""
    env = os.environ if env is None else env
    return Path(env[RUN_DIR_ENV]) if env.get(RUN_DIR_ENV) else layout.run_dir(env)


class UserRun:
    """One rank's writer; make it with `open_run()`. Usable as a context manager: an exception
    inside the `with` block ends the run as failed, with the error."""

    def __init__(self, path: Path, info: ranks.RankInfo, clock=time.time):
        self.path = path
        self.info = info
        self._clock = clock
        self._log = RunLog(path, info.rank, socket.gethostname())
        self._t0 = self._last = clock()
        self.steps = 0
        self.last_step: int | None = None
        self.ended = False

    @property
    def rank(self) -> int:
        return self.info.rank

    def step(self, step: int, loss: float, samples: int, *, epoch: int = 0, lr: float | None = None,
             loss_scale: float | None = None, overflow: bool = False, grad_norm: float | None = None,
             **extra) -> dict:
        """One optimizer step: `step` (1-based, global), this rank's `loss` and `samples`.

        `float(loss)` on a tensor reads it back, which waits for the device; a number you pass
        must already be one (see the module docstring)."""
        loss = float(loss)
        now = self._clock()
        step_time = max(now - self._last, 1e-9)
        self._last = now
        self.steps += 1
        self.last_step = int(step)
        return self._log.record(
            "step", step=int(step), epoch=epoch, loss=loss, lr=lr, loss_scale=loss_scale, overflow=bool(overflow),
            step_time=step_time, samples=int(samples), samples_per_s=samples / step_time, grad_norm=grad_norm,
            **extra)

    def eval(self, accuracy: float | None, *, loss: float | None = None, samples: int | None = None,
             epoch: int = 0, step: int | None = None) -> dict:
        """A held-out evaluation (accuracy 0-1): `plot` draws it beside the loss."""
        return self._log.record("eval", epoch=epoch, step=self.last_step if step is None else step,
                                accuracy=accuracy, loss=loss, samples=samples)

    def end(self, status: str = "complete", error: str | None = None) -> None:
        """The end record; rank 0 (or a failing rank, if rank 0 has not) writes summary.json."""
        if self.ended:
            return
        self.ended = True
        try:
            self._log.record("end", status=status, error=error, peak_mem_mb=_peak_mem_mb())
            primary = self.info.rank == 0
            if primary or status == "failed":
                # images_per_s stays out: rank 0 knows only its own samples; analysis sums the ranks'.
                summary = summary_record(
                    status=status, run_id=self.path.name, world_size=self.info.world_size, steps=self.last_step,
                    wall_s=round(self._clock() - self._t0, 3), error=error,
                    failed_rank=None if status == "complete" else self.info.rank,
                    failed_host=None if status == "complete" else self._log.host)
                self._log.write_summary(summary, only_if_absent_or_not_failed=not primary)
        finally:
            self._log.close()

    def __enter__(self) -> "UserRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.end()
        else:
            self.end("failed", f"{exc_type.__name__}: {exc}")


def open_run(*, device: str | None = None, precision: str | None = None, micro_batch: int | None = None,
             global_batch: int | None = None, params: int | None = None, env: dict[str, str] | None = None,
             **extra) -> UserRun:
    """Open this rank's metrics file and write the start record (and env/rank-R.json).

    Every argument is optional and only describes the run in the report; the rank and world
    size come from the launcher's environment."""
    env = os.environ if env is None else env
    info = ranks.detect_ranks(env)
    run = UserRun(run_dir(env), info)
    snap = effective_env(env)  # the environment that placed this rank, as train writes it
    snap.update({"host": run._log.host, "pid": os.getpid(), "versions": software_versions()})
    atomic_write_json(run.path / layout.ENV_DIR / f"rank-{info.rank}.json", snap)
    run._log.record("start", world_size=info.world_size, local_rank=info.local_rank, device=device,
                    precision=precision, micro_batch=micro_batch, grad_accum=1, global_batch=global_batch,
                    pid=os.getpid(), params=params, launcher=env.get(LAUNCHER_ENV) or info.source,
                    resumed_from_step=0, **extra)
    return run


def _peak_mem_mb() -> float | None:
    torch = sys.modules.get("torch")  # only if the script uses it: never import torch for a log line
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    except Exception:  # a broken CUDA context must not lose the end record
        pass
    return None


def program_exports(env: dict[str, str] | None = None) -> dict[str, str]:
    """What a user's program needs besides entry_cn.sh's node env: its place in the job by
    node/ranks.py's rule (a launcher's own RANK/MASTER_* win) and the run directory, absolute,
    so a script that changes directory still writes into the job's run."""
    env = dict(os.environ if env is None else env)
    info = ranks.detect_ranks(env)
    before = dict(env)
    ranks.export_env(info, layout.resolve_run_id(env), env,
                    warn=lambda m: print(f"entry_cn: warning: {m}", file=sys.stderr))
    if info.local_world_size and not env.get("LOCAL_WORLD_SIZE"):
        env["LOCAL_WORLD_SIZE"] = str(info.local_world_size)
    out = {k: v for k, v in env.items() if before.get(k) != v}
    if "RANK" in out:
        out[LAUNCHER_ENV] = info.source
    out[RUN_DIR_ENV] = os.path.abspath(run_dir(env))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--exports"]:
        print("usage: python -m dscluster.userlog --exports   (the exports entry_cn.sh gives a user's program)",
              file=sys.stderr)
        return 2
    try:
        exports = program_exports()
    except DsclusterError as e:  # a launcher variable that is not a number: name it, exit 2
        print(f"entry_cn: {e}", file=sys.stderr)
        return e.exit_code
    for key, value in sorted(exports.items()):
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
