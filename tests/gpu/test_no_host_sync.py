"""On a GPU: fetching a training batch and dscluster's step boundary never synchronise the host.

A blocking host→device copy from pageable memory waits for every queued kernel, so one per step
(the batch's indices) made the GPU idle while the next step was launched. torch's sync debug
mode turns any synchronising call into an error here. Skipped without CUDA (CI has none);
run on a GPU host with `python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from dscluster.core.data import SyntheticImageSet, TensorImageSet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_batches_reach_the_gpu_without_a_host_sync(no_sync):
    dev = torch.device("cuda")
    with torch.cuda.device(dev):
        torch.cuda.set_sync_debug_mode("default")  # building the data sets may copy eagerly
        synthetic = SyntheticImageSet(1000, 10, 32, dev, seed=0)
        g = torch.Generator().manual_seed(0)
        held = TensorImageSet("t", torch.randint(0, 255, (64, 3, 8, 8), dtype=torch.uint8, generator=g),
                              torch.randint(0, 10, (64,), generator=g), 10, 16, [0.5] * 3, [0.25] * 3)
        held.get_batch([0, 1], dev)  # mean/std go to the device once, here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for step in range(3):
            x, y = synthetic.get_batch(list(range(step, step + 32)), dev, channels_last=True)
            x2, y2 = held.get_batch(list(range(step, step + 16)), dev)
        assert x.is_cuda and y.is_cuda and x2.shape == (16, 3, 16, 16) and y2.is_cuda


def test_dscluster_clip_needs_no_host_sync(no_sync):
    torch.cuda.set_sync_debug_mode("default")
    model = torch.nn.Linear(64, 64).cuda()  # a pageable host→device copy: made before the watch
    x = torch.randn(8, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    model(x).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=True)
    assert norm.is_cuda
