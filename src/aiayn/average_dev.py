"""What averaging gave: the averaged model and the last checkpoint, side by side on the dev split.

The two models are compared on the same sentences in ``CHUNKS`` contiguous chunks of the dev file: the
averaged model is called worse when its NLL per token exceeds the last checkpoint's by more than noise,
twice the standard error of that difference estimated from the chunks (a paired comparison, so that what
both models find hard cancels out). The average stage then writes the model the later stages use
(``average.choose``): with ``dev``, the last checkpoint where the average is worse, else the average;
with ``paper``, the average always. Early in a run, while the learning rate still rises, an average of
the last checkpoints lags the last one (issue 46); after a whole schedule it leads it. Only dev is read.
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
    from aiayn.speed.precision import autocast_context

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


def chosen(summary: dict, choose: str) -> str:
    """Which model the later stages get: "last" where ``choose`` (``average.choose``) is dev and the average is
    worse on dev by more than noise, else "averaged" (the paper's; ``choose`` paper)."""
    return "last" if choose == "dev" and summary["averaged_worse"] else "averaged"


def _steps(steps: list[int]) -> str:
    """``[206, 209, 219]`` -> "steps 206-219"; one step -> "step 219"."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def reported_model(summary: dict, reported: str) -> str:
    """What the reported model is, in words, for the report's tables and MLflow: "averaged, steps 206-219",
    or "last checkpoint, step 219: the average was worse on dev by ..."."""
    if reported == "averaged":
        kept = " (worse on dev than the last checkpoint; average.choose: paper)" if summary["averaged_worse"] else ""
        return f"averaged, {_steps(summary['averaged_steps'])}{kept}"
    return (f"last checkpoint, {_steps(summary['last_steps'])}: the average ({_steps(summary['averaged_steps'])}) was "
            f"worse on dev by {summary['dev_ppl_averaged'] - summary['dev_ppl_last']:.2f} perplexity "
            f"({summary['dev_ppl_averaged']:.2f} against {summary['dev_ppl_last']:.2f})")


def _worse(summary: dict) -> str:
    steps = ", ".join(str(step) for step in summary["averaged_steps"])
    return (f"the averaged model (steps {steps}) has dev perplexity {summary['dev_ppl_averaged']:.2f}, worse than the "
            f"last checkpoint's {summary['dev_ppl_last']:.2f} ({summary['last_checkpoint']}; NLL "
            f"+{summary['dev_nll_difference']:.4f} a token, noise {summary['dev_nll_noise']:.4f})")


def worse_warning(summary: dict) -> str:
    """One line naming both figures, for an average worse than the last checkpoint that is kept anyway
    (average.choose: paper)."""
    return f"warning: {_worse(summary)}; the averaged model is kept, as the paper's procedure (average.choose: paper)"


def last_chosen_line(summary: dict, output: str | os.PathLike) -> str:
    """The one line the stage prints when it writes the last checkpoint instead of the average."""
    return (f"note: {_worse(summary)}; {output} is the last checkpoint, which decode, score, the report and export "
            "use (average.choose: paper keeps the average)")
