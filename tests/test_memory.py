"""aiayn.memory: sizes from a device's memory (GPUs faked), and a step or a search that runs out of it (a test
double raises torch.OutOfMemoryError) done again in smaller parts, to the same result."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aiayn import memory
from aiayn.config import load_config, model_fields, resolve_preset, section_defaults
from aiayn.errors import UserError
from aiayn.memory import (GiB, estimated_device_tokens, estimated_tokens_per_batch, resolve_device_tokens,
                          tokens_per_batch_for_device)
from aiayn.model import ModelConfig
from aiayn.search import SearchConfig
from aiayn.train.steps import TrainSettings
from aiayn.train.trainer import Preempted, Trainer, train
from conftest import REPO, tiny_preset
from test_decode import SENTENCES, spm_model, text_model  # noqa: F401 (fixtures)
from test_train import TRAIN_SECTION, final_weights, job

CUDA = torch.device("cuda", 0)
PAPER = load_config([REPO / "config" / "wmt14_en_de.yaml"])


def paper_model(name: str) -> ModelConfig:
    return ModelConfig(vocab_size=PAPER["bpe"]["vocab_size"], **model_fields(resolve_preset(PAPER, name)))


@pytest.fixture
def gpu_of(monkeypatch):
    """Fakes a CUDA device of the given GiB for the estimate's query (torch.cuda.get_device_properties)."""
    def fake(gib: float) -> None:
        properties = SimpleNamespace(total_memory=int(gib * GiB), name=f"a fake {gib:g} GiB GPU")
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    return fake


# --- train.device_tokens: auto --------------------------------------------------------------------

@pytest.mark.parametrize("preset, gib, low, high", [
    ("big", 16, 5000, 10000),     # a V100 or T4: a third of the 80 GB GPU's figure at most
    ("big", 40, 15000, 25000),
    ("big", 80, 25000, 25000),    # at tokens_per_step, the most a micro-batch can hold
    ("base", 16, 10000, 20000),
    ("base", 40, 25000, 25000),
    ("base", 80, 25000, 25000),
])
def test_auto_device_tokens_for_the_paper_models_on_16_40_and_80_gb_gpus(gpu_of, preset, gib, low, high):
    gpu_of(gib)
    tokens = resolve_device_tokens("auto", CUDA, paper_model(preset), "bf16", ceiling=25000)
    assert low <= tokens <= high


