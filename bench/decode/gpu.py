"""Beam-search decoding speed of the base model on a GPU, the shape of a newstest2014 run.

3003 sentences (newstest2014's count), beam 4, length penalty 0.6, bf16 autocast, the base model
(6+6 layers, d_model 512, 8 heads) with the paper's 37000-piece shared vocabulary. The weights are
random, so nothing here depends on a trained model; to make the work that of a real run, each
output has exactly as many tokens as its source (the model's EOS logit is pushed far down and the
search forces EOS at max_len = source length, max_len_a 1, max_len_b 0).

Source lengths: without the test set on the machine (a GPU node may have no internet), they are drawn
from a log-normal stand-in for news sentences in subword tokens (median --median-len, spread
--sigma, cut to 3-150); --lengths FILE uses real ones instead, one integer a line (for example the
token counts of newstest2014's English side under the run's SentencePiece model).

Prints sentences/s and target tokens/s (each output's EOS counted, as fairseq counts them). The
published anchor: CTranslate2 decodes about 6.6k target tokens/s in float32 on an A10G. On CUDA it
first counts the host synchronisations of one search with torch's sync debug mode: the search reads
the device once per step, and a few times per search outside its loop.

    PYTHONPATH=src python -m bench.decode.gpu                   # on the GPU
    PYTHONPATH=src python -m bench.decode.gpu --device cpu --sentences 40 --layers 2   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch

from aiayn.batching import length_sorted_batches
from aiayn.decode import resolve_tokens_per_batch
from aiayn.model import ModelConfig, Transformer
from aiayn.search import SearchConfig, beam_search, paper_search
from aiayn.speed.search_steps import FAST_STEPS
from aiayn.tokens import EOS_ID, PAD_ID
from bench.decode.cpu import NeverEnding  # torch and aiayn only at import: transformers is imported in its main


def source_lengths(args: argparse.Namespace) -> list[int]:
    if args.lengths:
        with open(args.lengths, encoding="utf-8") as handle:
            lengths = [int(line) for line in handle if line.strip()]
        return [max(1, length) for length in lengths[: args.sentences]]
    generator = torch.Generator().manual_seed(args.seed)
    normal = torch.randn(args.sentences, generator=generator, dtype=torch.float64)
    return [min(150, max(3, round(args.median_len * math.exp(args.sigma * float(z))))) for z in normal]


def count_synchronisations(model, ids, config: SearchConfig, autocast) -> tuple[int, int]:
    """The host synchronisations of one beam search, as torch's CUDA sync debug mode reports them, and
    its decoder steps."""
    steps = 0
    decode_step = model.decode_step

    def counted(*args):
        nonlocal steps
        steps += 1
        return decode_step(*args)

    model.decode_step = counted
    try:
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode(), autocast:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                beam_search(model, ids, config, steps=FAST_STEPS)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        del model.decode_step
    return sum("synchroniz" in str(warning.message) for warning in caught), steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=3003)
    parser.add_argument("--lengths", help="a file of source lengths in tokens, one a line (default: drawn)")
    parser.add_argument("--median-len", type=float, default=26.0)
    parser.add_argument("--sigma", type=float, default=0.5)
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--beam", type=int, default=paper_search()["beam_size"],
                        help="default: the schema's decode.beam_size")
    parser.add_argument("--tokens-per-batch", type=int, default=None,
                        help="padded source tokens x beam per batch (default: the decode stage's auto for the device)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    config = SearchConfig(beam_size=args.beam, max_len_b=0)  # the paper's alpha; outputs as long as their sources
    model_config = ModelConfig(vocab_size=args.vocab, n_layers=args.layers, d_model=args.d_model, d_ff=args.d_ff,
                               n_heads=args.heads, dropout=0.0)
    args.tokens_per_batch = resolve_tokens_per_batch(args.tokens_per_batch, device, model_config, config)
    torch.manual_seed(args.seed)
    model = NeverEnding(Transformer(model_config).to(device).eval())
    lengths = source_lengths(args)
    generator = torch.Generator().manual_seed(args.seed + 1)
    sources = [torch.randint(4, args.vocab, (length - 1,), generator=generator).tolist() + [EOS_ID]
               for length in lengths]
    batches = []
    for batch in length_sorted_batches(lengths, args.tokens_per_batch, args.beam):
        ids = torch.full((len(batch), max(lengths[i] for i in batch)), PAD_ID, dtype=torch.long)
        for row, index in enumerate(batch):
            ids[row, : lengths[index]] = torch.tensor(sources[index])
        batches.append(ids.to(device))
    target_tokens = sum(lengths) + len(lengths)  # each output: source-length tokens, then the forced EOS
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def run(selected) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode(), autocast:
            for ids in selected:
                beam_search(model, ids, config, steps=FAST_STEPS)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {args.precision}; {args.layers}+{args.layers} layers, d_model "
          f"{args.d_model}, vocab {args.vocab}; {len(lengths)} sentences, source tokens mean "
          f"{statistics.mean(lengths):.1f} median {statistics.median(lengths):.0f} max {max(lengths)}; "
          f"{len(batches)} batches of at most {args.tokens_per_batch} tokens x beam; beam {args.beam}")
    run(batches[:1] + batches[-1:])  # warm-up: allocator, kernels, the longest and the shortest batch
    if device.type == "cuda" and torch.cuda.is_available():
        syncs, steps = count_synchronisations(model, batches[0], config, autocast)
        print(f"host synchronisations in one search of {batches[0].shape[0]} sentences: {syncs} in {steps} steps "
              f"(the search reads the device once a step, and a few times before and after its loop)")
    with torch.inference_mode(), autocast:  # the planned work: source-length outputs
        for hypotheses, row in zip(beam_search(model, batches[-1], config, steps=FAST_STEPS), batches[-1].tolist()):
            assert len(hypotheses[0].tokens) == sum(token != PAD_ID for token in row), "another output length"
    seconds = statistics.median(run(batches) for _ in range(args.repeats))
    print(f"decode: {len(lengths) / seconds:.1f} sentences/s, {target_tokens / seconds:.0f} target tokens/s "
          f"({target_tokens} tokens in {seconds:.2f} s, median of {args.repeats}); "
          f"anchor: CTranslate2 fp32 on an A10G, about 6600 target tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
