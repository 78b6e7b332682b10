"""The CPU trainer's dropout: the paper's dropout (Section 5.4) with a mask cheaper to draw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aiayn.speed.dropout import MaskDropout, cpu_dropout
from aiayn.model import ModelConfig, Transformer


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_it_drops_at_p_and_scales_the_rest_so_the_mean_is_kept(p):
    torch.manual_seed(0)
    dropout = MaskDropout(p).train()
    x = torch.full((999, 2001), 2.0)  # not a multiple of 4: the last 64-bit draw is partly used
    out = dropout(x)
    dropped = (out == 0).double().mean().item()
    n = x.numel()
    assert abs(dropped - dropout.rounded_p) < 5 * (p * (1 - p) / n) ** 0.5
    assert abs(dropout.rounded_p - p) <= 0.5 / 65536
    kept = out[out != 0]
    assert torch.all(kept == 2.0 / (1 - dropout.rounded_p))
    assert abs(out.double().mean().item() - 2.0) < 5 * 2.0 * (p / (1 - p) / n) ** 0.5


def test_backward_uses_the_forward_mask_and_scale():
    torch.manual_seed(1)
    x = torch.randn(64, 33, dtype=torch.bfloat16, requires_grad=True)
    out = MaskDropout(0.1).train()(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    scale = 1 / (1 - MaskDropout(0.1).rounded_p)
    expected = torch.where(out != 0, grad * scale, torch.zeros_like(grad))
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, expected)


def test_masks_differ_between_calls_and_repeat_under_the_same_seed():
    x = torch.ones(200, 300)
    dropout = MaskDropout(0.1).train()
    torch.manual_seed(3)
    first, second = dropout(x), dropout(x)
    torch.manual_seed(3)
    assert not torch.equal(first, second)
    assert torch.equal(dropout(x), first)


def test_evaluation_and_p_0_change_nothing():
    x = torch.randn(10, 10)
    assert MaskDropout(0.1).eval()(x) is x
    assert MaskDropout(0.0).train()(x) is x


def test_draws_are_uniform_over_all_16_bit_values():
    from aiayn.speed.dropout import _draws

    torch.manual_seed(0)
    draws = _draws(torch.Size([1 << 22]), torch.device("cpu")).long()
    counts = torch.bincount(draws + (1 << 15), minlength=1 << 16).double()
    # each of the 65536 values about 64 times: all four quarters of the 64-bit draws cover the whole range
    quarters = [draws[offset::4] for offset in range(4)]
    for quarter in quarters:
        assert quarter.min() < -32000 and quarter.max() > 32000
        assert abs(quarter.double().mean().item()) < 5 * 18918 / quarter.numel() ** 0.5  # sd of uniform int16
    assert counts.min() > 0 and counts.std().item() < 1.2 * 8  # every value, with a Poisson-like spread


def test_a_model_on_the_cpu_gets_it_for_every_dropout_and_keeps_its_state_dict():
    model = Transformer(ModelConfig(vocab_size=50, n_layers=2, d_model=16, d_ff=32, n_heads=2, dropout=0.3))
    keys = list(model.state_dict())
    assert cpu_dropout(model, torch.device("cpu")) == 5  # 2 encoder layers, 2 decoder layers, embeddings
    assert not any(type(module) is nn.Dropout for module in model.modules())
    assert all(module.p == 0.3 for module in model.modules() if isinstance(module, MaskDropout))
    assert list(model.state_dict()) == keys


def test_a_model_on_a_gpu_keeps_torchs_dropout():
    model = Transformer(ModelConfig(vocab_size=50, n_layers=1, d_model=16, d_ff=32, n_heads=2))
    assert cpu_dropout(model, torch.device("cuda")) == 0
    assert any(type(module) is nn.Dropout for module in model.modules())
