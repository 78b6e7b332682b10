"""How a stage command receives its settings: every command takes ``--config FILE...`` (what every rule
passes, and nothing else a config key holds), a value is checked once, by the schema's rule for it, where it
enters the process, and the search's defaults are the schema's, read and not written again."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn import cli


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_takes_config_files(command):
    module = importlib.import_module(cli.COMMANDS[command][0])
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        module.main(["--help"])
    assert "--config FILE" in shown.getvalue()
    assert "<object object" not in shown.getvalue()  # the defaults shown are the real ones


def test_the_search_defaults_are_the_schemas_read_where_they_are_used():
    """A schema with other decode defaults gives other defaults everywhere: nothing holds its own copy."""
    code = """
import aiayn.schema as schema
decode = schema.parsed()["properties"]["decode"]["properties"]
decode["beam_size"]["default"], decode["length_penalty"]["default"] = 7, 0.9
decode["stop_when_beam_finished"]["default"], decode["tokens_per_batch"]["default"] = True, 1234
decode["workers"]["default"], decode["max_len_b"]["default"] = 3, 11
from aiayn.decode import resolve_tokens_per_batch, search_batches
from aiayn.search import SearchConfig
from aiayn.translate import arguments
from aiayn.search import paper_search
paper = SearchConfig()
print(paper.beam_size, paper.length_penalty, paper.stop_when_beam_finished, resolve_tokens_per_batch(None, "cpu"),
      paper_search()["max_len_b"])
print(arguments().format_help().replace("\\n", " "))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, help_text = done.stdout.split("\n", 1)
    assert first.split() == ["7", "0.9", "True", "1234", "11"]  # 11: greedy_search's too
    assert "default: 7, the paper's" in " ".join(help_text.split())


def spy_on_checks(monkeypatch) -> list[str]:
    """The keys of every section value the schema's one validator checks from now on, in order."""
    import aiayn.schema as schema

    checked: list[str] = []
    real = schema.validator

    def validator(schema):
        inner = real(schema)

        class Counting:
            def iter_errors(self, values):
                checked.extend(values if isinstance(values, dict) else [])
                return inner.iter_errors(values)
        return Counting()

    monkeypatch.setattr(schema, "validator", validator)
    return checked


def test_decode_checks_each_setting_once_where_it_enters(monkeypatch, tmp_path, capsys):
    """The options given without config files: each value is checked once, and the typed settings built
    from them are not checked again."""
    from aiayn.decode import main

    checked = spy_on_checks(monkeypatch)
    (tmp_path / "in.en").write_text("a b\n")
    status = main(["--workers", "2", "--max-source-tokens", "99",
                   "--model", str(tmp_path / "missing.pt"), "--spm-model", str(tmp_path / "missing.model"),
                   "--input", str(tmp_path / "in.en"), "--output", str(tmp_path / "out.de")])
    assert status == 2 and "not found" in capsys.readouterr().err  # stopped at the model, after the settings
    assert sorted(checked) == ["max_source_tokens", "workers"]


def test_a_config_number_that_is_not_finite_is_refused_naming_the_file(tmp_path):
    from aiayn.config import load_config
    from aiayn.errors import UserError

    config = write(tmp_path / "c.yaml", "models: [base]\ntrain: {max_minutes: .inf}\n")
    with pytest.raises(UserError, match=r"c\.yaml: train\.max_minutes = inf is not a finite number"):
        load_config([config])


def test_an_option_given_apart_is_blamed_by_its_own_name(tmp_path, capsys):
    from aiayn.decode import main

    (tmp_path / "in.en").write_text("a b\n")
    status = main(["--workers", "0", "--model", "m.pt", "--spm-model", "s.model",
                   "--input", str(tmp_path / "in.en"), "--output", str(tmp_path / "out.de")])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: --workers: decode.workers = 0") and "Traceback" not in err


