"""Config files: both shipped configs validate, and a broken one names the file and key."""

from __future__ import annotations

import dataclasses
import inspect
import shutil
import subprocess
import sys

import pytest
import yaml
from pathlib import Path
from conftest import REPO, config_file

from aiayn.config import SCHEMA_PATH, load_config, merge, resolve_preset, schema_default, to_json
from aiayn.errors import UserError
from aiayn.model import ModelConfig
from aiayn.params import count_parameters

DEFAULT = REPO / "config" / "config.yaml"
PAPER = REPO / "config" / "wmt14_en_de.yaml"
TABLE3_ROWS = ["A_heads_1", "A_heads_4", "A_heads_16", "A_heads_32", "B_dk_16", "B_dk_32", "C_layers_2",
               "C_layers_4", "C_layers_8", "C_dmodel_256", "C_dmodel_1024", "C_dff_1024", "C_dff_4096",
               "D_dropout_0", "D_dropout_0.2", "D_smoothing_0", "D_smoothing_0.2", "E_learned"]


def write(tmp_path, text: str):
    path = tmp_path / "override.yaml"
    path.write_text(text)
    return path


def test_the_demo_config_validates_and_gets_defaults():
    config = load_config([DEFAULT])
    assert config["data"]["source"] == "demo"
    assert config["data"]["hub"]["path"] == "wmt/wmt14"  # filled from the schema's defaults
    assert config["train"]["adam_betas"] == [0.9, 0.98] and config["train"]["adam_eps"] == 1e-9


def test_the_paper_config_has_base_big_and_all_18_table3_rows():
    config = load_config([PAPER])
    assert config["models"] == ["base", "big"] + TABLE3_ROWS
    assert config["bpe"]["vocab_size"] == 37000
    base, big = resolve_preset(config, "base"), resolve_preset(config, "big")
    assert (base["n_layers"], base["d_model"], base["d_ff"], base["n_heads"], base["dropout"], base["steps"]) == \
        (6, 512, 2048, 8, 0.1, 100000)
    assert (big["d_model"], big["d_ff"], big["n_heads"], big["dropout"], big["steps"], big["average_last"]) == \
        (1024, 4096, 16, 0.3, 300000, 20)
    assert base["average_last"] == 5 and base["checkpoint_minutes"] == 10 and base["warmup_steps"] == 4000


def test_table3_rows_change_only_what_the_paper_changes():
    config = load_config([PAPER])
    base = resolve_preset(config, "base")
    expected = {"A_heads_1": {"n_heads": 1, "d_head": 512}, "B_dk_16": {"d_head": 16, "d_value": 64},
                "C_dmodel_256": {"d_model": 256, "d_head": 32}, "D_smoothing_0.2": {"label_smoothing": 0.2},
                "E_learned": {"positional": "learned"}}
    for name, change in expected.items():
        row = resolve_preset(config, name)
        differing = {k: row[k] for k in base if k not in ("name", "paper") and row[k] != base[k]}
        assert differing == change, name
        assert row["paper"]["row"] and "bleu_test" not in row["paper"]  # the paper's numbers are not inherited


def test_every_paper_preset_builds_a_model_config():
    config = load_config([PAPER])
    for name in config["models"]:
        preset = resolve_preset(config, name)
        model = ModelConfig(vocab_size=37000, **{k: preset[k] for k in ("n_layers", "d_model", "d_ff", "n_heads",
                                                                      "d_head", "d_value", "dropout", "positional",
                                                                      "max_positions")})
        assert count_parameters(model) > 1e7


def test_an_unknown_key_names_the_file_and_the_allowed_keys(tmp_path):
    bad = write(tmp_path, "bpe:\n  vocab_sise: 100\n")
    with pytest.raises(UserError) as error:
        load_config([DEFAULT, bad])
    assert str(error.value).startswith(f"{bad}: unknown key bpe.vocab_sise")
    assert "vocab_size" in str(error.value)


