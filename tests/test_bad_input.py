"""A catalogue of broken inputs, each made here, each given to the real CLI (`python -m aiayn.cli`).

Every refusal is one message and exit status 2: stderr starts with ``error: `` (no traceback), names
the file (and line where there is one) and says what to do, and no output is left behind. Inputs
that are accepted but look wrong are counted in the download stage's stats.json and warned about
once. Every case runs under a timeout, so a stage that hangs fails its case.
"""

from __future__ import annotations

import bz2
import ctypes
import gzip
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import config_file, corpus_with_bpe, data_section, write_text_corpus

TIMEOUT = 60
BPE = {"vocab_size": 100, "input_sentence_size": 0, "character_coverage": 1.0, "seed": 1}
BINARIZE = {"max_tokens": 64, "workers": 1}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """A small corpus and a SentencePiece model trained on it, read (never changed) by every case."""
    root = tmp_path_factory.mktemp("shared")
    return corpus_with_bpe(root, held_out=20)


def run_cli(args: list[str], cwd: Path, stdin: bytes | None = None,
            unprivileged: bool = False) -> subprocess.CompletedProcess:
    """``aiayn ARGS`` in a subprocess; ``unprivileged``: one that file permissions apply to, also as root."""
    return subprocess.run([sys.executable, "-m", "aiayn.cli", *args], cwd=cwd, input=stdin, capture_output=True,
                          timeout=TIMEOUT, preexec_fn=_drop_read_override if unprivileged else None)


def _drop_read_override() -> None:
    """As root, drop the capabilities that let root read any file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)
    from the bounding set before exec, so that a file of mode 000 cannot be opened, as for any other user.
    Not root: nothing to drop."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def unreadable(path: Path) -> str:
    """``path`` made unreadable (mode 000); a test that cannot drop root's override is skipped."""
    path.chmod(0)
    if os.geteuid() == 0:
        try:
            subprocess.run([sys.executable, "-c", "pass"], check=True, preexec_fn=_drop_read_override)
        except (subprocess.SubprocessError, OSError) as error:
            pytest.skip(f"root without CAP_SETPCAP cannot give up reading every file ({error})")
    return str(path)


def model_file(path: Path, shared: Path, positional: str = "learned", max_positions: int = 16) -> str:
    """An untrained one-layer model of the shared vocabulary, as `aiayn average` writes it."""
    import torch

    from aiayn.bpe import load_processor, vocab_fingerprint
    from aiayn.model import ModelConfig, Transformer

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=load_processor(shared / "bpe" / "spm.model").get_piece_size(), n_layers=1,
                         d_model=16, d_ff=32, n_heads=2, positional=positional, max_positions=max_positions)
    torch.save({"format": "aiayn-model-v1", "model_config": config.to_dict(), "model": Transformer(config).state_dict(),
                "vocab_fingerprint": vocab_fingerprint(shared / "bpe" / "spm.model"), "data_fingerprint": "d",
                "averaged_steps": [1], "averaged_from": ["x"]}, path)
    return str(path)


def pickled_objects(path: Path) -> str:
    """A torch file holding a pickled object of a class (code to run when loaded), not only tensors."""
    import argparse

    import torch

    torch.save({"format": "aiayn-model-v1", "settings": argparse.Namespace(steps=1)}, path)
    return str(path)


def translate(case: Path, shared: Path) -> list[str]:
    return ["translate", "--model", model_file(case / "sinusoidal.pt", shared, "sinusoidal"),
            "--spm-model", str(shared / "bpe" / "spm.model"), "--device", "cpu", "--max-len-b", "2"]


def symlink_loop(folder: Path, name: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).symlink_to(folder / f"{name}.back")
    (folder / f"{name}.back").symlink_to(folder / name)
    return str(folder / name)


# --- making broken inputs ------------------------------------------------------------------------

