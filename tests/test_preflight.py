"""The preflight: the paper config's table against hand arithmetic, its refusals, the GPUs it lists (torch.cuda
faked), and its time estimates. No network: the hub is offline (conftest) or its probe is replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, tiny_preset, write_text_corpus

from aiayn import costs, params, preflight
from aiayn.config import read_config, resolve_presets
from aiayn.memory import tokens_per_batch_for_device
from aiayn.search import SearchConfig

PAPER = REPO / "config" / "wmt14_en_de.yaml"
GB = 10**9
# docs/cluster.md, "Disk and time before the queue": the hand count for config/wmt14_en_de.yaml
README_TOTAL = 175 * GB


@pytest.fixture
def cached_hub(tmp_path, monkeypatch):
    """An offline machine whose hub cache holds wmt/wmt14 de-en at revision main (empty stand-in files)."""
    cache = tmp_path / "hub"
    repo = cache / "datasets--wmt--wmt14"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    for split in ("train", "validation", "test"):
        folder = repo / "snapshots" / "abc123" / "de-en"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{split}-00000-of-00001.parquet").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def roomy_disk(monkeypatch):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 10**15)


def paper_table(tmp_path, measure=False):
    config = read_config([PAPER])
    rows, problems = preflight.preflight(config, resolve_presets(config), tmp_path / "results", measure)
    return config, {row.item: row for row in rows}, problems


def test_the_paper_configs_table_matches_hand_arithmetic(tmp_path, cached_hub, no_gpu, roomy_disk):
    config, rows, problems = paper_table(tmp_path)
    assert problems == []
    base, big = rows["base"], rows["big"]
    # a training checkpoint: fp32 weights and Adam's two moments, 12 bytes a parameter, and small state
    assert base.parameters == 63_082_496 and base.checkpoint == 12 * 63_082_496 + 2**20
    # base keeps 5 (average_last 5), big 20; a run holds two more at most for a moment
    assert (base.kept, big.kept) == (5, 20)
    dev_test_translations = (3000 + 3003) * costs.TEXT_BYTES_PER_PAIR / 2
    assert base.disk == pytest.approx((5 + 2) * (12 * 63_082_496 + 2**20) + 2 * 4 * 63_082_496
                                      + dev_test_translations, abs=1)
    assert big.disk == pytest.approx((20 + 2) * (12 * 214_245_376 + 2**20) + 2 * 4 * 214_245_376
                                     + dev_test_translations, abs=1)
    # the data: the hub card's bytes (text as Arrow, parquet), binarized at 2 bytes an id of typical length
    assert rows["data: text"].disk == 1_359_920_533 and rows["data: hub cache"].disk == 818_467_512
    pairs = 4_508_785 + 3000 + 3003
    assert rows["data: binarized"].disk == pytest.approx(pairs * (2 * 2 * 24 * 2.718281828 ** 0.18 + 24), rel=1e-6)
    assert rows["data: BPE"].disk == 32 * 37000
    runs = sum(rows[name].disk for name in config["models"])
    assert rows["total"].disk == runs + sum(rows[item].disk for item in
                                            ("data: text", "data: BPE", "data: binarized", "data: hub cache"))
    assert abs(rows["total"].disk - README_TOTAL) <= 0.15 * README_TOTAL


def test_the_parameters_agree_with_aiayn_params(tmp_path, cached_hub, no_gpu, roomy_disk, capsys):
    _, rows, _ = paper_table(tmp_path)
    assert params.main(["--config", str(PAPER), "--json"]) == 0
    counted = {row["preset"]: row["params"] for row in json.loads(capsys.readouterr().out)}
    assert {name: rows[name].parameters for name in counted} == counted


def test_a_training_checkpoint_is_within_its_estimate(tmp_path):
    from aiayn.model import ModelConfig, Transformer
    from aiayn.train.hardware import adam
    from aiayn.train.schedule import schedule_record

    config = ModelConfig(vocab_size=2000, n_layers=2, d_model=64, d_ff=256, n_heads=4)
    model = Transformer(config)
    optimizer = adam(model.parameters(), torch.device("cpu"), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # Adam's moments exist from the first step
    # what Trainer.save_checkpoint writes, its small entries included
    torch.save({"format": "aiayn-checkpoint-v1", "step": 1, "model_config": config.to_dict(),
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule_record(64, 4000, 1.0), "progress": {"step": 1, "dev_history": []},
                "rng": {"torch": torch.get_rng_state()}, "config": {"preset": tiny_preset()}}, tmp_path / "step.pt")
    count = params.count_parameters(config)
    assert 12 * count < (tmp_path / "step.pt").stat().st_size <= costs.checkpoint_bytes(count)


def test_a_disk_too_small_is_refused_in_one_paragraph(tmp_path, cached_hub, no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 20 * GB)
    status = preflight.main(["--config", str(PAPER), "--results", str(tmp_path / "results")])
    out, err = capsys.readouterr()
    assert status == 2
    assert "total" in out and "base" in out  # the table is printed before the refusal
    assert err.startswith("error: preflight: the workflow needs ") and err.count("\n") == 1
    assert "20.0 GB free" in err


def test_what_a_rerun_has_written_is_not_needed_again(tmp_path, cached_hub, no_gpu, monkeypatch):
    config, rows, _ = paper_table(tmp_path)
    need = rows["total"].disk
    monkeypatch.setattr(preflight, "free_bytes", lambda path: need - 10**6)
    written = tmp_path / "results" / "train" / "base" / "seed1"
    written.mkdir(parents=True)
    with open(written / "step_00001389.pt", "wb") as handle:
        handle.truncate(2 * 10**6)  # a sparse file: its length counts
    assert paper_table(tmp_path)[2] == []


def test_every_run_says_no_measurement_without_a_gpu(tmp_path, cached_hub, no_gpu, roomy_disk):
    config, rows, _ = paper_table(tmp_path, measure=True)
    assert {rows[name].time for name in config["models"]} == {"no measurement"}
    assert all(rows[name].hours is None for name in config["models"])
    assert "none visible here" in rows["GPUs"].note


def fake_gpus(monkeypatch, name="NVIDIA H200", memory=143_771 * 2**20, capability=(9, 0), count=2):
    properties = SimpleNamespace(name=name, total_memory=memory, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("AIAYN_PEAK_FLOPS", raising=False)


def test_the_gpus_here_are_listed_with_their_precision_and_sizes(tmp_path, cached_hub, roomy_disk, monkeypatch):
    fake_gpus(monkeypatch)
    config, rows, _ = paper_table(tmp_path)
    # decode.tokens_per_batch: auto, from each preset's model in the GPU's memory (aiayn.memory)
    batches = sorted({tokens_per_batch_for_device("auto", torch.device("cuda", 0), costs.model_config(preset, 37000),
                                                  SearchConfig(), "bf16") for preset in resolve_presets(config).values()})
    assert rows["GPU 0"].note == ("NVIDIA H200, 140.4 GiB, compute capability 9.0, precision bf16, "
                                  f"micro-batch 12500 tokens, decode batch {batches[0]}-{batches[-1]} tokens")
    assert 40_000 < batches[0] < batches[-1]
    assert "GPU 1" in rows and "GPU 2" not in rows
    assert rows["torch"].note.endswith("CUDA 12.8, NCCL 2.27.3")


def test_the_estimate_is_the_flop_count_at_the_measured_utilisation(tmp_path, cached_hub, roomy_disk, monkeypatch):
    fake_gpus(monkeypatch)
    config, rows, _ = paper_table(tmp_path)
    for name, steps, mfu in (("base", 100_000, 0.14), ("big", 300_000, 0.27)):
        model = costs.model_config(resolve_presets(config)[name], 37000)
        # a step: 25000 padded tokens a side in sentences of 29 tokens + 1, forward and backward (x 3)
        flops = 3 * costs.forward_flops(model, 25000 / 30, 30, 30)
        assert rows[name].hours == pytest.approx(steps * flops / (989e12 * mfu * 8) / 3600)
        # 8 GPUs share a step: 3125 tokens a GPU, fewer than were measured, so the time is a lower bound
        assert rows[name].time.startswith(">= ") and "MFU" in rows[name].note
    assert rows["C_layers_2"].note.startswith("8 GPUs, MFU 14% (H200 bf16, as measured on base)")
    assert rows["C_dmodel_1024"].note.startswith("8 GPUs, MFU 27% (H200 bf16, as measured on big)")


def test_a_gpu_the_project_never_measured_has_no_estimate(tmp_path, cached_hub, roomy_disk, monkeypatch):
    fake_gpus(monkeypatch, name="Tesla T4", memory=15 * 2**30, capability=(7, 5), count=1)
    config, rows, _ = paper_table(tmp_path)
    # a T4 (compute capability 7.5) trains in fp16, whose peak is known; the project never measured its utilisation
    assert rows["base"].time == "no measurement" and "no utilisation known for Tesla T4 in fp16" in rows["base"].note
    assert "precision fp16" in rows["GPU 0"].note


def test_a_preset_that_trains_on_the_cpu_has_no_gpu_estimate(tmp_path, roomy_disk, monkeypatch):
    fake_gpus(monkeypatch)
    config = read_config([REPO / "config" / "config.yaml"])  # the demo: gpus 0
    rows, _ = preflight.preflight(config, resolve_presets(config), tmp_path / "results")
    assert {(row.time, row.note) for row in rows if row.item in config["models"]} == \
        {("no measurement", "trains on the CPU (gpus: 0 or train.device: cpu)")}


def test_a_measured_step_runs_the_trainers_step(monkeypatch):
    config = read_config(None, "train")
    config = {"train": {**config, "tokens_per_step": 120, "device_tokens": 60, "precision": "fp32"}}
    seconds = preflight.measure_step_seconds(tiny_preset(gpus=1), config, torch.device("cpu"), vocab_size=50)
    assert 0 < seconds < 10


def test_the_hub_is_not_probed_when_offline_on_purpose(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(preflight, "hub_reachable", lambda: pytest.fail("probed the hub"))
    data = read_config([PAPER])["data"]
    status, problem = preflight.source_status(data, tmp_path / "data")
    assert "offline" in status and "not in the cache" in status
    assert "download would fail" in problem and "data.source: local" in problem


def test_the_hub_probe_is_one_short_head_request(monkeypatch):
    asked = []

    def urlopen(request, timeout):
        asked.append((request.get_method(), timeout))
        raise OSError("no network in tests")

    monkeypatch.setattr(preflight.urllib.request, "urlopen", urlopen)
    assert preflight.hub_reachable() is False
    assert asked == [("HEAD", 3.0)]


def test_downloaded_text_needs_no_source(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    data = read_config([PAPER])["data"]
    for name in ("train.en", "train.de", "dev.en", "dev.de", "test.en", "test.de", "stats.json"):
        (tmp_path / name).write_text("")
    assert preflight.source_status(data, tmp_path) == (f"present: {tmp_path} (downloaded)", None)


def test_an_unreachable_hub_is_not_refused_where_the_data_is_cached(tmp_path, cached_hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(preflight, "hub_reachable", lambda: False)
    status, problem = preflight.source_status(read_config([PAPER])["data"], tmp_path / "data")
    assert problem is None and "not reachable, in the cache" in status


def test_local_files_are_counted_at_their_size_and_missing_ones_refused(tmp_path, no_gpu, roomy_disk):
    local = write_text_corpus(tmp_path / "corpus")
    data = {"source": "local", "local": local}
    config = read_config(None, None, merged={"models": ["base"], "data": data}, sources=["test"])
    rows, problems = preflight.preflight(config, resolve_presets(config), tmp_path / "results")
    text = {row.item: row for row in rows}["data: text"].disk
    assert problems == [] and text == sum(os.path.getsize(path) for split in local.values() for path in split.values())
    os.remove(local["test"]["tgt"])
    _, problems = preflight.preflight(config, resolve_presets(config), tmp_path / "results")
    assert problems == [f"data.local.test.tgt: {local['test']['tgt']} does not exist"]


def test_snakemake_stops_a_gpu_workflow_whose_preflight_refuses(tmp_path):
    from test_config import copy_workflow

    copy_workflow(tmp_path)
    (tmp_path / "gpus.yaml").write_text("data: {source: hub}\npresets: {demo_base: {gpus: 1}}\n")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache"),
                   "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--configfile", "config/config.yaml",
                             "gpus.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 2, result.stderr
    assert "error: preflight: the hub dataset wmt/wmt14" in result.stderr
    assert not (tmp_path / "results" / "demo" / "data").exists()  # no job ran
