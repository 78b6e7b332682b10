"""No command overwrites what it reads, and a failed command leaves nothing that the next one trips on.

Each case runs the real CLI (`python -m aiayn.cli`) with an output that is one of the command's inputs,
spelled another way where that matters (relative, ``..``, a symbolic or hard link): exit status 2, one
``error:`` line naming the option, the input and the fix, and the input's bytes as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from conftest import REPO, config_file, corpus_with_bpe, data_section, tiny_preset, train_settings

TIMEOUT = 120
REFUSED = "writing it would destroy that input"


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn.cli", *args], cwd=cwd, capture_output=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """A corpus, its SentencePiece model, an untrained model over that vocabulary (decoding it works) and
    two window checkpoints of one run (averaging them works): what each case copies and names twice."""
    import torch

    from aiayn.bpe import vocab_fingerprint
    from aiayn.checkpoint import CHECKPOINT_FORMAT, MODEL_FORMAT, save_model
    from aiayn.model import ModelConfig, Transformer

    root = tmp_path_factory.mktemp("overwrite")
    corpus_with_bpe(root)
    config = ModelConfig(vocab_size=100, n_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0, pad_id=0)
    common = {"model_config": config.to_dict(), "vocab_fingerprint": vocab_fingerprint(root / "bpe" / "spm.model"),
              "data_fingerprint": "data"}
    torch.manual_seed(0)
    save_model({"format": MODEL_FORMAT, "model": Transformer(config).state_dict(), "averaged_steps": [0],
                "averaged_from": [], **common}, root / "model.pt")
    (root / "run" / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        save_model({"format": CHECKPOINT_FORMAT, "step": step, "model": Transformer(config).state_dict(), **common},
                   root / "run" / "checkpoints" / f"step_{step:08d}.pt")
    return root


def copy(shared: Path, case: Path, *names: str) -> None:
    """The named files (and folders) of ``shared``, copied into the case's own folder."""
    for name in names:
        (case / name).parent.mkdir(parents=True, exist_ok=True)
        if (shared / name).is_dir():
            shutil.copytree(shared / name, case / name)
        else:
            shutil.copyfile(shared / name, case / name)


def decode(output: str, model: str = "model.pt", spm: str = "bpe/spm.model", source: str = "raw/test.en") -> list[str]:
    return ["decode", "--model", model, "--spm-model", spm, "--input", source,
            "--output", output, "--threads", "1", "--device", "cpu"]


def with_files(*names: str, made: Callable[[Path], None] = lambda case: None) -> Callable[[Path, Path], None]:
    """A case's setup: copies of the named files of ``shared``, then whatever ``made`` adds."""
    def setup(case: Path, shared: Path) -> None:
        copy(shared, case, *names)
        made(case)
    return setup


def settings(name: str, **sections) -> Callable[[Path], None]:
    """A config file of ``sections`` in the case's folder."""
    return lambda case: config_file(case / name, **sections)


def own_bytes(*names: str) -> Callable[[Path], None]:
    """Files of any bytes (never read: the command stops before reading anything)."""
    def made(case: Path) -> None:
        for name in names:
            (case / name).parent.mkdir(parents=True, exist_ok=True)
            (case / name).write_bytes(b"an input's own bytes\n")
    return made


def symlink(link: str, target: str) -> Callable[[Path], None]:
    return lambda case: (case / link).symlink_to(case / target)


def hardlink(link: str, target: str) -> Callable[[Path], None]:
    return lambda case: os.link(case / target, case / link)


@dataclass
class Overwrite:
    """A command whose output is one of its inputs: ``kept`` keeps its bytes, stderr names ``names``."""

    id: str
    setup: Callable[[Path, Path], None]  # makes the case's files in its folder, from shared's
    command: list[str]  # run in the case's folder
    kept: str  # the input, relative to the case's folder
    names: tuple[str, ...]


DECODING = ("model.pt", "bpe/spm.model", "raw/test.en")
LOCAL = {split: {"src": f"raw/{split}.en", "tgt": f"raw/{split}.de"} for split in ("train", "dev", "test")}