def corpus(case: Path) -> dict:
    """A fresh copy of the corpus for a case to break; returns its data.local section."""
    return write_text_corpus(case / "raw", (("train", 200), ("dev", 20), ("test", 20)))


def download(case: Path, local: dict, **data) -> list[str]:
    return ["download", "--config", config_file(case / "settings" / "data.yaml", data=data_section(local=local, **data)),
            "--out-dir", str(case / "out")]


def broken_download(break_it: Callable[[Path, dict], None]) -> Callable[[Path, Path], list[str]]:
    def setup(case: Path, shared: Path) -> list[str]:
        local = corpus(case)
        break_it(case, local)
        return download(case, local)
    return setup


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def lines(n: int, word: str = "wort") -> bytes:
    return "".join(f"{word} {i} .\n" for i in range(n)).encode()


def bpe(case: Path, shared: Path, *inputs: str, options: tuple[str, ...] = (), **settings) -> list[str]:
    return ["bpe", "--config", config_file(case / "settings" / "bpe.yaml", bpe={**BPE, **settings}), "--threads", "1",
            *options,
            "--out-dir", str(case / "bpe"), *inputs]


def binarize(case: Path, shared: Path, src: str | None = None, tgt: str | None = None, spm: str | None = None,
             split: str = "dev", out: str | None = None, workers: str = "1", **settings) -> list[str]:
    return ["binarize", "--config", config_file(case / "settings" / "binarize.yaml", binarize={**BINARIZE, **settings}),
            "--split", split,
            "--src", src or str(shared / "raw" / f"{split}.en"), "--tgt", tgt or str(shared / "raw" / f"{split}.de"),
            "--spm-model", spm or str(shared / "bpe" / "spm.model"), "--out-dir", out or str(case / "bin" / split),
            "--workers", workers]


def decode(case: Path, shared: Path, model: str | None = None, spm: str | None = None,
           source: str | None = None, output: str | None = None) -> list[str]:
    return ["decode", "--model", model or str(case / "model.pt"),
            "--spm-model", spm or str(shared / "bpe" / "spm.model"),
            "--input", source or str(shared / "raw" / "dev.en"), "--output", output or str(case / "out.de"),
            "--threads", "1", "--device", "cpu"]


def score(case: Path, shared: Path, hyp: str | None = None, ref: str | None = None,
          output: str | None = None) -> list[str]:
    return ["score", "--hyp", hyp or str(shared / "raw" / "dev.de"), "--ref", ref or str(shared / "raw" / "dev.de"),
            "--output", output or str(case / "score.json")]


def mkdir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@dataclass
class Refused:
    """A broken input: the CLI must refuse it with one message naming ``names`` and ``fix``."""

    id: str
    setup: Callable[[Path, Path], list[str]]  # (case folder, shared folder) -> arguments of `aiayn`
    names: tuple[str, ...]                    # what the message must name: files, lines, options
    fix: str                                  # a fragment of the advice it must give
    outputs: tuple[str, ...] = ("out", "bpe", "bin", "out.de", "score.json", "model.pt.out")
    stdin: bytes | None = None
    absent: tuple[str, ...] = ()              # what the message must not say (a wrong diagnosis)
    unprivileged: bool = False                # run where file permissions apply (as root too)


