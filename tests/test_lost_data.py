"""Nothing a user names is lost: export never replaces a folder it did not write, ``--log`` and stdout are
outputs like any other, ``--log-to-run`` is read before the work, and a failed stage leaves nothing behind.

Each case runs the real CLI (``python -m aiayn.cli``) in a folder of its own: the exit status, the one
``error:`` paragraph, and the user's files as they were.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import config_file, data_section, tiny_preset, train_settings, write_text_corpus
from test_overwrite import TIMEOUT, copy, decode, run_cli, shared  # noqa: F401 (shared is a fixture)

pytest.importorskip("ctranslate2")

EXPORT_MARKER = "aiayn-export.json"


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (folders by their names)."""
    return {str(path.relative_to(folder)): (path.read_bytes() if path.is_file() else b"<folder>")
            for path in sorted(folder.rglob("*"))}


def one_error(result: subprocess.CompletedProcess) -> str:
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr[-3000:]
    assert stderr.startswith("error: ") and "Traceback" not in stderr, stderr[-3000:]
    return stderr


def export(out: str, model: str = "model.pt", spm: str = "bpe/spm.model") -> list[str]:
    return ["export", "--model", model, "--spm-model", spm, "--format", "ctranslate2", "--out", out]


@pytest.fixture(scope="module")
def other_vocabulary(shared, tmp_path_factory) -> Path:
    """A SentencePiece model of another size than the shared model's vocabulary."""
    from aiayn.bpe import learn_bpe

    folder = tmp_path_factory.mktemp("other")
    learn_bpe([shared / "raw" / "train.en"], folder, vocab_size=60, input_sentence_size=0, threads=1)
    return folder / "spm.model"


# --- 1. export writes a new folder, or replaces one it wrote -----------------------------------------------

def test_export_refuses_a_folder_of_the_users_own_and_names_what_is_in_it(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    (tmp_path / "mine" / "keep").mkdir(parents=True)
    (tmp_path / "mine" / "precious.txt").write_text("mine\n")
    (tmp_path / "mine" / "keep" / "notes.txt").write_text("notes\n")
    before = listing(tmp_path)
    stderr = one_error(run_cli(export("mine"), tmp_path))
    assert "--out mine is an existing folder that aiayn export did not write (it holds keep, precious.txt: " \
           "2 entries" in stderr, stderr
    assert "(nothing was read or written)" in stderr
    assert listing(tmp_path) == before


def test_export_refuses_the_folder_that_holds_its_model(shared, tmp_path):
    copy(shared, tmp_path, "bpe/spm.model")
    copy(shared, tmp_path / "work", "model.pt")
    (tmp_path / "work" / "precious.txt").write_text("mine\n")
    before = listing(tmp_path)
    stderr = one_error(run_cli(export("work", model="work/model.pt"), tmp_path))
    assert "--out work holds the input --model work/model.pt" in stderr, stderr
    assert listing(tmp_path) == before


def test_export_refuses_the_working_directory(shared, tmp_path):
    copy(shared, tmp_path / "in", "model.pt", "bpe/spm.model")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "precious.txt").write_text("mine\n")
    before = listing(tmp_path)
    stderr = one_error(run_cli(export(".", model="../in/model.pt", spm="../in/bpe/spm.model"), tmp_path / "work"))
    assert "--out . is the working directory" in stderr, stderr
    assert listing(tmp_path) == before


def test_export_refuses_the_folder_of_its_sentencepiece_model(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe")
    before = listing(tmp_path)
    stderr = one_error(run_cli(export("bpe"), tmp_path))
    assert "--out bpe holds the input --spm-model bpe/spm.model" in stderr, stderr
    assert listing(tmp_path) == before


def test_export_refuses_a_link_to_the_models_folder_before_the_work(shared, tmp_path):
    copy(shared, tmp_path / "run", "model.pt", "bpe/spm.model")
    (tmp_path / "out").symlink_to(tmp_path / "run")
    before = listing(tmp_path / "run")
    stderr = one_error(run_cli(export("out", model="run/model.pt", spm="run/bpe/spm.model"), tmp_path))
    assert "--out out holds the input --model run/model.pt" in stderr, stderr
    assert "replaces that folder as a whole" in stderr
    assert listing(tmp_path / "run") == before


def test_export_marks_its_folder_and_replaces_only_a_folder_so_marked(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    first = run_cli(export("exported"), tmp_path)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    assert (tmp_path / "exported" / EXPORT_MARKER).is_file()
    (tmp_path / "exported" / "model.bin").write_bytes(b"stale")
    again = run_cli(export("exported"), tmp_path)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert (tmp_path / "exported" / "model.bin").read_bytes() != b"stale"
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".tmp-")] == []


