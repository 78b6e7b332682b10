"""The download stage: local text and parquet, the demo, the hub offline, and every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import data_section, make_pairs, write_text_corpus

from aiayn.data import download
from aiayn.errors import UserError


def test_local_text_files_are_written_per_split_and_language(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    summary = download(data_section(local=local), tmp_path / "out")
    for split in ("train", "dev", "test"):
        for lang in ("en", "de"):
            assert (tmp_path / "out" / f"{split}.{lang}").read_text(encoding="utf-8") == \
                (tmp_path / "raw" / f"{split}.{lang}").read_text(encoding="utf-8")
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats == json.loads(json.dumps(summary))
    assert stats["splits"]["train"]["pairs_written"] == 400
    assert stats["splits"]["train"]["src_words"] > 400


def test_parquet_in_the_hub_translation_layout_goes_through_local(tmp_path):
    pairs = make_pairs(50, seed=3)
    table = pa.table({"translation": [{"de": t, "en": s} for s, t in pairs]})
    for split in ("train", "dev", "test"):
        pq.write_table(table, tmp_path / f"{split}-00000-of-00001.parquet")
    local = {split: {"parquet": str(tmp_path / f"{split}-*.parquet")} for split in ("train", "dev", "test")}
    download(data_section(local=local), tmp_path / "out")
    assert (tmp_path / "out" / "dev.en").read_text(encoding="utf-8").splitlines() == [s for s, _ in pairs]
    assert (tmp_path / "out" / "dev.de").read_text(encoding="utf-8").splitlines() == [t for _, t in pairs]


def test_parquet_with_one_column_per_language_goes_through_local(tmp_path):
    pairs = make_pairs(20, seed=4)
    pq.write_table(pa.table({"en": [s for s, _ in pairs], "de": [t for _, t in pairs]}), tmp_path / "m.parquet")
    local = {split: {"parquet": str(tmp_path / "m.parquet")} for split in ("train", "dev", "test")}
    download(data_section(local=local), tmp_path / "out")
    assert (tmp_path / "out" / "test.de").read_text(encoding="utf-8").splitlines() == [t for _, t in pairs]


def test_parquet_without_the_language_names_the_fields(tmp_path):
    pq.write_table(pa.table({"translation": [{"fr": "x", "en": "y"}]}), tmp_path / "t.parquet")
    local = {split: {"parquet": str(tmp_path / "t.parquet")} for split in ("train", "dev", "test")}
    with pytest.raises(UserError, match=r"no language 'de' \(it has"):
        download(data_section(local=local), tmp_path / "out")


def test_training_pairs_with_an_empty_or_over_long_side_are_dropped_and_counted(tmp_path):
    raw = tmp_path / "raw"
    local = write_text_corpus(raw)
    (raw / "train.en").write_text("a b\n\nshort\n" + "x" * 50 + "\n", encoding="utf-8")
    (raw / "train.de").write_text("c d\nnot empty\nkurz\ny\n", encoding="utf-8")
    summary = download(data_section(local=local, max_chars=20), tmp_path / "out")
    train = summary["splits"]["train"]
    assert (train["pairs_read"], train["pairs_written"], train["dropped_empty"], train["dropped_long"]) == (4, 2, 1, 1)
    assert (tmp_path / "out" / "train.en").read_text(encoding="utf-8") == "a b\nshort\n"


def test_evaluation_splits_are_never_filtered(tmp_path):
    raw = tmp_path / "raw"
    local = write_text_corpus(raw)
    (raw / "test.en").write_text("a\n" + "x" * 50 + "\n", encoding="utf-8")
    (raw / "test.de").write_text("b\ny\n", encoding="utf-8")
    summary = download(data_section(local=local, max_chars=20), tmp_path / "out")
    assert summary["splits"]["test"]["pairs_written"] == 2


def test_an_embedded_line_break_does_not_shift_later_lines(tmp_path):
    table = pa.table({"translation": [{"en": "one\ntwo", "de": "eins"}, {"en": "three", "de": "drei"}]})
    pq.write_table(table, tmp_path / "t.parquet")
    local = {split: {"parquet": str(tmp_path / "t.parquet")} for split in ("train", "dev", "test")}
    summary = download(data_section(local=local), tmp_path / "out")
    assert (tmp_path / "out" / "dev.en").read_text(encoding="utf-8") == "one two\nthree\n"
    assert summary["splits"]["dev"]["newlines_replaced"] == 1


def test_source_and_target_of_different_lengths_name_both_files_and_counts(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    (tmp_path / "raw" / "dev.de").write_text("nur eine zeile\n", encoding="utf-8")
    with pytest.raises(UserError) as error:
        download(data_section(local=local), tmp_path / "out")
    message = str(error.value)
    assert "dev.en has 40 lines" in message and "dev.de has 1" in message
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    (tmp_path / "raw" / "test.de").write_bytes(b"gut\nstra\xdfe\n")
    (tmp_path / "raw" / "test.en").write_text("good\nstreet\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"test\.de, line 2: bytes that are not UTF-8"):
        download(data_section(local=local), tmp_path / "out")


def test_an_empty_split_is_an_error(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    (tmp_path / "raw" / "dev.en").write_text("", encoding="utf-8")
    (tmp_path / "raw" / "dev.de").write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="the dev split is empty"):
        download(data_section(local=local), tmp_path / "out")


def test_a_local_path_that_does_not_exist_is_named(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    local["train"]["src"] = str(tmp_path / "nowhere.en")
    with pytest.raises(UserError, match=r"nowhere\.en: no such file"):
        download(data_section(local=local), tmp_path / "out")
    local["train"] = {"parquet": str(tmp_path / "missing-*.parquet")}
    with pytest.raises(UserError, match="no file matches"):
        download(data_section(local=local), tmp_path / "out")


def test_local_without_a_split_says_what_to_set(tmp_path):
    with pytest.raises(UserError, match=r"data\.local\.train is not set"):
        download(data_section(local={}), tmp_path / "out")


def test_hub_without_network_fails_fast_and_explains_local(tmp_path):
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        download(data_section(source="hub"), tmp_path / "out")
    assert time.monotonic() - start < 30
    message = str(error.value)
    assert "wmt/wmt14" in message and "data.source: local" in message and "parquet" in message


def test_cli_prints_one_error_line_and_exits_2(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    (tmp_path / "raw" / "train.de").write_text("x\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "aiayn.cli", "download", "--data-json", json.dumps(data_section(local=local)),
         "--out-dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
