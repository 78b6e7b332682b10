"""Training steps cold and warm, on the trainer's own batches: bench/gpu.sh's part 4, the speed of a step on a GPU.

A step on shapes the process has not run before (cold) pays for them once: cuDNN's attention plans, the
matrix kernels' choice, a compile's graphs; the same step again (warm) does not (BENCHMARKS.md, "GPU", has
the figures). For each variant, in one process and model:

    first  the variant's first step (the process's one-off set-up; under --compile, the compile)
    cold   --cold steps, each on micro-batch shapes that no earlier step of this process had (median)
    warm   the same steps again, --warm-passes times (median); tokens/s, MFU, step over its matmul floor

Batches: ``real`` are the trainer's: aiayn.batching.step_batches and split_step over WMT-like lengths
(log-normal, median 24 tokens, sigma 0.6, targets within about 20% of their sources), cut on lengths
bucketed as train.shape_buckets does on CUDA (aiayn.speed.shapes.bucketed_lengths), collated and grown to
the step's shape as aiayn.train.steps grows them; the ids are random. ``synthetic`` are bench.train.cpu's
(one micro-batch a step, lengths 10-60, as the 2026-12-04 figures were measured). The objective is the
trainer's (TrainingObjective, its loss chunk), under its autocast and train.attention's SDPA kernels.

Variants: each preset's eager step (train.attention auto) on each kind of batches, and on the first
preset's real batches each other --attention choice. With --compile, each preset's compiled step instead,
each in a child process stopped when --seconds are spent (a compile of base can outlast a short run).
Each variant's figures are one JSON line appended to --results; ``table`` prints them as one table.

    PYTHONPATH=src python -m bench.train.gpu measure --presets base big --results steps.jsonl
    PYTHONPATH=src python -m bench.train.gpu measure --presets base big --compile --seconds 150 --results steps.jsonl
    PYTHONPATH=src python -m bench.train.gpu table --results steps.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from aiayn.batching import Batch, padded_to_multiple
from aiayn.loss import TrainingObjective
from aiayn.model import ModelConfig
from aiayn.tokens import PAD_ID
from aiayn.speed.precision import attention_kernels, autocast_context
from aiayn.train.hardware import (COMPILE_MULTIPLE, adam, compiled, loss_chunk_tokens, model_for_training,
                                  peak_flops)
from aiayn.train.schedule import forward_flops
from bench.train.cpu import PRESETS, matmul_rate, seconds_of, sentence_flops, synthetic_batches
from bench.train.shapes import lognormal_lengths, step_source

PAPER_STEPS = {"base": 100000, "big": 300000}  # the paper's runs, for the projected hours


class RandomPairs:
    """What collate reads of a binarized split (aiayn.binarize), at the given lengths, with random ids."""

    def __init__(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray, vocab: int, seed: int):
        rng = np.random.default_rng(seed + 1)
        self.src_lengths, self.tgt_lengths = src_lengths, tgt_lengths
        self.src_offsets = np.concatenate([[0], np.cumsum(src_lengths)])
        self.tgt_offsets = np.concatenate([[0], np.cumsum(tgt_lengths)])
        self.src_ids = rng.integers(4, vocab, int(self.src_offsets[-1]), dtype=np.int32)
        self.tgt_ids = rng.integers(4, vocab, int(self.tgt_offsets[-1]), dtype=np.int32)


@dataclass
class Step:
    shapes: tuple                     # (rows, src_len, tgt_len) of each micro-batch, as computed
    make: Callable[[], list[Batch]]   # its micro-batches, collated on the host


def trainer_steps(args, compile: bool) -> tuple[list[Step], str]:
    """One epoch's steps of WMT-like pairs as the trainer cuts and pads them (aiayn.train.steps.StepSource;
    see the module's docstring)."""
    src, tgt = lognormal_lengths(24, 0.6, args.pairs, args.seed)  # WMT'14 EN-DE-shaped
    bucketed = args.shape_buckets == "on"
    source = step_source(RandomPairs(src, tgt, args.vocab, args.seed), bucketed, args.tokens, args.device_tokens,
                         gpus=1, seed=args.seed, compile=compile)

    def up(size: int) -> int:  # as padded_to_multiple grows a batch under train.compile
        return -(-size // COMPILE_MULTIPLE) * COMPILE_MULTIPLE if compile else size

    def make(micro, shape):
        return [source.batch(part, shape, index) for index, part in enumerate(micro)]

    steps = []
    for rows in source.steps_of(0):
        micro, shape = source.micro_batches(rows)
        shapes = tuple(tuple(up(size) for size in micro_shape) for micro_shape in shape.shapes)
        steps.append(Step(shapes, functools.partial(make, micro, shape)))
    epoch_shapes = len({shape for step in steps for shape in step.shapes})
    how = "cut on bucketed lengths (train.shape_buckets)" if bucketed else "cut on exact lengths"
    return steps, (f"{args.pairs} pairs of log-normal lengths (median 24, sigma 0.6), {how}: {len(steps)} steps, "
                   f"{epoch_shapes} distinct micro-batch shapes in the epoch")


def synthetic_steps(args, compile_multiple: int | None) -> list[Step]:
    steps = []
    for src, tgt_in, tgt_out in synthetic_batches(args.vocab, args.tokens, 8 * (args.cold + 1), args.seed):
        batch = Batch(src, tgt_in, tgt_out, int((src != PAD_ID).sum()), int((tgt_out != PAD_ID).sum()))
        if compile_multiple:
            batch = padded_to_multiple(batch, compile_multiple)
        steps.append(Step(((*batch.src.shape, batch.tgt_in.shape[1]),), lambda batch=batch: [batch]))
    return steps


def take(steps: list[Step], count: int, seen: set) -> list[Step]:
    """``count`` steps whose micro-batch shapes no step taken before in this process had."""
    chosen = []
    for step in steps:
        if len(chosen) < count and seen.isdisjoint(step.shapes):
            seen.update(step.shapes)
            chosen.append(step)
    if len(chosen) < count:
        raise SystemExit(f"error: only {len(chosen)} steps on shapes not yet run are left; raise --pairs")
    return chosen


def attention_context(name: str, device: torch.device):
    """train.attention's SDPA kernels (aiayn.speed.precision.attention_kernels) on CUDA; the trainer's CPU
    path attends without SDPA, so nothing there."""
    return attention_kernels(name) if device.type == "cuda" else contextlib.nullcontext()


def measure(args, preset: str, kind: str, pool: list[Step], seen: set, attention: str, backend: str | None) -> dict:
    """First, cold and warm steps of one variant (see the module's docstring); its figures."""
    layers, d_model, d_ff, heads = PRESETS[preset]
    config = ModelConfig(vocab_size=args.vocab, n_layers=layers, d_model=d_model, d_ff=d_ff, n_heads=heads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    chunk = loss_chunk_tokens(device, args.vocab, 2 * args.device_tokens)  # the trainer's loss chunk on this device
    objective = TrainingObjective(model_for_training(config, device), 0.1, chunk)
    if backend:  # as the trainer compiles (aiayn.train.hardware.compiled)
        objective.forward = compiled(objective.forward, backend)
    objective.train()
    optimizer = adam(objective.parameters(), device, lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    steps = [step.make() for step in take(pool, 1 + args.cold, seen)]  # on the host, untimed

    def run(micro: list[Batch]) -> float:
        real = sum(batch.tgt_tokens for batch in micro)

        def work():
            with autocast_context(device, args.precision), attention_context(attention, device):
                for batch in micro:  # to the device inside the step, as the trainer moves them
                    batch = batch.to(device)
                    loss, _ = objective(batch.src, batch.tgt_in, batch.tgt_out, batch.tgt_real)
                    (loss / real).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        seconds, loss = seconds_of(work, args.device)
        if not math.isfinite(loss.item()):
            raise RuntimeError("non-finite loss in the benchmark")
        return seconds

    name = f"{preset} {'compiled (' + backend + ')' if backend else 'eager'}, attention {attention}, {kind} batches"
    if backend:
        print(f"{name}: compiling (the first step)...", flush=True)
    first = run(steps[0])
    timed = steps[1:]
    cold = [run(step) for step in timed]
    warm = [run(step) for _ in range(args.warm_passes) for step in timed]
    floors = [sum(3 * forward_flops(config, *b.src.shape, b.tgt_in.shape[1])
                  / matmul_rate(config, int(b.src.numel()), args.device, args.precision, repeats=1) for b in step)
              for step in timed]
    flops = [3 * sum(forward_flops(config, *b.src.shape, b.tgt_in.shape[1]) for b in step) for step in timed]
    real_flops = [3 * sum(sentence_flops(config, b.src, b.tgt_out) for b in step) for step in timed]
    tokens = [sum(b.tgt_tokens for b in step) for step in timed]
    padded = sum(b.src.numel() + b.tgt_in.numel() for step in timed for b in step)
    peak = peak_flops(device, args.precision)
    passes = args.warm_passes
    result = {
        "preset": preset, "batches": kind, "attention": attention,
        "step": f"compiled ({backend})" if backend else "eager",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "vocab": args.vocab, "tokens": args.tokens, "cold_steps": len(cold), "warm_steps": len(warm),
        "shapes": len({(*b.src.shape, b.tgt_in.shape[1]) for step in timed for b in step}),
        "first_s": first, "cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
        "tgt_tokens_per_step": statistics.mean(tokens), "cold_tok_s": sum(tokens) / sum(cold),
        "warm_tok_s": passes * sum(tokens) / sum(warm), "floor_s": statistics.median(floors),
        "padded_over_real": padded / sum(b.src_tokens + b.tgt_tokens for step in timed for b in step),
        "cold_mfu": sum(real_flops) / sum(cold) / peak if peak else None,
        "warm_mfu": passes * sum(real_flops) / sum(warm) / peak if peak else None,
        "warm_mfu_padded": passes * sum(flops) / sum(warm) / peak if peak else None,
    }
    result["warm_over_floor"] = result["warm_s"] / result["floor_s"]
    mfu = (f", MFU {result['cold_mfu']:.1%} cold, {result['warm_mfu']:.1%} warm ({result['warm_mfu_padded']:.1%} "
           f"counting pads)" if peak else "")
    steps_planned = PAPER_STEPS.get(preset)
    hours = f"; {steps_planned} steps = {steps_planned * result['warm_s'] / 3600:.1f} h warm" if steps_planned else ""
    print(f"{name}: first step {first:.3f} s; cold {result['cold_s']:.3f} s/step ({len(cold)} steps on new shapes), "
          f"warm {result['warm_s']:.3f} s/step (the same, {passes}x): {result['cold_tok_s']:.0f} -> "
          f"{result['warm_tok_s']:.0f} tok/s{mfu}; warm step/floor {result['warm_over_floor']:.2f}{hours}", flush=True)
    del objective, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def append(path: Path, result: dict) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(result) + "\n")


def eager(args) -> int:
    """The eager variants, in this process (see the module's docstring)."""
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    pools, seen = {}, set()
    if "real" in args.batches:
        pools["real"], note = trainer_steps(args, compile=False)
        print(f"# {name}, torch {torch.__version__}, {args.precision}; vocab {args.vocab}, {args.tokens} target tokens "
              f"a step, micro-batches of at most {args.device_tokens}; real batches: {note}", flush=True)
    if "synthetic" in args.batches:
        pools["synthetic"] = synthetic_steps(args, None)
    attention = list(args.attention)
    variants = []
    for kind in args.batches:
        variants += [(preset, kind, "auto") for preset in args.presets]
        if kind == args.batches[0]:
            variants += [(args.presets[0], kind, choice) for choice in attention if choice != "auto"]
    for preset, kind, choice in variants:
        append(args.results, measure(args, preset, kind, pools[kind], seen, choice, None))
    return 0


def compiled_children(args, argv: list[str]) -> int:
    """Each preset's compiled step in a child process of its own, stopped (with its compile workers) when
    --seconds are spent; a preset that has too little time left is skipped with a line."""
    start = time.monotonic()
    for preset in args.presets:
        left = args.seconds - (time.monotonic() - start) if args.seconds else None
        label = f"{preset} compiled ({args.compile_backend})"
        if left is not None and left < args.min_seconds:
            print(f"{label}: skipped, {left:.0f} s left of this part, under the {args.min_seconds:.0f} s a compile "
                  f"is given (compiling base took over 105 s on 2026-12-04)", flush=True)
            append(args.results, {"preset": preset, "step": label.split(" ", 1)[1], "skipped_s": max(left, 0)})
            continue
        child = subprocess.Popen([sys.executable, "-m", __spec__.name, *argv, "--presets", preset, "--child"],
                                 start_new_session=True)
        try:
            child.wait(timeout=left)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=grace)
                    break
            print(f"{label}: not done after {left:.0f} s, stopped: no compiled figure", flush=True)
            append(args.results, {"preset": preset, "step": label.split(" ", 1)[1], "unfinished_s": left})
            continue
        if child.returncode != 0:
            return child.returncode
    return 0


def compiled_child(args) -> int:
    if args.batches[0] == "real":
        pool = trainer_steps(args, compile=True)[0]
    else:
        pool = synthetic_steps(args, COMPILE_MULTIPLE)
    append(args.results, measure(args, args.presets[0], args.batches[0], pool, set(), "auto", args.compile_backend))
    return 0


def table(args) -> int:
    """The variants of --results as one table, and which attention choice was fastest."""
    lines = args.results.read_text().splitlines() if args.results.exists() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    print("| preset | step | attention | batches | first s | cold s | warm s | cold/warm | warm tok/s | MFU cold "
          "| MFU warm | warm/floor | paper steps, h warm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "warm_s" not in row:
            why = (f"not done after {row['unfinished_s']:.0f} s" if "unfinished_s" in row else
                   f"skipped: {row.get('skipped_s', 0):.0f} s left")
            print(f"| {row['preset']} | {row['step']} | | | {why} | | | | | | | | |")
            continue

        def percent(key):
            return f"{row[key]:.1%}" if row.get(key) is not None else "-"

        steps = PAPER_STEPS.get(row["preset"])
        hours = f"{steps * row['warm_s'] / 3600:.1f}" if steps else "-"
        print(f"| {row['preset']} | {row['step']} | {row['attention']} | {row['batches']} | {row['first_s']:.2f} "
              f"| {row['cold_s']:.3f} | {row['warm_s']:.3f} | {row['cold_s'] / row['warm_s']:.1f} "
              f"| {row['warm_tok_s']:.0f} "
              f"| {percent('cold_mfu')} | {percent('warm_mfu')} | {row['warm_over_floor']:.2f} | {hours} |")
    for preset in dict.fromkeys(row["preset"] for row in rows):
        choices = [row for row in rows if "warm_s" in row and row["preset"] == preset and row["step"] == "eager"
                   and row["batches"] == "real"]
        if len({row["attention"] for row in choices}) < 2:
            continue
        for key in ("cold_s", "warm_s"):
            best = min(choices, key=lambda row: row[key])
            print(f"train.attention, {preset} on real batches: fastest {key[:4]} step {best['attention']} "
                  f"({best[key]:.3f} s; " + ", ".join(f"{row['attention']} {row[key]:.3f}" for row in choices) + ")")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("measure")
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["base", "big"])
    p.add_argument("--batches", nargs="+", choices=["real", "synthetic"], default=["real", "synthetic"])
    p.add_argument("--attention", nargs="+", choices=["auto", "cudnn", "flash", "efficient", "math"],
                   default=["auto", "cudnn", "flash", "efficient"],
                   help="train.attention choices timed on the first preset")
    p.add_argument("--vocab", type=int, default=37000)
    p.add_argument("--tokens", type=int, default=25000, help="target tokens a step (tokens_per_step)")
    p.add_argument("--device-tokens", type=int, default=None, help="a micro-batch's most tokens (default: --tokens)")
    p.add_argument("--pairs", type=int, default=200000, help="pairs of the real batches' epoch")
    p.add_argument("--shape-buckets", choices=["on", "off"], default="on")
    p.add_argument("--cold", type=int, default=3, help="timed steps on new shapes (then the same warm)")
    p.add_argument("--warm-passes", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="the compiled step, each preset in a child process")
    p.add_argument("--compile-backend", default="inductor", help="'eager' only traces: a smoke test of the path")
    p.add_argument("--seconds", type=float, default=None, help="with --compile: stop the children after this long")
    p.add_argument("--min-seconds", type=float, default=60.0, help="with --compile: skip a preset with less left")
    p.add_argument("--results", type=Path, required=True, help="a JSON-lines file each variant appends to")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p = commands.add_parser("table")
    p.add_argument("--results", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "table":
        return table(args)
    args.device_tokens = args.device_tokens or args.tokens
    if args.child:
        return compiled_child(args)
    if args.compile:
        return compiled_children(args, [arg for arg in argv if arg != "--child"])
    return eager(args)


if __name__ == "__main__":
    raise SystemExit(main())
