"""The training objective: label-smoothed cross-entropy, and the chunked projection that computes it
from hidden states without holding all logits, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import aiayn.loss
from aiayn.loss import label_smoothed_loss, projected_label_smoothed_loss, teacher_forced_loss
from aiayn.model import ModelConfig, Transformer

VOCAB, D_MODEL = 37, 16


def test_label_smoothed_loss_matches_a_hand_computed_case():
    logits = torch.tensor([[[2.0, 0.0, 1.0, -1.0], [0.5, 0.5, 0.5, 0.5]]])
    target = torch.tensor([[2, 0]])  # the second position is padding (id 0): it must not count
    log_probs = [2.0 - math.log(math.exp(2) + 1 + math.exp(1) + math.exp(-1)) + d for d in (0, -2, -1, -3)]
    nll = -log_probs[2]
    smooth = -sum(log_probs) / 4
    loss, nll_sum = label_smoothed_loss(logits, target, epsilon=0.1, pad_id=0)
    assert nll_sum.item() == pytest.approx(nll, rel=1e-6)
    assert loss.item() == pytest.approx(0.9 * nll + 0.1 * smooth, rel=1e-6)
    plain, _ = label_smoothed_loss(logits, target, epsilon=0.0, pad_id=0)
    assert plain.item() == pytest.approx(nll, rel=1e-6)
    reference = torch.nn.functional.cross_entropy(logits[0, :1], target[0, :1], label_smoothing=0.1)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_label_smoothed_loss_gradient_equals_autograd_through_the_formula():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64)
    target = torch.randint(1, 11, (2, 5), generator=generator)
    target[1, 3:] = 0  # padding gets no gradient

    def reference(values):
        log_probs = values.reshape(-1, 11).log_softmax(dim=-1)
        keep = (target.reshape(-1) != 0).double()
        nll = -log_probs.gather(1, target.reshape(-1, 1)).squeeze(1)
        return (((0.9 * nll - 0.1 * log_probs.mean(dim=-1)) * keep).sum(), (nll * keep).sum())

    for weights in ((1.0, 0.0), (0.7, 0.3)):  # the loss alone, and the loss and the NLL together
        ours = logits.clone().requires_grad_()
        theirs = logits.clone().requires_grad_()
        loss, nll = label_smoothed_loss(ours, target, epsilon=0.1)
        (weights[0] * loss + weights[1] * nll).backward()
        expected_loss, expected_nll = reference(theirs)
        (weights[0] * expected_loss + weights[1] * expected_nll).backward()
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
        assert torch.all(ours.grad[1, 3:] == 0)


# --- the chunked projection ----------------------------------------------------------------

def inputs(dtype=torch.float32, seed=0):
    """Hidden states (3, 11, d_model) with pads at the ends of two rows, the weight and the targets."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 11, D_MODEL, generator=generator, dtype=dtype)
    weight = torch.randn(VOCAB, D_MODEL, generator=generator, dtype=dtype) * 0.5
    target = torch.randint(1, VOCAB, (3, 11), generator=generator)
    target[1, 8:] = 0
    target[2, 10:] = 0  # 29 real tokens: a prime, so no chunk size above 1 divides them
    return hidden, weight, target


def reference(hidden, weight, target, epsilon):
    """Plain float64 log-softmax over all logits: (sum of smoothed losses, sum of NLLs) over non-pads."""
    log_probs = F.linear(hidden.double(), weight.double()).reshape(-1, VOCAB).log_softmax(dim=-1)
    target = target.reshape(-1)
    keep = (target != 0).double()
    nll = -log_probs.gather(1, target[:, None]).squeeze(1)
    smooth = -log_probs.mean(dim=-1)
    return (((1 - epsilon) * nll + epsilon * smooth) * keep).sum(), (nll * keep).sum()


