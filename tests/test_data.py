"""The download stage: local text and parquet, the demo, the hub offline, and every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import config_file, data_section, make_pairs, write_text_corpus

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


def parquet_splits(path: Path) -> dict:
    """One parquet file as the three splits of data.local, each split its own copy (a test split that is
    the training data is refused)."""
    local = {}
    for split in ("train", "dev", "test"):
        shutil.copyfile(path, path.with_name(f"{split}-{path.name}"))
        local[split] = {"parquet": str(path.with_name(f"{split}-{path.name}"))}
    return local


def test_parquet_with_one_column_per_language_goes_through_local(tmp_path):
    pairs = make_pairs(20, seed=4)
    pq.write_table(pa.table({"en": [s for s, _ in pairs], "de": [t for _, t in pairs]}), tmp_path / "m.parquet")
    local = parquet_splits(tmp_path / "m.parquet")
    download(data_section(local=local), tmp_path / "out")
    assert (tmp_path / "out" / "test.de").read_text(encoding="utf-8").splitlines() == [t for _, t in pairs]


def test_parquet_without_the_language_names_the_fields(tmp_path):
    pq.write_table(pa.table({"translation": [{"fr": "x", "en": "y"}]}), tmp_path / "t.parquet")
    local = parquet_splits(tmp_path / "t.parquet")
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
    local = parquet_splits(tmp_path / "t.parquet")
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
        [sys.executable, "-m", "aiayn.cli", "download", "--config",
         config_file(tmp_path / "c.yaml", data=data_section(local=local)), "--out-dir", str(tmp_path / "out")],
        capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _write_hub_repo(repo, pairs, train=None, fmt="parquet") -> None:
    """A dataset folder laid out as the hub's wmt/wmt14 parquet branch: one config, one folder
    (``fmt="jsonl"``: the same rows as JSON lines, a dataset that is not parquet)."""
    (repo / "de-en").mkdir(parents=True)
    for split in ("train", "validation", "test"):
        rows = [{"translation": {"de": t, "en": s}} for s, t in (train if split == "train" and train else pairs)]
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), repo / "de-en" / f"{split}-00000-of-00001.parquet",
                           row_group_size=1000)
        else:
            (repo / "de-en" / f"{split}-00000-of-00001.jsonl").write_text(
                "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    splits = "".join(f"  - split: {split}\n    path: de-en/{split}-*\n" for split in ("train", "validation", "test"))
    (repo / "README.md").write_text(f"---\nconfigs:\n- config_name: de-en\n  data_files:\n{splits}---\n")


def test_the_hub_source_reads_a_dataset_through_datasets_in_batches(tmp_path, monkeypatch):
    import datasets
    import aiayn.data as data

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "BATCH_PAIRS", 7)
    pairs = make_pairs(30, seed=5)
    _write_hub_repo(tmp_path / "wmt14", pairs)
    hub = {"path": str(tmp_path / "wmt14"), "name": "de-en", "revision": "main",
           "splits": {"train": "train", "dev": "validation", "test": "test"}}
    summary = download(data_section(source="hub", hub=hub), tmp_path / "out")
    assert (tmp_path / "out" / "test.de").read_text(encoding="utf-8").splitlines() == [t for _, t in pairs]
    assert summary["splits"]["dev"]["origin"] == [f"{tmp_path / 'wmt14'} (de-en, revision main, split validation)"]
    assert summary["splits"]["train"]["pairs_written"] == 30
    # parquet is read where it is, a row group at a time: no second copy of the corpus in an Arrow cache
    assert not list((tmp_path / "cache").rglob("*.arrow"))


def test_a_hub_dataset_that_is_not_parquet_goes_through_load_dataset(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    pairs = make_pairs(30, seed=6)
    outputs = {}
    for fmt in ("jsonl", "parquet"):
        _write_hub_repo(tmp_path / fmt / "wmt14", pairs, fmt=fmt)
        hub = {"path": str(tmp_path / fmt / "wmt14"), "name": "de-en", "revision": "main",
               "splits": {"train": "train", "dev": "validation", "test": "test"}}
        download(data_section(source="hub", hub=hub), tmp_path / fmt / "out")
        outputs[fmt] = {p.name: p.read_bytes() for p in (tmp_path / fmt / "out").glob("*.??")}
    assert outputs["jsonl"] == outputs["parquet"] and len(outputs["jsonl"]) == 6
    assert list((tmp_path / "cache").rglob("*.arrow"))  # JSON lines are converted by datasets, as before


def test_the_pinned_hub_revision_is_what_datasets_is_asked_for(tmp_path, monkeypatch):
    """data.hub.revision, a commit for a frozen reproduction, reaches datasets: the builder that resolves a
    parquet dataset's files, and load_dataset for any other format. (The calls are recorded and passed on;
    a local folder, as here, has no revisions, so datasets reads it as it is.)"""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    asked = []
    for name in ("load_dataset_builder", "load_dataset"):
        def recorded(*args, _call=getattr(datasets, name), _name=name, **kwargs):
            asked.append((_name, kwargs.get("revision")))
            return _call(*args, **kwargs)
        monkeypatch.setattr(datasets, name, recorded)
    commit = "4f7a2b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a"
    for fmt in ("parquet", "jsonl"):
        _write_hub_repo(tmp_path / fmt / "wmt14", make_pairs(10, seed=7), fmt=fmt)
        hub = {"path": str(tmp_path / fmt / "wmt14"), "name": "de-en", "revision": commit,
               "splits": {"train": "train", "dev": "validation", "test": "test"}}
        summary = download(data_section(source="hub", hub=hub), tmp_path / fmt / "out")
        assert f"revision {commit}" in summary["splits"]["test"]["origin"][0]
    assert {name for name, _ in asked} == {"load_dataset_builder", "load_dataset"}
    assert {revision for _, revision in asked} == {commit}


def test_parquet_rows_without_a_language_are_counted_over_the_split(tmp_path, monkeypatch):
    import aiayn.data as data

    monkeypatch.setattr(data, "BATCH_PAIRS", 2)
    rows = [{"en": "a", "de": "b"}, {"en": "c", "de": "d"}, {"en": None, "de": "e"}, {"en": "f", "de": None}]
    pq.write_table(pa.table({"translation": rows}), tmp_path / "t.parquet")
    local = parquet_splits(tmp_path / "t.parquet")
    with pytest.raises(UserError, match=r"row 2 has no 'en' or 'de' text \(2 such rows\)"):
        download(data_section(local=local), tmp_path / "out")


def test_a_bad_line_in_the_last_split_leaves_no_file_behind(tmp_path):
    local = write_text_corpus(tmp_path / "raw")
    (tmp_path / "raw" / "test.de").write_bytes(b"gut\n" * 39 + b"stra\xdfe\n")
    with pytest.raises(UserError, match=r"test\.de, line 40"):
        download(data_section(local=local), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # neither out nor a temporary folder


def test_pairs_over_the_length_ratio_are_dropped_and_counted_only_when_asked(tmp_path):
    raw = tmp_path / "raw"
    local = write_text_corpus(raw)
    (raw / "train.en").write_text("a b c\na b c d\none\n", encoding="utf-8")
    (raw / "train.de").write_text("x y\nx y\neins zwei\n", encoding="utf-8")
    summary = download(data_section(local=local, max_length_ratio=1.5), tmp_path / "out")
    train = summary["splits"]["train"]
    assert (train["pairs_written"], train["dropped_ratio"]) == (1, 2)  # 3:2 kept, 4:2 and 1:2 dropped
    assert (tmp_path / "out" / "train.de").read_text(encoding="utf-8") == "x y\n"
    assert summary["splits"]["test"]["dropped_ratio"] == 0  # evaluation splits are never filtered
    unfiltered = download(data_section(local=local, max_length_ratio=None), tmp_path / "plain")
    assert unfiltered["splits"]["train"]["pairs_written"] == 3 and "dropped_ratio" not in unfiltered["splits"]["train"]


@pytest.mark.parametrize("content", [b"", b"\n", b"\n\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n", b"\xef\xbb\xbfa\nb",
                                     b"a\r\nb\r\n", b"\r\n", b"a\n\nb\n\n", b"x\xe2\x80\xa8y\n\xc2\x85\n", b"\nlast"])
def test_streamed_lines_and_counts_equal_read_lines(tmp_path, content):
    from aiayn.reading import count_lines, iter_lines, read_lines

    (tmp_path / "f").write_bytes(content)
    assert list(iter_lines(tmp_path / "f")) == read_lines(tmp_path / "f")
    assert count_lines(tmp_path / "f") == len(read_lines(tmp_path / "f"))


def _peak_python_memory(function) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("layout", ["text", "parquet", "hub"])
def test_download_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch, layout):
    """Ten times the pairs: the peak grows by far less than the text added (holding it would take twice)."""
    import datasets
    import aiayn.data as data

    monkeypatch.setattr(data, "BATCH_PAIRS", 500)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    peaks, text_bytes = {}, {}
    for pairs in (5000, 50_000):
        raw = tmp_path / f"raw{pairs}"
        local = write_text_corpus(raw, (("train", pairs), ("dev", 10), ("test", 10)))
        text_bytes[pairs] = (raw / "train.en").stat().st_size + (raw / "train.de").stat().st_size
        if layout == "parquet":
            train = make_pairs(pairs, seed=0)
            pq.write_table(pa.table({"translation": [{"en": s, "de": t} for s, t in train]}),
                           raw / "train.parquet", row_group_size=1000)
            local["train"] = {"parquet": str(raw / "train.parquet")}
        section = data_section(local=local)
        if layout == "hub":
            _write_hub_repo(raw / "hub", make_pairs(10, seed=1), train=make_pairs(pairs, seed=0))
            section = data_section(source="hub", hub={"path": str(raw / "hub"), "name": "de-en", "revision": "main",
                                                      "splits": {"train": "train", "dev": "validation", "test": "test"}})
        peaks[pairs] = _peak_python_memory(lambda: download(section, tmp_path / f"out{pairs}"))
    assert peaks[50_000] - peaks[5000] < 0.2 * (text_bytes[50_000] - text_bytes[5000]), (peaks, text_bytes)
