"""The bpe stage: one SentencePiece BPE vocabulary shared by source and target (paper: about 37000).

Learned on a shuffled sample of both sides of the training data, with fixed ids for the
special symbols so that every later stage can rely on them (``aiayn.tokens``).
"""

from __future__ import annotations

import argparse
import codecs
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Iterator

from aiayn.errors import UserError, cli
from aiayn.reading import (GZIP_MAGIC, count_lines, decompressed_name, fingerprint_files, input_exists, iter_lines, open_input, same_file)
from aiayn.writing import atomic_path, prepare_output, refuse_overwriting_inputs, write_json_atomic
from aiayn.layout import BPE_INFO, SPM_MODEL, SPM_PREFIX, SPM_VOCAB
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

PROGRESS_EVERY = 65536  # lines between updates of the progress bar


def learn_bpe(
    train_files: list[str | Path],
    out_dir: str | Path,
    vocab_size: int,
    input_sentence_size: int | None = None,
    character_coverage: float | None = None,
    seed: int | None = None,
    threads: int | None = None,
) -> dict:
    """Train the shared vocabulary; write ``spm.model``, ``spm.vocab`` and ``bpe.json`` into ``out_dir``.

    A setting left as None takes the schema's default (its ``bpe`` section), written only there.
    """
    from aiayn.config import schema_default

    if input_sentence_size is None:
        input_sentence_size = schema_default("bpe.input_sentence_size")
    if character_coverage is None:
        character_coverage = schema_default("bpe.character_coverage")
    if seed is None:
        seed = schema_default("bpe.seed")

    out_dir = Path(out_dir)
    refuse_overwriting_inputs({"--out-dir": [out_dir / name for name in (SPM_MODEL, SPM_VOCAB, BPE_INFO)]},
                              {"training text": train_files}, {"--out-dir": out_dir / ".spm-training"})
    lines = check_training_text(train_files)
    if threads is not None and threads < 1:
        raise UserError(f"--threads {threads} must be at least 1")
    prepare_output(out_dir, directory=True)
    _write_model(train_files, out_dir, lines, vocab_size, character_coverage, input_sentence_size, seed, threads)
    info = {
        "vocab_size": vocab_size,
        "model_type": "bpe",
        "shared": True,
        "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
        "input_sentence_size": input_sentence_size,
        "character_coverage": character_coverage,
        "seed": seed,
        "fingerprint": vocab_fingerprint(out_dir / SPM_MODEL),
        "data_fingerprint": fingerprint_files(*train_files),
        "train_files": [str(p) for p in train_files],
    }
    write_json_atomic(out_dir / BPE_INFO, info)
    return info


def _write_model(train_files: list[str | Path], out_dir: Path, lines: int, vocab_size: int, character_coverage: float,
                 input_sentence_size: int, seed: int, threads: int | None) -> None:
    """``spm.model`` and ``spm.vocab`` into ``out_dir``, trained in a work folder beside them."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    # SentencePiece stores the model prefix in the model file: a fixed folder beside the outputs (not a
    # random temporary one) makes two runs of the same stage write the same bytes.
    work = out_dir / ".spm-training"
    shutil.rmtree(work, ignore_errors=True)  # a killed run's leftovers; one bpe job writes out_dir at a time
    created = not out_dir.exists()
    work.mkdir(parents=True)
    try:
        _train_sentencepiece(train_files, str(work / SPM_PREFIX), lines, vocab_size, character_coverage,
                             input_sentence_size, threads)
        for name in (SPM_MODEL, SPM_VOCAB):
            with atomic_path(out_dir / name) as tmp_path:
                shutil.copyfile(work / name, tmp_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(out_dir.iterdir()):  # a failed run leaves no output folder behind
            out_dir.rmdir()


def _train_sentencepiece(train_files: list[str | Path], prefix: str, lines: int, vocab_size: int,
                         character_coverage: float, input_sentence_size: int, threads: int | None) -> None:
    """SentencePiece's BPE trainer over the training text, writing ``<prefix>.model`` and ``.vocab``; a
    vocabulary larger than the text supports is the user's to lower."""
    import sentencepiece as spm
    from tqdm import tqdm

    try:
        with tqdm(total=lines, desc="bpe: reading", unit=" lines", mininterval=2.0, disable=None) as progress:
            spm.SentencePieceTrainer.train(
                sentence_iterator=training_lines(train_files, progress),
                model_prefix=prefix,
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=character_coverage,
                input_sentence_size=input_sentence_size,
                shuffle_input_sentence=True,
                num_threads=threads or os.cpu_count() or 1,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
                # identity: decoding gives back exactly the text, so BLEU sees the real characters
                normalization_rule_name="identity",
                minloglevel=2,
            )
    except RuntimeError as error:
        message = str(error)
        limit = re.search(r"<= (\d+)", message)
        if "Vocabulary size too high" in message or "vocab_size" in message:
            at_most = f" (at most {limit.group(1)})" if limit else ""
            raise UserError(
                f"bpe.vocab_size = {vocab_size} is more than the training data "
                f"({', '.join(str(p) for p in train_files)}) can support{at_most}; lower bpe.vocab_size "
                "in your config or use more training data"
            ) from None
        raise


