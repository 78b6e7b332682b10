"""Input that looks right and is not: each case ends in one message (exit status 2, or a warning line)
instead of a run that never ends, trains on data the user did not name, or scores what means nothing.

Issue 36, items 4 to 7, 10 (the --config and --configfile messages) and 11. Real subprocesses, as a user
runs the commands: ``python -m aiayn.cli`` and ``python -m snakemake``, on tiny data made here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, config_file, corpus_with_bpe, write_text_corpus

# A search that ran would take minutes; a refusal takes the seconds of starting Python and torch.
TIMEOUT = 90


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def run_cli(args: list[str], cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "aiayn.cli", *args], cwd=cwd, input=stdin, capture_output=True,
                            timeout=TIMEOUT, env=environment())
    result.stderr = result.stderr.decode("utf-8", "replace")
    return result


def errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def warnings(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning: ")]


def refused(result: subprocess.CompletedProcess) -> str:
    """The one error line of a command that refused (status 2, no traceback)."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(errors(result)) == 1, result.stderr
    return errors(result)[0]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """A corpus, its SentencePiece model and an untrained sinusoidal model over that vocabulary."""
    import torch

    from aiayn.bpe import vocab_fingerprint
    from aiayn.checkpoint import MODEL_FORMAT, save_model
    from aiayn.model import ModelConfig, Transformer

    root = tmp_path_factory.mktemp("misleading")
    corpus_with_bpe(root)
    config = ModelConfig(vocab_size=100, n_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0, pad_id=0)
    torch.manual_seed(0)
    save_model({"format": MODEL_FORMAT, "model": Transformer(config).state_dict(), "averaged_steps": [0],
                "averaged_from": [], "model_config": config.to_dict(), "data_fingerprint": "data",
                "vocab_fingerprint": vocab_fingerprint(root / "bpe" / "spm.model")}, root / "model.pt")
    return root


def long_line_source(folder: Path) -> Path:
    """Three lines, the second of 10,000 words: a document pasted as one sentence."""
    source = folder / "source.en"
    source.write_text("the man sees the dog .\n" + " ".join(["garden"] * 10_000) + "\nthe cat sleeps .\n",
                      encoding="utf-8")
    return source


# --- item 4: a line of 10,000 words ends at once -----------------------------------------------

def test_decode_refuses_a_line_of_ten_thousand_words_at_once(shared, tmp_path):
    source = long_line_source(tmp_path)
    result = run_cli(["decode", "--model", str(shared / "model.pt"), "--spm-model",
                      str(shared / "bpe" / "spm.model"), "--input", str(source), "--output", str(tmp_path / "out.de"),
                      "--threads", "1", "--device", "cpu"], tmp_path)
    message = refused(result)
    assert "line 2 (" in message and "decode.max_source_tokens = 1024" in message
    assert not (tmp_path / "out.de").exists()


def test_translate_refuses_a_line_of_ten_thousand_words_at_once(shared, tmp_path):
    source = long_line_source(tmp_path)
    result = run_cli(["translate", "--model", str(shared / "model.pt"), "--spm-model", str(shared / "bpe" / "spm.model"),
                      "--threads", "1", "--device", "cpu"], tmp_path, stdin=source.read_bytes())
    message = refused(result)
    assert message.startswith("error: stdin:") and "line 2 (" in message and "--max-source-tokens" in message
    assert result.stdout == b""


def test_decode_takes_its_limit_from_the_command_line(shared, tmp_path):
    source = tmp_path / "source.en"
    source.write_text("the man sees the dog in the garden today .\n", encoding="utf-8")
    result = run_cli(["decode", "--model", str(shared / "model.pt"), "--spm-model",
                      str(shared / "bpe" / "spm.model"), "--input", str(source), "--output", str(tmp_path / "out.de"),
                      "--threads", "1", "--device", "cpu", "--max-source-tokens", "3"], tmp_path)
    assert "decode.max_source_tokens = 3" in refused(result)


# --- item 5: silent acceptance that misleads ---------------------------------------------------

def write_config(folder: Path, data: dict, name: str = "mine.yaml") -> Path:
    """The demo's config with ``data`` in place of its data section."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text(encoding="utf-8"))
    config["data"] = data
    path = folder / name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_local_data_without_a_source_is_refused_not_swapped_for_the_demo(tmp_path):
    local = write_text_corpus(tmp_path / "corpus", (("train", 20), ("dev", 5), ("test", 5)))
    result = run_cli(["download", "--config", str(write_config(tmp_path, {"local": local})), "--out-dir",
                      str(tmp_path / "out")], tmp_path)
    message = refused(result)
    assert "data.local" in message and "data.source" in message
    assert not (tmp_path / "out").exists()


def local_data(tmp_path: Path, **splits: str) -> dict:
    """data.local with the named splits pointing at another split's files (test="train": a leak)."""
    local = write_text_corpus(tmp_path / "corpus", (("train", 40), ("dev", 5), ("test", 5)))
    return {"source": "local", "local": {**local, **{split: local[other] for split, other in splits.items()}}}


