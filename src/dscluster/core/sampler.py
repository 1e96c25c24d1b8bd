"""Which samples each rank takes at each step: one shared order, disjoint slices, equal step counts.

Every rank builds the same permutation from (seed, epoch). Optimizer step s of an epoch
consumes the block order[s*G : (s+1)*G] of G = sum(shares) × grad_accum samples; inside
it, micro-step k gives rank r the slice of `shares[r]` samples after the other ranks'.
The tail of an epoch that does not fill a whole global batch is dropped: a rank running
one step more than another would wait in the all-reduce forever, which is why a data set
size that does not divide by the world size must never hang.

Resume: `steps(epoch, start_step)` skips the first start_step steps of that epoch, so a
run restored from a mid-epoch checkpoint neither repeats nor loses a step.
"""

from __future__ import annotations

from typing import Iterator

import torch

from dscluster.core.balanced import BalancedBatchSampler
from dscluster.errors import UsageError


class StepSampler:
    """Uniform or balanced shares; yields, per optimizer step, this rank's index list per micro-step."""

    def __init__(self, dataset_len: int, shares: list[int], grad_accum: int, rank: int, seed: int,
                 *, shuffle: bool = True):
        if not shares or any(b < 1 for b in shares):
            raise UsageError(f"batch shares {shares} must be at least 1 per rank")
        if not 0 <= rank < len(shares):
            raise UsageError(f"rank {rank} outside 0..{len(shares) - 1}")
        self.dataset_len = dataset_len
        self.shares = list(shares)
        self.grad_accum = grad_accum
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.offset = sum(shares[:rank])
        self.micro_global = sum(shares)
        self.step_samples = self.micro_global * grad_accum
        if dataset_len < self.step_samples:
            raise UsageError(
                f"the training set has {dataset_len} samples, fewer than one global batch of {self.step_samples} "
                f"(shares {shares} × grad_accum {grad_accum}); lower micro_batch/global_batch or use more data"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.step_samples

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_len, generator=g)

    def steps(self, epoch: int, start_step: int = 0) -> Iterator[list[list[int]]]:
        order = self.order(epoch)
        for s in range(start_step, self.steps_per_epoch):
            base = s * self.step_samples
            micro = []
            for k in range(self.grad_accum):
                lo = base + k * self.micro_global + self.offset
                micro.append(order[lo:lo + self.shares[self.rank]].tolist())
            yield micro


class BalancedStepSampler(StepSampler):
    """Balanced shares through balanced.BalancedBatchSampler (one yield per micro-step)."""

    def steps(self, epoch: int, start_step: int = 0) -> Iterator[list[list[int]]]:
        inner = BalancedBatchSampler(self.dataset_len, self.shares, self.rank, seed=self.seed, epoch=epoch,
                                     shuffle=self.shuffle)
        micro: list[list[int]] = []
        step = 0
        for idx in inner:
            micro.append(list(idx))
            if len(micro) == self.grad_accum:
                if step >= start_step:
                    yield micro
                step += 1
                micro = []
                if step >= self.steps_per_epoch:
                    return
