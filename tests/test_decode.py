"""Tests for aiayn.decode and aiayn.translate: text in batches and threads through the search, and their CLIs."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from aiayn import translate
from aiayn.bpe import learn_bpe, load_processor, vocab_fingerprint
from aiayn.checkpoint import load_model
from aiayn.config import load_config
from aiayn.decode import hypothesis_text, main, resolve_tokens_per_batch, search_batches
from aiayn.decode import translate as translate_text
from aiayn.errors import UserError
from aiayn.model import Transformer
from aiayn.search import SearchConfig, beam_search
from aiayn.speed.incremental import InferenceModel
from aiayn.tokens import EOS_ID
from conftest import REPO, config_file
from test_search import sources, tiny_model  # the search's tiny random models and padded sources


# --- batches searched by worker threads ------------------------------------------------------------

def test_two_workers_return_what_one_worker_returns_batch_by_batch():
    model = tiny_model(seed=5)
    config = SearchConfig(beam_size=3, n_best=2, max_len_b=8)
    batches = [sources(lengths, seed=seed) for seed, lengths in enumerate([[5, 9], [12, 3, 7], [4], [8, 8, 2, 6]])]
    threads = torch.get_num_threads()
    finished = []
    one = search_batches(model, batches, config, workers=1)
    two = search_batches(model, batches, config, workers=2, on_done=finished.append)
    assert torch.get_num_threads() == threads  # restored after the workers' own setting
    assert sorted(finished) == sorted(batch.shape[0] for batch in batches)
    assert [[[h.tokens for h in sentence] for sentence in batch] for batch in two] == \
        [[[h.tokens for h in sentence] for sentence in batch] for batch in one]
    assert [h.score for batch in two for sentence in batch for h in sentence] == \
        pytest.approx([h.score for batch in one for sentence in batch for h in sentence], abs=1e-4)
    assert search_batches(model, [], config, workers=2) == []


def test_batches_searched_in_one_scratch_memory_equal_each_searched_alone():
    # Large, small, large: the third batch's cache reuses memory the first two wrote, never read back.
    model = tiny_model(seed=6)
    batches = [sources(lengths, seed=seed) for seed, lengths in enumerate([[9, 7, 8, 9], [3], [6, 9, 2, 5, 9]])]
    config = SearchConfig(beam_size=3, n_best=3, max_len_b=6)
    alone = [beam_search(model, batch, config) for batch in batches]
    shared = search_batches(model, batches, config)
    assert [[[(h.tokens, h.score) for h in sentence] for sentence in batch] for batch in shared] == \
        [[[(h.tokens, h.score) for h in sentence] for sentence in batch] for batch in alone]


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_search_batches_rejects_a_bad_worker_count(workers):
    with pytest.raises(UserError, match="workers"):
        search_batches(tiny_model(), [sources([3])], SearchConfig(), workers=workers)


# --- tokens per batch ------------------------------------------------------------------------------

@pytest.mark.parametrize("value, device, expected", [
    ("auto", "cpu", 8000), ("auto", "meta", 8000), (3000, "cuda", 3000), (3000, "cpu", 3000),
])
def test_auto_tokens_per_batch_is_the_cpus_off_cuda_and_a_number_is_kept(value, device, expected):
    assert resolve_tokens_per_batch(value, device) == expected  # auto on a GPU: tests/test_memory.py


@pytest.mark.parametrize("value", [0, -5, "many", True, 2.5])
def test_a_tokens_per_batch_that_is_not_a_whole_number_or_auto_is_a_user_error(value):
    with pytest.raises(UserError, match="tokens_per_batch"):
        resolve_tokens_per_batch(value, "cpu")


@pytest.mark.parametrize("paper_config", ["wmt14_en_de.yaml", "wmt14_en_fr.yaml"])
def test_the_paper_configs_decode_auto_sized_batches(paper_config):
    config = load_config([REPO / "config" / paper_config])  # as snakemake --configfile reads it
    assert config["decode"]["tokens_per_batch"] == "auto"


# --- text in, text out: a real SentencePiece model trained here, an untrained Transformer -------------

WORDS = "the a house cat dog is small big red green runs sleeps on under table garden we they see".split()


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spm")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(200):
        count = int(torch.randint(3, 10, (1,), generator=generator))
        lines.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (count,), generator=generator)))
    (directory / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    learn_bpe([directory / "train.txt"], directory, vocab_size=60, threads=1)
    return directory / "spm.model"


@pytest.fixture(scope="module")
def text_model(spm_model) -> InferenceModel:
    pieces = load_processor(spm_model).get_piece_size()
    return tiny_model(seed=19, vocab_size=pieces)


SENTENCES = ["the cat sleeps", "", "a big red dog runs under the green table in the garden", "we see", "   ",
             "they see a small house"]


def best_translations(model, processor, sentences, config, **options) -> list[str]:
    """The best hypothesis of each sentence as text, as the CLIs write it."""
    results = translate_text(model, processor, sentences, config, progress=False, **options)
    return [hypothesis_text(processor, hypotheses[0]) for hypotheses in results]


def test_translate_returns_one_result_per_line_in_input_order(spm_model, text_model):
    processor = load_processor(spm_model)
    config = SearchConfig(beam_size=2, max_len_b=5)
    outputs = best_translations(text_model, processor, SENTENCES, config, tokens_per_batch=30)
    assert len(outputs) == len(SENTENCES)
    assert outputs[1] == "" and outputs[4] == ""
    one_by_one = [best_translations(text_model, processor, [s], config)[0] for s in SENTENCES]
    assert outputs == one_by_one
    reversed_outputs = best_translations(text_model, processor, SENTENCES[::-1], config)
    assert reversed_outputs == outputs[::-1]


def test_translate_returns_the_searched_hypotheses_and_an_empty_one_for_a_blank_line(spm_model, text_model):
    processor = load_processor(spm_model)
    config = SearchConfig(beam_size=3, max_len_b=6)
    src = torch.tensor([processor.encode(SENTENCES[0]) + [EOS_ID]])
    results = translate_text(text_model, processor, SENTENCES[:2], config, progress=False)
    assert results[0] == beam_search(text_model, src, config)[0]
    assert [(h.tokens, h.score) for h in results[1]] == [([], 0.0)]
    assert hypothesis_text(processor, results[1][0]) == ""


def test_auto_tokens_per_batch_decodes_on_the_cpu_what_8000_decodes(spm_model, text_model):
    processor = load_processor(str(spm_model))
    config = SearchConfig(beam_size=2, max_len_b=4)
    auto = best_translations(text_model, processor, SENTENCES, config, tokens_per_batch="auto")
    assert auto == best_translations(text_model, processor, SENTENCES, config, tokens_per_batch=8000)


def test_translate_gives_n_best_scored_hypotheses_per_sentence_best_first(spm_model, text_model):
    processor = load_processor(spm_model)
    results = translate_text(text_model, processor, SENTENCES, SearchConfig(beam_size=3, n_best=3, max_len_b=5),
                             progress=False)
    assert len(results) == len(SENTENCES)
    for index in (0, 2, 3, 5):
        assert len(results[index]) == 3
        scores = [hypothesis.score for hypothesis in results[index]]
        assert scores == sorted(scores, reverse=True)


def save_model_file(path, model: Transformer, spm_model=None) -> None:
    """A model file as `aiayn average` writes it, of the vocabulary spm_model (by default a made-up one)."""
    fingerprint = vocab_fingerprint(spm_model) if spm_model is not None else "v"
    torch.save(
        {"format": "aiayn-model-v1", "model_config": model.config.to_dict(), "model": model.state_dict(),
         "vocab_fingerprint": fingerprint, "data_fingerprint": "d", "averaged_steps": [1], "averaged_from": ["x"]},
        path,
    )


def test_load_model_restores_the_weights_in_eval_mode(tmp_path, text_model):
    save_model_file(tmp_path / "model.pt", text_model.model)
    loaded = load_model(tmp_path / "model.pt")
    assert not loaded.training
    for key, value in text_model.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_load_model_refuses_weights_that_do_not_fit_their_config(tmp_path, text_model):
    save_model_file(tmp_path / "model.pt", text_model.model)
    checkpoint = torch.load(tmp_path / "model.pt", weights_only=True)
    checkpoint["model_config"]["d_ff"] = 48
    torch.save(checkpoint, tmp_path / "model.pt")
    with pytest.raises(UserError, match="do not fit its own model_config"):
        load_model(tmp_path / "model.pt")


DECODE = {"beam_size": 2, "length_penalty": 0.6, "max_len_a": 1.0, "max_len_b": 4, "tokens_per_batch": 40}


def decode_config(folder, decode=DECODE) -> list[str]:
    """``--config FILE`` of a config whose `decode` section is ``decode``."""
    return ["--config", config_file(folder / "decode.yaml", decode=decode)]


def test_decode_cli_writes_one_line_per_input_line(tmp_path, spm_model, text_model, capsys):
    save_model_file(tmp_path / "model.pt", text_model.model, spm_model)
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    status = main([*decode_config(tmp_path), "--model", str(tmp_path / "model.pt"), "--spm-model",
                   str(spm_model), "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "out" / "hyp.txt"),
                   "--threads", "1", "--device", "cpu"])
    assert status == 0
    written = (tmp_path / "out" / "hyp.txt").read_text(encoding="utf-8").split("\n")
    processor = load_processor(spm_model)
    expected = best_translations(text_model, processor, SENTENCES, SearchConfig(beam_size=2, max_len_b=4))
    assert written == expected + [""]
    assert "sentences/s" in capsys.readouterr().out


def test_decode_cli_with_two_workers_writes_what_one_worker_writes(tmp_path, spm_model, text_model):
    save_model_file(tmp_path / "model.pt", text_model.model, spm_model)
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES * 3) + "\n", encoding="utf-8")
    written = []
    for workers in (1, 2):
        section = {"beam_size": 2, "max_len_b": 4, "tokens_per_batch": 30, "workers": workers}
        output = tmp_path / f"hyp{workers}.txt"
        assert main([*decode_config(tmp_path / str(workers), section), "--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model),
                     "--input", str(tmp_path / "src.txt"), "--output", str(output), "--threads", "2",
                     "--device", "cpu"]) == 0
        written.append(output.read_text(encoding="utf-8"))
    assert written[0] == written[1]
    assert len(written[0].split("\n")) == 3 * len(SENTENCES) + 1


def test_decode_cli_reports_a_missing_model_file_with_exit_status_2(tmp_path, spm_model, capsys):
    (tmp_path / "src.txt").write_text("the cat\n", encoding="utf-8")
    status = main([*decode_config(tmp_path), "--model", str(tmp_path / "nope.pt"), "--spm-model", str(spm_model),
                   "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "hyp.txt"), "--device", "cpu"])
    assert status == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "nope.pt" in error and "Traceback" not in error
    assert not (tmp_path / "hyp.txt").exists()


def test_decode_cli_refuses_a_vocabulary_of_another_size(tmp_path, spm_model, capsys):
    save_model_file(tmp_path / "model.pt", tiny_model(seed=20, vocab_size=30).model, spm_model)
    (tmp_path / "src.txt").write_text("the cat\n", encoding="utf-8")
    status = main([*decode_config(tmp_path), "--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model),
                   "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "hyp.txt"), "--device", "cpu"])
    assert status == 2
    assert "vocab_size = 30" in capsys.readouterr().err


def test_decode_cli_refuses_another_vocabulary_of_the_same_size(tmp_path, spm_model, text_model, capsys):
    save_model_file(tmp_path / "model.pt", text_model.model)  # the right size, another fingerprint
    (tmp_path / "src.txt").write_text("the cat\n", encoding="utf-8")
    status = main([*decode_config(tmp_path), "--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model),
                   "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "hyp.txt"), "--device", "cpu"])
    assert status == 2
    assert "another vocabulary" in capsys.readouterr().err


def run_translate(monkeypatch, capsys, text: str, argv: list[str]) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8"))
    status = translate.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_translate_cli_writes_one_translation_per_stdin_line(
    workers, tmp_path, spm_model, text_model, monkeypatch, capsys
):
    save_model_file(tmp_path / "model.pt", text_model.model, spm_model)
    argv = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--beam", "2",
            "--max-len-b", "4", "--device", "cpu", "--workers", workers, "--tokens-per-batch", "30"]
    status, out, _ = run_translate(monkeypatch, capsys, "\n".join(SENTENCES) + "\n", argv)
    assert status == 0
    expected = best_translations(text_model, load_processor(spm_model), SENTENCES,
                                 SearchConfig(beam_size=2, max_len_b=4))
    assert out.split("\n") == expected + [""]


def test_translate_cli_takes_a_runs_decode_section_from_config_files_and_its_options_win(
    tmp_path, spm_model, text_model, monkeypatch, capsys
):
    save_model_file(tmp_path / "model.pt", text_model.model, spm_model)
    (tmp_path / "run.yaml").write_text(  # a run's whole config: the paper's base, its own search
        "models: [base]\ndecode: {beam_size: 2, max_len_b: 4, stop_when_beam_finished: true}\n")
    (tmp_path / "more.yaml").write_text("decode: {max_len_b: 3}\n")  # merged after the first, as everywhere
    model = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--device", "cpu"]
    processor = load_processor(spm_model)
    files = ["--config", str(tmp_path / "run.yaml"), str(tmp_path / "more.yaml")]
    status, out, err = run_translate(monkeypatch, capsys, "\n".join(SENTENCES) + "\n", model + files)
    assert status == 0, err
    assert out.split("\n") == best_translations(text_model, processor, SENTENCES, SearchConfig(
        beam_size=2, max_len_b=3, stop_when_beam_finished=True)) + [""]
    _, out, _ = run_translate(monkeypatch, capsys, "\n".join(SENTENCES) + "\n", model + files + ["--beam", "1"])
    assert out.split("\n") == best_translations(text_model, processor, SENTENCES, SearchConfig(
        beam_size=1, max_len_b=3, stop_when_beam_finished=True)) + [""]
    (tmp_path / "bad.yaml").write_text("models: [base]\ndecode: {beam_size: 0}\n")
    status, _, err = run_translate(monkeypatch, capsys, "x\n", model + ["--config", str(tmp_path / "bad.yaml")])
    assert status == 2 and "bad.yaml" in err and "beam_size" in err


def test_translate_cli_n_best_prints_scored_blocks(tmp_path, spm_model, text_model, monkeypatch, capsys):
    save_model_file(tmp_path / "model.pt", text_model.model, spm_model)
    argv = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--beam", "3", "--n-best", "2",
            "--max-len-b", "4", "--device", "cpu"]
    status, out, _ = run_translate(monkeypatch, capsys, "the cat\nwe see\n", argv)
    assert status == 0
    blocks = out.split("\n\n")
    assert len(blocks) == 3 and blocks[-1] == ""
    for block in blocks[:2]:
        lines = block.split("\n")
        assert len(lines) == 2
        scores = [float(line.split("\t")[0]) for line in lines]
        assert scores == sorted(scores, reverse=True)


def test_translate_cli_reports_n_best_above_beam_with_exit_status_2(tmp_path, spm_model, monkeypatch, capsys):
    argv = ["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--beam", "2", "--n-best", "3"]
    status, _, err = run_translate(monkeypatch, capsys, "the cat\n", argv)
    assert status == 2
    assert "n_best = 3 is more than beam_size = 2" in err


# --- sources a model cannot read, and stdin that is not one sentence a line ------------------------

def test_sources_longer_than_a_learned_table_are_refused_by_line_before_any_is_searched(spm_model):
    processor = load_processor(spm_model)
    pieces = processor.get_piece_size()
    learned = tiny_model(seed=3, vocab_size=pieces, positional="learned", max_positions=8)
    long_line = "a big red dog runs under the green table in the garden"  # more than 7 pieces
    sentences = ["the cat", long_line, "", long_line + " today"]
    with pytest.raises(UserError, match=r"dev.en: 2 sentences longer .*max_positions = 8.* lines 2 \(\d+ tokens\), "
                                        r"4 \(\d+ tokens\)"):
        translate_text(learned, processor, sentences, SearchConfig(beam_size=2, max_len_b=3), progress=False,
                       source="dev.en")
    fits = translate_text(learned, processor, ["the cat", "", "we see"], SearchConfig(beam_size=2, max_len_b=3),
                          progress=False)
    assert len(fits) == 3


def test_sinusoidal_positions_translate_a_source_of_any_length(spm_model):
    processor = load_processor(spm_model)
    model = tiny_model(seed=3, vocab_size=processor.get_piece_size(), positional="sinusoidal", max_positions=8)
    long_line = "a big red dog runs under the green table in the garden"
    assert len(translate_text(model, processor, [long_line], SearchConfig(beam_size=2, max_len_b=2),
                              progress=False)) == 1


@pytest.mark.parametrize("stdin, message", [
    (b"the cat\rwe see\r", "carriage return alone"),
    (b"the cat\nwe\x00see\n", "stdin, line 2: a NUL byte"),
])
def test_stdin_that_is_not_one_sentence_a_line_is_refused(stdin, message):
    with pytest.raises(UserError, match=message):
        translate.read_source(io.BytesIO(stdin))


def test_stdin_with_windows_line_ends_or_a_last_carriage_return_is_read_as_lines():
    assert translate.read_source(io.BytesIO(b"the cat\r\nwe see\r\n")) == ["the cat", "we see"]
    assert translate.read_source(io.BytesIO(b"the cat\r")) == ["the cat"]
