"""CPU beam search on the same trained weights: aiayn's decode path beside CTranslate2's.

The model is exported with ``aiayn.export.export_ctranslate2`` (float32, and int8 by the engine), so
both engines translate with the same weights. Each side gets the same sentences and the same search:
beam 4, the same alpha (the two length penalties differ in form: ours is GNMT's ((5 + len) / 6) **
alpha, CTranslate2's len ** alpha, so at alpha > 0 some sentences end differently; the agreement
printed says how many), at most source + 50 tokens, pad and BOS never generated, empty outputs
allowed. Ours runs as ``aiayn decode`` does (``aiayn.decode.translate``: length-sorted batches of
--tokens-per-batch, one worker) in float32 and, where the CPU has bf16 instructions, under bf16
autocast; CTranslate2 runs float32 and int8 (``compute_type``), batched by tokens
(--tokens-per-batch / beam source tokens), ``intra_threads`` = torch's threads.

Two inputs: a real test set (--input, --reference: Multi30k's test_2016_flickr) and a long-sentence
set made from it (consecutive sentences joined until a drawn length, log-normal words with a mean
near newstest's 25-30 and a tail to 100; the references joined the same way). For each set and
thread count the settings alternate, --repeats rounds, and the medians are printed: sentences/s, the
ratio to CTranslate2 float32, BLEU (sacreBLEU) and the share of sentences where the output equals
ours in float32.

--stop chooses our search's stopping rule, one or more (CTranslate2 keeps its own): t2t, the paper's
bound (the default, ``SearchConfig()``); beam_finished, fairseq's ``stop_when_beam_finished``, which
is what CTranslate2 does at alpha > 0 (it ends a sentence once beam_size x patience hypotheses have
finished); best_finished, ``stop_when_best_finished``, CTranslate2's early exit at alpha 0 (a step's
best candidate ends). With several, each is timed in the same rounds ("aiayn fp32 <rule>"), the first
is the one the agreement column, bf16 and the alpha-0 check use, and the output also says how often
each equals CTranslate2's float32. An untimed pass per set and rule counts the decoder rows
(sentences x beams, summed over steps) and steps our search decoded.

    python -m bench.decode.ct2 --model results/.../model.pt --spm-model results/.../spm.model \\
        --input data/multi30k/test_2016_flickr.en --reference data/multi30k/test_2016_flickr.de
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from aiayn.bpe import load_processor
from aiayn.checkpoint import load_model
from aiayn.decode import hypothesis_text, translate
from aiayn.export import export_ctranslate2
from aiayn.reading import read_lines
from aiayn.search import SearchConfig, paper_search
from aiayn.speed.incremental import InferenceModel, RowCounting
from aiayn.tokens import BOS_ID, PAD_ID


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def long_sentences(sources: list[str], references: list[str], count: int, seed: int,
                   mean_words: float = 27.0, most_words: int = 100) -> tuple[list[str], list[str]]:
    """Consecutive sentences joined until each reaches a drawn word count (log-normal, sigma 0.5, mean
    about mean_words, at most most_words), references joined alike."""
    rng = random.Random(seed)
    sigma = 0.5
    mu = __import__("math").log(mean_words) - sigma * sigma / 2
    joined_sources, joined_references, index = [], [], 0
    for _ in range(count):
        goal = min(most_words, max(5, round(rng.lognormvariate(mu, sigma))))
        source_parts, reference_parts, words = [], [], 0
        while words < goal:
            source_parts.append(sources[index % len(sources)])
            reference_parts.append(references[index % len(references)])
            words += len(sources[index % len(sources)].split())
            index += 1
        joined_sources.append(" ".join(source_parts))
        joined_references.append(" ".join(reference_parts))
    return joined_sources, joined_references


STOP_RULES = {
    "t2t": {},
    "beam_finished": {"stop_when_beam_finished": True},
    "best_finished": {"stop_when_best_finished": True},
}


def ours(model, processor, sentences, config, tokens_per_batch, bf16: bool) -> list[str]:
    # One worker, so the search runs in this thread, under this thread's autocast.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        results = translate(model, processor, sentences, config, tokens_per_batch, "cpu", progress=False, workers=1)
    return [hypothesis_text(processor, hypotheses[0]) for hypotheses in results]


def theirs(translator, processor, sentences, config, tokens_per_batch) -> list[str]:
    pieces = [processor.encode(sentence, out_type=str) for sentence in sentences]
    results = translator.translate_batch(
        pieces, beam_size=config.beam_size, length_penalty=config.length_penalty,
        max_decoding_length=max(len(p) for p in pieces) + 1 + config.max_len_b, min_decoding_length=0,
        max_batch_size=tokens_per_batch // config.beam_size, batch_type="tokens",
        suppress_sequences=[[processor.id_to_piece(PAD_ID)], [processor.id_to_piece(BOS_ID)]],
    )
    return [processor.decode_pieces(result.hypotheses[0]) for result in results]


def main(argv=None) -> int:
    import ctranslate2
    import sacrebleu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--spm-model", required=True)
    parser.add_argument("--input", required=True, help="source sentences, one a line")
    parser.add_argument("--reference", required=True, help="their references, one a line")
    parser.add_argument("--sentences", type=int, default=300, help="the first N of --input (0: all)")
    parser.add_argument("--long", type=int, default=100, help="long sentences made from --input (0: none)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--beam", type=int, default=paper_search()["beam_size"],
                        help="default: the schema's decode.beam_size")
    parser.add_argument("--alpha", type=float, default=paper_search()["length_penalty"])
    parser.add_argument("--tokens-per-batch", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stop", choices=sorted(STOP_RULES), nargs="+", default=["t2t"],
                        help="our search's stopping rules (CTranslate2 keeps its own; the module's doc says which)")
    args = parser.parse_args(argv)

    processor = load_processor(args.spm_model)
    transformer = load_model(args.model, "cpu", spm_model=args.spm_model)
    model = InferenceModel(transformer)
    pieces = [processor.id_to_piece(index) for index in range(processor.get_piece_size())]
    sources, references = read_lines(args.input), read_lines(args.reference)
    if args.sentences:
        sources, references = sources[: args.sentences], references[: args.sentences]
    sets = {"test": (sources, references)}
    if args.long:
        sets["long"] = long_sentences(read_lines(args.input), read_lines(args.reference), args.long, args.seed)
    stops = list(dict.fromkeys(args.stop))
    configs = {stop: SearchConfig(beam_size=args.beam, length_penalty=args.alpha, **STOP_RULES[stop]) for stop in stops}
    config = configs[stops[0]]
    ours_labels = {stop: "aiayn fp32" if len(stops) == 1 else f"aiayn fp32 {stop}" for stop in stops}
    first = ours_labels[stops[0]]
    bf16 = cpu_has_bf16()
    print(f"torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}, bf16 on this CPU: {bf16}; "
          f"beam {args.beam}, alpha {args.alpha}, tokens_per_batch {args.tokens_per_batch}, repeats {args.repeats}; "
          f"our stopping rule(s): {' '.join(stops)}")
    for name, (set_sources, _) in sets.items():
        words = [len(sentence.split()) for sentence in set_sources]
        tokens = [len(processor.encode(sentence)) for sentence in set_sources]
        print(f"set {name}: {len(set_sources)} sentences, words mean {statistics.mean(words):.1f} max {max(words)}, "
              f"pieces mean {statistics.mean(tokens):.1f} max {max(tokens)}")

    with tempfile.TemporaryDirectory() as folder:
        export_ctranslate2(transformer, pieces, Path(folder) / "ct2")
        translators = {
            threads: {kind: ctranslate2.Translator(str(Path(folder) / "ct2"), device="cpu", compute_type=kind,
                                                   inter_threads=1, intra_threads=threads)
                      for kind in ("float32", "int8")}
            for threads in args.threads
        }
        for name, (set_sources, set_references) in sets.items():
            for threads in args.threads:
                torch.set_num_threads(threads)
                runs = {
                    ours_labels[stop]: lambda stop=stop: ours(model, processor, set_sources, configs[stop],
                                                              args.tokens_per_batch, False)
                    for stop in stops
                }
                runs |= {
                    "ct2 fp32": lambda: theirs(translators[threads]["float32"], processor, set_sources, config,
                                               args.tokens_per_batch),
                    "ct2 int8": lambda: theirs(translators[threads]["int8"], processor, set_sources, config,
                                               args.tokens_per_batch),
                }
                if bf16:
                    runs["aiayn bf16"] = lambda: ours(model, processor, set_sources, config, args.tokens_per_batch,
                                                      True)
                seconds = {label: [] for label in runs}
                outputs = {}
                for round_index in range(args.repeats):
                    labels = list(runs)
                    labels = labels[round_index % len(labels):] + labels[: round_index % len(labels)]  # rotate
                    for label in labels:
                        start = time.perf_counter()
                        outputs[label] = runs[label]()
                        seconds[label].append(time.perf_counter() - start)
                base = statistics.median(seconds["ct2 fp32"])
                for label in runs:
                    median = statistics.median(seconds[label])
                    bleu = sacrebleu.corpus_bleu(outputs[label], [set_references]).score
                    same = sum(a == b for a, b in zip(outputs[label], outputs[first])) / len(set_sources)
                    print(f"{name:5s} threads={threads} {label:11s} {len(set_sources) / median:7.1f} sent/s  "
                          f"x{base / median:5.2f} of ct2 fp32  BLEU {bleu:5.2f}  same as {first} {same:6.1%}  "
                          f"(median of {[round(s, 2) for s in seconds[label]]} s)")
                for stop in stops:
                    label = ours_labels[stop]
                    same = sum(a == b for a, b in zip(outputs[label], outputs["ct2 fp32"])) / len(set_sources)
                    print(f"{name:5s} threads={threads} {label} output equals ct2 fp32's for {same:.1%} of sentences")
            # Untimed: the rows our search decodes with each rule.
            for stop in stops:
                counting = RowCounting(transformer)
                ours(counting, processor, set_sources, configs[stop], args.tokens_per_batch, False)
                print(f"{name:5s} aiayn fp32 ({stop}) decoded {counting.rows} decoder rows in {counting.steps} "
                      f"steps over its batches ({counting.rows / len(set_sources):.1f} a sentence)")
            # Untimed: with alpha 0 the two length penalties are the same (1), so the searches should agree.
            flat = dataclasses.replace(config, length_penalty=0.0)
            ours_flat = ours(model, processor, set_sources, flat, args.tokens_per_batch, False)
            theirs_flat = theirs(translators[args.threads[0]]["float32"], processor, set_sources, flat,
                                 args.tokens_per_batch)
            same = sum(a == b for a, b in zip(ours_flat, theirs_flat)) / len(set_sources)
            print(f"{name:5s} alpha=0: ct2 fp32 output equals aiayn fp32 ({stops[0]}) for {same:.1%} of sentences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