def test_the_estimate_grows_with_the_memory_and_shrinks_with_the_model_and_the_precision():
    base, big = paper_model("base"), paper_model("big")
    sizes = [estimated_device_tokens(big, gib * GiB, "bf16") for gib in (12, 16, 24, 40, 80, 141)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    for gib in (16, 40, 80):
        assert estimated_device_tokens(big, gib * GiB, "bf16") < estimated_device_tokens(base, gib * GiB, "bf16")
        assert estimated_device_tokens(big, gib * GiB, "fp32") < estimated_device_tokens(big, gib * GiB, "bf16")
    # big on an 80 GB GPU holds the paper's whole step of 25000 tokens a side in one micro-batch
    assert estimated_device_tokens(big, 80 * 10 ** 9, "bf16") > 25000


def test_a_gpu_too_small_for_the_model_gets_the_smallest_auto_and_leaves_the_rest_to_the_out_of_memory_cut(gpu_of):
    gpu_of(4)
    assert estimated_device_tokens(paper_model("big"), 4 * GiB, "bf16") == 0
    assert resolve_device_tokens("auto", CUDA, paper_model("big"), "bf16", ceiling=25000) == 1000


def test_numbers_a_user_sets_are_kept_and_auto_is_25000_on_the_cpu(gpu_of):
    gpu_of(16)
    preset = resolve_preset(PAPER, "big")
    train = {**section_defaults("train"), "tokens_per_step": 25000, "precision": "bf16"}
    for device in (None, torch.device("cpu"), CUDA):
        assert TrainSettings.from_config(preset, {**train, "device_tokens": 12500}, 1, device,
                                         paper_model("big")).device_tokens == 12500
    for device in (None, torch.device("cpu")):
        assert TrainSettings.from_config(preset, {**train, "device_tokens": "auto"}, 1, device).device_tokens == 25000
    on_gpu = TrainSettings.from_config(preset, {**train, "device_tokens": "auto"}, 1, CUDA, paper_model("big"))
    assert on_gpu.device_tokens == resolve_device_tokens("auto", CUDA, paper_model("big"), "bf16", 25000) < 12500


def test_processes_agree_on_the_smallest_of_their_sizes(monkeypatch):
    from dataclasses import replace

    settings = TrainSettings.from_config(tiny_preset(), {**TRAIN_SECTION, "device_tokens": 9000}, 1)
    others = []

    def all_reduce(tensor, op):  # another process sized it for a smaller GPU
        others.append(op)
        tensor.copy_(torch.minimum(tensor, torch.tensor([7000])))

    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert memory.agreed_device_tokens(settings, 2, CUDA) == replace(settings, device_tokens=7000)
    assert others == [torch.distributed.ReduceOp.MIN]
    assert memory.agreed_device_tokens(settings, 1, CUDA) is settings  # alone: nothing to agree on


def test_the_config_takes_auto_or_a_whole_number_for_train_device_tokens():
    from aiayn.config import read_config

    assert read_config(None, "train", {"train.device_tokens": ("x", "auto")})["device_tokens"] == "auto"
    with pytest.raises(UserError, match="device_tokens"):
        read_config(None, "train", {"train.device_tokens": ("x", "most")})


# --- decode.tokens_per_batch: auto ----------------------------------------------------------------

def test_auto_decoding_batches_of_big_keep_an_80_gb_gpu_a_quarter_free_at_the_worst_batch(gpu_of):
    """config/README.md's arithmetic: the worst batch is of two-token sources, outputs up to source + 50."""
    gpu_of(80e9 / GiB)
    big, search = paper_model("big"), SearchConfig.from_section(PAPER["decode"])
    tokens = tokens_per_batch_for_device("auto", CUDA, big, search)
    assert 45000 <= tokens <= 50000  # the 50000 that was this GPU's fixed figure
    rows, positions = tokens // 2, 2 + search.max_len_b + 1
    cache = rows * positions * 2 * big.n_layers * big.d_model * 2  # keys and values, bf16
    log_probs = rows * big.vocab_size * (2 + 4 + 4)
    assert cache * 1.5 + log_probs < 0.75 * 80e9


def test_auto_decoding_batches_grow_with_the_memory_and_shrink_with_the_model():
    search = SearchConfig()
    for model in (paper_model("base"), paper_model("big")):
        sizes = [estimated_tokens_per_batch(model, search, gib * GiB) for gib in (16, 40, 80)]
        assert sizes == sorted(sizes)
    assert estimated_tokens_per_batch(paper_model("big"), search, 16 * GiB) < \
        estimated_tokens_per_batch(paper_model("base"), search, 16 * GiB) < 25000


def test_decoding_numbers_are_kept_and_auto_is_8000_off_cuda(gpu_of):
    gpu_of(16)
    assert tokens_per_batch_for_device(3000, CUDA, paper_model("big"), SearchConfig()) == 3000
    for device in ("cpu", "meta"):
        assert tokens_per_batch_for_device("auto", torch.device(device), None, SearchConfig()) == 8000


# --- a training step that runs out of memory ------------------------------------------------------

SECTION = {**TRAIN_SECTION, "tokens_per_step": 1200, "device_tokens": 600, "dev_every": 0}


def out_of_memory_in(monkeypatch, at: set[tuple[int, int]], always: bool = False) -> list:
    """Trainer._micro_step raises torch.OutOfMemoryError once at each (step, micro-batch index) of ``at``, after
    its backward (its gradients are in), or at every call with ``always``; returns the calls that raised."""
    real = Trainer._micro_step
    raised = []

    def micro_step(self, step, index, batch, shape, last):
        if always:
            raised.append((step, index))
            raise torch.OutOfMemoryError("CUDA out of memory (a test double)")
        result = real(self, step, index, batch, shape, last)
        if (step, index) in at - set(raised):
            raised.append((step, index))
            raise torch.OutOfMemoryError("CUDA out of memory (a test double)")
        return result

    monkeypatch.setattr(Trainer, "_micro_step", micro_step)
    return raised


def assert_same_run(a: dict, b: dict, a_dir, b_dir) -> None:
    for key in ("step", "target_tokens", "source_tokens", "padded_tgt_tokens_per_step", "padded_src_tokens_per_step"):
        assert a[key] == b[key], key
    first, second = final_weights(a_dir), final_weights(b_dir)
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=1e-6, msg=name)