def test_a_test_split_that_is_the_training_data_is_refused(tmp_path):
    data = local_data(tmp_path, test="train")
    result = run_cli(["download", "--config", str(write_config(tmp_path, data)), "--out-dir", str(tmp_path / "out")],
                     tmp_path)
    message = refused(result)
    assert "data.local.test is data.local.train" in message
    assert not (tmp_path / "out").exists()


def test_a_dev_split_that_is_the_training_data_is_warned_about(tmp_path):
    data = local_data(tmp_path, dev="train")
    result = run_cli(["download", "--config", str(write_config(tmp_path, data)), "--out-dir", str(tmp_path / "out")],
                     tmp_path)
    assert result.returncode == 0, result.stderr
    assert [line for line in warnings(result) if "data.local.dev is data.local.train" in line]


def test_binarize_refuses_one_file_as_source_and_target(shared, tmp_path):
    text = shared / "raw" / "train.en"
    result = run_cli(["binarize", "--split", "train", "--src", str(text), "--tgt", str(text),
                      "--spm-model", str(shared / "bpe" / "spm.model"), "--out-dir", str(tmp_path / "bin")], tmp_path)
    assert "--src" in refused(result) and "--tgt" in errors(result)[0]
    assert not (tmp_path / "bin").exists()


SMALL_BPE = {"vocab_size": 60, "input_sentence_size": 0}