def test_a_bad_value_names_the_file_key_and_allowed_values(tmp_path):
    bad = write(tmp_path, "data:\n  source: web\n")
    with pytest.raises(UserError, match=r"data\.source = 'web' is not allowed \(allowed values: hub, local, demo\)"):
        load_config([DEFAULT, bad])
    bad = write(tmp_path, "presets:\n  demo_base:\n    positional: rotary\n")
    with pytest.raises(UserError, match=r"override\.yaml: presets\.demo_base\.positional = 'rotary' .*sinusoidal, learned, none"):
        load_config([DEFAULT, bad])


def test_an_overlay_given_alone_is_told_that_the_demo_no_longer_lies_under_it(tmp_path):
    overlay = write(tmp_path, "presets:\n  demo_base:\n    n_heads: 4\n")
    with pytest.raises(UserError) as error:
        load_config([overlay])
    message = str(error.value)
    assert message.startswith(f"{overlay}: 'models' is a required property")
    assert f"name it first, --configfile config/config.yaml {overlay}" in message


def test_an_unknown_preset_lists_the_known_ones(tmp_path):
    bad = write(tmp_path, "models: [demo_base, bigg]\n")
    with pytest.raises(UserError, match=r"override\.yaml: models lists unknown preset 'bigg' \(known presets: demo_base"):
        load_config([DEFAULT, bad])


def test_heads_that_do_not_divide_d_model_say_how_to_fix_it(tmp_path):
    bad = write(tmp_path, "presets:\n  demo_base:\n    n_heads: 3\n")
    with pytest.raises(UserError, match=r"n_heads = 3 does not divide d_model = 128 \(set d_head explicitly"):
        load_config([DEFAULT, bad])


def copy_workflow(folder):
    """The workflow's own files in a folder of its own (results and .snakemake stay there)."""
    for name in ("Snakefile", "workflow", "config", "profiles"):
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, folder / name)


def run_snakemake(tmp_path, *args, copy=True):
    if copy:
        copy_workflow(tmp_path)
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_paper_dry_run_lists_every_stage_for_every_preset(tmp_path):
    result = run_snakemake(tmp_path, "-n", "--configfile", "config/wmt14_en_de.yaml")
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    config = yaml.safe_load(PAPER.read_text())
    for stage in ("download", "bpe", "binarize", "train", "average", "decode", "score", "report"):
        assert f"rule {stage}:" in out or f"localrule {stage}:" in out, stage
    for model in config["models"]:
        for stage in ("train", "score", "average", "decode"):
            assert f"results/wmt14_en_de/{stage}/{model}/seed1/" in out, (stage, model)
    assert "results/demo/" not in out  # the demo's models are not trained by the paper's run


def test_a_broken_config_stops_snakemake_before_any_job(tmp_path):
    (tmp_path / "bad.yaml").write_text("train:\n  precision: fp8\n")
    result = run_snakemake(tmp_path, "-n", "--configfile", "config/config.yaml", "bad.yaml")
    assert result.returncode == 2
    assert "error: bad.yaml: train.precision = 'fp8' is not allowed (allowed values: auto, fp32, bf16, fp16)" in result.stderr


def test_the_en_fr_config_is_table2s_other_column():
    config = load_config([REPO / "config" / "wmt14_en_fr.yaml"])
    assert config["models"] == ["base", "big"] and config["bpe"]["vocab_size"] == 32000
    assert (config["data"]["hub"]["name"], config["data"]["tgt_lang"]) == ("fr-en", "fr")
    big = resolve_preset(config, "big")
    assert big["dropout"] == 0.1 and big["paper"]["bleu_test"] == 41.8


def test_a_section_read_without_files_stands_on_the_schemas_defaults_and_its_options_are_checked(tmp_path, capsys):
    from aiayn.bpe import main as bpe_main
    from aiayn.config import read_config, section_defaults

    decode = read_config(None, "decode", {"decode.beam_size": ("--beam", 2)})
    assert decode == {**section_defaults("decode"), "beam_size": 2}
    assert read_config(None, "data")["hub"]["splits"]["dev"] == "validation"  # nested defaults too
    with pytest.raises(UserError, match=r"--beam: decode.beam_size = 0"):
        read_config(None, "decode", {"decode.beam_size": ("--beam", 0)})
    whole = read_config(None, None, {"train.precision": ("--precision", "fp32")})
    assert whole["train"] == {**section_defaults("train"), "precision": "fp32"} and "models" not in whole
    # through a stage's command line: one message, exit 2
    config = config_file(tmp_path / "c.yaml", bpe={"vocab_sise": 100})
    status = bpe_main(["--config", config, "--out-dir", "unused", "in.txt"])
    assert status == 2
    assert "unknown key bpe.vocab_sise" in capsys.readouterr().err


