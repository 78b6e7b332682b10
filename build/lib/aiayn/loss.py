"""The training objective: label-smoothed cross-entropy (docs/PAPER.md, Regularization) over the
logits of the shared pre-softmax layer (Section 3.4), and the model with its loss as one module.

``label_smoothed_loss`` takes logits, as the paper's Figure 1 ends in them. Training and
validation use ``projected_label_smoothed_loss`` instead, which takes the decoder's hidden states
and the embedding matrix and never holds the whole (tokens, vocab) logits: at vocabulary 37000 a
micro-batch of 12500 target tokens has 1.85 GB of fp32 logits, and as much again of saved
log-probabilities. It exists for memory and speed only and equals the plain path (tests/test_loss.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.tokens import PAD_ID

# A chunk's fp32 log-probabilities hold at most this many numbers (128 MiB): large enough that its matrix
# products keep a GPU busy, small beside the model's activations.
CHUNK_ELEMENTS = 1 << 25


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon: float,
                        pad_id: int = PAD_ID) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed NLL over non-pad target tokens.

    The smoothed target puts 1 - eps on the reference and spreads eps uniformly over the
    vocabulary (as torch's ``label_smoothing``); one log-softmax serves both sums, and the
    gradient is the closed form of ``_SmoothedCrossEntropy`` (fewer passes over the logits than
    autograd's gather, mean and log-softmax backward).
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # fp32 even under autocast
    logits = logits.reshape(-1, logits.size(-1))  # (tokens, vocab)
    target = target.reshape(-1)
    keep = (target != pad_id).to(logits.dtype)
    return _SmoothedCrossEntropy.apply(logits, target, keep, float(epsilon))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """(tokens, vocab) logits -> (sum of smoothed losses, sum of NLLs) over the tokens where keep is 1.

    Per token, with p = softmax(logits) and y the reference: loss = (1 - eps) * nll + eps * mean_v(-log p_v),
    so d loss / d logits = p - (1 - eps) * onehot(y) - eps / vocab, and d nll / d logits = p - onehot(y).
    """

    @staticmethod
    def forward(ctx, logits, target, keep, epsilon):
        log_probs = logits.log_softmax(dim=-1)
        nll = -log_probs.gather(1, target[:, None]).squeeze(1)
        smooth = -log_probs.mean(dim=-1)
        ctx.save_for_backward(log_probs, target, keep)
        ctx.epsilon = epsilon
        return ((1.0 - epsilon) * nll + epsilon * smooth).mul(keep).sum(), nll.mul(keep).sum()

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        log_probs, target, keep = ctx.saved_tensors
        epsilon, vocab = ctx.epsilon, log_probs.shape[1]
        # The saved log-probs are not needed after this, so the gradient is built in their memory.
        grad = log_probs.exp_().mul_((keep * (grad_loss + grad_nll))[:, None])
        grad.sub_((keep * (grad_loss * epsilon / vocab))[:, None])
        grad.scatter_add_(1, target[:, None], (-keep * (grad_loss * (1.0 - epsilon) + grad_nll))[:, None])
        return grad, None, None, None


# torch.compile leaves this to eager: its loop over chunks depends on the number of real tokens,
# which would compile a graph for every count.
@torch.compiler.disable
def projected_label_smoothed_loss(hidden: Tensor, weight: Tensor, target: Tensor, epsilon: float,
                                  pad_id: int = PAD_ID, chunk_tokens: int | None = None,
                                  real: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``label_smoothed_loss(F.linear(hidden, weight), target, epsilon)``, a chunk of tokens at a time.

    hidden (..., d_model), weight (vocab, d_model) the shared embedding (Section 3.4: the pre-softmax
    layer, no bias), target (...). Pad targets are dropped before the product: ``real`` gives the flat
    positions of the others (``Batch.tgt_real``, found on the host); without it they are found here,
    which on a GPU waits for it once a call. Under autocast the products run in autocast's dtype and the
    softmax and sums in fp32, as on the plain path.
    ``chunk_tokens`` defaults to the tokens whose logits fit ``CHUNK_ELEMENTS``.
    """
    hidden = hidden.reshape(-1, hidden.size(-1))  # (tokens, d_model)
    target = target.reshape(-1)
    if real is None:
        real = target.ne(pad_id).nonzero().squeeze(1)
    hidden, target = hidden.index_select(0, real), target.index_select(0, real)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    # The forward pass prepares only the gradients that backward will be asked for (none in validation).
    wanted = (torch.is_grad_enabled() and hidden.requires_grad, torch.is_grad_enabled() and weight.requires_grad)
    return _ProjectedSmoothedCrossEntropy.apply(hidden, weight, target, float(epsilon), int(chunk), wanted)