# --- 9. a failed export leaves nothing behind ----------------------------------------------------------------

@pytest.mark.parametrize("broken", ["truncated", "text", "folder", "other vocabulary"])
def test_a_failed_export_leaves_no_output_folder(shared, other_vocabulary, tmp_path, broken):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    spm = "bpe/spm.model"
    if broken == "truncated":
        (tmp_path / "model.pt").write_bytes((shared / "model.pt").read_bytes()[:2000])
    elif broken == "text":
        (tmp_path / "model.pt").write_text("a line of text\n")
    elif broken == "folder":
        (tmp_path / "model.pt").unlink()
        (tmp_path / "model.pt").mkdir()
    else:
        shutil.copyfile(other_vocabulary, tmp_path / "other.model")
        spm = "other.model"
    before = listing(tmp_path)
    one_error(run_cli(export("exports/ct2", spm=spm), tmp_path))
    assert listing(tmp_path) == before  # no exports/, no exports/ct2, no temporaries


# --- 2. and 8. --log is an output like any other --------------------------------------------------------------

@pytest.mark.parametrize("log, option", [("raw/test.en", "--input"), ("bpe/spm.model", "--spm-model")],
                         ids=["the source text", "the SentencePiece model"])
def test_a_log_that_is_one_of_decodes_inputs_is_refused_and_the_input_kept(shared, tmp_path, log, option):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model", "raw/test.en")
    before = listing(tmp_path)
    stderr = one_error(run_cli(["--log", log, *decode("out.de")], tmp_path))
    assert f"--log {log} is the input {option} {log}" in stderr, stderr
    assert listing(tmp_path) == before


def test_a_log_that_is_bpes_training_text_is_refused_and_the_text_kept(shared, tmp_path):
    copy(shared, tmp_path, "raw/train.en", "raw/train.de")
    before = listing(tmp_path)
    stderr = one_error(run_cli(["--log", "raw/train.de", "bpe", "--out-dir", "bpe",
                                "raw/train.en", "raw/train.de"], tmp_path))
    assert "--log raw/train.de is the input training text raw/train.de" in stderr, stderr
    assert listing(tmp_path) == before


def test_a_log_that_is_an_output_of_bpe_is_refused(shared, tmp_path):
    copy(shared, tmp_path, "raw/train.en", "raw/train.de", "bpe")
    before = listing(tmp_path)
    stderr = one_error(run_cli(["--log", "bpe/spm.model", "bpe", "--out-dir", "bpe",
                                "raw/train.en", "raw/train.de"], tmp_path))
    assert "--log bpe/spm.model is also the output --out-dir bpe/spm.model" in stderr, stderr
    assert listing(tmp_path) == before


def test_a_log_that_is_a_folder_is_one_message(shared, tmp_path):
    copy(shared, tmp_path, "raw/test.de")
    (tmp_path / "logs").mkdir()
    stderr = one_error(run_cli(["--log", "logs", "score", "--hyp", "raw/test.de", "--ref", "raw/test.de"], tmp_path))
    assert stderr.startswith("error: --log logs is a folder") and stderr.count("\n") == 1, stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_log_in_a_read_only_folder_is_one_message(shared, tmp_path):
    copy(shared, tmp_path, "raw/test.de")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs").chmod(0o555)
    try:
        stderr = one_error(run_cli(["--log", "logs/score.log", "score", "--hyp", "raw/test.de", "--ref",
                                    "raw/test.de"], tmp_path))
    finally:
        (tmp_path / "logs").chmod(0o755)
    assert stderr.startswith("error: --log logs/score.log cannot be written"), stderr


def test_a_log_that_cannot_be_created_is_one_message(shared, tmp_path):
    """Where a file stands in the log's path (what root cannot write either)."""
    copy(shared, tmp_path, "raw/test.de")
    (tmp_path / "logs").write_text("a file\n")
    stderr = one_error(run_cli(["--log", "logs/score.log", "score", "--hyp", "raw/test.de", "--ref",
                                "raw/test.de"], tmp_path))
    assert stderr.startswith("error: --log logs/score.log cannot be written") and stderr.count("\n") == 1, stderr
    assert (tmp_path / "logs").read_text() == "a file\n"


