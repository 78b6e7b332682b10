"""Beam-search decoding speed on the CPU: aiayn's search beside Hugging Face MarianMT's ``generate``.

Both sides get the same work, so that target tokens per second compare like for like:

- the same architecture (post-norm encoder-decoder, ReLU feed-forward, sinusoidal positions, one
  shared embedding matrix tied to the output layer), the same sizes, both randomly initialised
  (their weights cannot be shared, and speed does not depend on their values);
- the same synthetic source sentences (random ids, EOS-terminated, seeded), cut into the same
  length-sorted batches (aiayn's own batching at tokens_per_batch);
- beam 4, length penalty 0.6, float32, torch threads set by --threads (default 2);
- exactly --target-len decoder steps for every sentence, so that early stopping and EOS timing
  cannot make one side do less: aiayn's model has its EOS logit pushed far below the rest (it
  never ends by itself) and decodes target_len - 1 tokens plus the EOS forced at its maximum
  length (max_len_a = 0, max_len_b = target_len - 1); Marian runs with min_new_tokens =
  max_new_tokens = target_len and no forced EOS. Both count target_len tokens a sentence.

aiayn is timed twice a round: one batch at a time with all --threads (as Marian runs), and with
--workers batches at once sharing them (``search_batches``, the decode stage's ``workers`` key).
The runs alternate and the medians are reported; the last line is ``ratio=<aiayn tokens/s / Marian
tokens/s>`` for the faster of aiayn's two settings (the line before it gives the 1-worker ratio).

transformers is not a dependency of the project; run this from a scratch environment:

    python3 -m venv /tmp/benchvenv
    /tmp/benchvenv/bin/pip install torch==2.13.0 transformers==5.23.0 sentencepiece==0.2.3 numpy tqdm
    PYTHONPATH=src /tmp/benchvenv/bin/python -m bench.decode.cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from aiayn.batching import length_sorted_batches
from aiayn.decode import search_batches
from aiayn.model import ModelConfig, Transformer
from aiayn.search import SearchConfig, paper_search
from aiayn.speed.incremental import InferenceModel
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID

MISSING_TRANSFORMERS = 3


class NeverEnding(InferenceModel):
    """A Transformer that ends only when the search forces EOS at its maximum length, so every output
    has the same length."""

    def decode_step(self, tokens, position, cache):
        logits = super().decode_step(tokens, position, cache)
        logits[:, EOS_ID] -= 1e4  # exp(-1e4) is 0 in float32: EOS only where the search forces it
        return logits


def synthetic_sources(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(4, vocab, (length,), generator=generator).tolist() + [EOS_ID] for length in lengths]


def padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), longest), PAD_ID, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
    return ids, ids.ne(PAD_ID).long()


def run_aiayn(model, batches, config: SearchConfig, target_len: int, workers: int = 1) -> float:
    start = time.perf_counter()
    for hypotheses in search_batches(model, [ids for ids, _ in batches], config, workers):
        for sentence in hypotheses:
            assert len(sentence[0].tokens) + 1 == target_len, "aiayn decoded another length"
    return time.perf_counter() - start


def run_marian(model, batches, generation_config, target_len: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            output = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config)
            assert output.shape[1] == target_len + 1, "Marian decoded another length"  # + decoder start
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--min-src-len", type=int, default=10, help="source tokens before EOS, at least")
    parser.add_argument("--max-src-len", type=int, default=40)
    parser.add_argument("--target-len", type=int, default=30, help="decoder steps (target tokens) per sentence")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6, help="encoder layers and decoder layers, each")
    parser.add_argument("--beam", type=int, default=paper_search()["beam_size"],
                        help="default: the schema's decode.beam_size")
    parser.add_argument("--alpha", type=float, default=paper_search()["length_penalty"])
    parser.add_argument("--tokens-per-batch", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2,
                        help="aiayn's batches searched at once (search_batches), sharing the threads; also timed with 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    try:
        import transformers
        from transformers import GenerationConfig, MarianConfig, MarianMTModel
    except ImportError:
        print(
            "transformers is not installed here (it is not a dependency of aiayn). Run the benchmark from a "
            "scratch environment:\n  python3 -m venv /tmp/benchvenv\n  /tmp/benchvenv/bin/pip install "
            "torch==2.13.0 transformers==5.23.0 sentencepiece==0.2.3 numpy tqdm\n"
            "  PYTHONPATH=src /tmp/benchvenv/bin/python -m bench.decode.cpu",
            file=sys.stderr,
        )
        return MISSING_TRANSFORMERS

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ours = NeverEnding(Transformer(ModelConfig(
        vocab_size=args.vocab, n_layers=args.layers, d_model=args.d_model, d_ff=args.d_ff, n_heads=args.heads,
        dropout=0.0, max_positions=1024,
    )).eval())
    torch.manual_seed(args.seed)
    peer = MarianMTModel(MarianConfig(
        vocab_size=args.vocab, decoder_vocab_size=args.vocab, max_position_embeddings=1024,
        encoder_layers=args.layers, decoder_layers=args.layers, d_model=args.d_model,
        encoder_ffn_dim=args.d_ff, decoder_ffn_dim=args.d_ff,
        encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        activation_function="relu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
    )).eval()
    generation_config = GenerationConfig(
        num_beams=args.beam, length_penalty=args.alpha, do_sample=False, num_return_sequences=1,
        max_new_tokens=args.target_len, min_new_tokens=args.target_len, early_stopping=True, use_cache=True,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID,
    )
    search = SearchConfig(beam_size=args.beam, length_penalty=args.alpha, max_len_a=0.0,
                          max_len_b=args.target_len - 1)

    sentences = synthetic_sources(args.sentences, args.min_src_len, args.max_src_len, args.vocab, args.seed)
    order = length_sorted_batches([len(s) for s in sentences], args.tokens_per_batch, args.beam)
    batches = [padded([sentences[i] for i in batch]) for batch in order]
    target_tokens = args.sentences * args.target_len
    trainable = lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)  # noqa: E731
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {args.layers}+{args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, {args.heads} heads, "
          f"vocab {args.vocab}; trainable parameters aiayn {trainable(ours.model):,}, Marian {trainable(peer):,}")
    print(f"work: {args.sentences} sentences of {args.min_src_len}-{args.max_src_len} source tokens + EOS, "
          f"{len(batches)} batches, beam {args.beam}, alpha {args.alpha}, {args.target_len} target tokens each "
          f"({target_tokens} in all), float32")

    warmup = batches[-1:]
    run_aiayn(ours, warmup, search, args.target_len)
    run_marian(peer, warmup, generation_config, args.target_len)
    sides = {"marian": "MarianMT generate", "aiayn_1": "aiayn, 1 worker"}
    if args.workers > 1:
        sides["aiayn_w"] = f"aiayn, {args.workers} workers"
    times: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        times["aiayn_1"].append(run_aiayn(ours, batches, search, args.target_len))
        times["marian"].append(run_marian(peer, batches, generation_config, args.target_len))
        if args.workers > 1:
            times["aiayn_w"].append(run_aiayn(ours, batches, search, args.target_len, args.workers))
        print(f"run {repeat + 1}: " + ", ".join(f"{sides[name]} {times[name][-1]:.1f} s" for name in sides), flush=True)
    rates = {}
    for name, label in sides.items():
        seconds = statistics.median(times[name])
        rates[name] = target_tokens / seconds
        print(f"{label:<18} {args.sentences / seconds:8.2f} sentences/s {rates[name]:9.1f} target tokens/s "
              f"(median of {args.repeats}: {seconds:.1f} s)")
    print(f"ratio with 1 worker={rates['aiayn_1'] / rates['marian']:.3f}")
    ours_best = max(rate for name, rate in rates.items() if name != "marian")
    print(f"ratio={ours_best / rates['marian']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