def test_out_of_memory_in_a_step_redoes_it_in_smaller_micro_batches_as_a_run_of_that_size(
        prepared, tmp_path, monkeypatch, capsys):
    raised = out_of_memory_in(monkeypatch, {(1, 1)})
    cut = train(job(prepared, tmp_path / "cut", train=SECTION))
    assert raised == [(1, 1)]
    smaller = cut["device_tokens"]
    assert smaller < 600
    lines = [line for line in capsys.readouterr().err.splitlines() if "ran out of memory" in line]
    assert len(lines) == 1 and f"train.device_tokens 600 -> {smaller}" in lines[0] and "step 1 " in lines[0]
    logged = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [(record["step"], record["device_tokens"]) for record in logged if "device_tokens" in record] == \
        [(1, smaller)]
    sized = train(job(prepared, tmp_path / "sized", train={**SECTION, "device_tokens": smaller}))
    assert sized["device_tokens"] == smaller
    assert_same_run(cut, sized, tmp_path / "cut", tmp_path / "sized")


def test_a_step_cut_mid_run_keeps_its_size_through_a_resume_as_a_run_resized_at_that_step(
        prepared, tmp_path, monkeypatch, capsys):
    out_of_memory_in(monkeypatch, {(3, 1)})
    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "cut", train=SECTION, stop_after_steps=4))
    capsys.readouterr()
    cut = train(job(prepared, tmp_path / "cut", train=SECTION))  # the setting it started with: the cut size
    smaller = cut["device_tokens"]
    assert smaller < 600
    assert f"goes on with the {smaller} its checkpoint recorded (an out-of-memory error cut 600 to it)" in \
        capsys.readouterr().err
    with pytest.raises(Preempted):  # the same run set to the smaller size from step 3 on
        train(job(prepared, tmp_path / "resized", train=SECTION, stop_after_steps=2))
    capsys.readouterr()
    resized = train(job(prepared, tmp_path / "resized", train={**SECTION, "device_tokens": smaller}))
    assert f"train.device_tokens: 600 -> {smaller}: the run goes on with the same steps" in capsys.readouterr().err
    assert_same_run(cut, resized, tmp_path / "cut", tmp_path / "resized")


def test_auto_resumes_with_the_size_its_checkpoint_recorded_where_auto_now_gives_another(
        prepared, tmp_path, monkeypatch, capsys):
    section = {**SECTION, "device_tokens": "auto"}
    straight = train(job(prepared, tmp_path / "straight", train=section))
    assert straight["device_tokens"] == 25000  # the CPU's: one micro-batch a step here
    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "moved", train=section, stop_after_steps=2))
    monkeypatch.setattr(memory, "CPU_DEVICE_TOKENS", 300)  # as on another kind of device: four micro-batches
    capsys.readouterr()
    moved = train(job(prepared, tmp_path / "moved", train=section))
    assert "goes on with the 25000 its checkpoint recorded (auto gives 300 on this device)" in capsys.readouterr().err
    assert moved["device_tokens"] == 25000
    assert_same_run(straight, moved, tmp_path / "straight", tmp_path / "moved")


def test_resuming_with_another_tokens_per_step_is_still_refused(prepared, tmp_path):
    with pytest.raises(Preempted):
        train(job(prepared, tmp_path / "run", train=SECTION, stop_after_steps=1))
    with pytest.raises(UserError, match=r"tokens_per_step 1200 -> 900"):
        train(job(prepared, tmp_path / "run", train={**SECTION, "tokens_per_step": 900, "device_tokens": 300}))


def test_a_step_that_runs_out_of_memory_with_one_sentence_a_micro_batch_stops_the_run_saying_why(
        prepared, tmp_path, monkeypatch):
    raised = out_of_memory_in(monkeypatch, set(), always=True)
    with pytest.raises(UserError) as error:
        train(job(prepared, tmp_path / "run", train=SECTION))
    message = str(error.value)
    assert "preset 'tiny' does not fit on cpu" in message and "micro-batches of one sentence" in message
    assert "GiB for the model's weights" in message and "binarize.max_tokens" in message
    assert len(raised) > 3  # cut again and again, down to one sentence
    assert not (tmp_path / "run" / "final.json").exists()


