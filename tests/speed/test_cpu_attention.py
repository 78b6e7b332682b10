"""Eq. 1 on the CPU (src/aiayn/speed/cpu_attention.py): the model's attention to rounding, in bf16 for training and
for the decoder step's few queries."""

from __future__ import annotations

import copy

import pytest
import torch

from aiayn.model import ModelConfig, MultiHeadAttention, Transformer, key_padding_mask, scaled_dot_product_attention
from aiayn.speed.cpu_attention import BF16CPUAttention, cpu_attention, key_padding_bias, matmul_attention

CONFIG = ModelConfig(vocab_size=40, n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.1)


def reference(queries, keys, values, key_mask, causal):
    """The model's Eq. 1 in float64."""
    q, k, v = (t.double() for t in (queries, keys, values))
    return scaled_dot_product_attention(q, k, v, key_mask, causal)


def inputs(seed=0, batch=3, length=7):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 4, length, 8, generator=generator) for _ in range(3))
    lengths = torch.tensor([length, 4, 1])[:batch]
    key_mask = key_padding_mask(torch.arange(length)[None, :] >= lengths[:, None])
    return q, k, v, key_mask


@pytest.mark.parametrize("causal", [False, True])
def test_matmul_attention_is_eq_1_to_bf16_rounding_in_values_and_gradients(causal):
    q, k, v, key_mask = inputs()
    key_mask = None if causal else key_mask
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = matmul_attention(*leaves, key_mask, causal)
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
    torch.testing.assert_close(matmul_attention(q, k, changed, key_mask)[1], matmul_attention(q, k, v, key_mask)[1],
                               rtol=0, atol=0)
    nothing = torch.zeros_like(key_mask)  # every key hidden, as in a row of padding
    out = matmul_attention(q, k, v, nothing)
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
    monkeypatch.setattr(aiayn.speed.cpu_attention, "matmul_attention",
                        lambda *args: calls.append(args[0].dtype) or matmul_attention(*args))
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


@pytest.mark.parametrize("queries", [1, 4])
@pytest.mark.parametrize("keys", [9, 60])  # 1 query over 9 keys of size 8 takes the products-and-sums path
def test_few_queries_in_float32_attend_as_the_model_with_and_without_a_key_mask(queries, keys):
    generator = torch.Generator().manual_seed(queries)
    q, k, v = (torch.randn(3, 2, length, 8, generator=generator) for length in (queries, keys, keys))
    src_pad = torch.zeros(3, keys, dtype=torch.bool)
    src_pad[0, 5:] = True
    src_pad[2, 1:] = True  # one key left
    mask = ~src_pad[:, None, None, :]
    for key_mask in (None, mask):
        expected = scaled_dot_product_attention(q, k, v, key_mask)
        torch.testing.assert_close(matmul_attention(q, k, v, key_mask), expected, rtol=1e-5, atol=1e-6)
    # The mask as an additive bias, with keys contiguous or stored transposed (as init_cache does on the CPU).
    expected = scaled_dot_product_attention(q, k, v, mask)
    for keys in (k, k.transpose(-1, -2).contiguous().transpose(-1, -2)):
        result = matmul_attention(q, keys, v, key_padding_bias(src_pad, torch.float32))
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_float64_inputs_give_the_model_s_attention_to_float64_rounding(causal):
    q, k, v, key_mask = inputs(seed=3)
    q, k, v = q.double(), k.double(), v.double()
    key_mask = None if causal else key_mask
    torch.testing.assert_close(matmul_attention(q, k, v, key_mask, causal),
                               scaled_dot_product_attention(q, k, v, key_mask, causal), rtol=1e-12, atol=1e-12)
