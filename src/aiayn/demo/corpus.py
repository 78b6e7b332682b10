"""The demo corpus from a seed (``generate_corpus``) and its command, ``aiayn demo``."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Sequence

from aiayn.demo.grammar import render
from aiayn.demo.sampler import Sampler
from aiayn.errors import UserError, cli
from aiayn.writing import write_lines_atomic

MAX_SOURCE_TOKENS = 40
MAX_TARGET_TOKENS = 46


def generate_corpus(seed: int, sizes: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    """``sizes[split]`` distinct (English, German) pairs per split, the same for the same seed.

    No source or target sentence occurs twice in the whole corpus, so the splits are disjoint.
    Splits are filled in the order of their names, so the result does not depend on the order
    of ``sizes``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"demo seed must be an integer, got {seed!r}")
    for split, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise UserError(f"demo size of split {split!r} must be a non-negative integer, got {size!r}")
    total = sum(sizes.values())
    sampler = Sampler(random.Random(seed))
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    attempts = 0
    while len(pairs) < total:
        attempts += 1
        if attempts > 20 * total + 10_000:
            raise UserError(f"the demo grammar ran out of new sentences after {len(pairs)} of {total}; "
                            "ask for fewer pairs")
        for sentence in sampler.sentences():
            en, de = render(sentence)
            if len(en.split()) > MAX_SOURCE_TOKENS or len(de.split()) > MAX_TARGET_TOKENS:
                continue
            if en in seen or de in seen or len(pairs) == total:
                continue
            seen.update((en, de))
            pairs.append((en, de))
    corpus, start = {}, 0
    for split in sorted(sizes):
        corpus[split] = pairs[start:start + sizes[split]]
        start += sizes[split]
    return {split: corpus[split] for split in sizes}


@cli
def main(argv: Sequence[str] | None = None) -> int:
    from aiayn.config import config_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn demo", description="The embedded demo corpus: synthetic English -> German-like sentence pairs from a seed.")
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once): their data.demo and languages")
    parser.add_argument("--seed", type=int, help="the corpus' seed (default: data.demo.seed's)")
    for split in ("train", "dev", "test"):
        parser.add_argument(f"--{split}", type=int, help=f"pairs in the {split} split (default: data.demo.{split}'s)")
    parser.add_argument("--out-dir", required=True, help="folder for <split>.<lang>")
    parser.add_argument("--src-lang", help="suffix of the English-like files (default: data.src_lang's)")
    parser.add_argument("--tgt-lang", help="suffix of the German-like files (default: data.tgt_lang's)")
    args = parser.parse_args(argv)
    data = config_from_arguments(args, {
        **{key: (f"--{key}", f"data.demo.{key}") for key in ("seed", "train", "dev", "test")},
        "src_lang": ("--src-lang", "data.src_lang"), "tgt_lang": ("--tgt-lang", "data.tgt_lang")})["data"]
    demo, src_lang, tgt_lang = data["demo"], data["src_lang"], data["tgt_lang"]
    if src_lang == tgt_lang:
        raise UserError(f"--src-lang and --tgt-lang are both {src_lang!r}; they must differ")
    corpus = generate_corpus(demo["seed"], {split: demo[split] for split in ("train", "dev", "test")})
    out_dir = Path(args.out_dir)
    for split, pairs in corpus.items():
        write_lines_atomic(out_dir / f"{split}.{src_lang}", [en for en, _ in pairs])
        write_lines_atomic(out_dir / f"{split}.{tgt_lang}", [de for _, de in pairs])
        print(f"{split}: {len(pairs)} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
