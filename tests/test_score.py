"""Tests for aiayn.score: the BLEU variants, file alignment, CLI errors and the paired bootstrap."""

from __future__ import annotations

import math

import json
import shutil
import subprocess
import sys

import pytest
from sacrebleu.metrics import BLEU, CHRF

from aiayn.errors import UserError
from aiayn.score import main, paired_bootstrap, score, score_files, split_compounds, t2t_tokenize

REFERENCES = [
    "Die US-Regierung hat am Montag neue Sanktionen angekündigt.",
    "Das Baden-Württemberg-Ticket gilt einen ganzen Tag lang.",
    "Wir müssen über die Zukunft der Energie-Politik sprechen.",
    "Der Zug kam mit zwanzig Minuten Verspätung in Berlin an.",
    "„Das ist nicht akzeptabel“, sagte die Ministerin.",
    "Die Polizei sucht weiterhin nach Zeugen des Unfalls.",
    "Im Jahr 2013 stieg die Zahl der Arbeitslosen um 3,5 Prozent.",
    "Viele Menschen haben ihre E-Mails nicht gelesen.",
    "Die Stadt plant einen neuen Park am Fluss.",
    "Er hat das Spiel mit 2:1 gewonnen.",
    "Die Kinder spielen im Garten, während es regnet.",
    "Der Bundestag stimmte dem Gesetz mit großer Mehrheit zu.",
    "Es gibt keine einfache Antwort auf diese Frage.",
    "Die Preise für Heizöl sind im Winter gestiegen.",
    "Sie arbeitet seit zehn Jahren als Ärztin in München.",
    "Das Museum ist montags geschlossen.",
    "Die Nord-Süd-Verbindung wird im Herbst eröffnet.",
    "Wir haben den ganzen Abend über Politik diskutiert.",
    "Die Firma will bis 2020 tausend neue Stellen schaffen.",
    "Ich weiß nicht, ob er morgen kommt.",
]

HYPOTHESES = [
    "Die US-Regierung kündigte am Montag neue Sanktionen an.",
    "Das Baden-Württemberg-Ticket ist einen ganzen Tag gültig.",
    "Wir müssen über die Zukunft der Energiepolitik sprechen.",
    "Der Zug kam mit zwanzig Minuten Verspätung in Berlin an.",
    "\"Das ist nicht akzeptabel\", sagte der Minister.",
    "Die Polizei sucht noch nach Zeugen des Unfalls.",
    "2013 stieg die Zahl der Arbeitslosen um 3,5 Prozent.",
    "Viele Leute haben ihre E-Mails nicht gelesen.",
    "Die Stadt plant einen neuen Park am Fluss.",
    "Er gewann das Spiel 2:1.",
    "Die Kinder spielen im Garten, während es regnet.",
    "Der Bundestag hat dem Gesetz mit großer Mehrheit zugestimmt.",
    "Auf diese Frage gibt es keine einfache Antwort.",
    "Die Heizölpreise sind im Winter gestiegen.",
    "Sie arbeitet seit zehn Jahren als Ärztin in München.",
    "Das Museum ist am Montag geschlossen.",
    "Die Nord-Süd-Verbindung wird im Herbst eröffnet.",
    "Wir diskutierten den ganzen Abend über Politik.",
    "Das Unternehmen will bis 2020 tausend neue Arbeitsplätze schaffen.",
    "Ich weiß nicht, ob er morgen kommt.",
]


def write_lines(path, lines):
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    return path


@pytest.fixture
def sample_files(tmp_path):
    return write_lines(tmp_path / "hyp.de", HYPOTHESES), write_lines(tmp_path / "ref.de", REFERENCES)


