"""Dev BLEU during training (aiayn.train.dev_bleu): what ``aiayn decode`` + ``aiayn score`` give on the same
model and sentences, logged beside dev perplexity, and without changing a step of training."""

from __future__ import annotations

import json

from conftest import config_file, tiny_preset
import numpy as np
import torch

from aiayn.binarize import load_split
from aiayn.checkpoint import list_checkpoints, load_model
from aiayn.config import section_defaults
from aiayn.train.dev_bleu import DevBleu
from aiayn.train.trainer import TrainJob, train

TRAIN_SECTION = {**section_defaults("train"), "tokens_per_step": 600, "device_tokens": 300, "log_every": 2,
                 "dev_every": 4, "precision": "fp32", "device": "cpu", "dev_bleu_sentences": 12}


def job(prepared, run_dir, track=False, **train) -> TrainJob:
    return TrainJob(tiny_preset(steps=12, checkpoint_steps=4, dropout=0.1), {**TRAIN_SECTION, **train}, 1,
                    prepared / "bin" / "train", prepared / "bin" / "dev", prepared / "bpe" / "spm.model", run_dir,
                    "tests", None, track, "cpu", None, False)


def test_dev_bleu_during_training_equals_aiayn_decode_and_aiayn_score_on_the_same_model_and_sentences(prepared,
                                                                                                    tmp_path):
    from aiayn.decode import main as decode
    from aiayn.score import main as score

    summary = train(job(prepared, tmp_path / "run"))
    sample = tmp_path / "sample"
    for side in ("en", "de"):
        lines = (prepared / "data" / f"dev.{side}").read_text(encoding="utf-8").splitlines()[:12]
        (tmp_path / f"sample.{side}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert decode(["--config", config_file(tmp_path / "c.yaml", decode={"beam_size": 1}), "--model", str(tmp_path / "run" / "final.pt"),
                   "--spm-model", str(prepared / "bpe" / "spm.model"), "--device", "cpu", "--threads", "1",
                   "--input", f"{sample}.en", "--output", str(tmp_path / "hyp.de")]) in (0, None)
    assert score(["--hyp", str(tmp_path / "hyp.de"), "--ref", f"{sample}.de", "--json",
                  "--output", str(tmp_path / "score.json")]) in (0, None)
    scored = json.loads((tmp_path / "score.json").read_text())
    assert summary["dev_bleu"] == scored["sacrebleu"]
    # the same translations, not only the same number (the tiny model's BLEU on this corpus is 0)
    dev_bleu = DevBleu.from_section(TRAIN_SECTION, load_split(prepared / "bin" / "dev"), np.arange(60),
                                    prepared / "bpe" / "spm.model", torch.device("cpu"))
    translations = dev_bleu.translations(load_model(tmp_path / "run" / "final.pt"))
    assert translations == (tmp_path / "hyp.de").read_text(encoding="utf-8").splitlines()
    assert any(translations)


def test_dev_bleu_is_logged_beside_dev_perplexity_at_every_dev_evaluation(prepared, tmp_path):
    summary = train(job(prepared, tmp_path / "run"))
    assert [entry["step"] for entry in summary["dev_history"]] == [4, 8, 12]
    assert all("dev_bleu" in entry and "dev_ppl" in entry for entry in summary["dev_history"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in logged if "dev_bleu" in record] == [4, 8, 12]


def test_no_dev_bleu_where_its_sample_is_zero_sentences(prepared, tmp_path):
    summary = train(job(prepared, tmp_path / "run", dev_bleu_sentences=0))
    assert "dev_bleu" not in summary and all("dev_bleu" not in entry for entry in summary["dev_history"])


def test_training_takes_the_same_steps_with_dev_bleu_on_and_off(prepared, tmp_path):
    train(job(prepared, tmp_path / "on", dev_every=2))
    train(job(prepared, tmp_path / "off", dev_every=2, dev_bleu_sentences=0))
    on, off = (list_checkpoints(tmp_path / run / "checkpoints") for run in ("on", "off"))
    assert [step for step, _ in on] == [step for step, _ in off] == [4, 8, 12]
    for (_, path_on), (_, path_off) in zip(on, off):
        states = [torch.load(path, weights_only=True) for path in (path_on, path_off)]
        for name, tensor in states[0]["model"].items():
            assert torch.equal(tensor, states[1]["model"][name]), (path_on.name, name)
        assert torch.equal(states[0]["rng"]["torch"], states[1]["rng"]["torch"])
        for key, value in states[0]["optimizer"]["state"].items():
            for part, tensor in value.items():
                assert torch.equal(tensor, states[1]["optimizer"]["state"][key][part]), (key, part)