def test_a_search_config_is_checked_by_the_schemas_rules_unless_built_from_a_checked_section(monkeypatch):
    from aiayn.config import section_defaults
    from aiayn.errors import UserError
    from aiayn.search import SEARCH_KEYS, SearchConfig

    with pytest.raises(UserError, match=r"decode\.length_penalty = -1"):
        SearchConfig(length_penalty=-1)  # the schema's minimum: 0
    with pytest.raises(UserError, match=r"decode\.length_penalty = nan is not a finite number"):
        SearchConfig(length_penalty=float("nan"))  # which passes JSON Schema's own type and bounds
    section = section_defaults("decode")
    checked = spy_on_checks(monkeypatch)
    assert SearchConfig.from_section(section, n_best=2) == SearchConfig(n_best=2)
    assert sorted(checked) == sorted(SEARCH_KEYS)  # the second one's check alone


# --- the commands that gained --config ------------------------------------------------------------------

def write(path, text):
    path.write_text(text)
    return str(path)


def test_score_takes_the_target_language_from_config_files_and_the_option_wins(tmp_path, capsys):
    from aiayn.score import main

    hyp, ref = write(tmp_path / "hyp.fr", "le chat .\n"), write(tmp_path / "ref.fr", "le chat .\n")
    config = write(tmp_path / "fr.yaml", "data: {src_lang: en, tgt_lang: fr}\nmodels: [base]\n")
    assert main(["--hyp", hyp, "--ref", ref, "--json", "--config", config]) == 0
    assert "-l fr " in json.loads(capsys.readouterr().out)["bleu_tok_method"]
    assert main(["--hyp", hyp, "--ref", ref, "--json", "--config", config, "--lang", "de"]) == 0
    assert "-l de " in json.loads(capsys.readouterr().out)["bleu_tok_method"]


def test_average_takes_average_last_from_the_configs_preset(tmp_path, capsys):
    from test_average import write_checkpoint

    from aiayn.average import main

    run = tmp_path / "checkpoints"
    run.mkdir()
    for step in (100, 200, 300, 400):
        write_checkpoint(run / f"step_{step:08d}.pt", step)
    config = write(tmp_path / "c.yaml", "models: [mine]\npresets:\n  mine: {inherit: base, average_last: 3}\n")
    output = tmp_path / "model.pt"
    assert main(["--config", config, "--checkpoint-dir", str(run), "--output", str(output)]) == 0
    assert torch.load(output, map_location="cpu", weights_only=True)["averaged_steps"] == [200, 300, 400]
    two = write(tmp_path / "two.yaml", "models: [mine, other]\npresets:\n  mine: {inherit: base, average_last: 3}\n"
                                       "  other: {inherit: base, average_last: 2}\n")
    assert main(["--config", two, "--preset", "other", "--checkpoint-dir", str(run), "--output", str(output)]) == 0
    assert torch.load(output, map_location="cpu", weights_only=True)["averaged_steps"] == [300, 400]
    assert main(["--config", two, "--preset", "other", "--last", "3", "--checkpoint-dir", str(run),
                 "--output", str(output)]) == 0  # an option given beside the files wins
    assert torch.load(output, map_location="cpu", weights_only=True)["averaged_steps"] == [200, 300, 400]
    capsys.readouterr()
    assert main(["--config", two, "--checkpoint-dir", str(run), "--output", str(output)]) == 2
    assert "--preset" in capsys.readouterr().err
    assert main(["--preset", "base", "--checkpoint-dir", str(run), "--last", "2", "--output", str(output)]) == 2
    assert "--config" in capsys.readouterr().err


def test_compare_takes_the_experiment_and_store_from_config_files(tmp_path, capsys, monkeypatch):
    from aiayn.compare import main

    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    MlflowClient(f"sqlite:///{tmp_path}/m.db").search_experiments()  # an empty store
    config = write(tmp_path / "c.yaml", f"experiment: mine\ntracking_uri: sqlite:///{tmp_path}/m.db\n"
                                        "models: [base]\n")
    assert main(["--config", config]) == 2  # the store and the experiment the files name
    assert f"no MLflow experiment 'mine' at sqlite:///{tmp_path}/m.db" in capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the store it read does not become every later run's
    assert main([]) == 2
    assert "--experiment" in capsys.readouterr().err


