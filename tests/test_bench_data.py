"""bench.data.cpu at a tiny size: the generator's word types follow its lexicons, and a run of
chosen stages measures them and records the sample's word types."""

from __future__ import annotations

import json

from bench.data import cpu as data_cpu
from conftest import REPO


def test_bigger_lexicons_give_more_word_types(tmp_path):
    counts = {}
    for size in (200, 5000):
        folder = tmp_path / str(size)
        folder.mkdir()
        src, tgt = data_cpu.write_corpus(folder, 3000, lexicons=(size, size))
        counts[size] = data_cpu.word_types(src, 3000), data_cpu.word_types(tgt, 3000)
    assert all(n <= 201 for n in counts[200])  # the lexicon and the final "."
    assert all(big > 5 * small for big, small in zip(counts[5000], counts[200]))


def test_a_run_of_chosen_stages_measures_only_those(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "src"))
    out = tmp_path / "result.json"
    assert data_cpu.main(["--pairs", "3000", "--vocab", "300", "--input-sentence-size", "0", "--lexicons", "400",
                          "400", "--stages", "bpe", "binarize", "--workers", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [stage["stage"] for stage in result["stages"]] == ["bpe", "binarize (1 process)"]
    assert result["stages"][0]["word_types"] == result["word_types"] and result["word_types"]["in_pairs"] == 3000
    assert result["stages"][1]["pairs_per_s"] > 0 and result["stages"][0]["peak_rss_mb"] > 0


def test_a_kept_corpus_is_reused_by_a_run_of_the_same_size(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "src"))
    common = ["--vocab", "300", "--input-sentence-size", "0", "--lexicons", "400", "400", "--stages", "bpe",
              "--corpus", str(tmp_path / "corpus")]
    assert data_cpu.main(["--pairs", "2000", *common]) == 0
    first = (tmp_path / "corpus" / "raw.en").stat().st_mtime_ns
    assert data_cpu.main(["--pairs", "2000", *common]) == 0
    assert (tmp_path / "corpus" / "raw.en").stat().st_mtime_ns == first  # reused, not generated again
    assert data_cpu.main(["--pairs", "2500", *common]) == 0  # another size: generated again
    assert json.loads((tmp_path / "corpus" / "corpus.json").read_text())["pairs"] == 2500
    assert sum(1 for _ in open(tmp_path / "corpus" / "raw.de", encoding="utf-8")) == 2500