def test_bpe_warns_about_one_file_given_twice(shared, tmp_path):
    text = shared / "raw" / "train.en"
    result = run_cli(["bpe", "--config", config_file(tmp_path / "bpe.yaml", bpe=SMALL_BPE), "--threads", "1",
                      "--out-dir", str(tmp_path / "bpe"), str(text), str(text)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert len([line for line in warnings(result) if "given again" in line]) == 1


def test_score_refuses_a_hypothesis_file_that_is_the_reference(shared, tmp_path):
    reference = shared / "raw" / "test.de"
    result = run_cli(["score", "--hyp", str(reference), "--ref", str(reference)], tmp_path)
    assert "one file" in refused(result)
    assert result.stdout == b""


def test_score_warns_about_a_copy_of_the_references(shared, tmp_path):
    reference = shared / "raw" / "test.de"
    shutil.copyfile(reference, tmp_path / "hyp.de")
    result = run_cli(["score", "--hyp", str(tmp_path / "hyp.de"), "--ref", str(reference)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert len([line for line in warnings(result) if "a copy of the references" in line]) == 1


def test_score_warns_in_one_line_about_moses_escaped_hypotheses(tmp_path):
    (tmp_path / "ref.de").write_text('Es ist "gut" .\nDas ist es nicht .\nDas Haus ist klein .\n', encoding="utf-8")
    (tmp_path / "hyp.de").write_text("Es ist &quot;gut&quot; .\nDas ist&apos;s nicht .\nDas Haus ist klein .\n",
                                     encoding="utf-8")
    result = run_cli(["score", "--hyp", str(tmp_path / "hyp.de"), "--ref", str(tmp_path / "ref.de")], tmp_path)
    assert result.returncode == 0, result.stderr
    escaped = [line for line in warnings(result) if "Moses escapes" in line]
    assert len(escaped) == 1 and "2 lines" in escaped[0] and "first line 1" in escaped[0]


# --- item 6: config values that cannot be right ------------------------------------------------

def demo_config_with(folder: Path, edit) -> Path:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text(encoding="utf-8"))
    edit(config)
    path = folder / "mine.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("section, key, value, said", [
    ("presets.demo_base", "d_model", 32.0, "presets.demo_base.d_model = 32.0 is not a whole number"),
    ("presets.demo_base", "dropout", 1.0, "presets.demo_base.dropout = 1.0"),
    ("presets.demo_base", "label_smoothing", 1.0, "presets.demo_base.label_smoothing = 1.0"),
    ("train", "tokens_per_step", 3000.0, "train.tokens_per_step = 3000.0 is not a whole number"),
    ("train", "adam_betas", [1.0, 0.98], "train.adam_betas[0] = 1.0"),
    ("train", "adam_eps", 0, "train.adam_eps = 0"),
    ("decode", "max_source_tokens", 0, "decode.max_source_tokens = 0"),
])
def test_a_value_that_cannot_be_right_is_refused_naming_file_and_key(tmp_path, section, key, value, said):
    def edit(config):
        node = config
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[key] = value

    path = demo_config_with(tmp_path, edit)
    result = run_cli(["download", "--config", str(path), "--out-dir", str(tmp_path / "out")], tmp_path)
    message = refused(result)
    assert message.startswith(f"error: {path}: ") and said in message


def test_a_key_given_twice_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "mine.yaml"
    text = (REPO / "config" / "config.yaml").read_text(encoding="utf-8")
    path.write_text(text.replace("  vocab_size: 2000\n", "  vocab_size: 2000\n  vocab_size: 4000\n"), encoding="utf-8")
    line = path.read_text(encoding="utf-8").splitlines().index("  vocab_size: 4000") + 1
    result = run_cli(["bpe", "--config", str(path), "--out-dir", str(tmp_path / "bpe"), "x.en", "x.de"], tmp_path)
    message = refused(result)
    assert message.startswith(f"error: {path}, line {line}, ") and "'vocab_size' is given twice" in message


# --- item 7: text that is not what it looks like -----------------------------------------------

def test_bpe_learns_no_piece_from_a_byte_order_mark(shared, tmp_path):
    text = (shared / "raw" / "train.en").read_bytes()
    (tmp_path / "bom.en").write_bytes(b"\xef\xbb\xbf" + text)
    result = run_cli(["bpe", "--config", config_file(tmp_path / "bpe.yaml", bpe=SMALL_BPE), "--threads", "1",
                      "--out-dir", str(tmp_path / "bpe"), str(tmp_path / "bom.en"), str(shared / "raw" / "train.de")],
                     tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\ufeff" not in (tmp_path / "bpe" / "spm.vocab").read_text(encoding="utf-8")


def test_binarize_counts_whitespace_only_lines_as_empty(shared, tmp_path):
    lines = (shared / "raw" / "train.de").read_text(encoding="utf-8").splitlines()
    (tmp_path / "blank.en").write_text("".join((" " if i % 2 else " \t ") + "\n" for i in range(len(lines))),
                                       encoding="utf-8")
    result = run_cli(["binarize", "--split", "train", "--src", str(tmp_path / "blank.en"),
                      "--tgt", str(shared / "raw" / "train.de"), "--spm-model", str(shared / "bpe" / "spm.model"),
                      "--out-dir", str(tmp_path / "bin")], tmp_path)
    assert f"keeps none of its {len(lines)} pairs" in refused(result)


# --- items 10 and 11: Snakemake's config messages, and its commands without --cores ------------

@pytest.fixture(scope="module")
def workflow(tmp_path_factory) -> Path:
    """The workflow's own files in a folder of their own (.snakemake stays there)."""
    folder = tmp_path_factory.mktemp("workflow")
    for name in ("Snakefile", "workflow", "config", "profiles"):
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, folder / name)
    return folder


def snakemake(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=folder, capture_output=True, text=True,
                          timeout=300, env=environment())


def test_a_wrong_config_override_is_blamed_not_the_config_file(workflow):
    result = snakemake(workflow, "--cores", "1", "-n", "--config", "models=[nosuch]")
    assert result.returncode == 2, result.stderr
    assert "error: --config models=[nosuch]: models lists unknown preset 'nosuch'" in result.stderr


def test_an_empty_configfile_is_named(workflow, tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n", encoding="utf-8")
    result = snakemake(workflow, "--cores", "1", "-n", "--configfile", str(tmp_path / "empty.yaml"))
    assert result.returncode == 2, result.stderr
    assert f"error: {tmp_path / 'empty.yaml'}: the config file is empty" in result.stderr


@pytest.mark.parametrize("profile", [[], ["--workflow-profile", "none"]])
def test_a_key_given_twice_in_a_configfile_stops_snakemake(workflow, tmp_path, profile):
    (tmp_path / "mine.yaml").write_text("models: [demo_base]\nmodels: [demo_learned]\n", encoding="utf-8")
    result = snakemake(workflow, *profile, "--cores", "1", "-n", "--configfile", "config/config.yaml",
                       str(tmp_path / "mine.yaml"))
    assert result.returncode == 2, result.stderr
    assert f"error: {tmp_path / 'mine.yaml'}, line 2, column 1: " in result.stderr
    assert "'models' is given twice" in result.stderr


@pytest.mark.parametrize("command", [["--unlock"], ["--summary"]])
def test_snakemake_commands_that_run_no_job_need_no_cores(workflow, command):
    result = snakemake(workflow, *command)
    assert result.returncode == 0, result.stderr
    assert "number of cores" not in result.stderr
