"""Held-out evaluation of a compiled model: it runs eagerly, so it compiles nothing (the first held-out
pass of a compiled run on an H100 spent about 15 s compiling an eval-mode graph) and gives what the
eager model gives."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from dscluster.core.evaluation import evaluate


class Held:
    """A held-out set as ImageSet.get_batch serves it."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def get_batch(self, idx, device, dtype, channels_last=False):
        return self.x[idx].to(device, dtype), self.y[idx].to(device)


class Engine:
    def __init__(self, module):
        self.module = module


def test_a_compiled_model_is_evaluated_eagerly_and_alike():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))
    reference = evaluate(Engine(model), Held(70), torch.float32, torch.device("cpu"), False, batch=32)
    torch._dynamo.reset()
    counters.clear()
    model.compile(backend="eager")  # in place, as DeepSpeed's engine.compile() does
    model.train()
    model(torch.randn(4, 8)).sum().backward()  # a training step's forward: the one graph training needs
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1, "the training forward did not go through torch.compile"
    got = evaluate(Engine(model), Held(70), torch.float32, torch.device("cpu"), False, batch=32)  # 32, 32, 6
    assert counters["stats"]["unique_graphs"] == graphs, "evaluation compiled graphs of its own"
    assert got == reference and model.training  # eval mode (no dropout) while evaluating, training after


def test_evaluation_runs_under_trainings_autocast_where_training_autocasts():
    # an amp run's forward autocasts to half; its evaluation does too (Built.autocast), where it ran in fp32
    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    plain = evaluate(Engine(model), Held(70), torch.float32, torch.device("cpu"), False, batch=32)
    half = evaluate(Engine(model), Held(70), torch.float32, torch.device("cpu"), False, batch=32,
                    autocast=torch.bfloat16)  # the half dtype CPU autocast has
    assert seen == [torch.float32] * 3 + [torch.bfloat16] * 3
    assert half[2] == plain[2] == 70 and abs(half[0] - plain[0]) <= 0.05  # the same samples, nearly the same answer
