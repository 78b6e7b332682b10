"""Config files: both shipped configs validate, and a broken one names the file and key."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from aiayn.config import load_config, resolve_preset
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
    config = load_config([DEFAULT, PAPER])
    assert config["models"] == ["base", "big"] + TABLE3_ROWS
    assert config["bpe"]["vocab_size"] == 37000
    base, big = resolve_preset(config, "base"), resolve_preset(config, "big")
    assert (base["n_layers"], base["d_model"], base["d_ff"], base["n_heads"], base["dropout"], base["steps"]) == \
        (6, 512, 2048, 8, 0.1, 100000)
    assert (big["d_model"], big["d_ff"], big["n_heads"], big["dropout"], big["steps"], big["average_last"]) == \
        (1024, 4096, 16, 0.3, 300000, 20)
    assert base["average_last"] == 5 and base["checkpoint_minutes"] == 10 and base["warmup_steps"] == 4000


def test_table3_rows_change_only_what_the_paper_changes():
    config = load_config([DEFAULT, PAPER])
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
    config = load_config([DEFAULT, PAPER])
    for name in config["models"]:
        preset = resolve_preset(config, name)
        model = ModelConfig(vocab_size=37000, **{k: preset[k] for k in ("n_layers", "d_model", "d_ff", "n_heads",
                                                                      "d_head", "d_value", "dropout", "positional",
                                                                      "max_positions")})
        assert count_parameters(model) > 1e7


def test_the_paper_run_does_not_inherit_the_demo_settings():
    merged = load_config([DEFAULT, PAPER])
    alone = load_config([PAPER])
    for section in ("experiment", "data", "bpe", "binarize", "train", "decode", "models", "seeds"):
        if section == "data":
            merged[section].pop("demo"), alone[section].pop("demo")
        assert merged[section] == alone[section], section


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


def test_an_unknown_preset_lists_the_known_ones(tmp_path):
    bad = write(tmp_path, "models: [demo_base, bigg]\n")
    with pytest.raises(UserError, match=r"override\.yaml: models lists unknown preset 'bigg' \(known presets: demo_base"):
        load_config([DEFAULT, bad])


def test_heads_that_do_not_divide_d_model_say_how_to_fix_it(tmp_path):
    bad = write(tmp_path, "presets:\n  demo_base:\n    n_heads: 3\n")
    with pytest.raises(UserError, match=r"n_heads = 3 does not divide d_model = 128 \(set d_head explicitly"):
        load_config([DEFAULT, bad])


def run_snakemake(tmp_path, *args):
    for name in ("Snakefile", "workflow", "config"):
        source = REPO / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
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
    result = run_snakemake(tmp_path, "-n", "--configfile", "bad.yaml")
    assert result.returncode != 0
    assert "error: bad.yaml: train.precision = 'fp8' is not allowed (allowed values: auto, fp32, bf16)" in result.stderr


def test_the_en_fr_config_is_table2s_other_column():
    config = load_config([DEFAULT, REPO / "config" / "wmt14_en_fr.yaml"])
    assert config["models"] == ["base", "big"] and config["bpe"]["vocab_size"] == 32000
    assert (config["data"]["hub"]["name"], config["data"]["tgt_lang"]) == ("fr-en", "fr")
    big = resolve_preset(config, "big")
    assert big["dropout"] == 0.1 and big["paper"]["bleu_test"] == 41.8


def test_a_section_given_as_json_is_checked_and_gets_the_schemas_defaults(capsys):
    from aiayn.bpe import main as bpe_main
    from aiayn.config import check_section, section_defaults

    decode = check_section("decode", {"beam_size": 2}, "--decode-json")
    assert decode == {**section_defaults("decode"), "beam_size": 2}
    assert check_section("data", {}, "x")["hub"]["splits"]["dev"] == "validation"  # nested defaults too
    with pytest.raises(UserError, match=r"--decode-json: decode.beam_size = 0"):
        check_section("decode", {"beam_size": 0}, "--decode-json")
    # through a stage's command line: one message, exit 2
    status = bpe_main(["--bpe-json", '{"vocab_sise": 100}', "--out-dir", "unused", "in.txt"])
    assert status == 2
    assert "unknown key bpe.vocab_sise" in capsys.readouterr().err


def test_every_code_default_equals_the_schemas():
    """The schema is the one home of defaults: a default written in code must be the schema's."""
    import dataclasses
    import inspect

    from aiayn.config import section_defaults
    from aiayn.decode import search_batches, translate
    from aiayn.search import SearchConfig
    from aiayn.translate import arguments

    decode = section_defaults("decode")
    search_defaults = {field.name: field.default for field in dataclasses.fields(SearchConfig)}
    shared = set(search_defaults) & set(decode)
    assert shared == {"beam_size", "length_penalty", "max_len_a", "max_len_b", "stop_when_beam_finished"}
    assert {key: search_defaults[key] for key in shared} == {key: decode[key] for key in shared}
    for function in (translate, search_batches):
        parameters = inspect.signature(function).parameters
        for key in ("tokens_per_batch", "workers"):
            if key in parameters:
                assert parameters[key].default == decode[key], (function.__name__, key)
    options = vars(arguments().parse_args(["--model", "m.pt", "--spm-model", "spm.model"]))
    assert (options["beam"], options["alpha"], options["max_len_a"], options["max_len_b"],
            options["tokens_per_batch"], options["workers"]) == (
        decode["beam_size"], decode["length_penalty"], decode["max_len_a"], decode["max_len_b"],
        decode["tokens_per_batch"], decode["workers"])


def test_the_model_configs_defaults_are_the_papers_base_model():
    config = load_config([REPO / "config" / "wmt14_en_de.yaml"])
    base = resolve_preset(config, "base")
    defaults = {field.name: field.default for field in dataclasses.fields(ModelConfig) if field.name != "vocab_size"}
    assert {key: base[key] for key in defaults if key in base} == {key: defaults[key] for key in defaults if key in base}