CASES = [
    Overwrite("decode: --output is --input, spelled ./", with_files(*DECODING), decode("./raw/test.en"),
              "raw/test.en", ("--output ./raw/test.en is the input --input raw/test.en (both are ",)),
    Overwrite("decode: --output is --model through a symbolic link",
              with_files(*DECODING, made=symlink("translations.de", "model.pt")), decode("translations.de"),
              "model.pt", ("--output translations.de is the input --model model.pt",)),
    Overwrite("decode: --output is --spm-model, spelled with ..", with_files(*DECODING),
              decode("raw/../bpe/spm.model"), "bpe/spm.model", ("--output raw/../bpe/spm.model", "--spm-model")),
    Overwrite("explore: --out is --model, spelled ./", with_files(*DECODING),
              ["explore", "--model", "model.pt", "--spm-model", "bpe/spm.model", "--sentence", "the dog .", "--out",
               "./model.pt"],
              "model.pt", ("--out ./model.pt is the input --model model.pt",)),
    Overwrite("score: --output is --hyp", with_files("raw/test.de", "raw/test.en"),
              ["score", "--hyp", "raw/test.de", "--ref", "raw/test.en", "--output", "raw/test.de"],
              "raw/test.de", ("--output raw/test.de is the input --hyp raw/test.de",)),
    Overwrite("average: --output is a checkpoint it averages", with_files("run"),
              ["average", "--output", "run/checkpoints/step_00000004.pt", "run/checkpoints/step_00000002.pt",
               "run/checkpoints/step_00000004.pt"],
              "run/checkpoints/step_00000004.pt", ("--output run/checkpoints/step_00000004.pt is the input",)),
    Overwrite("average --last: --output is a window checkpoint, spelled with ..", with_files("run"),
              ["average", "--output", "run/../run/checkpoints/step_00000004.pt", "--last", "2", "--checkpoint-dir",
               "run/checkpoints"],
              "run/checkpoints/step_00000004.pt", ("--output run/../run/checkpoints/step_00000004.pt",)),
    Overwrite("average --last: --output is an older checkpoint of the run, not averaged", with_files("run"),
              ["average", "--output", "run/checkpoints/step_00000002.pt", "--last", "1", "--checkpoint-dir",
               "run/checkpoints"],
              "run/checkpoints/step_00000002.pt", ("the input --checkpoint-dir run/checkpoints/step_00000002.pt",)),
    Overwrite("average: --output is a hard link of a checkpoint",
              with_files("run", made=hardlink("averaged.pt", "run/checkpoints/step_00000004.pt")),
              ["average", "--output", "averaged.pt", "run/checkpoints/step_00000002.pt",
               "run/checkpoints/step_00000004.pt"],
              "run/checkpoints/step_00000004.pt", ("--output averaged.pt", "a hard link")),
    Overwrite("download: --out-dir holds its local text files",
              with_files("raw", made=settings("data.yaml", data=data_section(local=LOCAL))),
              ["download", "--config", "data.yaml", "--out-dir", "raw"],
              "raw/train.en", ("--out-dir would write raw/train.en, which is the input data.local.train.src",)),
    Overwrite("bpe: --out-dir would write over its training text", with_files("raw", made=own_bytes("raw/spm.vocab")),
              ["bpe", "--out-dir", "raw", "raw/train.en", "raw/spm.vocab"],
              "raw/spm.vocab", ("--out-dir would write raw/spm.vocab, which is the input training text",)),
    Overwrite("binarize: --out-dir, replaced as a whole, holds --spm-model",
              with_files("raw", made=own_bytes("bin/spm.model")),
              ["binarize", "--workers", "1", "--split", "test",
               "--src", "raw/test.en", "--tgt", "raw/test.de", "--spm-model", "bin/spm.model", "--out-dir", "bin"],
              "bin/spm.model", ("--out-dir bin holds the input --spm-model bin/spm.model",
                                "replaces that folder as a whole")),
    Overwrite("report: --out-dir would write over --dev-references", with_files(made=own_bytes("out/table3.md")),
              ["report", "--config", str(REPO / "config" / "config.yaml"), "--runs", "final.json", "--dev-scores", "dev.json", "--test-scores",
               "test.json", "--dev-references", "out/table3.md", "--out-dir", "out", "--no-tracking"],
              "out/table3.md", ("--out-dir would write out/table3.md, which is the input --dev-references",)),
    Overwrite("compare: --csv is the tracking store", with_files(made=own_bytes("store/mlflow.db")),
              ["compare", "--experiment", "x", "--tracking-uri", "sqlite:///store/mlflow.db",
               "--csv", "store/mlflow.db"],
              "store/mlflow.db", ("--csv store/mlflow.db is the input --tracking-uri store/mlflow.db",)),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(case, shared, tmp_path):
    case.setup(tmp_path, shared)
    before = (tmp_path / case.kept).read_bytes()
    listing = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))

    result = run_cli(case.command, tmp_path)

    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    for name in case.names:
        assert name in stderr, (name, stderr)
    assert REFUSED in stderr and "(nothing was read or written)" in stderr, stderr
    assert (tmp_path / case.kept).read_bytes() == before
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == listing  # nothing written


