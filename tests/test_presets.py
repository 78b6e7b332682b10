"""The paper's presets by name: a config names them without copying them and overrides single keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, write_text_corpus

from aiayn.config import PRESET_KEYS, load_config, resolve_preset
from aiayn.errors import UserError
from aiayn.presets import paper_presets


def smallest_config(folder, extra: str = "") -> str:
    """Data paths and `models: [base]`: the whole config for a pair of one's own (``extra`` may name other
    models: a key given twice in one file is refused)."""
    write_text_corpus(folder / "corpus", (("train", 50), ("dev", 5), ("test", 5)))
    path = folder / "config.yaml"
    path.write_text(
        "experiment: en_xx\n"
        "data:\n"
        "  source: local\n"
        "  src_lang: en\n"
        "  tgt_lang: de\n"
        "  local:\n"
        "    train: {src: corpus/train.en, tgt: corpus/train.de}\n"
        "    dev: {src: corpus/dev.en, tgt: corpus/dev.de}\n"
        "    test: {src: corpus/test.en, tgt: corpus/test.de}\n"
        + ("" if extra.startswith("models:") else "models: [base]\n") + extra)
    return str(path)


def test_a_config_of_data_paths_and_models_base_trains_the_papers_base(tmp_path):
    config = load_config([smallest_config(tmp_path)])
    base = resolve_preset(config, "base")
    assert (base["n_layers"], base["d_model"], base["d_ff"], base["n_heads"]) == (6, 512, 2048, 8)
    assert base["steps"] == 100000 and base["paper"]["bleu_test"] == 27.3
    assert set(PRESET_KEYS) <= set(base)


def test_the_paper_config_names_the_presets_and_does_not_copy_them():
    paper_config = yaml.safe_load((REPO / "config" / "wmt14_en_de.yaml").read_text())
    assert "presets" not in paper_config
    assert set(paper_config["models"]) == set(paper_presets())
    config = load_config([REPO / "config" / "wmt14_en_de.yaml"])
    assert resolve_preset(config, "big")["d_model"] == 1024
    assert resolve_preset(config, "C_layers_2")["n_layers"] == 2


def test_a_key_under_presets_merges_over_the_papers_preset(tmp_path):
    config = load_config([smallest_config(tmp_path, "presets: {base: {steps: 50000}}\n")])
    base = resolve_preset(config, "base")
    assert base["steps"] == 50000
    assert base["d_model"] == 512 and base["warmup_steps"] == 4000 and base["paper"]["row"] == "base"
    assert resolve_preset(config, "big")["steps"] == 300000  # big inherits base but sets its own steps


def test_paper_numbers_given_for_a_preset_replace_the_papers_whole(tmp_path):
    config = load_config([smallest_config(tmp_path, "presets: {base: {paper: {table: table2, row: base}}}\n")])
    assert resolve_preset(config, "base")["paper"] == {"table": "table2", "row": "base"}


def test_a_preset_from_scratch_takes_the_keys_it_leaves_out_from_the_schema(tmp_path):
    own = ("models: [small]\npresets:\n  small: {n_layers: 2, d_model: 128, d_ff: 512, n_heads: 4, steps: 1000, "
           "checkpoint_steps: 100}\n")
    small = resolve_preset(load_config([smallest_config(tmp_path, own)]), "small")
    assert small["dropout"] == 0.1 and small["positional"] == "sinusoidal" and small["d_head"] is None
    assert small["paper"] == {}
    assert set(PRESET_KEYS) <= set(small)


def test_a_preset_on_two_nodes_is_laid_out_for_all_their_gpus_and_no_other_preset_gains_the_key(tmp_path):
    from aiayn.train.rendezvous import devices, nodes_of

    own = "models: [base, base_2x8]\npresets:\n  base_2x8: {inherit: base, nodes: 2}\n"
    config = load_config([smallest_config(tmp_path, own)])
    two, base = resolve_preset(config, "base_2x8"), resolve_preset(config, "base")
    assert (two["nodes"], two["gpus"], devices(two)) == (2, 8, 16)  # gpus is per node
    assert "nodes" not in base and (nodes_of(base), devices(base)) == (1, 8)  # its runs' params are unchanged


def test_nodes_below_1_are_refused_naming_the_preset(tmp_path):
    own = "models: [base_0]\npresets:\n  base_0: {inherit: base, nodes: 0}\n"
    with pytest.raises(UserError, match=r"presets\.base_0\.nodes = 0: 0 is less than the minimum of 1"):
        load_config([smallest_config(tmp_path, own)])


def test_a_key_set_by_inherit_wins_over_the_schemas_default(tmp_path):
    own = "models: [wide]\npresets:\n  wide: {inherit: big, n_layers: 2}\n"
    wide = resolve_preset(load_config([smallest_config(tmp_path, own)]), "wide")
    assert wide["dropout"] == 0.3 and wide["d_model"] == 1024 and wide["n_layers"] == 2


def test_a_key_without_default_names_the_preset_to_inherit(tmp_path):
    own = "models: [small]\npresets:\n  small: {d_model: 128}\n"
    with pytest.raises(UserError, match=r"preset 'small' .*does not set n_layers, d_ff, n_heads, steps, "
                                        r"checkpoint_steps.*`inherit: base`"):
        load_config([smallest_config(tmp_path, own)])


def test_an_unknown_preset_lists_the_configs_own_then_the_papers(tmp_path):
    with pytest.raises(UserError, match=r"unknown preset 'bsae' \(known presets: the paper's: base, big, A_heads_1"):
        load_config([smallest_config(tmp_path, "models: [bsae]\n")])


def aiayn(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_aiayn_params_lists_the_papers_presets_without_a_config(tmp_path):
    result = aiayn("params", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()[1:]]
    assert names == list(paper_presets())
    assert "63,082,496" in result.stdout.splitlines()[1]  # base at the paper's 37000 tokens, as before
    one = aiayn("params", "big", cwd=tmp_path)
    assert one.stdout.splitlines()[1].split()[:2] == ["big", "214,245,376"]
    unknown = aiayn("params", "bsae", cwd=tmp_path)
    assert unknown.returncode == 2 and "'bsae'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_snakemake_plans_the_smallest_config_from_another_folder(tmp_path):
    """The whole config is data paths and `models: [base]`; the workflow runs from the user's folder."""
    smallest_config(tmp_path)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "-s", str(REPO / "Snakefile"),
                             "--configfile", "config.yaml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "results/en_xx/train/base/seed1/final.json" in result.stdout
    assert "report" in result.stdout
