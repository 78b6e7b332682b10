"""Sizes from the device's memory, and what a step or a search does when the GPU runs out of it all the same.

``train.device_tokens: auto`` and ``decode.tokens_per_batch: auto`` are counted, not measured: the bytes the
device holds for the model, and for each token of a batch what training keeps for its backward pass or what
beam search caches, at the precision used, with a margin (config/README.md has the arithmetic). On the CPU
``auto`` is a fixed number, so that a CPU run does not depend on the machine. Where a GPU runs out of memory
regardless (another process on it, the allocator's fragmentation, an estimate too high), a training step is
cut into more micro-batches and done again from its start (``fit_step``), and a decoding batch is searched
in halves (``BatchHalving``): the same sentences, the same step or the same translations.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
from typing import Callable

import numpy as np
import torch

from aiayn.batching import StepShape
from aiayn.errors import UserError
from aiayn.model import ModelConfig
from aiayn.params import count_parameters
from aiayn.speed.precision import inference_precision, resolved_precision

GiB = 2 ** 30
CPU_DEVICE_TOKENS = 25000     # train.device_tokens: auto on the CPU: the schema's default before auto existed
CPU_TOKENS_PER_BATCH = 8000   # decode.tokens_per_batch: auto on the CPU: the default before auto existed
RESERVED_BYTES = GiB          # the CUDA context, cuBLAS's and cuDNN's workspaces: not the model's
TRAINING_MARGIN = 2.0         # the count's share of the memory left: the allocator's fragmentation over many
                              # micro-batch shapes, and backward's transient tensors, take the rest
DECODING_MARGIN = 4 / 3       # a quarter of what is left to the allocator (the count is of the worst batch)
SMALLEST_AUTO_DEVICE_TOKENS = 1000  # below this an estimate says little: the out-of-memory cut decides


def element_bytes(precision: str) -> int:
    """The size of an activation at a resolved precision: fp32, or a 16-bit autocast dtype."""
    return 4 if precision == "fp32" else 2


def device_memory(device: torch.device) -> int:
    """The total memory of a CUDA device, in bytes."""
    return torch.cuda.get_device_properties(device).total_memory


def device_description(device: torch.device) -> str:
    """``cuda:0 (NVIDIA A100-SXM4-40GB, 39.4 GiB)``, or ``cpu``."""
    if device.type != "cuda":
        return str(device)
    properties = torch.cuda.get_device_properties(device)
    return f"{device} ({properties.name}, {properties.total_memory / GiB:.1f} GiB)"


def free_device_memory(device: torch.device) -> None:
    """Hand back what a failed attempt left: its tensors (once nothing refers to them) and the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def tokens_argument(text: str) -> int | str:
    """A --tokens-per-batch or --dev-tokens value: a whole number, or auto (the schema's rule checks it)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or auto") from None


# --- training: train.device_tokens ----------------------------------------------------------------

def training_state_bytes(config: ModelConfig, precision: str) -> int:
    """Bytes a training process holds for the model whatever the batch: for each parameter its fp32 weight (4),
    gradient (4), Adam's two moments (8) and DDP's gradient bucket (4), and its 16-bit copy under autocast (2)."""
    return count_parameters(config) * (20 + (0 if precision == "fp32" else 2))


def training_bytes_per_token(config: ModelConfig, precision: str) -> int:
    """Bytes a micro-batch holds from its forward pass to its backward pass for each padded token a side (one
    source and one target token): what autograd saves, layer by layer. Linear maps keep their input in the
    product's dtype; attention its queries, keys, values, output, merged heads and log-sum-exp (SDPA's kernels
    keep no scores); dropout a 1-byte mask; LayerNorm its fp32 input (autocast runs it in fp32); ReLU its
    output. Each decoder layer casts the encoder's output for its own keys and values. The loss keeps the
    decoder's output and its gradient in fp32, and a chunk of fp32 log-probabilities and their copy in the
    product's dtype (``aiayn.loss``), counted here as if the chunk were the whole micro-batch."""
    e = element_bytes(precision)
    d, f, heads = config.d_model, config.d_ff, config.n_heads
    q, v = heads * config.head_dim, heads * config.value_dim  # query and key width, value width
    residual = d + 4 * d  # a sub-layer's dropout mask and the LayerNorm input after its residual sum
    self_attention = e * (d + 2 * q + v + 2 * v) + 4 * heads + residual
    cross_attention = e * (d + q + 2 * v) + 4 * heads + residual
    encoder_output = e * (2 * d + q + v)  # per source token, in each decoder layer: its casts, keys and values
    feed_forward = e * (d + f) + residual
    encoder_layer = self_attention + feed_forward
    decoder_layer = self_attention + cross_attention + encoder_output + feed_forward
    embeddings = 2 * d  # each side's dropout mask
    loss = 2 * 4 * d + config.vocab_size * (4 + e)
    return config.n_layers * (encoder_layer + decoder_layer) + embeddings + loss


