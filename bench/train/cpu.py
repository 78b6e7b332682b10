"""Training throughput of our step against Hugging Face MarianMT at the same size, side by side.

Both models are the paper's post-norm, sinusoidal, shared-embedding Transformer built at the
same size, fed the same synthetic length-bucketed batches, trained with label-smoothed cross
entropy (0.1) and Adam at the same precision (the trainer's autocast context: in bf16 on the
CPU ours attends in bf16 as the trainer does, aiayn.speed.cpu_attention, and the peer through SDPA's math
kernel), one after the other, with the median of the timed steps reported.
With a peer on the CPU each model is timed in a fresh process: ours with freed host memory kept, as
`aiayn train` keeps it (aiayn.speed.host_memory), the peer as Hugging Face runs it (``--peer-host-memory
kept``: as ours). Ours is the trainer's objective: the chunked output projection and loss of
aiayn.loss. `transformers` is only needed for the peer:

    python3 -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install torch==2.13.0 transformers==5.23.0 numpy
    PYTHONPATH=src /tmp/benchvenv/bin/python -m bench.train.cpu            # CPU, base size
    PYTHONPATH=src python -m bench.train.cpu --device cuda --preset big --tokens 25000 --no-peer

Each precision's line also gives our step over its matmul floor (the step's linear-layer products
alone, timed at its shapes, after each timed step and in the same process: see ``matmul_rate`` and
``measure``) and, where the device's peak is known, model FLOPs utilisation of the sentences' own
FLOPs and of the padded batch's. The last line is `ratio=<ours/peer>` (target tokens per second) for the precision at which ours
is fastest, or `ratio=nan` without a peer.
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from aiayn.batching import Batch, padded_to_multiple
from aiayn.loss import TrainingObjective
from aiayn.model import ModelConfig
from aiayn.speed.host_memory import keep_freed_memory
from aiayn.speed.precision import autocast_context
from aiayn.train.hardware import COMPILE_MULTIPLE, adam, compiled, model_for_training, peak_flops
from aiayn.train.schedule import forward_flops

PRESETS = {  # (n_layers, d_model, d_ff, n_heads)
    "base": (6, 512, 2048, 8),
    "big": (6, 1024, 4096, 16),
    "small": (3, 256, 1024, 4),
    "demo": (2, 128, 512, 4),  # config/config.yaml's demo_base (with --vocab 2000 --tokens 3000 --threads 1)
    "tiny": (1, 64, 128, 2),  # a smoke test of this script (bench/gpu.sh --device cpu)
}


def synthetic_batches(vocab: int, tokens: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Length-bucketed batches: within a batch similar lengths (as our batcher makes), across batches 10-60."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        length = int(torch.randint(10, 60, (1,), generator=generator))
        rows = max(1, tokens // length)
        src_len = torch.randint(max(1, length - 3), length + 1, (rows,), generator=generator)
        tgt_len = torch.randint(max(1, length - 3), length + 1, (rows,), generator=generator)
        src = torch.randint(4, vocab, (rows, length), generator=generator)
        tgt = torch.randint(4, vocab, (rows, length + 1), generator=generator)
        src[torch.arange(length)[None, :] >= src_len[:, None]] = 0
        tgt[torch.arange(length + 1)[None, :] >= tgt_len[:, None] + 1] = 0
        tgt_in, tgt_out = tgt[:, :-1].clone(), tgt[:, 1:].clone()
        tgt_in[:, 0] = 2
        batches.append((src, tgt_in, tgt_out))
    return batches


def autocast(device: str, precision: str):
    """The trainer's precision context (aiayn.speed.precision.autocast_context), for both models."""
    return autocast_context(torch.device(device), precision)


