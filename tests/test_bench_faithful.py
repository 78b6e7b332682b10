"""bench/faithful/deviations.py: which checkpoints each cadence picks, and the reference side of tokenized BLEU."""

from __future__ import annotations

import pytest

from bench.faithful.deviations import clock_picks, main, step_picks


def test_the_step_cadence_counts_back_from_the_last_step():
    assert step_picks(list(range(5, 505, 5)), every=50, last=5) == [300, 350, 400, 450, 500]
    with pytest.raises(SystemExit, match="no checkpoint at steps"):
        step_picks(list(range(10, 510, 20)), every=50, last=5)


def test_a_steady_clock_picks_the_step_cadence_and_a_slowdown_moves_it():
    steady = {step: step * 2.0 for step in range(5, 505, 5)}  # 2 s a step
    assert clock_picks(steady, every=50, last=5) == [300, 350, 400, 450, 500]
    # twice as slow over the last 200 steps: the clock's last marks fall fewer steps apart
    slowed = {step: step * 2.0 if step <= 300 else 600 + (step - 300) * 4.0 for step in range(5, 505, 5)}
    picks = clock_picks(slowed, every=50, last=5)
    assert picks[-1] == 500 and len(picks) == 5
    assert picks != [300, 350, 400, 450, 500] and picks[0] > 300  # the window covers fewer steps


def test_the_reference_side_is_measured_both_ways(tmp_path, capsys):
    """t2t's reference is tokenised but not normalised: typographic quotes in it no longer match the
    hypothesis's normalised ones, where our method normalises both sides alike."""
    ref = tmp_path / "ref.de"
    hyp = tmp_path / "hyp.de"
    ref.write_text("„Das ist nicht akzeptabel“, sagte die Ministerin.\nDer Zug kam in Berlin an.\n", encoding="utf-8")
    hyp.write_text("„Das ist nicht akzeptabel“, sagte die Ministerin.\nDer Zug kam in Berlin an.\n", encoding="utf-8")
    main(["reference", "--hyp", str(hyp), "--ref", str(ref), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "1 of 2 reference lines differ" in printed
    row = [line for line in printed.splitlines() if line.startswith(f"| {hyp}")][0]
    same, t2t = (float(cell) for cell in row.split("|")[2:4])
    assert same == 100.0 and t2t < same