REFUSED = [
    # download, local text files
    Refused("download: a directory for a text file",
            broken_download(lambda case, local: local["train"].update(src=mkdir(case / "texts"))),
            ("data.local.train.src", "texts is a directory"), "give the file itself"),
    Refused("download: a missing text file",
            broken_download(lambda case, local: local["dev"].update(tgt=str(case / "nowhere.de"))),
            ("data.local.dev.tgt", "nowhere.de: no such file"), "check the path"),
    Refused("download: source and target of different lengths",
            broken_download(lambda case, local: write(case / "raw" / "train.de", lines(199))),
            ("train.en has 200 lines", "train.de has 199"), "one line per sentence pair"),
    Refused("download: Latin-1 bytes",
            broken_download(lambda case, local: write(case / "raw" / "test.de", lines(1) + "Grüße\n".encode("latin-1")
                                                      + lines(18))),
            ("test.de, line 2",), "iconv -f latin1"),
    Refused("download: UTF-16 text with its byte-order mark",
            broken_download(lambda case, local: write(case / "raw" / "dev.en", lines(20).decode().encode("utf-16"))),
            ("dev.en", "UTF-16"), "iconv -f UTF-16 -t UTF-8"),
    Refused("download: UTF-16 text without a byte-order mark",
            broken_download(lambda case, local: write(case / "raw" / "dev.en", lines(20).decode().encode("utf-16-le"))),
            ("dev.en", "NUL bytes"), "iconv -f UTF-16"),
    Refused("download: old Mac line endings (CR only)",
            broken_download(lambda case, local: write(case / "raw" / "train.de", lines(200).replace(b"\n", b"\r"))),
            ("train.de", "carriage return"), "tr '\\r' '\\n'"),
    Refused("download: a bzip2-compressed text file",
            broken_download(lambda case, local: write(case / "raw" / "train.en", bz2.compress(lines(200)))),
            ("train.en", "bzip2-compressed"), "bunzip2"),
    Refused("download: a damaged gzip file",
            broken_download(lambda case, local: write(case / "raw" / "train.en",
                                                      gzip.compress(lines(200))[:40])),
            ("train.en", "damaged gzip"), "gzip -t"),
    Refused("download: a Parquet file given as text",
            broken_download(lambda case, local: pq.write_table(pa.table({"x": [1]}), case / "raw" / "train.en")),
            ("train.en", "Parquet"), "data.local.<split>.parquet"),
    Refused("download: parquet without the translation column",
            broken_download(lambda case, local: (
                pq.write_table(pa.table({"a": ["x"], "b": ["y"]}), case / "t.parquet"),
                local.update(train={"parquet": str(case / "t.parquet")}))),
            ("t.parquet", "no `translation` column"), "translation layout"),
    Refused("download: a directory for parquet files",
            broken_download(lambda case, local: local.update(train={"parquet": mkdir(case / "pq")})),
            ("data.local.train.parquet", "pq is a directory"), "*.parquet"),
    Refused("download: a parquet path that matches nothing",
            broken_download(lambda case, local: local.update(train={"parquet": str(case / "nothing-*.parquet")})),
            ("data.local.train.parquet", "nothing-*.parquet"), "check the path"),
    Refused("download: a text file given as parquet",
            broken_download(lambda case, local: local.update(train={"parquet": local["train"]["src"]})),
            ("train.en", "cannot read as parquet"), "parquet"),
    Refused("download: a split that is not set",
            broken_download(lambda case, local: local.pop("test")),
            ("data.local.test",), "give either"),
    Refused("download: an empty training split",
            broken_download(lambda case, local: (write(case / "raw" / "train.en", b""),
                                                 write(case / "raw" / "train.de", b""))),
            ("the train split is empty", "train.en"), "dropped"),
    Refused("download: a test split whose source lines are all blank",
            broken_download(lambda case, local: write(Path(local["test"]["src"]), b"\n" * 20)),
            ("test.en", "every source line of the test split is blank (20 pairs)"), "data.local.test"),
    Refused("download: an output folder that is a file",
            lambda case, shared: download(case, corpus(case))[:-1] + [str(write(case / "taken", b"x"))],
            ("taken is a file",), "give another path"),
    # bpe
    Refused("bpe: a directory for training text",
            lambda case, shared: bpe(case, shared, mkdir(case / "texts"), str(shared / "raw" / "train.de")),
            ("texts is a directory",), "give the file itself"),
    Refused("bpe: missing training text",
            lambda case, shared: bpe(case, shared, str(case / "train.en"), str(shared / "raw" / "train.de")),
            ("train.en: training text not found",), "run the download stage first"),
    Refused("bpe: empty training text",
            lambda case, shared: bpe(case, shared, str(write(case / "train.en", b"")),
                                     str(shared / "raw" / "train.de")),
            ("train.en is empty",), "both sides"),
    Refused("bpe: training text that is not UTF-8",
            lambda case, shared: bpe(case, shared, str(write(case / "train.en", lines(3) + b"caf\xe9\n")),
                                     str(shared / "raw" / "train.de")),
            ("train.en, line 4", "not UTF-8"), "iconv"),
    Refused("bpe: gzip-compressed training text",
            lambda case, shared: bpe(case, shared, str(write(case / "train.en.gz", gzip.compress(lines(50)))),
                                     str(shared / "raw" / "train.de")),
            ("train.en.gz", "gzip-compressed"), "gunzip -c"),
    Refused("bpe: gzip-compressed training text with a .txt name",
            lambda case, shared: bpe(case, shared, str(write(case / "train.txt", gzip.compress(lines(50)))),
                                     str(shared / "raw" / "train.de")),
            ("train.txt", "gzip-compressed"), "gunzip -c " + "{case}/train.txt > {case}/train.plain.txt"),
    Refused("bpe: training text whose lines are all blank",
            lambda case, shared: bpe(case, shared, str(write(case / "train.en", b"\n  \n\t\n")),
                                     str(write(case / "train.de", b"\n\n \n"))),
            ("train.en holds 3 lines, every one of them blank",), "no text to learn a vocabulary from"),
    Refused("bpe: training text this user may not read",
            lambda case, shared: bpe(case, shared, unreadable(write(case / "train.en", lines(50))),
                                     str(shared / "raw" / "train.de")),
            ("train.en", "cannot be read, permission denied"), "chmod a+r", unprivileged=True),
    Refused("bpe: a loop of symbolic links for training text",
            lambda case, shared: bpe(case, shared, symlink_loop(case / "links", "train.en"),
                                     str(shared / "raw" / "train.de")),
            ("train.en", "a loop of symbolic links", "train.en.back"), "point the link at the file",
            absent=("not found",)),
    Refused("bpe: a vocabulary the text cannot support",
            lambda case, shared: bpe(case, shared, str(shared / "raw" / "train.en"), str(shared / "raw" / "train.de"),
                                     vocab_size=50000),
            ("bpe.vocab_size = 50000", "train.en"), "lower bpe.vocab_size"),
    Refused("bpe: no threads",
            lambda case, shared: bpe(case, shared, str(shared / "raw" / "train.en"), str(shared / "raw" / "train.de"),
                                     options=("--threads", "0")),
            ("--threads 0",), "at least 1"),
    # binarize
    Refused("binarize: a file that is not a SentencePiece model (two workers)",
            lambda case, shared: binarize(case, shared, spm=str(write(case / "spm.model", b"not a model\n")),
                                          workers="2"),
            ("spm.model", "not a SentencePiece model"), "give the spm.model written by the bpe stage"),
    Refused("binarize: the vocabulary listing instead of the model",
            lambda case, shared: binarize(case, shared, spm=str(shared / "bpe" / "spm.vocab")),
            ("spm.vocab", "not a SentencePiece model"), "give spm.model beside it"),
    Refused("binarize: a missing SentencePiece model",
            lambda case, shared: binarize(case, shared, spm=str(case / "spm.model")),
            ("spm.model: SentencePiece model not found",), "run the bpe stage first"),
    Refused("binarize: the bpe folder instead of its model",
            lambda case, shared: binarize(case, shared, spm=str(shared / "bpe")),
            ("bpe is a directory",), "did you mean"),
    Refused("binarize: a directory for the source text",
            lambda case, shared: binarize(case, shared, src=mkdir(case / "texts")),
            ("texts is a directory",), "give the file itself"),
    Refused("binarize: source and target of different lengths",
            lambda case, shared: binarize(case, shared, tgt=str(write(case / "dev.de", lines(19)))),
            ("dev.en has 20 lines", "dev.de has 19"), "parallel"),
    Refused("binarize: a line that is not UTF-8, late in the file",
            lambda case, shared: binarize(case, shared, tgt=str(write(case / "dev.de", lines(19) + b"\xff\n"))),
            ("dev.de, line 20", "not UTF-8"), "iconv"),
    Refused("binarize: a NUL byte late in the text",
            lambda case, shared: binarize(case, shared, src=str(write(case / "dev.en", lines(19) + b"ein\x00wort\n"))),
            ("dev.en, line 20", "NUL byte"), "tr -d '\\000'"),
    Refused("binarize: an evaluation split whose source lines are all blank",
            lambda case, shared: binarize(case, shared, src=str(write(case / "dev.en", b"\n" * 19 + b"  \n"))),
            ("dev.en", "every one of its 20 lines is blank", "the dev split"), "give the dev split's source-language"),
    Refused("binarize: a training split that keeps no pair",
            lambda case, shared: binarize(case, shared, split="train", max_tokens=1),
            ("the train split keeps none of its 200 pairs", "binarize.max_tokens = 1"), "raise it"),
    Refused("binarize: a SentencePiece model this user may not read",
            lambda case, shared: binarize(case, shared, spm=unreadable(write(
                case / "spm.model", (shared / "bpe" / "spm.model").read_bytes()))),
            ("spm.model", "cannot be read, permission denied"), "chmod a+r", absent=("not a SentencePiece",),
            unprivileged=True),
    Refused("binarize: no workers",
            lambda case, shared: binarize(case, shared, workers="0"),  # the schema's rule, through the door
            ("--workers", "binarize.workers = 0"), "minimum of 1"),
    Refused("binarize: workers that are not a number",
            lambda case, shared: binarize(case, shared, workers="many"),
            ("aiayn binarize", "--workers", "'many'"), "--help"),
    Refused("binarize: a split that does not exist",
            lambda case, shared: binarize(case, shared)[:4] + ["validation"] + binarize(case, shared)[5:],
            ("--split", "'validation'"), "choose from"),
    Refused("binarize: an output folder holding other things",
            lambda case, shared: binarize(case, shared, out=str(write(case / "mine" / "notes.txt", b"x").parent)),
            ("mine",), "give --out-dir a new folder"),
    # decode, translate and average import torch (seconds each), so only their own cases: the rest of
    # their checks (threads, counts, a missing file) are the ones above or in their unit tests
    Refused("decode: a directory for the source text",
            lambda case, shared: decode(case, shared, source=mkdir(case / "texts")),
            ("texts is a directory",), "give the file itself"),
    Refused("decode: a directory for the SentencePiece model",
            lambda case, shared: decode(case, shared, spm=mkdir(case / "vocab")),
            ("vocab is a directory",), "SentencePiece model file is expected"),
    Refused("decode: a directory for the model",
            lambda case, shared: decode(case, shared, model=mkdir(case / "average")),
            ("average is a directory",), "checkpoint or model file is expected"),
    Refused("decode: a run folder for the model",
            lambda case, shared: decode(case, shared, model=str(write(case / "run" / "final.pt", b"x").parent)),
            ("run is a directory", "checkpoint or model file is expected"), "did you mean {case}/run/final.pt"),
    Refused("decode: a checkpoint this user may not read",
            lambda case, shared: decode(case, shared, model=unreadable(Path(model_file(case / "model.pt", shared)))),
            ("model.pt", "cannot be read, permission denied"), "chmod a+r", absent=("corrupt", "delete it"),
            unprivileged=True),
    Refused("decode: a loop of symbolic links for the model",
            lambda case, shared: decode(case, shared, model=symlink_loop(case / "links", "model.pt")),
            ("model.pt", "a loop of symbolic links"), "point the link at the file", absent=("no such",)),
    Refused("decode: sentences longer than a learned positional table, refused before decoding",
            lambda case, shared: decode(case, shared, model=model_file(case / "model.pt", shared, max_positions=16)),
            ("dev.en", "sentences longer than the model's learned positional table", "max_positions = 16",
             "lines 2 ("), "split or shorten those lines"),
    Refused("decode: a directory for the output, refused before decoding",
            lambda case, shared: decode(case, shared, output=mkdir(case / "translations")),
            ("translations is a directory",), "give the name of the file to write"),
    Refused("decode: a model file that is not a checkpoint",
            lambda case, shared: decode(case, shared, model=str(write(case / "model.pt", b"hello\n"))),
            ("model.pt", "text, not a checkpoint", "'hello'"), "give a checkpoint or model file",
            absent=("corrupt",)),
    # text whose first byte a pickle reader takes for an opcode ("Z", "#") used to be called code
    Refused("decode: a translation given as the model",
            lambda case, shared: decode(case, shared, model=str(write(case / "model.pt", "Zwei Männer .\n".encode()))),
            ("model.pt", "text, not a checkpoint", "'Zwei Männer .'"), "give a checkpoint or model file",
            absent=("holding code", "corrupt")),
    Refused("decode: a checkpoint holding pickled objects",
            lambda case, shared: decode(case, shared, model=pickled_objects(case / "model.pt")),
            ("model.pt", "holding code (pickled Python objects"), "give a checkpoint or model file",
            absent=("text",)),
    # translate
    Refused("translate: a file that is not a SentencePiece model",
            lambda case, shared: ["translate", "--model", str(case / "model.pt"), "--spm-model",
                                  str(write(case / "spm.model", b"\x00\x01garbage")), "--device", "cpu"],
            ("spm.model", "not a SentencePiece model"), "spm.model written by the bpe stage", stdin=b"hello\n"),
    Refused("translate: a directory for the model",
            lambda case, shared: ["translate", "--model", mkdir(case / "average"), "--spm-model",
                                  str(shared / "bpe" / "spm.model"), "--device", "cpu"],
            ("average is a directory",), "checkpoint or model file", stdin=b"hello\n"),
    Refused("translate: a text file given as the model",
            lambda case, shared: ["translate", "--model", str(write(case / "notes.pt", b"# my notes\n")),
                                  "--spm-model", str(shared / "bpe" / "spm.model"), "--device", "cpu"],
            ("notes.pt", "text, not a checkpoint", "'# my notes'"), "give a checkpoint or model file",
            stdin=b"hello\n", absent=("holding code",)),
    Refused("translate: old Mac line endings (CR only) on stdin",
            translate, ("stdin", "carriage return alone"), "tr '\\r' '\\n'", stdin=b"the man .\rthe dog .\r"),
    Refused("translate: a NUL byte on stdin",
            translate, ("stdin, line 2", "NUL byte"), "tr -d", stdin=b"the man .\nthe\x00dog .\n"),
    # score
    Refused("score: a directory for the hypotheses",
            lambda case, shared: score(case, shared, hyp=mkdir(case / "decode")),
            ("decode is a directory",), "give the file itself"),
    Refused("score: missing references",
            lambda case, shared: score(case, shared, ref=str(case / "ref.de")),
            ("ref.de: no such file",), "check the path"),
    Refused("score: references in a folder this user may not search",
            lambda case, shared: score(case, shared, ref=(write(case / "refs" / "ref.de", lines(20)),
                                                          unreadable(case / "refs"))[0].as_posix()),
            ("ref.de", "permission denied on the way to it"), "ls -ld", absent=("no such file",), unprivileged=True),
    Refused("score: hypotheses and references of different lengths",
            lambda case, shared: score(case, shared, hyp=str(write(case / "hyp.de", lines(19)))),
            ("hyp.de has 19 lines", "dev.de has 20"), "one line per reference line"),
    Refused("score: UTF-16 hypotheses",
            lambda case, shared: score(case, shared,
                                       hyp=str(write(case / "hyp.de", lines(20).decode().encode("utf-16")))),
            ("hyp.de", "UTF-16"), "iconv -f UTF-16"),
    Refused("score: an output path that is a folder",
            lambda case, shared: score(case, shared, output=str(write(case / "keep" / "precious.txt", b"x").parent)),
            ("keep is a directory",), "give the name of the file to write", outputs=("score.json",)),
    Refused("score: an output path under a file",
            lambda case, shared: score(case, shared, output=str(write(case / "plain", b"x") / "score.json")),
            ("plain is a file, not a folder",), "cannot write"),
    Refused("score: required arguments missing",
            lambda case, shared: ["score", "--hyp", str(shared / "raw" / "dev.de")],
            ("aiayn score", "--ref"), "--help"),
    # average
    Refused("average: a directory among the checkpoints",
            lambda case, shared: ["average", "--output", str(case / "model.pt.out"), mkdir(case / "checkpoints")],
            ("checkpoints is a directory",), "--last K --checkpoint-dir"),
    Refused("average: a checkpoint folder that is a file",
            lambda case, shared: ["average", "--output", str(case / "model.pt.out"), "--last", "2", "--checkpoint-dir",
                                  str(write(case / "checkpoints", b"x"))],
            ("checkpoints is a file",), "list checkpoint files"),
    Refused("average: an output path that is a folder",
            lambda case, shared: ["average", "--output", mkdir(case / "average"), str(case / "step_00000001.pt")],
            ("average is a directory",), "give the name of the file to write"),
    Refused("average: a text file among the checkpoints",
            lambda case, shared: ["average", "--output", str(case / "model.pt.out"),
                                  str(write(case / "step_00000001.pt", b"Zeile eins\n"))],
            ("step_00000001.pt", "text, not a checkpoint"), "give a checkpoint or model file",
            absent=("holding code",)),
    # export
    Refused("export: a text file given as the model",
            lambda case, shared: ["export", "--model", str(write(case / "model.pt", b"# a model\n")), "--spm-model",
                                  str(shared / "bpe" / "spm.model"), "--format", "ctranslate2", "--out",
                                  str(case / "out")],
            ("model.pt", "text, not a checkpoint"), "give a checkpoint or model file", absent=("holding code",)),
    # the command itself
    Refused("aiayn: an unknown command",
            lambda case, shared: ["binarize-all"],
            ("'binarize-all'",), "aiayn --help"),
    Refused("aiayn: an attempt that is not a number",
            lambda case, shared: ["--log", str(case / "job.log"), "--attempt", "first", "score"],
            ("--attempt", "'first'"), "aiayn --help"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[case.id for case in REFUSED])
def test_a_broken_input_is_refused_with_one_message_naming_it_and_the_fix(case, shared, tmp_path):
    args = case.setup(tmp_path, shared)
    before = {path for path in tmp_path.rglob("*")}
    result = run_cli(args, tmp_path, case.stdin, case.unprivileged)
    stderr = result.stderr.decode("utf-8", errors="replace")
    assert result.returncode == 2, stderr[-3000:]
    assert stderr.startswith("error: ") and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.strip()] == [stderr.strip()], stderr  # one message
    for name in case.names:
        assert name in stderr, (name, stderr)
    assert case.fix.format(case=tmp_path) in stderr, (case.fix, stderr)
    for wrong in case.absent:
        assert wrong not in stderr, (wrong, stderr)
    for output in case.outputs:
        assert not (tmp_path / output).exists() or tmp_path / output in before, output
    assert not [path for path in tmp_path.rglob(".tmp-*")], "a temporary was left behind"