def build_ours(config: ModelConfig, device: str, chunk_tokens: int | None = None):
    """The trainer's objective (aiayn.loss.TrainingObjective): encoder, decoder, then the chunked
    projection and label-smoothed loss, on the trainer's model for the device
    (aiayn.train.hardware.model_for_training); ``chunk_tokens`` None is the trainer's default."""
    objective = TrainingObjective(model_for_training(config, torch.device(device)), 0.1, chunk_tokens)

    def step(src, tgt_in, tgt_out):
        loss, _ = objective(src, tgt_in, tgt_out)
        return loss / (tgt_out != 0).sum()

    return objective, step


def build_marian(config: ModelConfig, device: str):
    from transformers import MarianConfig, MarianMTModel

    marian = MarianConfig(
        vocab_size=config.vocab_size, decoder_vocab_size=config.vocab_size, d_model=config.d_model,
        encoder_layers=config.n_layers, decoder_layers=config.n_layers, encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads, encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
        activation_function="relu", dropout=config.dropout, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=1024, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=3, decoder_start_token_id=2,
    )
    model = MarianMTModel._from_config(marian, attn_implementation="sdpa").to(device)

    def step(src, tgt_in, tgt_out):
        logits = model(input_ids=src, attention_mask=src != 0, decoder_input_ids=tgt_in,
                       decoder_attention_mask=tgt_in != 0).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt_out.reshape(-1),
                               ignore_index=0, label_smoothing=0.1)

    return model, step