# --- 3. stdout appended into an input --------------------------------------------------------------------------

def run_appending(command: list[str], cwd: Path, into: Path, stdin=None) -> subprocess.CompletedProcess:
    with open(into, "ab") as appended:
        return subprocess.run([sys.executable, "-m", "aiayn.cli", *command], cwd=cwd, stdin=stdin, stdout=appended,
                              stderr=subprocess.PIPE, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_decode_refuses_stdout_appended_to_its_input(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model", "raw/test.en")
    before = listing(tmp_path)
    stderr = one_error(run_appending(decode("out.de"), tmp_path, tmp_path / "raw" / "test.en"))
    assert "stdout is redirected into the input --input raw/test.en" in stderr, stderr
    assert listing(tmp_path) == before


def test_score_refuses_stdout_appended_to_its_hypotheses(shared, tmp_path):
    copy(shared, tmp_path, "raw/test.de", "raw/test.en")
    before = listing(tmp_path)
    stderr = one_error(run_appending(["score", "--hyp", "raw/test.de", "--ref", "raw/test.en"], tmp_path,
                                     tmp_path / "raw" / "test.de"))
    assert "stdout is redirected into the input --hyp raw/test.de" in stderr, stderr
    assert listing(tmp_path) == before


def translate(extra: tuple[str, ...] = ()) -> list[str]:
    return ["translate", "--model", "model.pt", "--spm-model", "bpe/spm.model", "--device", "cpu", "--threads", "1",
            "--max-len-b", "3", *extra]


def test_translate_refuses_stdout_appended_to_its_stdin(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model", "raw/test.en")
    before = listing(tmp_path)
    with open(tmp_path / "raw" / "test.en", "rb") as source:
        stderr = one_error(run_appending(translate(), tmp_path, tmp_path / "raw" / "test.en", stdin=source))
    assert "stdout is redirected into the input stdin" in stderr, stderr
    assert listing(tmp_path) == before


def test_translate_says_why_its_stdin_is_empty_when_stdout_emptied_it(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    path = tmp_path / "f.txt"
    path.write_text("the dog .\n")
    with open(path, "rb") as source, open(path, "wb") as emptied:  # the shell's `< f > f`
        result = subprocess.run([sys.executable, "-m", "aiayn.cli", *translate()], cwd=tmp_path, stdin=source,
                                stdout=emptied, stderr=subprocess.PIPE, timeout=TIMEOUT)
    stderr = one_error(result)
    assert stderr.startswith("error: stdin is empty: stdout and stdin are the same file"), stderr
    assert "f.txt" in stderr


# --- 8. --log-to-run read first; a preset checked by the schema; tracking leaves nothing ---------------------

@pytest.mark.parametrize("kind", ["missing", "not JSON"])
def test_score_reads_log_to_run_before_the_work(shared, tmp_path, kind):
    copy(shared, tmp_path, "raw/test.de", "raw/test.en")
    if kind == "not JSON":
        (tmp_path / "final.json").write_text("not json\n")
    before = listing(tmp_path)
    stderr = one_error(run_cli(["score", "--hyp", "raw/test.de", "--ref", "raw/test.en", "--output", "out/score.json",
                                "--log-to-run", "final.json"], tmp_path))
    assert "final.json" in stderr and stderr.count("\n") == 1, stderr
    assert listing(tmp_path) == before


@pytest.mark.parametrize("kind", ["missing", "not JSON"])
def test_average_reads_log_to_run_before_the_work_and_leaves_no_model(shared, tmp_path, kind):
    copy(shared, tmp_path, "run")
    if kind == "not JSON":
        (tmp_path / "final.json").write_text("{not json\n")
    before = listing(tmp_path)
    stderr = one_error(run_cli(["average", "--output", "avg/model.pt", "--last", "2", "--checkpoint-dir",
                                "run/checkpoints", "--log-to-run", "final.json"], tmp_path))
    assert "final.json" in stderr and stderr.count("\n") == 1, stderr
    assert listing(tmp_path) == before


def train_command(prepared: Path, run_dir: Path, *extra: str, **preset) -> list[str]:
    from aiayn.config import section_defaults

    section = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 600, "log_every": 1,
               "dev_every": 0, "precision": "fp32", "device": "cpu"}
    return ["train", *train_settings(Path(run_dir).parent / "settings", tiny_preset(**preset), section), "--seed", "1",
            "--train-data", str(prepared / "bin" / "train"), "--spm-model",
            str(prepared / "bpe" / "spm.model"), "--run-dir", str(run_dir), "--device", "cpu", "--threads", "1",
            *extra]


@pytest.mark.parametrize("key, value", [("warmup_steps", 0), ("lr_scale", -1.0)])
def test_train_checks_its_preset_json_against_the_schema(prepared, tmp_path, key, value):
    from aiayn.schema import schema as _schema

    if key == "warmup_steps" and "minimum" not in _schema()["$defs"]["preset"]["properties"]["warmup_steps"]:
        pytest.skip("the schema sets no lower bound for warmup_steps")
    stderr = one_error(run_cli(train_command(prepared, tmp_path / "run", "--no-tracking", **{key: value}), tmp_path))
    assert stderr.startswith(f"error: {tmp_path / 'settings' / 'tiny.yaml'}: presets.tiny.{key} = {value!r}"), stderr
    assert stderr.count("\n") == 1 and "ZeroDivisionError" not in stderr, stderr
    assert [path.name for path in tmp_path.iterdir()] == ["settings"]  # the config file alone: no run folder


def test_an_unreachable_tracking_server_leaves_no_run_folder(prepared, tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound and released: nothing listens there
    env = {key: value for key, value in os.environ.items() if key != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, "-m", "aiayn.cli",
                             *train_command(prepared, tmp_path / "runs" / "base", "--tracking-uri",
                                            f"http://127.0.0.1:{port}")],
                            cwd=tmp_path, capture_output=True, timeout=TIMEOUT, env={**env, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr.decode()[-3000:]
    assert "cannot use the MLflow tracking store" in result.stderr.decode()
    left = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*"))
    assert left == ["runs", "runs/settings", "runs/settings/tiny.yaml"]  # the config file alone: no run folder


# --- 9. a failed download leaves nothing behind ----------------------------------------------------------------

def test_a_download_whose_train_split_is_all_blank_leaves_no_folder(tmp_path):
    local = write_text_corpus(tmp_path / "raw", (("train", 20), ("dev", 5), ("test", 5)))
    for side in ("en", "de"):
        (tmp_path / "raw" / f"train.{side}").write_text("\n" * 20)
    config = config_file(tmp_path / "c.yaml", data=data_section(local=local))
    before = listing(tmp_path)
    stderr = one_error(run_cli(["download", "--config", config, "--out-dir", "results/data/local"], tmp_path))
    assert "the train split is empty" in stderr, stderr
    assert listing(tmp_path) == before


# --- 10. messages that say what a file is -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "pickle"])
def test_a_model_that_is_no_checkpoint_is_called_what_it_is(shared, tmp_path, kind):
    copy(shared, tmp_path, "bpe/spm.model", "raw/test.en")
    if kind == "text":
        (tmp_path / "model.pt").write_text("the dog .\n")
        said = "model.pt: text, not a checkpoint"
    else:
        import pickle

        (tmp_path / "model.pt").write_bytes(pickle.dumps(Path("anything")))
        said = "model.pt: a checkpoint holding code"
    stderr = one_error(run_cli(decode("out.de"), tmp_path))
    assert said in stderr and "corrupt or truncated" not in stderr, stderr


def test_a_checkpoint_given_as_input_is_said_to_belong_to_model(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    stderr = one_error(run_cli(decode("out.de", source="model.pt"), tmp_path))
    assert "model.pt: a PyTorch checkpoint or model file" in stderr and "--model" in stderr, stderr
    assert "unzip" not in stderr


def test_compressed_text_on_translates_stdin_is_named(shared, tmp_path):
    copy(shared, tmp_path, "model.pt", "bpe/spm.model")
    result = subprocess.run([sys.executable, "-m", "aiayn.cli", *translate()], cwd=tmp_path,
                            input=lzma.compress(b"the dog .\n"), capture_output=True, timeout=TIMEOUT)
    stderr = one_error(result)
    assert stderr.startswith("error: stdin: xz-compressed, not UTF-8 text; decompress it on the way in: xz -dc"), stderr
