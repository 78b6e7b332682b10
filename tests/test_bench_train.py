"""bench/train_cpu.py's timing schedule: which steps run, and which are timed."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO

from aiayn.model import ModelConfig

sys.path.insert(0, str(REPO / "bench"))
import train_cpu  # noqa: E402

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