def test_every_code_default_equals_the_schemas():
    """The schema is the one home of defaults: a default written in code must be the schema's."""
    import dataclasses
    import inspect

    from aiayn.config import section_defaults
    from aiayn.decode import search_batches, translate
    from aiayn.search import SearchConfig
    from aiayn.translate import _parse

    decode = section_defaults("decode")
    search_defaults = dataclasses.asdict(SearchConfig())
    shared = set(search_defaults) & set(decode)
    assert shared == {"beam_size", "length_penalty", "max_len_a", "max_len_b", "stop_when_beam_finished",
                      "stop_when_best_finished", "eos_candidates"}
    assert {key: search_defaults[key] for key in shared} == {key: decode[key] for key in shared}
    for function in (translate, search_batches):  # left out: the schema's (tests/test_stage_settings.py)
        parameters = inspect.signature(function).parameters
        for key in ("tokens_per_batch", "workers"):
            if key in parameters:
                assert parameters[key].default is None, (function.__name__, key)
    _, section = _parse(["--model", "m.pt", "--spm-model", "spm.model"])
    assert section == decode


def test_the_model_configs_defaults_are_the_papers_base_model():
    config = load_config([REPO / "config" / "wmt14_en_de.yaml"])
    base = resolve_preset(config, "base")
    defaults = {field.name: field.default for field in dataclasses.fields(ModelConfig) if field.name != "vocab_size"}
    assert {key: base[key] for key in defaults if key in base} == {key: defaults[key] for key in defaults if key in base}


# --- the layers under a user's config: the schema's defaults, never the demo's values ---------------

MINIMAL_PRESET = {"n_layers": 1, "d_model": 32, "d_ff": 64, "n_heads": 4, "d_head": None, "d_value": None,
                  "dropout": 0.1, "label_smoothing": 0.1, "positional": "sinusoidal", "max_positions": 64,
                  "steps": 4, "warmup_steps": 2, "lr_scale": 1.0, "average_last": 2, "keep_checkpoints": 2,
                  "checkpoint_minutes": None, "checkpoint_steps": 2, "gpus": 0, "runtime_minutes": 5}


def minimal_config(folder):
    """A user's config from scratch: local data, one preset, nothing else."""
    from conftest import write_text_corpus

    config = {"data": {"source": "local", "local": write_text_corpus(folder / "corpus")},
              "models": ["mine"], "presets": {"mine": MINIMAL_PRESET}}
    path = folder / "minimal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def schema_leaves(node, prefix=""):
    """(dotted key, default) for every key of the schema that has a default and no keys of its own."""
    for key, child in node.get("properties", {}).items():
        if "properties" in child:
            yield from schema_leaves(child, f"{prefix}{key}.")
        elif "default" in child:
            yield f"{prefix}{key}", child["default"]


RUNTIME_ONLY = {"train": ("log_every", "threads", "share_gpus", "dev_bleu_sentences", "dev_bleu_beam", "spike_window",
                          "spike_sigmas", "reference"), "binarize": ("workers",), "decode": ("workers", "max_source_tokens")}
STAGE_SECTIONS = {"download": "data", "bpe": "bpe", "binarize": "binarize", "train": "train", "decode": "decode"}


def planned_settings(output: str, folder) -> dict:
    """The config sections the planned jobs read (each stage's section of the resolved config that
    `--config FILE` hands it in `snakemake -n -p`), without the keys that change no output."""
    import re

    found: dict = {}
    for stage, path, rest in re.findall(r"--attempt \d+ ([a-z]+) --config (\S+)(.*)", output):
        if stage in STAGE_SECTIONS:
            section = STAGE_SECTIONS[stage]
            resolved = load_config([Path(folder) / path.strip("'")])
            kept = {key: value for key, value in resolved[section].items() if key not in RUNTIME_ONLY.get(section, ())}
            found.setdefault(section, set()).add(to_json(kept))
        if stage == "train":
            name = re.search(r"--preset (\S+)", rest).group(1)
            found.setdefault("preset", set()).add(to_json(resolve_preset(resolved, name)))
    return found