def check_training_text(train_files: list[str | Path]) -> int:
    """Every file UTF-8 text with at least one line, checked whole before SentencePiece reads it: it
    fails on a directory, an empty file or one of blank lines with a traceback, and takes bytes that are
    not UTF-8 silently. Returns the number of lines in all."""
    lines = 0
    for path in train_files:
        if not input_exists(path):
            raise UserError(f"{path}: training text not found (run the download stage first)")
        with open_input(path) as handle:  # and a directory, a file this user may not read, ...
            if handle.read(2) == GZIP_MAGIC:  # SentencePiece reads plain files only
                raise UserError(f"{path}: gzip-compressed; the bpe stage reads plain text: "
                                f"gunzip -c {path} > {decompressed_name(Path(path), '.gz')}")
        count = count_lines(path)  # and every check of aiayn.reading: encodings, line endings
        lines += count
        if not count or not _has_text(path):
            what = "is empty" if not count else f"holds {count} lines, every one of them blank"
            raise UserError(
                f"{path} {what}: there is no text to learn a vocabulary from (a shared vocabulary needs both "
                "sides of the training data; check the download stage's output and its log)"
            )
    for index, path in enumerate(train_files):
        if again := next((other for other in train_files[:index] if same_file(other, path)), None):
            print(f"warning: {path} is {again} given again: its lines count twice in the vocabulary's sample, and "
                  "a shared vocabulary is meant to be learned from both sides of the training data (source and "
                  "target files)", file=sys.stderr)
    return lines


def _has_text(path: str | Path) -> bool:
    """Whether any line of ``path`` holds more than whitespace (SentencePiece fails on text of blanks alone)."""
    return any(line.strip() for line in iter_lines(path))


def training_lines(train_files: list[str | Path], progress) -> Iterator[bytes]:
    """The files' lines as SentencePiece's own reader gives them (split at newlines only, which it drops),
    counted on ``progress``: read through Python, the minutes of reading at WMT size get a progress bar."""
    for path in train_files:
        done = 0
        with open(path, "rb") as handle:
            for number, line in enumerate(handle):
                if number == 0:  # a byte-order mark is not text (the other readers of aiayn.reading drop it too)
                    line = line.removeprefix(codecs.BOM_UTF8)
                yield line[:-1] if line.endswith(b"\n") else line
                done += 1
                if done == PROGRESS_EVERY:
                    progress.update(done)
                    done = 0
        progress.update(done)
    progress.close()  # what follows, SentencePiece's merges, reports nothing while it runs


def vocab_fingerprint(model_path: str | Path) -> str:
    """A short hash of the vocabulary itself (pieces and scores, in id order).

    Not of the model file: SentencePiece stores its training options there, temporary
    paths included, so two identical vocabularies would hash differently.
    """
    import hashlib

    processor = load_processor(model_path)
    digest = hashlib.sha256()
    for piece_id in range(processor.get_piece_size()):
        digest.update(f"{processor.id_to_piece(piece_id)}\t{processor.get_score(piece_id)!r}\n".encode("utf-8"))
    return digest.hexdigest()[:16]


def load_processor(model_path: str | Path):
    """The SentencePiece processor of ``model_path``; anything but a model file is a UserError."""
    import sentencepiece as spm

    model_path = Path(model_path)
    if model_path.is_dir():
        hint = f" (did you mean {model_path / SPM_MODEL}?)" if (model_path / SPM_MODEL).is_file() else ""
        raise UserError(f"{model_path} is a directory, but a SentencePiece model file is expected{hint}")
    if not input_exists(model_path):
        raise UserError(f"{model_path}: SentencePiece model not found (run the bpe stage first)")
    with open_input(model_path) as handle:  # read here, so that a file this user may not read is named so
        proto = handle.read()
    try:
        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(proto)
        return processor
    except (RuntimeError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = " (that is the vocabulary listing; give spm.model beside it)" if model_path.suffix == ".vocab" else ""
        raise UserError(
            f"{model_path}: not a SentencePiece model ({reason}){hint}; give the spm.model written by the bpe stage"
        ) from None


@cli
def main(argv=None):
    from aiayn.config import add_config_arguments, section_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn bpe", description=__doc__.splitlines()[0])
    add_config_arguments(parser, "bpe")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("inputs", nargs="+", help="training text files (source and target sides)")
    args = parser.parse_args(argv)
    bpe = section_from_arguments(args, "bpe")
    info = learn_bpe(args.inputs, args.out_dir, bpe["vocab_size"], bpe["input_sentence_size"],
                     bpe["character_coverage"], bpe["seed"], args.threads)
    print(f"vocabulary of {info['vocab_size']} pieces, fingerprint {info['fingerprint']}")


if __name__ == "__main__":
    raise SystemExit(main())
