"""The bpe stage: one shared SentencePiece vocabulary with fixed special ids."""

from __future__ import annotations

import json

import pytest

from aiayn.bpe import learn_bpe, load_processor
from aiayn.errors import UserError
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def test_bpe_round_trips_text_exactly(prepared):
    processor = load_processor(prepared / "bpe" / "spm.model")
    for lang in ("en", "de"):
        lines = (prepared / "data" / f"dev.{lang}").read_text(encoding="utf-8").splitlines()
        assert [processor.decode(processor.encode(line)) for line in lines] == lines


def test_one_vocabulary_serves_both_languages(prepared):
    processor = load_processor(prepared / "bpe" / "spm.model")
    info = json.loads((prepared / "bpe" / "bpe.json").read_text())
    assert processor.get_piece_size() == info["vocab_size"] == 120 and info["shared"]
    pieces = {processor.id_to_piece(i) for i in range(processor.get_piece_size())}
    assert "▁the" in pieces and "▁der" in pieces  # whole words of both sides are in the one vocabulary
    assert not any(processor.unk_id() in processor.encode(word) for word in ("läuft", "quickly", "schläft"))


def test_special_symbols_have_fixed_ids(prepared):
    processor = load_processor(prepared / "bpe" / "spm.model")
    assert (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)


def test_the_vocabulary_is_deterministic_and_fingerprinted(prepared, tmp_path):
    files = [prepared / "data" / "train.en", prepared / "data" / "train.de"]
    first = learn_bpe(files, tmp_path / "a", vocab_size=120, input_sentence_size=500, seed=7, threads=1)
    second = learn_bpe(files, tmp_path / "b", vocab_size=120, input_sentence_size=500, seed=7, threads=1)
    assert first["fingerprint"] == second["fingerprint"]
    assert (tmp_path / "a" / "spm.vocab").read_text() == (tmp_path / "b" / "spm.vocab").read_text()
    assert first["data_fingerprint"] == json.loads((prepared / "bpe" / "bpe.json").read_text())["data_fingerprint"]


def test_a_vocabulary_the_corpus_cannot_support_is_a_clear_error(prepared, tmp_path):
    files = [prepared / "data" / "train.en", prepared / "data" / "train.de"]
    with pytest.raises(UserError, match=r"bpe\.vocab_size = 50000 is more than the training data .* \(at most \d+\)"):
        learn_bpe(files, tmp_path / "big", vocab_size=50000, input_sentence_size=0, threads=1)
    assert not (tmp_path / "big" / "spm.model").exists()


def test_a_rerun_writes_the_same_model_bytes_and_leaves_no_training_folder(prepared, tmp_path, monkeypatch):
    import hashlib

    files = [prepared / "data" / "train.en", prepared / "data" / "train.de"]
    monkeypatch.chdir(tmp_path)  # relative paths, as the workflow passes them

    def run() -> dict[str, str]:
        learn_bpe(files, "bpe", vocab_size=120, input_sentence_size=500, seed=7, threads=1)
        return {name: hashlib.sha256((tmp_path / "bpe" / name).read_bytes()).hexdigest()
                for name in ("spm.model", "spm.vocab")}

    first = run()
    (tmp_path / "bpe" / ".spm-training").mkdir()  # as a killed run would leave it
    assert run() == first
    assert sorted(path.name for path in (tmp_path / "bpe").iterdir()) == ["bpe.json", "spm.model", "spm.vocab"]


@pytest.mark.parametrize("sample", [0, 500])
def test_reading_through_python_for_the_progress_bar_learns_what_sentencepieces_reader_would(prepared, tmp_path, sample):
    """The stage feeds SentencePiece the lines from Python (so that it can count them on a progress bar);
    the vocabulary must be the one SentencePiece learns reading the same files itself, sampled or whole."""
    import sentencepiece as spm

    from aiayn.bpe import vocab_fingerprint

    files = [prepared / "data" / "train.en", prepared / "data" / "train.de"]
    ours = learn_bpe(files, tmp_path / "ours", vocab_size=120, input_sentence_size=sample, seed=7, threads=1)
    spm.set_random_generator_seed(7)
    spm.SentencePieceTrainer.train(
        input=",".join(str(p) for p in files), model_prefix=str(tmp_path / "direct"), model_type="bpe",
        vocab_size=120, character_coverage=1.0, input_sentence_size=sample, shuffle_input_sentence=True,
        num_threads=1, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_piece="<pad>",
        unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", normalization_rule_name="identity", minloglevel=2)
    assert ours["fingerprint"] == vocab_fingerprint(tmp_path / "direct.model")
    assert (tmp_path / "ours" / "spm.vocab").read_bytes() == (tmp_path / "direct.vocab").read_bytes()


def test_the_bpe_stage_counts_the_lines_it_reads_on_a_progress_bar(prepared, tmp_path):
    from aiayn.bpe import training_lines

    class Bar:
        counted, closed = 0, False

        def update(self, lines):
            self.counted += lines

        def close(self):
            self.closed = True

    files = [prepared / "data" / "train.en", prepared / "data" / "train.de"]
    bar = Bar()
    lines = list(training_lines(files, bar))
    expected = [line.encode() for path in files for line in path.read_text(encoding="utf-8").split("\n")[:-1]]
    assert lines == expected and bar.counted == len(expected) and bar.closed