def losses_and_gradients(loss_function, hidden, weight, target, epsilon, weights=(0.7, 0.3)):
    """Both sums and the gradients of weights[0] * loss + weights[1] * nll for hidden and the weight."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = loss_function(hidden, weight, target, epsilon)
    (weights[0] * loss + weights[1] * nll).backward()
    return loss.detach(), nll.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 4, 7, 29, 64, None])
def test_chunked_loss_and_gradients_equal_a_float64_reference_at_any_chunk_size(chunk, epsilon):
    hidden, weight, target = inputs()

    def chunked(h, w, t, eps):
        return projected_label_smoothed_loss(h, w, t, eps, chunk_tokens=chunk)

    ours = losses_and_gradients(chunked, hidden, weight, target, epsilon)
    expected = losses_and_gradients(reference, hidden.double(), weight.double(), target, epsilon)
    assert ours[0].dtype == ours[2].dtype == ours[3].dtype == torch.float32
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [3, 64])
def test_chunked_loss_in_float64_equals_the_reference_to_rounding(chunk):
    hidden, weight, target = inputs(torch.float64)

    def chunked(h, w, t, eps):
        return projected_label_smoothed_loss(h, w, t, eps, chunk_tokens=chunk)

    for weights in ((1.0, 0.0), (0.0, 1.0), (0.7, 0.3)):
        ours = losses_and_gradients(chunked, hidden, weight, target, 0.1, weights)
        expected = losses_and_gradients(reference, hidden, weight, target, 0.1, weights)
        for got, want in zip(ours, expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_pad_positions_get_no_gradient_and_no_loss():
    hidden, weight, target = inputs()
    _, _, hidden_grad, _ = losses_and_gradients(
        lambda h, w, t, eps: projected_label_smoothed_loss(h, w, t, eps, chunk_tokens=5), hidden, weight, target, 0.1)
    assert torch.all(hidden_grad[1, 8:] == 0) and torch.all(hidden_grad[2, 10:] == 0)
    assert torch.all(hidden_grad[0].abs().sum(dim=-1) > 0)
    changed = hidden.clone()
    changed[1, 8:] = 1e6  # whatever the decoder left at pad positions
    assert torch.equal(projected_label_smoothed_loss(changed, weight, target, 0.1)[0],
                       projected_label_smoothed_loss(hidden, weight, target, 0.1)[0])


def test_the_gradient_of_either_input_alone_and_the_loss_without_gradients_equal_the_reference():
    hidden, weight, target = inputs(torch.float64)
    _, _, hidden_grad, weight_grad = losses_and_gradients(reference, hidden, weight, target, 0.1)
    for which, expected in ((0, hidden_grad), (1, weight_grad)):
        tensors = [hidden.clone(), weight.clone()]
        tensors[which].requires_grad_()
        loss, nll = projected_label_smoothed_loss(*tensors, target, 0.1, chunk_tokens=6)
        (0.7 * loss + 0.3 * nll).backward()
        torch.testing.assert_close(tensors[which].grad, expected, rtol=1e-12, atol=1e-12)
    with torch.inference_mode():  # validation: values only
        values = projected_label_smoothed_loss(hidden, weight, target, 0.1, chunk_tokens=6)
    for got, want in zip(values, reference(hidden, weight, target, 0.1)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_chunk_of_logits_has_more_tokens_than_the_chunk_size(monkeypatch):
    rows = []
    real = aiayn.loss._chunk_log_probs

    def counted(hidden, weight, dtype):
        rows.append(hidden.shape[0])
        return real(hidden, weight, dtype)

    monkeypatch.setattr(aiayn.loss, "_chunk_log_probs", counted)
    hidden, weight, target = inputs()
    losses_and_gradients(lambda h, w, t, eps: projected_label_smoothed_loss(h, w, t, eps, chunk_tokens=8),
                         hidden, weight, target, 0.1)
    assert rows == [8, 8, 8, 5]  # 29 real tokens; backward computes no logits
    monkeypatch.setattr(aiayn.loss, "CHUNK_ELEMENTS", 10 * VOCAB)
    rows.clear()
    projected_label_smoothed_loss(hidden, weight, target, 0.1)
    assert rows == [10, 10, 9]  # the default: as many tokens as CHUNK_ELEMENTS logits allow


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_under_bf16_autocast_the_chunked_loss_stays_within_bf16_rounding_of_the_reference(epsilon):
    hidden, weight, target = inputs()

    def chunked(h, w, t, eps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return projected_label_smoothed_loss(h, w, t, eps, chunk_tokens=7)

    def plain_autocast(h, w, t, eps):  # what the trainer did before: bf16 logits, an fp32 loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, w)
        return label_smoothed_loss(logits, t, eps)

    ours = losses_and_gradients(chunked, hidden, weight, target, epsilon)
    plain = losses_and_gradients(plain_autocast, hidden, weight, target, epsilon)
    expected = losses_and_gradients(reference, hidden.double(), weight.double(), target, epsilon)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == ours[3].dtype == torch.float32
    for got, before, want in zip(ours, plain, expected):  # loss, nll, hidden's and the weight's gradients
        error, error_before = ((value.double() - want).norm() / want.norm() for value in (got, before))
        assert error < 1e-2  # bf16 keeps 8 significant bits
        assert error <= 1.25 * error_before  # as close as the plain path under autocast


def test_teacher_forced_loss_equals_the_loss_of_the_models_logits():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=VOCAB, n_layers=2, d_model=D_MODEL, d_ff=32, n_heads=2, dropout=0.0))
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (3, 6), generator=generator)
    src[2, 4:] = 0
    tgt_in = torch.randint(4, VOCAB, (3, 5), generator=generator)
    tgt_out = torch.randint(4, VOCAB, (3, 5), generator=generator)
    tgt_in[1, 3:] = tgt_out[1, 2:] = 0

    def gradients_of(loss_and_nll):
        model.zero_grad()
        (loss_and_nll[0] + 0.5 * loss_and_nll[1]).backward()
        return loss_and_nll[0].detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    ours = gradients_of(teacher_forced_loss(model, src, tgt_in, tgt_out, 0.1, chunk_tokens=4))
    plain = gradients_of(label_smoothed_loss(model(src, tgt_in), tgt_out, 0.1))
    torch.testing.assert_close(ours[0], plain[0])
    for name, grad in plain[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