def _product_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype autocast would multiply in here (the forward pass below turns autocast off)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_log_probs(hidden: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """(chunk, d_model) x (vocab, d_model) -> (chunk, vocab) log-probabilities in ``dtype``."""
    return (hidden @ weight.t()).log_softmax(dim=-1, dtype=dtype)


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """(tokens, d_model) hidden, (vocab, d_model) weight, (tokens,) references, none of them pad ->
    (sum of smoothed losses, sum of NLLs), one chunk of tokens' logits at a time.

    Per token, with z = hidden @ weight^T and p = softmax(z), the gradient with respect to z of
    a * loss + b * nll is (a + b) (p - onehot(y)) + a eps (onehot(y) - 1 / vocab). Forward, while a
    chunk's p is at hand, multiplies q = p - onehot(y) into the gradients it makes for hidden
    (q @ weight) and the weight (q^T @ hidden, summed over chunks in fp32); backward scales them by
    a + b and adds the smoothing term, which needs no logits: a eps (weight[y] - mean(weight)) for
    hidden, and for the weight a eps times each token's hidden state added to its reference's row,
    less the sum of all of them / vocab from every row. The same products as the plain path, none
    of them repeated, and no (tokens, vocab) tensor is kept.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, chunk, wanted):
        dtype = _product_dtype(hidden)
        accumulate = torch.promote_types(dtype, torch.float32)  # the softmax and the sums: fp32 at least
        weight_cast = weight.to(dtype)
        tokens = hidden.shape[0]
        loss_sum = torch.zeros((), dtype=accumulate, device=hidden.device)
        nll_sum = torch.zeros((), dtype=accumulate, device=hidden.device)
        hidden_grad = torch.empty_like(hidden) if wanted[0] else None
        weight_grad = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if wanted[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, tokens, chunk):
                end = min(start + chunk, tokens)
                hidden_chunk = hidden[start:end].to(dtype)
                reference = target[start:end, None]
                log_probs = _chunk_log_probs(hidden_chunk, weight_cast, accumulate)  # (chunk, vocab)
                nll = -log_probs.gather(1, reference).squeeze(1)
                smooth = -log_probs.mean(dim=-1)
                loss_sum += ((1.0 - epsilon) * nll + epsilon * smooth).sum()
                nll_sum += nll.sum()
                if not any(wanted):
                    continue
                # q = p - onehot(y), built in the log-probs' memory
                q = log_probs.exp_().scatter_add_(1, reference, log_probs.new_full(reference.shape, -1.0)).to(dtype)
                if hidden_grad is not None:
                    hidden_grad[start:end] = q @ weight_cast
                if weight_grad is not None and weight_grad.dtype == q.dtype:
                    weight_grad.addmm_(q.t(), hidden_chunk)
                elif weight_grad is not None:
                    weight_grad += q.t() @ hidden_chunk
        ctx.save_for_backward(hidden, weight, target, hidden_grad, weight_grad)
        ctx.epsilon, ctx.wanted = epsilon, wanted
        return loss_sum, nll_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        hidden, weight, target, hidden_grad, weight_grad = ctx.saved_tensors
        if any(want and not prepared for want, prepared in zip(ctx.needs_input_grad, ctx.wanted)):
            raise RuntimeError("the loss was computed without the gradients now asked for (under torch.no_grad, "
                               "or of a tensor that did not require them)")
        scale, smoothing = grad_loss + grad_nll, grad_loss * ctx.epsilon
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            # smoothing x (onehot(y) - 1 / vocab) @ weight
            onto_hidden = (weight.index_select(0, target) - weight.mean(dim=0)).to(hidden_grad.dtype)
            grad_hidden = torch.addcmul(hidden_grad * scale, onto_hidden, smoothing.to(hidden_grad.dtype))
        if ctx.needs_input_grad[1]:
            # smoothing x (onehot(y) - 1 / vocab)^T @ hidden: the reference rows gain their tokens' hidden
            # states, every row loses their sum / vocab
            smoothed = hidden.to(weight_grad.dtype) * smoothing
            grad_weight = (weight_grad * scale).sub_(smoothed.sum(dim=0) / weight.shape[0])
            grad_weight = grad_weight.index_add_(0, target, smoothed).to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def teacher_forced_loss(model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, epsilon: float,
                        chunk_tokens: int | None = None, tgt_real: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The training objective of one batch: (sum of label-smoothed losses, sum of NLLs) over its
    non-pad target tokens (at ``tgt_real`` if given), from the model's encoder and decoder and its
    shared embedding."""
    memory, src_pad = model.encode(src)
    hidden = model.decode(tgt_in, memory, src_pad)  # (batch, tgt_len, d_model)
    return projected_label_smoothed_loss(hidden, model.embedding.weight, tgt_out, epsilon,
                                         model.config.pad_id, chunk_tokens, tgt_real)


class TrainingObjective(nn.Module):
    """The model and its loss as one module: (src, tgt_in, tgt_out) -> (loss sum, NLL sum).

    DistributedDataParallel and torch.compile wrap this, so that they see every use of the shared
    embedding (input, output and pre-softmax) inside one forward call.
    """

    def __init__(self, model: nn.Module, epsilon: float, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.epsilon = epsilon
        self.chunk_tokens = chunk_tokens

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
                tgt_real: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return teacher_forced_loss(self.model, src, tgt_in, tgt_out, self.epsilon, self.chunk_tokens, tgt_real)