def test_a_minimal_config_takes_every_unset_key_from_the_schema_and_nothing_from_the_demo(tmp_path):
    path, written = minimal_config(tmp_path)
    config = load_config([path])
    for key, default in schema_leaves(yaml.safe_load(SCHEMA_PATH.read_text())):
        node, given = config, written
        for part in key.split("."):
            node, given = node[part], (given or {}).get(part) if isinstance(given, dict) else None
        if given is None:
            assert node == default == schema_default(key), key
    # Through snakemake: the jobs get those values, and editing the demo's config/config.yaml changes none
    plans = []
    for name, demo_edit in (("as_shipped", {}), ("edited", {"experiment": "edited", "seeds": [9],
                                                           "bpe": {"vocab_size": 1234, "seed": 5},
                                                           "train": {"precision": "bf16", "tokens_per_step": 777},
                                                           "decode": {"tokens_per_batch": 555, "beam_size": 2}})):
        folder = tmp_path / name
        folder.mkdir()
        copy_workflow(folder)
        demo = yaml.safe_load((folder / "config" / "config.yaml").read_text())
        (folder / "config" / "config.yaml").write_text(yaml.safe_dump(merge(demo, demo_edit)))
        result = run_snakemake(folder, "-n", "-p", "--configfile", str(path), copy=False)
        assert result.returncode == 0, result.stderr[-3000:]
        # a dry run writes nothing; the file the planned jobs name is written by a run that plans for real
        # (--dag plans and starts no job)
        assert not (folder / "results").exists()
        assert run_snakemake(folder, "--dag", "--configfile", str(path), copy=False).returncode == 0
        plans.append(planned_settings(result.stdout, folder))
    assert plans[0] == plans[1]
    for section in ("data", "bpe", "binarize", "train", "decode"):
        expected = {k: v for k, v in config[section].items() if k not in RUNTIME_ONLY.get(section, ())}
        assert plans[0][section] == {to_json(expected)}, section
    assert plans[0]["preset"] == {to_json(resolve_preset(config, "mine"))}


def test_without_a_configfile_snakemake_runs_the_demo(tmp_path):
    result = run_snakemake(tmp_path, "-n", "-p")
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_snakemake(tmp_path, "--dag", copy=False).returncode == 0  # writes the config the planned jobs name
    demo = load_config([DEFAULT])
    assert planned_settings(result.stdout, tmp_path)["bpe"] == {to_json(demo["bpe"])}
    assert "results/demo/train/demo_heads_1/seed1/" in result.stdout


def test_the_multi30k_recipes_resolve_to_what_their_results_were_measured_with():
    """BENCHMARKS.md's Multi30k numbers were measured when the demo's config lay under every config:
    the recipe now sets the two values it took from it (the rest are the schema's defaults)."""
    recipe = load_config([REPO / "config" / "multi30k.yaml"])
    assert (recipe["train"]["precision"], recipe["decode"]["tokens_per_batch"]) == ("fp32", 6000)
    assert (recipe["train"]["threads"], recipe["bpe"]["seed"], recipe["data"]["max_chars"]) == (0, 1, 1000)
    thirty = load_config([REPO / "config" / "multi30k.yaml", REPO / "config" / "multi30k_30min.yaml"])
    assert (thirty["train"]["precision"], thirty["decode"]["tokens_per_batch"]) == ("auto", 6000)


# --- config errors through plain snakemake: one line naming the file, exit status 2 ----------------

