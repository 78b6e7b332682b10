"""The CPU trainer's attention: Eq. 1 in bf16 under bf16 autocast, the paper's module otherwise."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from aiayn.speed.cpu_attention import BF16CPUAttention, bf16_attention, cpu_attention
from aiayn.model import ModelConfig, MultiHeadAttention, Transformer, key_padding_mask

CONFIG = ModelConfig(vocab_size=40, n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.1)


def reference(queries, keys, values, key_mask, causal):
    """Eq. 1 in float64."""
    q, k, v = (t.double() for t in (queries, keys, values))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, -math.inf)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return scores.softmax(dim=-1) @ v


def inputs(seed=0, batch=3, length=7):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 4, length, 8, generator=generator) for _ in range(3))
    lengths = torch.tensor([length, 4, 1])[:batch]
    key_mask = key_padding_mask(torch.arange(length)[None, :] >= lengths[:, None])
    return q, k, v, key_mask


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_attention_is_eq_1_to_bf16_rounding_in_values_and_gradients(causal):
    q, k, v, key_mask = inputs()
    key_mask = None if causal else key_mask
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = bf16_attention(*leaves, key_mask, causal)
    assert out.dtype == torch.bfloat16
    exact_leaves = [t.detach().double().requires_grad_() for t in leaves]
    exact = reference(*exact_leaves, key_mask, causal)
    torch.testing.assert_close(out.double(), exact, rtol=0.02, atol=0.02)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad.bfloat16())
    exact.backward(grad.double())
    for ours, want in zip(leaves, exact_leaves):
        assert ours.grad.dtype == torch.bfloat16
        torch.testing.assert_close(ours.grad.double(), want.grad, rtol=0.05, atol=0.05)


def test_masked_keys_get_no_weight_and_a_query_with_no_key_stays_finite():
    q, k, v, key_mask = (t.bfloat16() if t.is_floating_point() else t for t in inputs(length=5))
    changed = v.clone()
    changed[1, :, 4:] = 100.0  # values behind row 1's mask (it has 4 keys)
    torch.testing.assert_close(bf16_attention(q, k, changed, key_mask)[1], bf16_attention(q, k, v, key_mask)[1],
                               rtol=0, atol=0)
    nothing = torch.zeros_like(key_mask)  # every key hidden, as in a row of padding
    out = bf16_attention(q, k, v, nothing)
    assert torch.isfinite(out).all()


def test_fp32_inputs_and_modules_off_the_cpu_keep_the_papers_attention_exactly():
    torch.manual_seed(0)
    paper = MultiHeadAttention(CONFIG)
    ours = copy.deepcopy(paper)
    ours.__class__ = BF16CPUAttention
    x = torch.randn(2, 6, CONFIG.d_model)
    mask = key_padding_mask(torch.tensor([[False] * 6, [False] * 3 + [True] * 3]))
    assert torch.equal(ours(x, x, mask), paper(x, x, mask))
    assert torch.equal(ours(x, x, None, causal=True), paper(x, x, None, causal=True))


def test_under_bf16_autocast_it_computes_in_bf16_and_stays_within_rounding_of_the_papers_module(monkeypatch):
    import aiayn.speed.cpu_attention

    torch.manual_seed(0)
    paper = MultiHeadAttention(CONFIG)
    ours = copy.deepcopy(paper)
    ours.__class__ = BF16CPUAttention
    calls = []
    monkeypatch.setattr(aiayn.speed.cpu_attention, "bf16_attention",
                        lambda *args: calls.append(args[0].dtype) or bf16_attention(*args))
    x = torch.randn(2, 6, CONFIG.d_model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = paper(x, x, None, causal=True), ours(x, x, None, causal=True)
    assert calls == [torch.bfloat16]
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.03)
    ours(x, x, None, causal=True)  # fp32: the paper's module
    assert calls == [torch.bfloat16]


def test_cpu_attention_changes_every_attention_on_the_cpu_only_and_no_parameter():
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert cpu_attention(copy.deepcopy(model), torch.device("cuda")) == 0
    assert cpu_attention(model, torch.device("cpu")) == 3 * CONFIG.n_layers  # encoder self, decoder self and cross
    assert not any(type(module) is MultiHeadAttention for module in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