def test_demo_takes_its_sizes_and_languages_from_config_files(tmp_path):
    from aiayn.demo.corpus import main

    config = write(tmp_path / "c.yaml", "data: {src_lang: fr, tgt_lang: it, demo: {train: 7, dev: 2, test: 3}}\n"
                                        "models: [base]\n")
    assert main(["--config", config, "--out-dir", str(tmp_path / "out"), "--test", "4"]) == 0
    lines = {path.name: len(path.read_text().splitlines()) for path in (tmp_path / "out").iterdir()}
    assert lines == {"train.fr": 7, "train.it": 7, "dev.fr": 2, "dev.it": 2, "test.fr": 4, "test.it": 4}


# --- the one door: every command and every rule reads its settings through config.read_config ---------

class Entered(Exception):
    """Raised by the spy at the validator: the command reached the one door with its settings."""


# each command with --config and the least else its parser needs (inputs need not exist: the settings come first)
LEAST = {
    "demo": ["--out-dir", "{tmp}/out"],
    "download": ["--out-dir", "{tmp}/out"],
    "bpe": ["--out-dir", "{tmp}/out", "{tmp}/train.en"],
    "binarize": ["--split", "dev", "--src", "s", "--tgt", "t", "--spm-model", "m", "--out-dir", "{tmp}/out"],
    "params": [],
    "preflight": ["--results", "{tmp}/results"],
    "train": ["--preset", "demo_base", "--train-data", "t", "--spm-model", "m", "--run-dir", "{tmp}/run"],
    "average": ["--checkpoint-dir", "{tmp}/c", "--output", "{tmp}/m.pt"],
    "decode": ["--model", "m", "--spm-model", "s", "--input", "{tmp}/i", "--output", "{tmp}/o"],
    "translate": ["--model", "m", "--spm-model", "s"],
    "score": ["--hyp", "h", "--ref", "r"],
    "reference": ["--runs", "{tmp}/run", "--out", "{tmp}/reference.json"],
    "report": ["--runs", "f", "--dev-scores", "d", "--test-scores", "t", "--out-dir", "{tmp}/report"],
    "explore": ["--model", "m", "--spm-model", "s", "--out", "{tmp}/x.html"],
    "compare": [],
    "export": ["--model", "m", "--spm-model", "s", "--format", "ctranslate2", "--out", "{tmp}/e"],
}


def test_every_command_has_its_least_arguments_listed():
    assert sorted(LEAST) == sorted(cli.COMMANDS)


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_reads_its_config_files_through_the_one_validator(command, tmp_path, monkeypatch):
    """The schema's one validator sees the whole merged config of the files, once, before anything else."""
    import aiayn.schema as schema
    from conftest import REPO

    seen = []

    def validator(node):
        seen.append(node is schema.parsed())
        raise Entered

    monkeypatch.setattr(schema, "validator", validator)
    module = importlib.import_module(cli.COMMANDS[command][0])
    argv = ["--config", str(REPO / "config" / "config.yaml"), *[a.format(tmp=tmp_path) for a in LEAST[command]]]
    with pytest.raises(Entered):
        module.main(argv)
    assert seen == [True]  # the whole config, not a section on its own


def rule_commands() -> dict[str, str]:
    """Each rule file's shell command, as written (its string pieces, SETTINGS a name still)."""
    from conftest import REPO

    return {path.stem: path.read_text().split("shell:", 1)[1] for path in (REPO / "workflow" / "rules").glob("*.smk")
            if "shell:" in path.read_text()}


# what a rule's command may name besides the config: its files, its wildcards, the job's threads and attempt
RUNTIME_FIELDS = re.compile(r"\{(log|threads|output(\.\w+)?|input(\.\w+)?|wildcards\.\w+|resources\.attempt|"
                            r"params\.(out_dir|run_dir|checkpoint_dir|base))(:q)?\}")


