"""Gradient communication on the ZeRO-0 DDP path: compression hooks, the hand-off mark, PowerSGD state.

On several ranks with ZeRO-0 and overlap_comm, torch DDP reduces the gradients inside the DeepSpeed
engine (setup_engine.OverlapDDP); its communication hook is where `comm.compression` acts, with torch's
own hooks (none, fp16, bf16, powersgd). Every hook goes through one wrapper that first marks the moment
the bucket is handed to communication (split.StepSplit), `none` too, so the step's split is measured
the same way for every option. PowerSGD's error feedback is per rank: a checkpoint keeps each rank's
state, and the first synchronised step of every process is a plain all-reduce, because DDP lays its
buckets out anew in each process. Which options run where: config_checks.compression_conflict;
the options and their measurements: docs/training-config.md, "Communication options".
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from dscluster.files.fsutil import atomic_write_bytes

POWERSGD_DIR = "powersgd"
"""Per-rank PowerSGD state files inside a checkpoint tag: powersgd/rank-R.pt."""
MIN_COMPRESSION_RATE = 2
"""torch's default: a matrix is compressed only when that at least halves its numbers."""


def powersgd_start(cfg) -> int:
    """comm.powersgd_start_step resolved: 'auto' is after the learning-rate warm-up (torch's advice:
    no earlier than warm-up), and never before step 2 (DDP rebuilds its buckets after step 1)."""
    v = cfg.comm.powersgd_start_step
    return max(2, int(cfg.optim.warmup_steps)) if v == "auto" else int(v)