def test_several_processes_stop_at_an_out_of_memory_error_naming_the_size_to_set(gpu_of):
    gpu_of(16)
    micro = [np.arange(0, 40), np.arange(40, 80)]
    shape = SimpleNamespace(shapes=((40, 30, 31), (40, 30, 33)))

    def forward_backward(step, micro, shape):
        raise torch.OutOfMemoryError("CUDA out of memory (a test double)")

    zeroed = []
    trainer = SimpleNamespace(
        forward_backward=forward_backward, world=2, device=CUDA, job=SimpleNamespace(preset={"name": "big"}),
        settings=SimpleNamespace(device_tokens=12500),
        optimizer=SimpleNamespace(zero_grad=lambda set_to_none: zeroed.append(set_to_none)))
    with pytest.raises(UserError) as error:
        memory.fit_step(trainer, 7, micro, shape)
    message = str(error.value)
    assert "preset 'big' ran out of memory on cuda:0 (a fake 16 GiB GPU, 16.0 GiB) at step 7" in message
    assert "micro-batches of up to 1320 padded tokens" in message
    assert "set train.device_tokens to 660 or lower" in message and "resumes from its last checkpoint" in message
    assert zeroed == [True]


# --- a decoding batch that runs out of memory -----------------------------------------------------

def out_of_memory_above(monkeypatch, rows: int) -> list[int]:
    """decode's beam_search raises torch.OutOfMemoryError for a batch of more than ``rows`` sentences;
    returns the sizes of the batches searched."""
    import aiayn.decode

    real, searched = aiayn.decode.beam_search, []

    def beam_search(model, src, *args, **kwargs):
        searched.append(src.shape[0])
        if src.shape[0] > rows:
            raise torch.OutOfMemoryError("CUDA out of memory (a test double)")
        return real(model, src, *args, **kwargs)

    monkeypatch.setattr(aiayn.decode, "beam_search", beam_search)
    return searched


def test_a_decoding_batch_that_runs_out_of_memory_is_searched_in_halves_to_the_same_translations(
        spm_model, text_model, monkeypatch, capsys):  # noqa: F811 (fixtures)
    from aiayn.bpe import load_processor
    from aiayn.decode import translate

    processor = load_processor(spm_model)
    config = SearchConfig(beam_size=2, n_best=2, max_len_b=5)
    whole = translate(text_model, processor, SENTENCES, config, tokens_per_batch=8000, progress=False)
    searched = out_of_memory_above(monkeypatch, 1)
    halves = translate(text_model, processor, SENTENCES, config, tokens_per_batch=8000, progress=False)
    assert searched[0] == 4 and searched.count(1) == 4  # one batch of four, searched a sentence at a time
    assert [[h.tokens for h in sentence] for sentence in halves] == [[h.tokens for h in sentence] for sentence in whole]
    assert [h.score for sentence in halves for h in sentence] == \
        pytest.approx([h.score for sentence in whole for h in sentence], abs=1e-5)
    assert capsys.readouterr().err.count("searched in halves") == 1


def test_a_sentence_whose_search_alone_runs_out_of_memory_is_a_user_error_naming_its_line(
        spm_model, text_model, monkeypatch):  # noqa: F811 (fixtures)
    from aiayn.bpe import load_processor
    from aiayn.decode import translate

    out_of_memory_above(monkeypatch, 0)
    with pytest.raises(UserError, match=r"^news.en, line 3 \(\d+ BPE tokens\): its search alone ran out of memory"):
        translate(text_model, load_processor(spm_model), SENTENCES, SearchConfig(beam_size=2, max_len_b=5),
                  progress=False, source="news.en")


def test_an_out_of_memory_error_on_one_of_two_processes_ends_the_job_with_status_2_and_the_size_to_set(
        prepared, tmp_path, monkeypatch):
    from test_train import _run, _train_command

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # rank 1 runs out of memory in step 2's first micro-batch
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch\n"
        "    from aiayn.train.trainer import Trainer\n"
        "    real = Trainer._micro_step\n"
        "    def micro_step(self, step, index, batch, shape, last):\n"
        "        if step == 2:\n"
        "            raise torch.OutOfMemoryError('CUDA out of memory (a test double)')\n"
        "        return real(self, step, index, batch, shape, last)\n"
        "    Trainer._micro_step = micro_step\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    preset = tiny_preset(steps=4, checkpoint_steps=2, keep_checkpoints=2, average_last=2, gpus=2)
    section = {**SECTION, "device_tokens": 300}
    result = _run(_train_command(prepared, tmp_path / "run", preset, section, "--processes", "2"), timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "preset 'tiny' ran out of memory on cpu at step 2" in result.stderr
    assert "set train.device_tokens to " in result.stderr
    assert not (tmp_path / "run" / "final.json").exists()
