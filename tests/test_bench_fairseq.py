"""bench.train.fairseq_m30k without fairseq: its preset is fairseq's model and schedule as our config
validates them, and it reads fairseq's log as fairseq writes it."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from conftest import REPO

from aiayn.config import load_config, model_fields, resolve_preset
from aiayn.model import ModelConfig
from aiayn.train.schedule import learning_rate
from bench.train import fairseq_m30k


@pytest.fixture
def parity_preset(tmp_path):
    layered = tmp_path / "parity.yaml"
    layered.write_text(yaml.safe_dump(fairseq_m30k.our_config(tmp_path, 1000, 250, 1, 3600, 128)))
    config = load_config([REPO / "config" / "multi30k.yaml", layered])
    return config, resolve_preset(config, "parity")


def test_the_preset_is_fairseqs_model(parity_preset):
    config, preset = parity_preset
    assert (preset["n_layers"], preset["d_model"], preset["d_ff"], preset["n_heads"], preset["d_head"],
            preset["d_value"]) == (3, 256, 1024, 4, 64, 64)
    assert (preset["dropout"], preset["label_smoothing"], preset["steps"]) == (0.1, 0.1, 1000)
    assert config["train"]["precision"] == "fp32" and config["models"] == ["parity"]
    assert config["data"]["local"]["dev"]["src"].endswith("val.en")
    assert model_fields(preset)["init"] == "fairseq"  # fairseq's initialisation, to compare like with like


def test_presets_that_leave_init_out_resolve_as_before():
    """No `init` key appears in a preset that does not set it, so the Snakefile's params of runs made
    before the key existed are unchanged (no rerun), and the model gets t2t's initialisation."""
    config = load_config([REPO / "config" / "multi30k.yaml"])
    preset = resolve_preset(config, "m30k_base")
    assert "init" not in preset and "init" not in model_fields(preset)
    assert ModelConfig(vocab_size=100, **model_fields(preset)).init == "t2t"


def test_the_schedule_is_fairseqs_inverse_sqrt(parity_preset):
    """fairseq: lr = 1e-3 * step / 1000 for 1000 steps, then 1e-3 * sqrt(1000 / step)."""
    _, preset = parity_preset
    for step, fairseq_lr in ((1, 1e-6), (500, 5e-4), (1000, 1e-3), (4000, 5e-4)):
        ours = learning_rate(step, preset["d_model"], preset["warmup_steps"], preset["lr_scale"])
        assert math.isclose(ours, fairseq_lr, rel_tol=1e-9)


def test_fairseqs_json_log_gives_perplexity_from_bits_and_tokens_a_step():
    def line(tag, stats):
        return f"2026-12-01 12:00:00 | INFO | {tag} | {json.dumps(stats)}"

    log = "\n".join([
        "2026-12-01 12:00:00 | INFO | fairseq_cli.train | model transformer",
        line("train_inner", {"epoch": 1, "update": 0.4, "loss": "9.1", "wpb": "3500", "num_updates": "50"}),
        line("train_inner", {"epoch": 1, "update": 0.8, "loss": "8.2", "wpb": "3600", "num_updates": "100"}),
        line("valid", {"epoch": 1, "valid_loss": "6.5", "valid_nll_loss": "5.0", "valid_ppl": "32", "valid_num_updates": "250"}),
        line("valid", {"epoch": 2, "valid_loss": "5.5", "valid_nll_loss": "4.0", "valid_ppl": "16", "valid_num_updates": "500"}),
    ])
    curve, tokens = fairseq_m30k.fairseq_curve(log)
    assert curve == {250: 32.0, 500: 16.0} and tokens == 3550.0


def test_the_comparison_holds_only_within_the_tolerance_at_every_step():
    theirs = {250: 100.0, 500: 20.0, 1000: 10.0}
    lines, holds = fairseq_m30k.comparison({250: 104.0, 500: 20.9, 1000: 9.0}, theirs, [250, 500, 1000], 0.05)
    assert holds and len(lines) == 5
    lines, holds = fairseq_m30k.comparison({250: 104.0, 500: 21.2, 1000: 9.0}, theirs, [250, 500, 1000], 0.05)
    assert not holds and "| 500 | 21.20 | 20.00 | 1.060 | NO |" in lines
    _, holds = fairseq_m30k.comparison({250: 104.0, 500: 20.0}, theirs, [250, 500, 1000], 0.05)
    assert not holds