def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment: x\nmodels: [base\npresets: {}\n")
    expected = f"{bad.name}, line 3, column 8: not valid YAML: expected ',' or ']', but got ':'"
    with pytest.raises(UserError) as error:
        load_config([bad])
    assert expected in str(error.value)
    for command in (["-n", "--configfile", "bad.yaml"], ["-n", "--configfiles=bad.yaml", "--cores", "1"]):
        result = run_snakemake(tmp_path, *command, copy=command[1] == "--configfile")
        assert result.returncode == 2, result.stderr
        assert f"error: {expected}" in result.stderr
        assert "Traceback" not in result.stderr and "WorkflowError" not in result.stderr
    params = subprocess.run([sys.executable, "-m", "aiayn.cli", "params", "--config", "bad.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert params.returncode == 2 and f"error: {expected}" in params.stderr


def test_a_missing_configfile_or_a_folder_is_named_with_exit_status_2(tmp_path):
    result = run_snakemake(tmp_path, "-n", "--configfile", "mine.yaml")
    assert result.returncode == 2
    assert "error: mine.yaml: config file not found" in result.stderr
    result = run_snakemake(tmp_path, "-n", "--configfile", "config", copy=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: config: a folder, not a config file" in result.stderr


def test_a_head_count_error_names_the_users_file_not_the_demos(tmp_path):
    (tmp_path / "wider.yaml").write_text("presets:\n  demo_base:\n    d_model: 102\n")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({
        "models": ["mine", "narrow"], "presets": {"mine": MINIMAL_PRESET,
                                                 "narrow": {"inherit": "mine", "d_model": 30}}}))
    result = run_snakemake(tmp_path, "-n", "--configfile", "config/config.yaml", "wider.yaml")
    assert result.returncode == 2
    assert "error: wider.yaml: presets.demo_base.n_heads = 4 does not divide d_model = 102" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_snakemake(tmp_path, "-n", "--configfile", "mine.yaml", copy=False)
    assert result.returncode == 2
    assert "error: mine.yaml: presets.narrow.n_heads = 4 does not divide d_model = 30" in result.stderr


def test_code_defaults_come_from_the_schema(tmp_path):
    from conftest import write_text_corpus

    from aiayn.bpe import learn_bpe
    from aiayn.search import greedy_search

    train = subprocess.run([sys.executable, "-m", "aiayn.train", "--help"], capture_output=True, text=True, timeout=120)
    assert f"sets none, {schema_default('experiment')}, the schema's)" in " ".join(train.stdout.split())
    local = write_text_corpus(tmp_path / "corpus")
    info = learn_bpe([local["train"]["src"], local["train"]["tgt"]], tmp_path / "bpe", vocab_size=60, threads=1)
    assert {key: info[key] for key in ("input_sentence_size", "character_coverage", "seed")} == {
        key: schema_default(f"bpe.{key}") for key in ("input_sentence_size", "character_coverage", "seed")}
    greedy = inspect.signature(greedy_search).parameters
    # left out, the schema's (aiayn.search.paper_search; tests/test_stage_settings.py changes the schema)
    assert (greedy["max_len_a"].default, greedy["max_len_b"].default, greedy["length_penalty_alpha"].default) == (
        None, None, None)


# --- every stage reads config files the same way: train too ----------------------------------------------

def _train_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", nargs="+")
    for option in ("--preset", "--experiment", "--tracking-uri"):
        parser.add_argument(option)
    parser.add_argument("--log-every", type=int)
    return parser.parse_args(argv)


def test_train_takes_config_files_and_a_preset_name_as_the_snakefile_resolves_them():
    from aiayn.train.launch import _settings

    demo = str(REPO / "config" / "config.yaml")
    config = load_config([demo])
    preset, train_section, experiment, uri = _settings(_train_args(["--config", demo, "--preset", "demo_base"]))
    assert preset == resolve_preset(config, "demo_base")
    assert (train_section, experiment, uri) == (config["train"], config["experiment"], config["tracking_uri"])
    given = _settings(_train_args(["--config", demo, "--preset", "demo_base", "--log-every", "3", "--experiment",
                                   "other", "--tracking-uri", "sqlite:///other.db"]))
    assert given[1]["log_every"] == 3 and given[2:] == ("other", "sqlite:///other.db")


def test_train_refuses_a_command_line_without_config_files_or_a_preset(capsys):
    from aiayn.train.launch import main

    for argv, missing in (([], "--config, --preset"), (["--config", "x.yaml"], "--preset"),
                          (["--preset", "base"], "--config")):
        assert main([*argv, "--train-data", "t", "--spm-model", "m", "--run-dir", "r"]) == 2
        assert f"the following arguments are required: {missing}" in capsys.readouterr().err
