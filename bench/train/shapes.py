"""How many micro-batch shapes an epoch brings, and what padding costs, with and without train.shape_buckets.

The steps are drawn as the trainer draws them (aiayn.train.steps.StepSource) from a binarized split's
lengths (``--split``, as the DAG writes it) or from log-normal lengths (``--lognormal MEDIAN SIGMA PAIRS``:
sources with that median and spread in BPE tokens, targets within about 20% of them, cut to 250). Prints,
for each: steps, distinct shapes, and padded over real tokens (computed positions per non-pad token).

    PYTHONPATH=src python -m bench.train.shapes --split results/multi30k/bin/train --tokens-per-step 4000 --gpus 0
    PYTHONPATH=src python -m bench.train.shapes --lognormal 26 0.5 3003             # newstest2014-shaped
    PYTHONPATH=src python -m bench.train.shapes --lognormal 24 0.6 4500000 --gpus 8  # WMT'14 EN-DE-sized
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np

from aiayn.config import section_defaults
from aiayn.train.steps import Progress, StepSource, TrainSettings


def lognormal_lengths(median: float, sigma: float, pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """BPE lengths of ``pairs`` pairs: log-normal sources (``median``, ``sigma``), targets within about 20% of
    them, cut to binarize's 250 (median 24, sigma 0.6: WMT'14 EN-DE's training pairs)."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(pairs))), 1, 250).astype(np.int64)
    tgt = np.clip(np.round(src * np.exp(0.2 * rng.standard_normal(pairs))), 1, 250).astype(np.int64)
    return src, tgt


def step_source(split, buckets: bool, tokens_per_step: int, device_tokens: int, gpus: int, seed: int = 1,
                compile: bool = False) -> StepSource:
    """The trainer's steps (aiayn.train.steps.StepSource) over a split's lengths, with these train settings
    and the train section's defaults for the rest."""
    preset = {"steps": 1, "warmup_steps": 1, "lr_scale": 1.0, "label_smoothing": 0.1, "keep_checkpoints": 1,
              "average_last": 1, "checkpoint_steps": 1, "checkpoint_minutes": None, "gpus": gpus}
    train = {**section_defaults("train"), "tokens_per_step": tokens_per_step, "device_tokens": device_tokens,
             "shape_buckets": buckets, "compile": compile}
    return StepSource(split, TrainSettings.from_config(preset, train, seed=seed))


def epoch(src: np.ndarray, tgt: np.ndarray, buckets: bool, tokens_per_step: int, device_tokens: int,
          gpus: int) -> dict:
    """One epoch's steps as the trainer draws them: their count, distinct micro-batch shapes, padding."""
    source = step_source(SimpleNamespace(src_lengths=src, tgt_lengths=tgt), buckets, tokens_per_step, device_tokens,
                         gpus)
    progress, shapes, real, padded = Progress(), set(), 0, 0
    for _ in source.steps_of(0):
        _, shape = source.next(progress)
        shapes.update(shape.shapes)
        real += shape.real_src + shape.real_tgt
        padded += shape.padded_src + shape.padded_tgt
    return {"steps": len(source.steps_of(0)), "shapes": len(shapes), "padded_over_real": padded / real}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--split", help="a binarized split folder (results/<experiment>/bin/train)")
    source.add_argument("--lognormal", nargs=3, type=float, metavar=("MEDIAN", "SIGMA", "PAIRS"))
    parser.add_argument("--tokens-per-step", type=int, default=25000)
    parser.add_argument("--device-tokens", type=int, default=12500)
    parser.add_argument("--gpus", type=int, default=1, help="the preset's gpus: micro-batches a step are a multiple")
    args = parser.parse_args(argv)
    if args.split:
        from aiayn.binarize import load_split

        split = load_split(args.split)
        src, tgt, what = split.src_lengths, split.tgt_lengths, f"{args.split} ({len(split)} pairs)"
    else:
        median, sigma, pairs = args.lognormal
        src, tgt = lognormal_lengths(median, sigma, int(pairs))
        what = f"log-normal lengths, median {median:g}, sigma {sigma:g}, {int(pairs)} pairs"
    print(f"# {what}; {args.tokens_per_step} tokens a step, micro-batches of at most {args.device_tokens}, "
          f"gpus {args.gpus}")
    rows = {buckets: epoch(src, tgt, buckets, args.tokens_per_step, args.device_tokens, args.gpus)
            for buckets in (False, True)}
    for buckets, row in rows.items():
        print(f"shape_buckets {str(buckets).lower():5}: {row['steps']} steps, {row['shapes']} distinct micro-batch "
              f"shapes, padded/real tokens {row['padded_over_real']:.4f}")
    added = rows[True]["padded_over_real"] / rows[False]["padded_over_real"] - 1
    print(f"buckets: {rows[True]['shapes'] / rows[False]['shapes']:.2f}x the shapes, {added:+.1%} computed positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
