"""The binarize stage: compact arrays that decode back to exactly the BPE pieces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import write_text_corpus

from aiayn.binarize import binarize_split, load_split
from aiayn.bpe import load_processor, vocab_fingerprint
from aiayn.errors import UserError
from aiayn.reading import fingerprint_files


def test_binarized_data_decodes_back_to_exactly_the_bpe_pieces(prepared):
    processor = load_processor(prepared / "bpe" / "spm.model")
    split = load_split(prepared / "bin" / "dev")
    src_lines = (prepared / "data" / "dev.en").read_text(encoding="utf-8").splitlines()
    tgt_lines = (prepared / "data" / "dev.de").read_text(encoding="utf-8").splitlines()
    assert len(split) == len(src_lines)
    for i, line in enumerate(split.lines):
        assert split.src(i).tolist() == processor.encode(src_lines[line])
        assert split.tgt(i).tolist() == processor.encode(tgt_lines[line])
        assert processor.decode(split.tgt(i).tolist()) == tgt_lines[line]


def test_small_vocabularies_are_stored_as_uint16_with_fingerprints(prepared):
    split = load_split(prepared / "bin" / "train")
    assert split.src_ids.dtype == np.uint16 and split.tgt_ids.dtype == np.uint16
    assert split.meta["vocab_fingerprint"] == vocab_fingerprint(prepared / "bpe" / "spm.model")
    assert split.meta["data_fingerprint"] == fingerprint_files(prepared / "data" / "train.en", prepared / "data" / "train.de")


def test_the_length_filter_drops_and_counts_long_training_pairs(prepared, tmp_path):
    meta = binarize_split("train", prepared / "data" / "train.en", prepared / "data" / "train.de",
                          prepared / "bpe" / "spm.model", tmp_path / "train", max_tokens=12, workers=1)
    split = load_split(tmp_path / "train")
    assert meta["dropped_too_long"] > 0
    assert meta["pairs_kept"] + meta["dropped_too_long"] + meta["dropped_empty"] == meta["pairs_in"] == 1200
    assert split.src_lengths.max() <= 12 and split.tgt_lengths.max() <= 12
    assert len(split) == meta["pairs_kept"]


def test_two_processes_give_the_same_arrays_as_one(prepared, tmp_path, monkeypatch):
    import aiayn.binarize as binarize

    monkeypatch.setattr(binarize, "CHUNK_PAIRS", 300)  # several chunks over the 1200 pairs
    args = ("train", prepared / "data" / "train.en", prepared / "data" / "train.de", prepared / "bpe" / "spm.model")
    binarize_split(*args, tmp_path / "one", max_tokens=64, workers=1)
    binarize_split(*args, tmp_path / "two", max_tokens=64, workers=2)
    for name in ("src.ids", "src.offsets", "tgt.ids", "tgt.offsets", "lines"):
        assert np.array_equal(np.load(tmp_path / "one" / f"{name}.npy"), np.load(tmp_path / "two" / f"{name}.npy"))


def test_binarize_memory_does_not_grow_with_the_corpus(prepared, tmp_path, monkeypatch):
    """Ten times the pairs: the peak grows by far less than the text added (holding it would take more)."""
    import tracemalloc

    import aiayn.binarize as binarize

    monkeypatch.setattr(binarize, "CHUNK_PAIRS", 500)
    peaks, text_bytes = {}, {}
    for pairs in (5000, 50_000):
        local = write_text_corpus(tmp_path / f"raw{pairs}", (("train", pairs),))
        text_bytes[pairs] = sum(Path(local["train"][side]).stat().st_size for side in ("src", "tgt"))
        tracemalloc.start()
        binarize_split("train", local["train"]["src"], local["train"]["tgt"], prepared / "bpe" / "spm.model",
                       tmp_path / f"bin{pairs}", max_tokens=64, workers=1)
        peaks[pairs] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[50_000] - peaks[5000] < 0.2 * (text_bytes[50_000] - text_bytes[5000]), (peaks, text_bytes)


def test_arrays_written_in_pieces_equal_np_save(tmp_path):
    from aiayn.binarize import NpyWriter

    for dtype, pieces in ((np.uint16, [np.arange(5), np.arange(0), np.arange(70000) % 65536]), (np.int64, []),
                          (np.int32, [np.arange(3)])):
        with NpyWriter(tmp_path / "pieces.npy", dtype) as writer:
            for piece in pieces:
                writer.append(piece)
        whole = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
        np.save(tmp_path / "whole.npy", whole)
        assert (tmp_path / "pieces.npy").read_bytes() == (tmp_path / "whole.npy").read_bytes()


def test_a_bad_line_late_in_the_text_leaves_no_split_behind(prepared, tmp_path, monkeypatch):
    import aiayn.binarize as binarize

    monkeypatch.setattr(binarize, "CHUNK_PAIRS", 100)
    src = (prepared / "data" / "train.en").read_bytes()
    (tmp_path / "train.en").write_bytes(src[:-1] + b" \xff\n")  # the last line is not UTF-8
    with pytest.raises(UserError, match=r"train\.en, line 1200: bytes that are not UTF-8"):
        binarize_split("train", tmp_path / "train.en", prepared / "data" / "train.de", prepared / "bpe" / "spm.model",
                       tmp_path / "bin", max_tokens=64, workers=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.en"]


def test_a_worker_that_dies_ends_the_stage_instead_of_hanging(prepared, monkeypatch):
    """multiprocessing.Pool replaced a killed worker and waited forever for its chunk; now the stage ends."""
    import multiprocessing
    import os
    import signal

    import aiayn.binarize as binarize

    monkeypatch.setattr(binarize, "CHUNK_PAIRS", 50)
    chunks = binarize.encode_chunks(prepared / "data" / "train.en", prepared / "data" / "train.de",
                                    prepared / "bpe" / "spm.model", workers=2)
    next(chunks)
    for worker in multiprocessing.active_children():
        os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="a binarize worker process died"):
        for _ in chunks:
            pass


def test_the_old_spelling_of_the_command_still_runs_with_a_warning(capsys):
    from aiayn.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["binarise", "--help"])
    assert stopped.value.code == 0
    captured = capsys.readouterr()
    assert "use `aiayn binarize`" in captured.err and "usage: aiayn binarize" in captured.out


def test_each_worker_encodes_with_one_thread_so_a_job_uses_the_cores_it_asked_for(monkeypatch):
    """SentencePiece's batch encode starts a thread per core of the machine by default; a binarize job
    asks the cluster for `workers` cores, so each worker process encodes with one thread."""
    import aiayn.binarize as binarize

    calls = []

    class Recording:
        def encode(self, lines, out_type, num_threads=-1):
            calls.append(num_threads)
            return [[len(line)] for line in lines]

    monkeypatch.setattr(binarize, "_processor", Recording())
    src_flat, src_len, tgt_flat, tgt_len = binarize._encode_chunk((["ab", "c"], ["d", "efg"]))
    assert calls == [1, 1]
    assert src_flat.tolist() == [2, 1] and tgt_len.tolist() == [1, 1] and tgt_flat.tolist() == [1, 3]


@pytest.mark.parametrize("long_pairs, kept", [(9, True), (10, False)])
def test_a_training_split_that_keeps_under_a_tenth_of_its_pairs_is_refused_naming_why(prepared, tmp_path,
                                                                                      long_pairs, kept):
    """One short pair in 10 is kept (10%); one in 11 is not, and the message names the length filter."""
    long_text = " ".join(["the big red dog sees the small cat in the old garden today"] * 3)
    (tmp_path / "t.en").write_text("the dog .\n" + f"{long_text}\n" * long_pairs, encoding="utf-8")
    (tmp_path / "t.de").write_text("der hund .\n" + f"{long_text}\n" * long_pairs, encoding="utf-8")
    arguments = ("train", tmp_path / "t.en", tmp_path / "t.de", prepared / "bpe" / "spm.model", tmp_path / "bin")
    if kept:
        assert binarize_split(*arguments, max_tokens=20)["pairs_kept"] == 1
        return
    with pytest.raises(UserError, match=r"the train split keeps 1 of 11 pairs \(at least 10% must be kept\): 10 have "
                                        r"a side of more than binarize.max_tokens = 20 .*max_tokens = \d+ would keep"):
        binarize_split(*arguments, max_tokens=20)
    assert not (tmp_path / "bin").exists()