def seconds_of(work, device: str) -> tuple[float, object]:
    """Wall-clock seconds of work() and its result, with the device's queue drained before and after."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def measure(build, config, batches, device: str, precision: str, warmup: int, compile_backend: str | None = None,
            warm_pass: bool = False, floor: bool = False) -> dict:
    """Median tokens/s and seconds of the steps after the first ``warmup`` batches. ``warm_pass`` first
    trains once, untimed, on every batch that will be timed: the process then holds the heap and the
    kernels its shapes need, as a long run does, and the timed steps measure that steady state rather
    than first-touch page faults and first-use kernel set-up of each new shape. ``floor`` times the
    step's matrix products alone (``matmul_rate``) right after each timed step, in the same process,
    and adds the median floor and the median of step/floor over the timed steps: each step is divided
    by a floor measured seconds from it, so that a machine whose speed drifts between minutes (a
    shared VM) moves both alike."""
    torch.manual_seed(0)
    model, step = build(config, device)
    if compile_backend:  # as the trainer compiles (aiayn.train.hardware.compiled), on batches padded as it pads them
        model.forward = compiled(model.forward, compile_backend)
        padded = [padded_to_multiple(Batch(*batch, 0, 0), COMPILE_MULTIPLE) for batch in batches]
        batches = [(batch.src, batch.tgt_in, batch.tgt_out) for batch in padded]
    model.train()
    optimizer = adam(model.parameters(), torch.device(device), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    times, tokens, flops, real_flops, floors = [], [], [], [], []
    schedule = list(enumerate(batches))
    if warm_pass:  # the timed batches once untimed (index -1), after the warmup ones
        schedule = schedule[:warmup] + [(-1, batch) for batch in batches[warmup:]] + schedule[warmup:]
    for index, (src, tgt_in, tgt_out) in schedule:
        src, tgt_in, tgt_out = src.to(device), tgt_in.to(device), tgt_out.to(device)

        def train_step():
            with autocast(device, precision):
                loss = step(src, tgt_in, tgt_out)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        elapsed, loss = seconds_of(train_step, device)
        if not math.isfinite(loss.item()):
            raise RuntimeError("non-finite loss in the benchmark")
        if index >= warmup:
            times.append(elapsed)
            tokens.append(int((tgt_out != 0).sum()))
            flops.append(3 * forward_flops(config, src.size(0), src.size(1), tgt_in.size(1)))
            real_flops.append(3 * sentence_flops(config, src, tgt_out))
            if floor:
                floors.append(flops[-1] / matmul_rate(config, int(src.numel()), device, precision, repeats=1))
    rates = [t / s for t, s in zip(tokens, times)]
    result = {"tokens_per_second": statistics.median(rates), "step_seconds": statistics.median(times),
              "flops_per_second": statistics.median([f / s for f, s in zip(flops, times)]),
              "real_flops_per_second": statistics.median([f / s for f, s in zip(real_flops, times)])}
    if floor:
        result["floor_seconds"] = statistics.median(floors)
        result["floor_flops_per_second"] = statistics.median([f / s for f, s in zip(flops, floors)])
        result["step_over_floor"] = statistics.median([t / f for t, f in zip(times, floors)])
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_apart(build, config, batches, device: str, precision: str, warmup: int, *, kept_memory: bool,
                  apart: bool, **options) -> dict:
    """``measure``; where ``apart`` (a peer is timed too) and on the CPU, in a fresh process, so that
    no model inherits another's heap, with host memory kept (aiayn.speed.host_memory) where ``kept_memory``,
    as `aiayn train` keeps it. Otherwise in this process, which keeps its memory (``main``); a GPU's
    caching allocator holds device memory either way. ``options`` go to ``measure``."""
    args = (build, config, batches, device, precision, warmup)
    if device != "cpu" or not apart:
        return measure(*args, **options)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure_in_child, (torch.get_num_threads(), kept_memory, args, options))


def _measure_in_child(threads: int, kept_memory: bool, args: tuple, options: dict) -> dict:
    torch.set_num_threads(threads)
    if kept_memory:
        keep_freed_memory()
    return measure(*args, **options)


def sentence_flops(config: ModelConfig, src: torch.Tensor, tgt_out: torch.Tensor) -> float:
    """The forward FLOPs of a batch's sentences each at its own length: the model's useful work,
    without what padding adds (forward_flops counts the padded batch, as the hardware does it)."""
    src_lengths = (src != 0).sum(dim=1).tolist()
    tgt_lengths = (tgt_out != 0).sum(dim=1).tolist()
    return sum(forward_flops(config, 1, s, t) for s, t in zip(src_lengths, tgt_lengths))


def matmul_rate(config: ModelConfig, tokens: int, device: str, precision: str, repeats: int = 3) -> float:
    """FLOP/s of this device's matrix multiplies at a step's own shapes: every linear layer's forward
    product and its two backward products (input and weight gradients), each timed alone, summed.

    3 * forward_flops / this rate is the step time of an implementation that did nothing but those
    multiplies at this speed: no attention softmax, no layer norm, no optimizer. A peer's step time
    over it is the highest ratio against that peer these FLOPs allow."""
    d, ff, width = config.d_model, config.d_ff, config.n_heads * config.head_dim
    linears = [(d, 3 * width), (width, d), (d, width), (d, ff), (ff, d), (d, config.vocab_size)]
    total_flops, total_seconds = 0.0, 0.0
    generator = torch.Generator(device=device).manual_seed(0)
    for fan_in, fan_out in linears:
        x = torch.randn(tokens, fan_in, device=device, generator=generator)
        w = torch.randn(fan_out, fan_in, device=device, generator=generator)
        g = torch.randn(tokens, fan_out, device=device, generator=generator)
        products = [lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x]  # forward, input grad, weight grad
        for product in products:
            def run(product=product):
                with autocast(device, precision):
                    return product()

            run()
            seconds = [seconds_of(run, device)[0] for _ in range(repeats)]
            total_flops += 2.0 * tokens * fan_in * fan_out
            total_seconds += statistics.median(seconds)
    return total_flops / total_seconds


def describe(measured: dict, peak: float | None, project_steps: int) -> str:
    """tokens/s and seconds a step; MFU when the device's peak is known; the hours for project_steps steps."""
    text = f"{measured['tokens_per_second']:.0f} tok/s ({measured['step_seconds']:.3f} s/step)"
    if peak:  # model FLOPs utilisation: the sentences' own FLOPs, then the padded batch's
        text += (f", MFU {measured['real_flops_per_second'] / peak:.1%} "
                 f"({measured['flops_per_second'] / peak:.1%} counting pads)")
    if project_steps:
        text += f", {project_steps} steps = {project_steps * measured['step_seconds'] / 3600:.1f} h"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=4000, help="target tokens per step (and about as many source)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="also time our model under torch.compile")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend ('eager' only traces: a quick smoke test of the compiled path)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--warm-pass", action=argparse.BooleanOptionalAction, default=True,
                        help="train once untimed on each timed batch first, so that steps are timed in the steady state "
                             "of a long run (default; --no-warm-pass times each shape's first use)")
    parser.add_argument("--peer-host-memory", choices=["default", "kept"], default="default",
                        help="the peer's malloc: as Hugging Face runs it (default), or with freed memory kept as "
                             "`aiayn train` keeps it (ours always is)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="target tokens per chunk of our output projection and loss (default: the trainer's, "
                             "aiayn.loss.CHUNK_ELEMENTS / vocab)")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip timing the step's matrix products alone (the floor that step/floor divides by)")
    parser.add_argument("--project-steps", type=int, default=0,
                        help="also print the hours this many steps would take at the measured speed")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # for ours when no peer is timed (each model then runs in this process)
    layers, d_model, d_ff, heads = PRESETS[args.preset]
    config = ModelConfig(vocab_size=args.vocab, n_layers=layers, d_model=d_model, d_ff=d_ff, n_heads=heads)
    batches = synthetic_batches(args.vocab, args.tokens, args.warmup + args.steps)
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    peer = not args.no_peer
    if peer:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: no peer (see this file's docstring to install it)", file=sys.stderr)
            peer = False
    print(f"# {args.preset} ({layers} layers, d_model {d_model}), vocab {args.vocab}, {args.tokens} target tokens/step, "
          f"{args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    best = None
    ours_build = functools.partial(build_ours, chunk_tokens=args.chunk)
    for precision in precisions:
        timing = dict(warm_pass=args.warm_pass, floor=not args.no_floor)
        peak = peak_flops(torch.device(args.device), precision)
        ours = measure_apart(ours_build, config, batches, args.device, precision, args.warmup, kept_memory=True,
                             apart=peer, **timing)
        line = f"{precision}: ours {describe(ours, peak, args.project_steps)}"
        if args.compile:  # eager printed first: a compile that runs out of time loses only its own line
            print(line, flush=True)
            ours_compiled = measure_apart(ours_build, config, batches, args.device, precision, args.warmup,
                                          kept_memory=True, apart=peer, compile_backend=args.compile_backend,
                                          **timing)
            line = f"{precision}: ours compiled ({args.compile_backend}) {describe(ours_compiled, peak, args.project_steps)}"
            if ours_compiled["tokens_per_second"] > ours["tokens_per_second"]:
                ours = {**ours_compiled, "which": "compiled"}
        ratio = float("nan")
        if peer:
            marian = measure_apart(build_marian, config, batches, args.device, precision, args.warmup,
                                   kept_memory=args.peer_host_memory == "kept", apart=True, **timing)
            ratio = ours["tokens_per_second"] / marian["tokens_per_second"]
            line += f"; marian {marian['tokens_per_second']:.0f} tok/s; ratio {ratio:.2f}"
        if not args.no_floor:
            line += (f"; the matmuls alone at the step's shapes, timed after each of its steps, run at "
                     f"{ours['floor_flops_per_second'] / 1e9:.0f} GFLOP/s, a step of nothing but them would take "
                     f"{ours['floor_seconds']:.3f} s: ours{' ' + ours['which'] if 'which' in ours else ''} "
                     f"step/floor {ours['step_over_floor']:.2f}")
            if peer:
                line += (f", marian's {marian['step_over_floor']:.2f} "
                         f"(its floor {marian['floor_flops_per_second'] / 1e9:.0f} GFLOP/s)")
        print(line, flush=True)
        if best is None or ours["tokens_per_second"] > best[0]:
            best = (ours["tokens_per_second"], ratio)
    print(f"ratio={best[1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
