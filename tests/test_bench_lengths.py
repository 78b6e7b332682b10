"""bench.decode.lengths's two pieces of arithmetic: a sequence's teacher-forced log-probability, and why a
short output beat its reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.model import ModelConfig, Transformer
from aiayn.search import length_penalty
from aiayn.tokens import BOS_ID, EOS_ID
from bench.decode import lengths


def test_sequence_log_probs_sum_each_tokens_log_probability_including_eos_whatever_the_batching():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=30, n_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0)).eval()
    sources = [[5, 6, 7, EOS_ID], [8, EOS_ID], [9, 10, 11, 12, 13, EOS_ID]]
    outputs = [[14, 15], [16, 17, 18, 19], []]
    expected = []
    for src, out in zip(sources, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([src]), torch.tensor([[BOS_ID] + out]))
        log_probs = F.log_softmax(logits[0], dim=-1)
        expected.append(sum(log_probs[i, token].item() for i, token in enumerate(out + [EOS_ID])))
    for batch_size in (1, 2, 64):
        assert lengths.sequence_log_probs(model, sources, outputs, batch_size) == pytest.approx(expected, abs=1e-5)


def test_a_short_output_is_a_search_error_when_the_reference_has_the_better_objective():
    assert lengths.classify(-5.0, 10, -4.0, 12, 0.6)[0] == "search"  # the reference is likelier outright
    assert lengths.classify(-5.0, 10, -5.2, 12, 0.6)[0] == "search"  # likelier only after the penalty
    assert lengths.classify(-5.0, 12, -4.0, 12, 0.6) is None  # not shorter
    assert lengths.classify(-5.0, 14, -9.0, 12, 0.6) is None


def test_otherwise_the_model_is_blamed_with_the_alpha_that_would_tie_the_two():
    cause, alpha = lengths.classify(-5.0, 10, -8.0, 12, 0.6)
    assert cause == "model" and alpha > 0.6
    assert -8.0 / length_penalty(13, alpha) == pytest.approx(-5.0 / length_penalty(11, alpha))
    assert lengths.classify(0.0, 3, -1.0, 5, 0.6) == ("model", math.inf)  # a certain output: no alpha helps
