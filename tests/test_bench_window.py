"""bench.average.window_span's choice of checkpoints: which kept steps each share of a run averages."""

from __future__ import annotations

from bench.average import window_span


def test_each_share_takes_the_kept_steps_nearest_its_evenly_spaced_targets_once_each():
    kept = [52, 103, 157, 206, 1389, 1422, 1442, 1461, 1480, 1500, 1520]
    assert window_span.spread(kept, 1520, 0.06, 5) == [1422, 1461, 1480, 1500, 1520]
    assert window_span.spread(kept, 1520, 0.5, 5) == [206, 1389, 1422, 1442, 1520]  # targets 760 950 1140 1330
    # targets closer together than the kept steps: the nearest not taken yet, never one twice
    assert window_span.spread(kept, 1520, 0.001, 5) == [1442, 1461, 1480, 1500, 1520]


def test_a_window_checkpoint_is_taken_before_a_safety_one_of_the_same_step(tmp_path):
    for name in ("safety_00000100.pt", "step_00000100.pt", "safety_00000150.pt", "step_00000200.pt", "notes.txt"):
        (tmp_path / name).write_text("")
    assert {step: path.name for step, path in window_span.kept_steps(tmp_path).items()} == {
        100: "step_00000100.pt", 150: "safety_00000150.pt", 200: "step_00000200.pt"}