def run_main(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_json_sacrebleu_equals_the_sacrebleu_command_line(sample_files, capsys):
    hyp, ref = sample_files
    status, out, _ = run_main(["--hyp", str(hyp), "--ref", str(ref), "--json"], capsys)
    command_line = subprocess.run(
        [sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-b", "-w", "4"],
        capture_output=True, text=True, check=True,
    )
    assert status == 0
    assert round(json.loads(out)["sacrebleu"], 4) == float(command_line.stdout.strip())


def test_json_has_every_score_and_the_signature(sample_files, capsys):
    hyp, ref = sample_files
    _, out, _ = run_main(["--hyp", str(hyp), "--ref", str(ref), "--json"], capsys)
    result = json.loads(out)
    assert set(result) >= {"sacrebleu", "sacrebleu_signature", "bleu_tok", "bleu_tok_method", "chrf", "n_segments"}
    assert "tok:13a" in result["sacrebleu_signature"] and "version:2.6.0" in result["sacrebleu_signature"]
    assert result["n_segments"] == len(REFERENCES)


def test_text_output_names_each_score_and_output_file_holds_the_json(sample_files, tmp_path, capsys):
    hyp, ref = sample_files
    output = tmp_path / "scores" / "test.json"
    status, out, _ = run_main(["--hyp", str(hyp), "--ref", str(ref), "--output", str(output)], capsys)
    assert status == 0
    assert "sacreBLEU" in out and "tokenized BLEU" in out and "chrF" in out and "tok:13a" in out
    assert json.loads(output.read_text()) == score_files(hyp, ref)


def test_compound_split_inserts_at_markers_around_each_hyphen():
    assert t2t_tokenize(["Die US-Regierung und das Baden-Württemberg-Ticket"]) == [
        "Die US ##AT##-##AT## Regierung und das Baden ##AT##-##AT## Württemberg ##AT##-##AT## Ticket"
    ]


def test_compound_split_leaves_free_standing_dashes_alone():
    assert split_compounds("Er kam - spät - an") == "Er kam - spät - an"


FRENCH_HYP = ["Il est peut-être venu vingt-deux fois, c'est-à-dire trop.", "Le porte-parole a-t-il parlé ?"]
FRENCH_REF = ["Il est peut-être venu vingt-trois fois, c'est-à-dire trop.", "Le porte-parole a-t-il répondu ?"]


def test_french_tokenized_bleu_has_no_compound_split_and_names_its_method():
    tokenized = t2t_tokenize(FRENCH_HYP, "fr")
    assert not any("##AT##" in line for line in tokenized)
    assert "peut-être" in tokenized[0] and "porte-parole" in tokenized[1]
    result = score(FRENCH_HYP, FRENCH_REF, "fr")
    assert "no compound split" in result["bleu_tok_method"] and "-l fr" in result["bleu_tok_method"]


def test_a_change_to_the_hyphen_split_moves_french_scores_not_at_all(monkeypatch):
    import aiayn.score as scoring

    before = score(FRENCH_HYP, FRENCH_REF, "fr")["bleu_tok"]
    german_before = score(["Die US-Regierung kam."], ["Die US-Regierung ging."], "de")["bleu_tok"]
    monkeypatch.setattr(scoring, "split_compounds", lambda line: line)  # no split at all
    assert score(FRENCH_HYP, FRENCH_REF, "fr")["bleu_tok"] == before
    assert score(["Die US-Regierung kam."], ["Die US-Regierung ging."], "de")["bleu_tok"] != german_before


@pytest.mark.skipif(shutil.which("perl") is None, reason="perl is not installed")
def test_compound_split_matches_the_perl_one_liner_of_get_ende_bleu():
    lines = ["a-b-c", "Baden-Württemberg-Ticket", "x\u00a0-y -z", "E-Mail-Adresse", "--", "1-2-3-4"]
    perl = subprocess.run(
        ["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"],
        input=("\n".join(lines) + "\n").encode("utf-8"), capture_output=True, check=True,
    )
    assert [split_compounds(line) for line in lines] == perl.stdout.decode("utf-8").split("\n")[:-1]


def test_tokenized_bleu_differs_from_sacrebleu_when_compounds_are_present():
    # Only the compounds' second halves are wrong: split, their first halves still match.
    hypotheses = ["Die US-Regierung und die Nord-Süd-Bahn sind neu", "Das E-Mail-Konto ist weg"]
    references = ["Die US-Behörde und die Nord-West-Bahn sind neu", "Das E-Mail-Postfach ist weg"]
    result = score(hypotheses, references)
    assert result["bleu_tok"] > result["sacrebleu"] + 10


def test_tokenized_bleu_equals_sacrebleu_without_compounds_or_punctuation():
    hypotheses = ["Die Kinder spielen heute im Garten", "Wir haben den ganzen Abend diskutiert"]
    references = ["Die Kinder spielen morgen im Garten", "Wir haben den ganzen Tag diskutiert"]
    result = score(hypotheses, references)
    assert result["bleu_tok"] == pytest.approx(result["sacrebleu"])


def test_a_copy_of_the_references_scores_100(tmp_path):
    ref = write_lines(tmp_path / "ref.de", REFERENCES)
    copy = write_lines(tmp_path / "copy.de", REFERENCES)
    result = score_files(copy, ref)
    assert result["bleu_tok"] == pytest.approx(100.0)
    assert result["sacrebleu"] == pytest.approx(100.0)


def test_chrf_matches_sacrebleu_chrf():
    expected = CHRF().corpus_score(HYPOTHESES, [REFERENCES]).score
    assert score(HYPOTHESES, REFERENCES)["chrf"] == expected


def test_unequal_line_counts_name_both_files_and_counts(tmp_path):
    hyp = write_lines(tmp_path / "hyp.de", HYPOTHESES[:-1])
    ref = write_lines(tmp_path / "ref.de", REFERENCES)
    with pytest.raises(UserError) as raised:
        score_files(hyp, ref)
    message = str(raised.value)
    assert str(hyp) in message and str(ref) in message
    assert str(len(HYPOTHESES) - 1) in message and str(len(REFERENCES)) in message


def test_cli_exits_2_with_one_error_line_on_unequal_counts(tmp_path, capsys):
    hyp = write_lines(tmp_path / "hyp.de", HYPOTHESES[:-1])
    ref = write_lines(tmp_path / "ref.de", REFERENCES)
    status, out, err = run_main(["--hyp", str(hyp), "--ref", str(ref)], capsys)
    assert status == 2
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1


def test_unicode_line_separators_and_bom_do_not_shift_alignment(tmp_path):
    references = list(REFERENCES)
    hypotheses = list(HYPOTHESES)
    # U+2028 and U+0085 are line breaks for str.splitlines but not for the files we read.
    references[3] = "Der Zug kam\u2028mit zwanzig Minuten Verspätung\u0085in Berlin an."
    hypotheses[3] = references[3]
    ref = tmp_path / "ref.de"
    ref.write_bytes(b"\xef\xbb\xbf" + ("\n".join(references) + "\n").encode("utf-8"))
    hyp = write_lines(tmp_path / "hyp.de", hypotheses)
    result = score_files(hyp, ref)
    assert result["n_segments"] == len(REFERENCES)
    assert result["sacrebleu"] == pytest.approx(score(hypotheses, references)["sacrebleu"])
    copy = tmp_path / "copy.de"
    copy.write_bytes(ref.read_bytes())
    aligned = score_files(copy, ref)
    assert aligned["bleu_tok"] == pytest.approx(100.0)


def test_non_utf8_file_names_file_and_line(tmp_path):
    hyp = tmp_path / "hyp.de"
    hyp.write_bytes("erste Zeile\nzweite Zeile\n".encode("utf-8") + "Gr\u00fc\u00dfe\n".encode("latin-1"))
    ref = write_lines(tmp_path / "ref.de", ["a", "b", "c"])
    with pytest.raises(UserError, match=r"hyp\.de, line 3"):
        score_files(hyp, ref)


def test_tokenized_bleu_is_case_sensitive():
    lowered = [line.lower() for line in REFERENCES]
    assert score(lowered, REFERENCES)["bleu_tok"] < 100.0


def test_sacrebleu_matches_the_sacrebleu_api():
    assert score(HYPOTHESES, REFERENCES)["sacrebleu"] == BLEU().corpus_score(HYPOTHESES, [REFERENCES]).score


def test_paired_bootstrap_returns_a_p_value_and_system_confidence_interval():
    baseline = [" ".join(line.split()[:-2]) for line in HYPOTHESES]
    result = paired_bootstrap(baseline, HYPOTHESES, REFERENCES, n_samples=50, seed=7)
    assert 0.0 <= result["p_value"] <= 1.0
    assert result["system_bleu"] == pytest.approx(BLEU().corpus_score(HYPOTHESES, [REFERENCES]).score)
    assert result["system_ci"] >= 0.0
    assert "bs:50" in result["signature"] and "seed:7" in result["signature"]


def test_paired_bootstrap_is_deterministic_for_a_seed():
    baseline = [" ".join(line.split()[:-2]) for line in HYPOTHESES]
    first = paired_bootstrap(baseline, HYPOTHESES, REFERENCES, n_samples=30, seed=3)
    second = paired_bootstrap(baseline, HYPOTHESES, REFERENCES, n_samples=30, seed=3)
    assert first == second


def test_the_length_ratio_is_hypothesis_over_reference_length_in_sacrebleus_tokens(tmp_path):
    from aiayn.score import score

    references = ["the dog sees the cat .", "a man runs ."]
    short = score(["the dog .", "a man runs ."], references)
    assert short["length_ratio"] == pytest.approx(7 / 10)
    assert short["brevity_penalty"] == pytest.approx(math.exp(1 - 10 / 7))
    assert score(references, references)["length_ratio"] == 1.0
