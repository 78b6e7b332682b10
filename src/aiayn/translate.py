"""The translate command: source sentences on stdin, translations on stdout, with a trained model.

The same beam search as the decode stage (aiayn.decode), for trying a model by hand:

    echo "The house is small." | aiayn translate --model model.pt --spm-model spm.model

Output format: with ``--n-best 1`` (the default) one translation a line, one line for each input
line. With ``--n-best N`` each input line gets N lines ``score<TAB>translation``, best first
(score = log-probability / length penalty), and a blank line ends each sentence's block.
All of stdin is read before decoding starts, so that sentences of similar length share batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import stat
import sys
import zlib
from pathlib import Path
from typing import Sequence, TextIO

from aiayn.decode import DecodeSettings, add_runtime_arguments, hypothesis_text, load_runtime, translate_settings
from aiayn.errors import UserError, cli
from aiayn.memory import tokens_argument
from aiayn.reading import GZIP_MAGIC, _not_text
from aiayn.writing import refuse_overwriting_inputs
from aiayn.search import SearchConfig

# What decompresses each format that _not_text names into a pipe.
_DECOMPRESS = (("xz", "xz -dc"), ("zstd", "zstd -dc"), ("bzip2", "bunzip2 -c"), ("zip archive", "unzip -p"),
               ("UTF-16", "iconv -f UTF-16 -t UTF-8"), ("UTF-32", "iconv -f UTF-32 -t UTF-8"))


def refuse_stdin_emptied_by_stdout() -> None:
    """``translate < f > f``: the shell emptied f before the command started, so there is nothing to read;
    say so (and that the text is gone from f) instead of translating nothing in silence."""
    try:
        stdin, stdout = os.fstat(0), os.fstat(1)
    except OSError:
        return
    if not (stat.S_ISREG(stdin.st_mode) and (stdin.st_dev, stdin.st_ino) == (stdout.st_dev, stdout.st_ino)):
        return
    try:
        name = os.readlink("/proc/self/fd/0")
    except OSError:
        name = "that file"
    if stdin.st_size == 0:
        raise UserError(f"stdin is empty: stdout and stdin are the same file ({name}), which the shell emptied "
                        "before translate started (`< f > f`); its text is no longer in it; send stdout to "
                        "another file (aiayn translate ... < f > f.out)")


def read_source(stream) -> list[str]:
    """Lines of a binary stream, split on "\\n" only (as aiayn.reading.read_lines splits files).

    As for files, carriage returns alone as line ends (old Mac text) are refused: split on "\\n" the whole
    input would be one sentence, its translation one line for many; so are NUL bytes.
    """
    raw = stream.read()
    if raw.startswith(GZIP_MAGIC):  # read through, as the file readers do
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise UserError(f"stdin: damaged gzip data ({error}); check the file with gzip -t") from None
    reason = _not_text(Path("stdin"), raw[:64], raw[-4:])
    if reason:
        what = reason.split("; ", 1)[0]
        tool = next((tool for word, tool in _DECOMPRESS if word in what), None)
        fix = (f"decompress it on the way in: {tool} FILE | aiayn translate ..." if tool else
               "give UTF-8 text (iconv -t UTF-8 re-encodes text)")
        raise UserError(f"{what}; {fix}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = raw.count(b"\n", 0, error.start) + 1
        raise UserError(f"stdin, line {line_number}: bytes that are not UTF-8; re-encode the input as UTF-8") from None
    if (nul := raw.find(b"\x00")) >= 0:
        line_number = raw.count(b"\n", 0, nul) + 1
        raise UserError(f"stdin, line {line_number}: a NUL byte, which text never holds; give text (tr -d '\\000' "
                        "removes NUL bytes)")
    if "\n" not in text and "\r" in text.removesuffix("\r"):
        returns = text.count("\r")
        raise UserError(f"stdin: its lines end in a carriage return alone (old Mac line endings: {returns} "
                        "CR, no LF), so all of it would be translated as one sentence; convert them to newlines: "
                        "tr '\\r' '\\n' < FILE | aiayn translate ...")
    text = text.removeprefix("\ufeff")
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        return []
    return [line.removesuffix("\r") for line in text.split("\n")]


def write_translations(results: list[list[tuple[float, str]]], n_best: int, out: TextIO) -> None:
    for sentence in results:
        if n_best == 1:
            out.write(sentence[0][1] + "\n")
            continue
        for score, translation in sentence:
            out.write(f"{score:.4f}\t{translation}\n")
        out.write("\n")


# option -> the `decode` key it sets (each given option checked once, by the schema's rule for that key)
OPTIONS = {"beam": "beam_size", "alpha": "length_penalty", "max_len_a": "max_len_a", "max_len_b": "max_len_b",
           "tokens_per_batch": "tokens_per_batch", "workers": "workers", "max_source_tokens": "max_source_tokens"}


def arguments() -> argparse.ArgumentParser:
    """The command's options; what is left out is the `decode` section's: --config's files', else the
    schema's defaults."""
    from aiayn.config import section_defaults

    paper = section_defaults("decode")
    parser = argparse.ArgumentParser(prog="aiayn translate", description=__doc__.splitlines()[0])
    add_runtime_arguments(parser)
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once) whose `decode` section sets the defaults "
                             "of the options below: a run's own search")
    parser.add_argument("--beam", type=int, help=f"beam size (default: {paper['beam_size']}, the paper's)")
    parser.add_argument("--alpha", type=float, help=f"length penalty (default: {paper['length_penalty']}, the paper's)")
    parser.add_argument("--n-best", type=int, default=SearchConfig.n_best, help="hypotheses per sentence")
    parser.add_argument("--max-len-a", type=float, help=f"default: {paper['max_len_a']:g}")
    parser.add_argument("--max-len-b", type=int, help=f"default: {paper['max_len_b']}")
    parser.add_argument("--tokens-per-batch", type=tokens_argument,
                        help="padded source tokens x beam per batch (default: auto, by device, config/README.md)")
    parser.add_argument("--workers", type=int,
                        help="CPU only: batches searched at once, each with threads / workers torch threads")
    parser.add_argument("--max-source-tokens", type=int,
                        help=f"a longer input line (in BPE tokens) is refused, naming it, before any is translated "
                             f"(default: {paper['max_source_tokens']})")
    return parser


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict]:
    """The options, and the `decode` section they stand on: --config's files' (checked as they are read),
    else the schema's defaults, with each option given on the command line in place of its key, checked
    by the schema's rule for it."""
    from aiayn.config import read_config

    args = arguments().parse_args(argv)
    return args, read_config(args.config, "decode", {
        f"decode.{key}": ("--" + option.replace("_", "-"), getattr(args, option)) for option, key in OPTIONS.items()})


@cli
def main(argv: Sequence[str] | None = None) -> None:
    args, section = _parse(argv)
    # `> model.pt` has emptied the model already (loading it says so); `>> model.pt` would append to it,
    # and `< f >> f` would grow the file it reads
    refuse_stdin_emptied_by_stdout()
    refuse_overwriting_inputs({"stdout": sys.stdout}, {"--model": args.model, "--spm-model": args.spm_model,
                                                       "stdin": sys.stdin})

    settings = dataclasses.replace(DecodeSettings.from_section(section),
                                   search=SearchConfig.from_section(section, n_best=args.n_best))
    config = settings.search
    model, processor, device = load_runtime(args)
    sentences = read_source(sys.stdin.buffer)
    hypotheses = translate_settings(model, processor, sentences, settings, device, progress=False, source="stdin")
    results = [[(hypothesis.score, hypothesis_text(processor, hypothesis)) for hypothesis in sentence]
               for sentence in hypotheses]
    write_translations(results, config.n_best, sys.stdout)
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