class CommHook:
    """The hook DDP calls for each gradient bucket; `hook` is the function DDP is given (DDP reads
    its signature and name, so an instance cannot be registered)."""

    def __init__(self, compression: str, split=None, delay_s: float = 0.0, *, powersgd_rank: int = 4,
                 powersgd_start_step: int = 2, seed: int = 0, bucket_mb: int = 0):
        self.compression = compression
        self.bucket_mb = bucket_mb  # the bucket layout PowerSGD's per-bucket state was made for
        self.split = split
        self.delay_s = delay_s
        self.settled = False  # the first synchronised backward of this process is over
        self.state = None
        self.seed = seed
        self._fresh_q: dict[int, torch.Tensor] = {}  # per bucket: Q's restart after an overflow
        if compression == "powersgd":
            self.state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start_step,
                min_compression_rate=MIN_COMPRESSION_RATE, use_error_feedback=True, warm_start=True,
                random_seed=seed,
                # One orthogonalisation per shape, not per matrix: ViT's blocks repeat four shapes,
                # so a bucket's ~20 QR factorisations (each its own cuSOLVER calls) become ~4.
                batch_tensors_with_same_shape=True)
        send = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook, "powersgd": self._powersgd}[compression]

        def dscluster_comm_hook(state, bucket):
            if self.split is not None:
                self.split.bucket_handed()
            if self.delay_s and bucket.is_last():
                time.sleep(self.delay_s)  # test-only slow link (faults.py): after the mark, before sending
            return send(None, bucket)

        self.hook = dscluster_comm_hook

    def _powersgd(self, _group, bucket):
        if not self.settled:
            # DDP's initial bucket layout, replaced after this backward: keyed state would not fit it.
            if bucket.is_last():
                self.settled = True
            self.state.maybe_increase_iter(bucket)  # as powerSGD_hook does for its plain all-reduce steps
            return default_hooks.allreduce_hook(None, bucket)
        self._drop_non_finite(bucket.index())
        return psgd.powerSGD_hook(self.state, bucket)

    def _drop_non_finite(self, index: int) -> None:
        """Clear what an overflowed step left in this bucket's state, on the device, without a sync.

        An fp16 step whose gradients overflow reaches the hook with inf in them: the error feedback
        and the warm-start factors Q it leaves are inf/NaN. The loss scaler skips that step, but
        torch's hook would add the NaN error to every later step's gradients, so every later step
        overflows too (seen on 4 GPUs: 26 of 50 steps, the scale halved down to 0.0005, the run
        stopped). Here a non-finite error is dropped (that step was skipped anyway) and a
        non-finite Q restarts from a fixed random one, the same on every rank (Q is all-reduced).
        One pass over the error per step, done for every precision so the cost is always counted.
        """
        err = self.state.error_dict.get(index)
        if err is not None:
            torch.nan_to_num_(err, nan=0.0, posinf=0.0, neginf=0.0)
        q = self.state.q_memory_dict.get(index)
        if q is not None:
            if index not in self._fresh_q:
                g = torch.Generator(device=q.device).manual_seed(self.seed * 1000003 + index)
                self._fresh_q[index] = torch.randn(q.shape, generator=g, device=q.device, dtype=q.dtype)
            q.copy_(torch.where(torch.isfinite(q), q, self._fresh_q[index]))

    # --- PowerSGD state in checkpoints -------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def _quiet():
        """PowerSGDState warns on every pickle and unpickle that its process group is left out: we know."""
        level = psgd.logger.level
        psgd.logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            psgd.logger.setLevel(level)

    def save(self, tag_dir: Path, rank: int, world_size: int) -> None:
        """This rank's PowerSGD state into TAG/powersgd/rank-R.pt, atomically (nothing without PowerSGD)."""
        if self.state is None:
            return
        buf = io.BytesIO()
        with self._quiet():
            torch.save({"world_size": world_size, "rank": rank, "bucket_mb": self.bucket_mb, "state": self.state}, buf)
        atomic_write_bytes(Path(tag_dir) / POWERSGD_DIR / f"rank-{rank}.pt", buf.getvalue())

    def read(self, tag_dir: Path, rank: int, world_size: int, device) -> tuple[object | None, str | None]:
        """(the saved state to use, None) or (None, why this rank starts fresh)."""
        path = Path(tag_dir) / POWERSGD_DIR / f"rank-{rank}.pt"
        if not path.is_file():
            return None, "the checkpoint holds no PowerSGD state (saved with another comm.compression)"
        try:
            with self._quiet():
                saved = torch.load(path, map_location=device, weights_only=False)
        except Exception as e:  # a truncated or foreign file: training can go on, without the old error
            return None, f"its PowerSGD state could not be read ({type(e).__name__}: {e})"
        if saved.get("world_size") != world_size:
            return None, (f"the checkpoint was saved by {saved.get('world_size')} ranks, this run has {world_size}: "
                          "error feedback is per rank")
        if saved.get("bucket_mb") != self.bucket_mb:
            return None, (f"ddp_bucket_mb changed ({saved.get('bucket_mb')} -> {self.bucket_mb}): the state is "
                          "kept per gradient bucket")
        state = saved["state"]
        if state.matrix_approximation_rank != self.state.matrix_approximation_rank:
            return None, (f"comm.powersgd_rank changed ({state.matrix_approximation_rank} -> "
                          f"{self.state.matrix_approximation_rank})")
        return state, None

    def restore(self, tag_dir: Path, rank: int, world_size: int, device, agree) -> str | None:
        """Collective: every rank reads its file; the saved states are used only if every rank has
        one that fits (`agree` gathers a string from each rank). Returns the note for the run."""
        if self.state is None:
            return None
        state, why = self.read(tag_dir, rank, world_size, device)
        verdicts = agree("" if why is None else why)
        reasons = [v for v in verdicts if v]
        if reasons:
            return f"PowerSGD error feedback starts fresh: {reasons[0]}"
        state.process_group = None  # the default group of this run (unpickling set the same)
        state.start_powerSGD_iter = self.state.start_powerSGD_iter  # the config of this run decides
        self.state = state
        return f"PowerSGD error feedback restored (step {state.iter}, {len(state.error_dict)} bucket(s) per rank)"


def install(ddp: torch.nn.parallel.DistributedDataParallel, cfg, split, delay_s: float = 0.0) -> CommHook:
    """Register the one communication hook of this run's DDP wrapper."""
    hook = CommHook(cfg.comm.compression, split, delay_s, powersgd_rank=cfg.comm.powersgd_rank,
                    powersgd_start_step=powersgd_start(cfg), seed=cfg.seed, bucket_mb=cfg.ddp_bucket_mb)
    ddp.register_comm_hook(None, hook.hook)
    return hook