def test_an_output_folder_given_as_the_output_file_is_left_as_it_was(shared, tmp_path):
    """Writing a file over a folder used to delete the folder (a file never replaces a folder now)."""
    keep = tmp_path / "keep"
    write(keep / "precious.txt", b"x")
    result = run_cli(score(tmp_path, shared, output=str(keep)), tmp_path)
    assert result.returncode == 2
    assert (keep / "precious.txt").read_bytes() == b"x"


# --- accepted, counted and warned about ----------------------------------------------------------

@dataclass
class Warned:
    """Input that is accepted, counted in stats.json as ``stats[split][count]`` and warned about once."""

    id: str
    break_it: Callable[[Path, dict], None]
    counts: dict[str, int]                     # split -> expected count
    count: str
    warning: str                               # a fragment of the one warning
    extra: dict = field(default_factory=dict)  # more data settings


def moses_escaped(case: Path, local: dict) -> None:
    text = Path(local["train"]["src"]).read_text(encoding="utf-8").splitlines()
    text[4] = "it &apos;s a well @-@ known &quot; quote &quot;"
    text[9] = "the man &apos;s dog"
    Path(local["train"]["src"]).write_text("\n".join(text) + "\n", encoding="utf-8")


def empty_sides(case: Path, local: dict) -> None:
    for split, line in (("dev", 3), ("test", 7)):
        text = Path(local[split]["tgt"]).read_text(encoding="utf-8").splitlines()
        text[line] = ""
        Path(local[split]["tgt"]).write_text("\n".join(text) + "\n", encoding="utf-8")