def test_translate_refuses_stdout_appended_to_its_model(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    before = (tmp_path / "model.pt").read_bytes()
    with open(tmp_path / "model.pt", "ab") as appended:
        result = subprocess.run([sys.executable, "-m", "aiayn.cli", "translate", "--model", "model.pt", "--spm-model",
                                 "bpe/spm.model", "--device", "cpu", "--threads", "1"], cwd=tmp_path,
                                input=b"the dog .\n", stdout=appended, stderr=subprocess.PIPE, timeout=TIMEOUT)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert stderr.startswith("error: stdout is redirected into the input --model model.pt"), stderr
    assert "send stdout to a file of its own" in stderr
    assert (tmp_path / "model.pt").read_bytes() == before


def test_translate_to_a_pipe_is_not_taken_for_an_input(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    result = subprocess.run([sys.executable, "-m", "aiayn.cli", "translate", "--model", "model.pt", "--spm-model",
                             "bpe/spm.model", "--device", "cpu", "--threads", "1", "--max-len-b", "3"], cwd=tmp_path,
                            input=b"the dog .\n", capture_output=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.count(b"\n") == 1


def test_a_failed_average_leaves_no_output_folder(shared, tmp_path):
    copy(shared, tmp_path, "run", "bpe/spm.model")
    result = run_cli(["average", "--output", "averaged/base/model.pt", "run/checkpoints/step_00000002.pt",
                      "bpe/spm.model"], tmp_path)
    assert result.returncode == 2, result.stderr.decode()
    assert "bpe/spm.model" in result.stderr.decode()
    assert not (tmp_path / "averaged").exists()


def test_an_average_makes_the_folder_of_its_output(shared, tmp_path):
    copy(shared, tmp_path, "run")
    result = run_cli(["average", "--output", "averaged/base/model.pt", "--last", "2", "--checkpoint-dir",
                      "run/checkpoints"], tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "averaged" / "base" / "model.pt").is_file()


@pytest.mark.parametrize("uri", ["sqlite:///missing/mlflow.db", "sqlite:///mlflow.db", "missing/mlruns",
                                 "file:missing/mlruns"])
def test_compare_on_a_store_that_does_not_exist_says_so_and_creates_nothing(tmp_path, uri):
    result = run_cli(["compare", "--experiment", "demo", "--tracking-uri", uri], tmp_path)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert stderr.startswith(f"error: no MLflow store at {uri}: ") and "does not exist (nothing was created)" in stderr
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert list(tmp_path.iterdir()) == []


def test_compare_on_an_sqlite_database_given_as_a_path_names_the_uri(tmp_path):
    (tmp_path / "mlflow.db").write_bytes(b"")
    result = run_cli(["compare", "--experiment", "demo", "--tracking-uri", "mlflow.db"], tmp_path)
    assert result.returncode == 2
    assert "an sqlite database is named sqlite:///mlflow.db" in result.stderr.decode()


# --- a failed training run --------------------------------------------------------------------------

TRAIN_SECTION = {"tokens_per_step": 600, "device_tokens": 600, "log_every": 1, "dev_every": 0, "precision": "fp32",
                 "device": "cpu"}


def train_command(prepared: Path, run_dir: Path, train_data: Path, **preset) -> list[str]:
    from aiayn.config import section_defaults

    settings = train_settings(Path(run_dir).parent, tiny_preset(**preset), {**section_defaults("train"), **TRAIN_SECTION})
    return ["train", *settings, "--seed", "1", "--train-data", str(train_data),
            "--spm-model", str(prepared / "bpe" / "spm.model"), "--run-dir", str(run_dir), "--no-tracking",
            "--device", "cpu", "--threads", "1"]


def test_a_train_that_fails_at_once_leaves_no_run_folder_or_lock(prepared, tmp_path):
    result = run_cli(train_command(prepared, tmp_path / "train" / "base", tmp_path / "missing"), tmp_path)
    assert result.returncode == 2, result.stderr.decode()
    left = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*"))
    assert left == ["train", "train/tiny.yaml"]  # the config file alone: no run folder, no lock


def test_a_finished_train_leaves_no_lock_file(prepared, tmp_path):
    result = run_cli(train_command(prepared, tmp_path / "run", prepared / "bin" / "train", steps=2), tmp_path)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert (tmp_path / "run" / "final.json").exists() and not (tmp_path / "run" / ".lock").exists()


def test_a_run_that_diverged_before_its_first_checkpoint_is_rerun_from_scratch_and_logged_afresh(prepared, tmp_path):
    """The rerun after a fixed config logs its own steps: none is skipped as held by the failed attempt."""
    run_dir, data = tmp_path / "run", prepared / "bin" / "train"
    failed = run_cli(train_command(prepared, run_dir, data, lr_scale=1e12, checkpoint_steps=100), tmp_path)
    assert failed.returncode == 2 and "became nan" in failed.stderr.decode(), failed.stderr.decode()[-2000:]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged and not list((run_dir / "checkpoints").glob("*.pt"))

    rerun = run_cli(train_command(prepared, run_dir, data, checkpoint_steps=100), tmp_path)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "train_loss" in record] == [1, 2, 3, 4, 5, 6]
    assert all(record["time"] > logged[-1]["time"] for record in records)  # the failed attempt's are gone