def test_every_rule_hands_its_stage_the_resolved_config_and_no_config_value_apart():
    """The Snakefile reads the config through the door (read_config) and writes it resolved (SETTINGS); every
    rule passes that file and, besides it, only its files, wildcards and the job's threads and attempt."""
    from conftest import REPO

    common = (REPO / "workflow" / "rules" / "common.smk").read_text()
    assert "read_config(merged=config" in common and "SETTINGS = f\"{RESULTS}/config/resolved.yaml\"" in common
    assert "write_resolved(config, SETTINGS)" in common
    commands = rule_commands()
    assert sorted(commands) == ["average", "binarize", "bpe", "data", "decode", "export", "report", "score", "train"]
    for rule, command in commands.items():
        assert "f\"--config {SETTINGS} \"" in command, rule  # formatted when parsed: a module's shell cannot see SETTINGS
        fields = re.findall(r"\{[^{}]*\}", command.replace("{SETTINGS}", ""))
        assert [field for field in fields if not RUNTIME_FIELDS.fullmatch(field)] == [], rule
        assert "-json" not in command, rule


def test_the_resolved_config_reads_back_as_the_config_it_was_written_from(tmp_path):
    from aiayn.config import read_config, write_resolved
    from conftest import REPO

    config = read_config([REPO / "config" / "wmt14_en_de.yaml"])
    path = Path(write_resolved(config, tmp_path / "config" / "resolved.yaml"))
    assert read_config([path]) == config
    written = path.stat().st_mtime_ns
    os.utime(path, ns=(written - 10**9, written - 10**9))
    write_resolved(config, path)  # the same config: the file is left as it was
    assert path.stat().st_mtime_ns == written - 10**9
    config["decode"]["beam_size"] += 1
    write_resolved(config, path)
    assert read_config([path])["decode"]["beam_size"] == config["decode"]["beam_size"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["resolved.yaml"]  # no scratch file left


# --- options given beside the files go through the door: checked by the schema's rule for their key ---------

FILE_SETTINGS = ("models: [base]\nexperiment: fromfile\ntracking_uri: sqlite:///fromfile.db\n"
                 "data: {tgt_lang: it, demo: {seed: 3, train: 7}}\ntrain: {device_tokens: 999, precision: fp32}\n"
                 "average: {choose: dev}\nbinarize: {workers: 3}\n")

# command, option, a value the schema's rule for its key refuses, that key
BAD_OPTIONS = [
    ("average", "--precision", "fp8", "train.precision"),
    ("average", "--dev-tokens", "0", "train.device_tokens"),
    ("average", "--choose", "nope", "average.choose"),
    ("compare", "--experiment", "bad name", "experiment"),
    ("demo", "--train", "0", "data.demo.train"),
    ("demo", "--dev", "-1", "data.demo.dev"),
    ("binarize", "--workers", "0", "binarize.workers"),
]


@pytest.mark.parametrize("files", [True, False], ids=["beside_config", "alone"])
@pytest.mark.parametrize("command, option, value, key", BAD_OPTIONS)
def test_an_option_beside_the_config_files_is_checked_by_the_schemas_rule_and_named(command, option, value, key,
                                                                                   files, tmp_path, capsys):
    """Given beside --config's files (which set the key well) or without them, a wrong value is refused by the
    schema's rule for its key, exit 2, with the option named; nothing is run."""
    config = write(tmp_path / "c.yaml", FILE_SETTINGS)
    settings = ["--config", config] if files else []
    argv = [command, *settings, *[a.format(tmp=tmp_path) for a in LEAST[command]], f"{option}={value}"]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert f"error: {option}: {key} = " in error, error
    assert not (tmp_path / "out").exists()


# command, the option and a good value (as typed, as parsed), the key, the files' value of it
GOOD_OPTIONS = [
    ("compare", "--experiment", "other", "other", "experiment", "fromfile"),
    ("compare", "--tracking-uri", "sqlite:///x.db", "sqlite:///x.db", "tracking_uri", "sqlite:///fromfile.db"),
    ("demo", "--seed", "5", 5, "data.demo.seed", 3),
]


@pytest.mark.parametrize("given", [True, False], ids=["given", "left_at_default"])
@pytest.mark.parametrize("command, option, typed, value, key, from_file", GOOD_OPTIONS)
def test_a_good_option_beside_the_config_files_wins_and_one_left_out_does_not(command, option, typed, value, key,
                                                                              from_file, given, tmp_path, monkeypatch):
    """The option given wins over the files in the config the command reads through the door; an option left
    out leaves the files' value."""
    import aiayn.config as config_module

    seen = {}
    real = config_module.config_from_arguments

    def spy(*arguments, **keywords):
        seen["config"] = real(*arguments, **keywords)
        raise Entered

    monkeypatch.setattr(config_module, "config_from_arguments", spy)
    config = write(tmp_path / "c.yaml", FILE_SETTINGS)
    argv = ["--config", config, *[a.format(tmp=tmp_path) for a in LEAST[command]]]
    with pytest.raises(Entered):
        importlib.import_module(cli.COMMANDS[command][0]).main(argv + ([option, typed] if given else []))
    node = seen["config"]
    for part in key.split("."):
        node = node[part]
    assert node == (value if given else from_file)


# command, its settings class and field, the option and a good value (as typed, as read), the files' value of it
SETTINGS_OPTIONS = [
    ("average", "AverageSettings", "dev_tokens", "--dev-tokens", "123", 123, 999),
    ("average", "AverageSettings", "precision", "--precision", "bf16", "bf16", "fp32"),
    ("average", "AverageSettings", "choose", "--choose", "paper", "paper", "dev"),
    ("average", "AverageSettings", "last", "--last", "2", 2, 5),  # base's average_last
    ("score", "ScoreSettings", "lang", "--lang", "fr", "fr", "it"),
    ("report", "ReportSettings", "tracking_uri", "--tracking-uri", "sqlite:///x.db", "sqlite:///x.db",
     "sqlite:///fromfile.db"),
]


@pytest.mark.parametrize("given", [True, False], ids=["given", "left_out"])
@pytest.mark.parametrize("command, name, field, option, typed, value, from_file", SETTINGS_OPTIONS)
def test_a_stages_settings_object_holds_the_option_given_else_the_files_value(command, name, field, option, typed,
                                                                             value, from_file, given, tmp_path,
                                                                             monkeypatch):
    """The stage builds its one settings object through the door: an option given beside the files wins, one
    left out leaves the files' value."""
    settings_class = getattr(importlib.import_module(cli.COMMANDS[command][0]), name)
    real, seen = settings_class.from_arguments.__func__, []

    def spy(cls, args):
        seen.append(real(cls, args))
        raise Entered

    monkeypatch.setattr(settings_class, "from_arguments", classmethod(spy))
    config = write(tmp_path / "c.yaml", FILE_SETTINGS)
    argv = ["--config", config, *[a.format(tmp=tmp_path) for a in LEAST[command]]]
    with pytest.raises(Entered):
        cli.run(command, argv + ([option, typed] if given else []))
    assert getattr(seen[0], field) == (value if given else from_file)


@pytest.mark.parametrize("given", [True, False], ids=["given", "left_at_default"])
def test_binarize_workers_beside_the_config_files_wins(given, tmp_path, monkeypatch):
    import aiayn.binarize as binarize

    seen = []

    def spy(*arguments):
        seen.append(arguments[-1])
        raise Entered

    monkeypatch.setattr(binarize, "binarize_split", spy)
    config = write(tmp_path / "c.yaml", FILE_SETTINGS)
    with pytest.raises(Entered):
        binarize.main(["--config", config, *[a.format(tmp=tmp_path) for a in LEAST["binarize"]]]
                      + (["--workers", "1"] if given else []))
    assert seen == [1 if given else 3]