def padded(case: Path, local: dict) -> None:
    text = Path(local["dev"]["src"]).read_text(encoding="utf-8").splitlines()
    text[0], text[5], text[6] = "  " + text[0], text[5] + " \t", "\t" + text[6] + " "
    Path(local["dev"]["src"]).write_text("\n".join(text) + "\n", encoding="utf-8")


WARNED = [
    Warned("text already tokenized or Moses-escaped", moses_escaped, {"train": 2, "dev": 0}, "moses_escaped",
           "2 pairs look tokenized or Moses-escaped"),
    Warned("the same file for source and target", lambda case, local: local["test"].update(tgt=local["test"]["src"]),
           {"test": 20, "dev": 0}, "identical_sides", "every pair of the test split has the same source and target"),
    Warned("dev and test pairs with an empty side", empty_sides, {"dev": 1, "test": 1, "train": 0},
           "empty_side_kept", "2 dev/test pairs have an empty side"),
    Warned("whitespace around lines", padded, {"dev": 3, "train": 0}, "whitespace_trimmed",
           "3 pairs had whitespace around a side, which was trimmed"),
]


@pytest.mark.parametrize("case", WARNED, ids=[case.id for case in WARNED])
def test_suspicious_input_is_accepted_counted_in_stats_and_warned_about_once(case, tmp_path):
    local = corpus(tmp_path)
    case.break_it(tmp_path, local)
    result = run_cli(download(tmp_path, local, **case.extra), tmp_path)
    stderr = result.stderr.decode("utf-8", errors="replace")
    assert result.returncode == 0, stderr[-3000:]
    assert stderr.count(case.warning) == 1 and stderr.count("warning: ") == 1, stderr
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    for split, count in case.counts.items():
        assert stats["splits"][split][case.count] == count, (split, stats["splits"][split])
    assert any(case.warning in note for note in stats["warnings"])


def test_gzip_compressed_text_is_read_through(tmp_path):
    local = corpus(tmp_path)
    for side in ("src", "tgt"):
        plain = Path(local["train"][side])
        write(plain.with_name(plain.name + ".gz"), gzip.compress(plain.read_bytes()))
        local["train"][side] = str(plain) + ".gz"
    result = run_cli(download(tmp_path, local), tmp_path)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert (tmp_path / "out" / "train.en").read_bytes() == (tmp_path / "raw" / "train.en").read_bytes()
    assert b"warning" not in result.stderr


def test_the_binarize_log_says_an_evaluation_split_keeps_every_pair(shared, tmp_path):
    result = run_cli(binarize(tmp_path, shared, split="test"), tmp_path)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    summary = result.stdout.decode()
    assert "all 20 pairs kept (an evaluation split: none is dropped)" in summary and "None" not in summary
