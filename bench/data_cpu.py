"""Data-stage speed: BPE learning at the paper's vocabulary size, and binarisation with 1 and 2 processes.

The corpus is generated (seeded): sentence pairs over a Zipf-distributed lexicon of pseudo-words
with German-like umlauts and lengths like WMT's, big enough for a 37000-piece vocabulary, which
the small demo language is not.

    PYTHONPATH=src .venv/bin/python bench/data_cpu.py --pairs 1000000
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from aiayn.binarize import binarize_split
from aiayn.bpe import learn_bpe

SYLLABLES = ["ka", "ri", "to", "mo", "ne", "sa", "lu", "ve", "schu", "ber", "ung", "ich", "ä", "ö", "ü", "ge", "ein",
             "st", "an", "or", "in", "al", "er", "ha", "ze", "wi", "pro", "tra", "de", "ß"]


def lexicon(size: int, rng: random.Random) -> list[str]:
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 5))))
    return sorted(words)


def write_corpus(folder: Path, pairs: int, seed: int = 1) -> tuple[Path, Path]:
    rng = random.Random(seed)
    source_words, target_words = lexicon(60000, rng), lexicon(80000, rng)
    np_rng = np.random.default_rng(seed)
    lengths = np.clip(np_rng.gamma(2.5, 9.0, pairs).astype(int), 1, 120)
    src_path, tgt_path = folder / "train.en", folder / "train.de"
    with open(src_path, "w", encoding="utf-8") as src, open(tgt_path, "w", encoding="utf-8") as tgt:
        for length in lengths:
            src_ids = np.minimum(np_rng.zipf(1.2, length), len(source_words)) - 1
            tgt_ids = np.minimum(np_rng.zipf(1.2, max(1, length + int(np_rng.integers(-2, 3)))), len(target_words)) - 1
            src.write(" ".join(source_words[i] for i in src_ids) + " .\n")
            tgt.write(" ".join(target_words[i] for i in tgt_ids) + " .\n")
    return src_path, tgt_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--input-sentence-size", type=int, default=2_000_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="aiayn-bench-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        src, tgt = write_corpus(folder, args.pairs)
        print(f"generated {args.pairs} pairs in {time.perf_counter() - start:.1f} s "
              f"({src.stat().st_size / 1e6:.0f} + {tgt.stat().st_size / 1e6:.0f} MB)", flush=True)
        start = time.perf_counter()
        learn_bpe([src, tgt], folder / "bpe", vocab_size=args.vocab, input_sentence_size=args.input_sentence_size,
                  threads=os.cpu_count())
        print(f"bpe: {args.vocab} pieces from {min(2 * args.pairs, args.input_sentence_size)} sampled sentences "
              f"in {time.perf_counter() - start:.1f} s with {os.cpu_count()} threads", flush=True)
        for workers in (1, 2):
            start = time.perf_counter()
            meta = binarize_split("train", src, tgt, folder / "bpe" / "spm.model", folder / f"bin{workers}",
                                  max_tokens=250, workers=workers)
            seconds = time.perf_counter() - start
            print(f"binarise: {workers} process(es): {meta['pairs_in'] / seconds:,.0f} pairs/s "
                  f"({seconds:.1f} s, {meta['src_tokens'] + meta['tgt_tokens']:,} tokens)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
