"""bench.decode.ct2 runs end to end on a tiny model and prints a line per engine and setting."""

from __future__ import annotations

import pytest

from bench.decode import ct2 as decode_ct2
from test_decode import WORDS, save_model_file, spm_model, text_model  # noqa: F401 (fixtures)
from test_export import need


def test_long_sentences_join_consecutive_sentences_and_their_references_alike():
    sources = [f"s{i} w w" for i in range(10)]
    references = [f"r{i}" for i in range(10)]
    joined, joined_references = decode_ct2.long_sentences(sources, references, count=5, seed=1)
    assert len(joined) == len(joined_references) == 5
    for source, reference in zip(joined, joined_references):
        assert [word[1:] for word in source.split() if word.startswith("s")] == \
               [word[1:] for word in reference.split()]
        assert len(source.split()) >= 5


@pytest.mark.parametrize("stops", [["t2t"], ["best_finished", "t2t", "beam_finished"]])
def test_the_bench_prints_speed_bleu_and_agreement_for_each_engine(stops, tmp_path, spm_model, text_model,  # noqa: F811
                                                                   capsys):
    need("ctranslate2")
    save_model_file(tmp_path / "model.pt", text_model.model, spm_model)
    lines = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(6)]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert decode_ct2.main(["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model),
                            "--input", str(tmp_path / "in.en"), "--reference", str(tmp_path / "ref.de"),
                            "--sentences", "6", "--long", "2", "--threads", "1", "--repeats", "1", "--stop", *stops]) == 0
    out = capsys.readouterr().out
    ours = ["aiayn fp32"] if len(stops) == 1 else [f"aiayn fp32 {stop}" for stop in stops]
    for label in (*ours, "ct2 fp32", "ct2 int8"):
        assert out.count(f"threads=1 {label} ") == 2 * (1 + (label in ours))  # each set; ours also vs ct2
    assert out.count(f"alpha=0: ct2 fp32 output equals aiayn fp32 ({stops[0]}) for") == 2
    assert f"our stopping rule(s): {' '.join(stops)}" in out
    for stop in stops:
        assert out.count(f"aiayn fp32 ({stop}) decoded ") == 2
