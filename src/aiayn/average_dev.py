"""What averaging gave: the averaged model and the last checkpoint, side by side on the dev split.

The average stage keeps the paper's averaged model whatever this says (it never swaps models); it
records both perplexities so that a user sees when the window reached back too far into the learning
curve. The two models are compared on the same sentences in ``CHUNKS`` contiguous chunks of the dev
file: the averaged model is called worse when its NLL per token exceeds the last checkpoint's by more
than noise, twice the standard error of that difference estimated from the chunks (a paired
comparison, so that what both models find hard cancels out).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from aiayn.batching import collate, length_batches
from aiayn.loss import teacher_forced_loss
from aiayn.model import ModelConfig, Transformer

CHUNKS = 20  # paired samples of the NLL difference, each about 50 sentences of newstest2013 or Multi30k's val


def model_from(checkpoint: dict, device: torch.device) -> Transformer:
    """The Transformer of an averaged model (or checkpoint) dict, in eval mode."""
    model = Transformer(ModelConfig.from_dict(checkpoint["model_config"]))
    model.load_state_dict(checkpoint["model"], strict=True)
    return model.to(device).eval()


def chunk_nll(model: Transformer, split, chunks: list[np.ndarray], device: torch.device, precision: str,
              max_tokens: int) -> np.ndarray:
    """(sum of target NLLs, target tokens) of each chunk of rows: shape (chunks, 2)."""
    from aiayn.train.hardware import autocast_context

    sums = np.zeros((len(chunks), 2))
    with torch.inference_mode():
        for index, rows in enumerate(chunks):
            for batch_rows in length_batches(split.src_lengths[rows], split.tgt_lengths[rows], max_tokens):
                batch = collate(split, rows[batch_rows]).to(device)
                with autocast_context(device, precision):
                    _, nll = teacher_forced_loss(model, batch.src, batch.tgt_in, batch.tgt_out, 0.0,
                                                 tgt_real=batch.tgt_real)
                sums[index] += (float(nll), batch.tgt_tokens)
    return sums


def paired_difference(averaged: np.ndarray, last: np.ndarray) -> tuple[float, float]:
    """NLL per token of the averaged model minus the last checkpoint's, and its noise (twice its standard
    error over the chunks, as a ratio estimate: chunks differ in tokens)."""
    tokens = last[:, 1].sum()
    differences = averaged[:, 0] - last[:, 0]
    mean = differences.sum() / tokens
    n = len(differences)
    if n < 2:
        return float(mean), math.inf
    residuals = differences - mean * last[:, 1]
    standard_error = math.sqrt(n / (n - 1) * float((residuals ** 2).sum())) / tokens
    return float(mean), 2 * standard_error


def compare_on_dev(averaged: dict, last_path: str | os.PathLike, dev_data: str | os.PathLike, device: torch.device,
                   precision: str = "fp32", max_tokens: int = 4000) -> dict:
    """The dev NLL and perplexity of the averaged model (an ``aiayn-model-v1`` dict) and of the checkpoint
    at ``last_path``, the noise of their difference, and whether the average is worse by more than it."""
    from aiayn.binarize import load_split
    from aiayn.checkpoint import load_checkpoint
    from aiayn.train.steps import dev_rows

    split = load_split(dev_data)
    last = load_checkpoint(last_path)
    config = ModelConfig.from_dict(averaged["model_config"])
    rows = dev_rows(split, config, dev_data)
    chunks = [chunk for chunk in np.array_split(rows, min(CHUNKS, len(rows))) if len(chunk)]
    sums = {}
    for name, checkpoint in (("averaged", averaged), ("last", last)):
        model = model_from(checkpoint, device)
        sums[name] = chunk_nll(model, split, chunks, device, precision, max_tokens)
        del model
    difference, noise = paired_difference(sums["averaged"], sums["last"])
    summary = {"dev_data": str(dev_data), "dev_sentences": int(len(rows)), "dev_tokens": int(sums["last"][:, 1].sum()),
               "chunks": len(chunks), "precision": precision}
    for name, values in sums.items():
        nll = values[:, 0].sum() / values[:, 1].sum()
        summary[f"dev_nll_{name}"] = float(nll)
        summary[f"dev_ppl_{name}"] = math.exp(min(float(nll), 50.0))
    last_steps = [int(last["step"])] if "step" in last else [int(step) for step in last["averaged_steps"]]
    summary.update({"dev_nll_difference": difference, "dev_nll_noise": noise,
                    "averaged_worse": bool(difference > noise), "averaged_steps": averaged["averaged_steps"],
                    "averaged_from": averaged["averaged_from"], "last_checkpoint": Path(last_path).name,
                    "last_steps": last_steps})
    return summary


def worse_warning(summary: dict) -> str:
    """One line naming both figures, for an average worse than the last checkpoint by more than noise."""
    steps = ", ".join(str(step) for step in summary["averaged_steps"])
    return (f"warning: the averaged model (steps {steps}) has dev perplexity {summary['dev_ppl_averaged']:.2f}, worse "
            f"than the last checkpoint's {summary['dev_ppl_last']:.2f} ({summary['last_checkpoint']}; NLL "
            f"+{summary['dev_nll_difference']:.4f} a token, noise {summary['dev_nll_noise']:.4f}); the averaged model "
            "is kept, as the paper's procedure")