def estimated_device_tokens(config: ModelConfig, total_memory: int, precision: str) -> int:
    """Padded tokens a side that one micro-batch may hold on a device of ``total_memory`` bytes: what is left
    after RESERVED_BYTES and ``training_state_bytes``, over ``training_bytes_per_token`` x TRAINING_MARGIN."""
    left = total_memory - RESERVED_BYTES - training_state_bytes(config, precision)
    return max(0, int(left // (TRAINING_MARGIN * training_bytes_per_token(config, precision))))


def resolve_device_tokens(setting: int | str, device: torch.device | None, config: ModelConfig | None,
                          precision: str, ceiling: int) -> int:
    """train.device_tokens as a number: a number as it is; ``auto`` on a CUDA device the estimate
    (``estimated_device_tokens``) for ``config`` at ``precision`` (train.precision: ``auto`` is resolved for
    that device here, the one place it decides a size), at most ``ceiling`` (the
    step's train.tokens_per_step: a micro-batch is never larger) and at least SMALLEST_AUTO_DEVICE_TOKENS;
    elsewhere (or without ``device``) CPU_DEVICE_TOKENS."""
    if setting != "auto":
        return setting
    if device is None or device.type != "cuda":
        return CPU_DEVICE_TOKENS
    if config is None:
        raise ValueError("train.device_tokens: auto on a GPU needs the model's config")
    tokens = estimated_device_tokens(config, device_memory(device), resolved_precision(precision, device))
    return max(min(tokens, ceiling), min(SMALLEST_AUTO_DEVICE_TOKENS, ceiling))


def agreed_device_tokens(settings, world: int, device: torch.device):
    """``settings`` with train.device_tokens the smallest of every process's: each splits every step itself, and
    all must split it alike, where ``auto`` sized it on GPUs of several kinds (a number set is the same on all)."""
    if world == 1 or device.type != "cuda":
        return settings
    on = device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")  # gloo: processes share a GPU
    tokens = torch.tensor([settings.device_tokens], device=on)
    torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MIN)
    return dataclasses.replace(settings, device_tokens=int(tokens.item()))


def resumed_device_tokens(settings, setting: int | str, checkpoint: dict, say: bool):
    """``settings`` as a resumed run goes on: with the micro-batch size its checkpoint recorded where
    train.device_tokens is ``auto`` (whatever auto gives on this device) or is the number the run started
    with (which an out-of-memory error may have cut since); with a number set since, that number. The size
    only splits a step, never changes its sentences: where it is not the checkpoint's, one line says so."""
    recorded = checkpoint.get("batch_rule", {}).get("device_tokens", settings.device_tokens)
    recorded_setting = checkpoint.get("config", {}).get("train", {}).get("device_tokens", recorded)
    if setting == "auto" or setting == recorded_setting:
        if say and recorded != settings.device_tokens:
            why = (f"auto gives {settings.device_tokens} on this device" if setting == "auto" else
                   f"an out-of-memory error cut {setting} to it")
            print(f"train.device_tokens: the run goes on with the {recorded} its checkpoint recorded ({why}), so "
                  "that its steps are split as before", file=sys.stderr)
        return dataclasses.replace(settings, device_tokens=recorded)
    if say and setting != recorded:
        print(f"train.device_tokens: {recorded} -> {setting}: the run goes on with the same steps, split into "
              "micro-batches of the new size", file=sys.stderr)
    return settings


def fit_step(trainer, step: int, micro: list[np.ndarray], shape: StepShape):
    """``trainer.forward_backward`` of one step (``trainer``: an ``aiayn.train.trainer.Trainer``). Where CUDA runs
    out of memory on a single process, the step is done again from its start (gradients zeroed, memory freed)
    in more, smaller micro-batches: the same sentences, split at a lower train.device_tokens (``smaller_split``),
    which later steps keep and checkpoints record; one line on stderr and the metric ``device_tokens`` say so.
    Its dropout masks are then those of a run set to that size from this step. Several processes do not
    redo a step: one that ran out stops the run, naming the size to set (``several_processes_error``).
    Returns the micro-batches that ran, their sizes and the loss sums."""
    started_with, ran_out_at = trainer.settings.device_tokens, None
    while True:
        try:
            sums = trainer.forward_backward(step, micro, shape)
            break
        except torch.OutOfMemoryError:
            pass  # handled out here, once the error's frames and the tensors they hold are gone
        trainer.optimizer.zero_grad(set_to_none=True)
        free_device_memory(trainer.device)
        if trainer.world > 1:
            raise several_processes_error(trainer, step, shape)
        ran_out_at = ran_out_at or largest_micro_batch(shape)
        micro, shape = smaller_split(trainer, step, micro, shape)
    if ran_out_at is not None:
        print(f"step {step} ran out of memory on {device_description(trainer.device)} in micro-batches of up to "
              f"{ran_out_at} padded tokens a side; it was done again in {len(micro)} micro-batches, and later steps "
              f"keep the smaller size (train.device_tokens {started_with} -> {trainer.settings.device_tokens})",
              file=sys.stderr)
        if trainer.tracker is not None:
            trainer.tracker.log_metrics({"device_tokens": trainer.settings.device_tokens}, step)
    return micro, shape, sums


def largest_micro_batch(shape: StepShape) -> int:
    """Padded tokens on the longer side of a step's largest micro-batch."""
    return max(rows * max(src_len, tgt_len) for rows, src_len, tgt_len in shape.shapes)


def smaller_split(trainer, step: int, micro: list[np.ndarray], shape: StepShape):
    """The step's sentences split at train.device_tokens halved (from the largest micro-batch that ran, or the
    setting if smaller) until a micro-batch holds fewer sentences than before; ``trainer.settings`` (and its
    step source's) take the new size. None smaller (one sentence a micro-batch, or as few as the preset's
    layout allows) stops the run with ``cannot_fit_error``."""
    rows = np.concatenate(micro)  # split_step cuts the step's rows in order
    most = max(len(part) for part in micro)
    tokens = min(trainer.settings.device_tokens, largest_micro_batch(shape))
    while most > 1 and tokens > 1:
        tokens //= 2
        candidate = trainer.source.micro_batches(rows, tokens)
        if max(len(part) for part in candidate[0]) < most:
            trainer.settings = trainer.source.settings = dataclasses.replace(trainer.settings, device_tokens=tokens)
            return candidate
    raise cannot_fit_error(trainer, step, most, largest_micro_batch(shape))


def _state_gib(trainer) -> float:
    return training_state_bytes(trainer.model_config, trainer.precision) / GiB


def cannot_fit_error(trainer, step: int, sentences: int, tokens: int) -> UserError:
    many = f"{sentences} sentences" if sentences > 1 else "one sentence"
    layout = (f" (its gpus: {trainer.settings.layout} lays a step out in a multiple of {trainer.settings.layout} "
              "micro-batches)" if sentences > 1 and trainer.settings.layout > 1 else "")
    return UserError(
        f"preset {trainer.job.preset['name']!r} does not fit on {device_description(trainer.device)}: step {step} "
        f"ran out of memory in micro-batches of {many} ({tokens} padded tokens a side at most){layout}, beside "
        f"about {_state_gib(trainer):.1f} GiB for the model's weights, gradients and Adam's moments. Train it on "
        "a GPU with more memory, or lower binarize.max_tokens so that the longest training pairs are left out, "
        "or train a smaller preset")


def several_processes_error(trainer, step: int, shape: StepShape) -> UserError:
    smaller = max(1, min(trainer.settings.device_tokens, largest_micro_batch(shape)) // 2)
    return UserError(
        f"preset {trainer.job.preset['name']!r} ran out of memory on {device_description(trainer.device)} at step "
        f"{step}, in micro-batches of up to {largest_micro_batch(shape)} padded tokens a side (train.device_tokens "
        f"{trainer.settings.device_tokens}). With {trainer.world} processes a step is not cut and done again (the "
        f"others are already summing its gradients), so the run stops here: set train.device_tokens to {smaller} "
        "or lower, and rerun; it resumes from its last checkpoint with the smaller micro-batches")


# --- decoding: decode.tokens_per_batch ------------------------------------------------------------

# The batch decoding holds most for: sources of two tokens (one piece and EOS). A batch of padded source
# length S holds tokens_per_batch / S decoder rows, and each caches keys and values for max_len_a x S +
# max_len_b + 1 positions, which per token of the budget falls as S grows.
WORST_SOURCE_LENGTH = 2


def decoding_bytes_per_token(config: ModelConfig, max_len_a: float, max_len_b: int, beam_size: int,
                             precision: str = "bf16") -> float:
    """Bytes a decoding batch holds for each token of decode.tokens_per_batch (a padded source token times the
    beam) at its worst (WORST_SOURCE_LENGTH): each decoder row's self-attention keys and values for every
    position and layer, half as much again while a reorder gathers one of them; each row's log-probabilities
    of one step (logits in the product's dtype, their fp32 copy and log-softmax); the encoder's keys and values."""
    e, length = element_bytes(precision), WORST_SOURCE_LENGTH
    position = config.n_layers * config.n_heads * (config.head_dim + config.value_dim) * e  # keys and values
    positions = math.floor(max_len_a * length + max_len_b) + 1  # up to max_len tokens, then the forced EOS
    rows = 1 / length
    cache = rows * positions * position * 1.5
    log_probs = rows * config.vocab_size * (e + 4 + 4)
    return cache + log_probs + position / beam_size


def estimated_tokens_per_batch(config: ModelConfig, search, total_memory: int, precision: str = "bf16") -> int:
    """decode.tokens_per_batch for a device of ``total_memory`` bytes: what is left after RESERVED_BYTES and the
    weights (fp32, and their autocast copies), over ``decoding_bytes_per_token`` x DECODING_MARGIN; at least 1."""
    weights = count_parameters(config) * (4 + element_bytes(precision))
    per_token = decoding_bytes_per_token(config, search.max_len_a, search.max_len_b, search.beam_size, precision)
    return max(1, int((total_memory - RESERVED_BYTES - weights) // (DECODING_MARGIN * per_token)))


def tokens_per_batch_for_device(setting: int | str, device: torch.device, config: ModelConfig | None,
                                search, precision: str = "bf16") -> int:
    """decode.tokens_per_batch as a number: a number as it is; ``auto`` on a CUDA device the estimate for the
    model and search there (``estimated_tokens_per_batch``) at ``precision`` (``auto``: the one the search
    runs in on that GPU, ``inference_precision``), elsewhere CPU_TOKENS_PER_BATCH."""
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return CPU_TOKENS_PER_BATCH
    if config is None:
        raise ValueError("decode.tokens_per_batch: auto on a GPU needs the model's config")
    if precision == "auto":
        precision = inference_precision(device)
    return estimated_tokens_per_batch(config, search, device_memory(device), precision)


class BatchHalving:
    """A batch's search, and where CUDA runs out of memory its two halves' searches, recursively down to one
    sentence, whose results are the batch's in order. Each sentence's search is its own (its beams, its
    maximum length): a half keeps the batch's padded width, so its sentences are searched as in the whole.
    ``release`` drops what the failed search kept (its scratch memory); ``where(index, row)`` names a
    sentence, for the error where one alone runs out. One line on stderr at the first split."""

    def __init__(self, release: Callable[[], None], where: Callable[[int, int], str]):
        self.release, self.where, self.split = release, where, False

    def run(self, search: Callable[[torch.Tensor], list], batch: torch.Tensor, index: int, first_row: int = 0) -> list:
        """``search(batch)``, or its halves' (``index``: the batch's place, ``first_row``: this part's first row)."""
        try:
            return search(batch)
        except torch.OutOfMemoryError:
            pass  # handled out here, once the error's frames and the tensors they hold are gone
        self.release()
        free_device_memory(batch.device)
        if batch.shape[0] == 1:
            raise UserError(
                f"{self.where(index, first_row)}: its search alone ran out of memory on "
                f"{device_description(batch.device)}; nothing was written. Split that line into sentences, lower "
                "decode.max_source_tokens so that such a line is refused before decoding, or decode on a GPU with "
                "more memory") from None
        if not self.split:
            self.split = True
            print(f"note: a batch of {batch.shape[0]} sentences ran out of memory on {device_description(batch.device)}"
                  "; such batches are searched in halves (a smaller decode.tokens_per_batch avoids the retries)",
                  file=sys.stderr)
        half = (batch.shape[0] + 1) // 2
        return (self.run(search, batch[:half], index, first_row) +
                self.run(search, batch[half:], index, first_row + half))
