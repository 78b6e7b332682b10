"""bench.train.cpu's timing schedule: which steps run, and which are timed."""

from __future__ import annotations

import pytest
import torch

from aiayn.model import ModelConfig
from bench.train import cpu as train_cpu

CONFIG = ModelConfig(vocab_size=50, n_layers=1, d_model=8, d_ff=16, n_heads=2)


def recording_build(seen: list[int]):
    """A build whose step records the batch it trained on (each batch's first source token tells it apart)."""
    def build(config, device):
        model = torch.nn.Linear(1, 1)

        def step(src, tgt_in, tgt_out):
            seen.append(int(src[0, 0]))
            return model(torch.ones(1, 1)).sum()

        return model, step
    return build


@pytest.mark.parametrize("warm_pass, expected", [
    (False, [0, 1, 2, 3, 4]),
    (True, [0, 1, 2, 3, 4, 2, 3, 4]),  # the timed batches once untimed, then timed
])
def test_the_warm_pass_trains_once_on_every_timed_batch_before_timing_any(monkeypatch, warm_pass, expected):
    batches = [(torch.full((2, 3), index), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
               for index in range(5)]
    seen: list[int] = []
    clock = iter(range(100))
    monkeypatch.setattr(train_cpu, "seconds_of", lambda work, device: (float(next(clock) + 1), work()))
    result = train_cpu.measure(recording_build(seen), CONFIG, batches, "cpu", "fp32", 2, warm_pass=warm_pass)
    assert seen == expected
    # only the last three calls were timed: with a clock that says 1, 2, 3, ... seconds, the median
    # of the timed steps is the second of them
    assert result["step_seconds"] == float(len(expected) - 1)


def test_the_floor_is_timed_after_each_timed_step_and_each_step_is_divided_by_its_own(monkeypatch):
    batches = [(torch.full((2, 3 + index), index), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
               for index in range(4)]
    seen: list = []
    steps = iter([9.0, 9.0, 10.0, 30.0])  # seconds of the steps; the last two are timed
    monkeypatch.setattr(train_cpu, "seconds_of", lambda work, device: (next(steps), work()))
    floors = iter([8.0, 20.0])  # a machine that slowed down between the two timed steps
    step_flops = {int(src.numel()): 3 * train_cpu.forward_flops(CONFIG, src.size(0), src.size(1), tgt_in.size(1))
                  for src, tgt_in, _ in batches}

    def rate(config, tokens, device, precision, repeats):  # FLOP/s that make the floor of this step next(floors)
        seen.append(("floor", tokens))
        return step_flops[tokens] / next(floors)

    monkeypatch.setattr(train_cpu, "matmul_rate", rate)
    result = train_cpu.measure(recording_build(seen), CONFIG, batches, "cpu", "fp32", 2, floor=True)
    assert seen == [0, 1, 2, ("floor", 2 * 5), 3, ("floor", 2 * 6)]  # each timed step's own source tokens
    assert result["floor_seconds"] == pytest.approx(14.0)  # the median of 8 and 20
    assert result["step_over_floor"] == pytest.approx((10 / 8 + 30 / 20) / 2)  # not 20 / 14
