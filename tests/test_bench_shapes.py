"""bench.train.shapes: an epoch's micro-batch shapes and padding, with and without train.shape_buckets."""

from __future__ import annotations

from bench.train import shapes


def test_the_shapes_benchmark_prints_both_ways_for_log_normal_lengths(capsys):
    assert shapes.main(["--lognormal", "26", "0.5", "3003"]) == 0
    out = capsys.readouterr().out
    assert "shape_buckets false: 4 steps, 15 distinct micro-batch shapes" in out
    assert "shape_buckets true : 5 steps, 13 distinct micro-batch shapes" in out
