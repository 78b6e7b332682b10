"""Checkpoint averaging: the average stage's cost, and how wide its window should be."""
