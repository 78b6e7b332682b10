"""Is the run on course? At each dev evaluation: its place against its reference's seed band and the projected
final dev perplexity, to MLflow (``dev_ppl_band``, ``dev_ppl_projected*``, tag ``dev_ppl_band``) and the log.

Which reference: ``train.reference`` (``aiayn.reference.choose_reference``); the fit: ``aiayn.projection``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from aiayn.projection import project
from aiayn.reference import POSITION_NAMES, band_at, band_position, choose_reference


class DevMonitor:
    """The trainer's reference and projection, said at every dev evaluation."""

    def __init__(self, reference: dict | None, about: str, final_step: int, warmup_steps: int,
                 name: str = "", seed: int = 0, run_dir: Path | None = None):
        self.reference, self.about = reference, about
        self.final_step, self.warmup_steps = final_step, warmup_steps
        self.name, self.seed, self.run_dir = name, seed, run_dir
        self.said_about, self.said_step = False, None

    @classmethod
    def for_run(cls, reference: str, preset: dict, experiment: str, seed: int, run_dir: Path,
                data_fingerprint: str) -> "DevMonitor":
        """The monitor of one run of ``preset``: ``reference`` (train.reference) picks its reference curve."""
        curve, about = choose_reference(reference, preset["name"], experiment, data_fingerprint)
        return cls(curve, about, preset["steps"], preset["warmup_steps"], preset["name"], seed, run_dir)

    def observe(self, step: int, history: list[dict]) -> tuple[dict[str, float], dict[str, str], str]:
        """The metrics, tags and log line for the dev evaluation at ``step`` (the last of ``history``)."""
        dev_ppl = float(history[-1]["dev_ppl"])
        metrics, tags, words = {}, {}, [f"dev step {step}: ppl {dev_ppl:.3f}"]
        position = band_position(self.reference, step, dev_ppl) if self.reference else None
        if position is not None:
            low, high = band_at(self.reference, step)
            metrics["dev_ppl_band"] = float(position)
            tags["dev_ppl_band"] = POSITION_NAMES[position]
            words.append(f"{POSITION_NAMES[position]} the reference band [{low:.3f}, {high:.3f}]"
                         if position else f"inside the reference band [{low:.3f}, {high:.3f}]")
        projection = project(history, self.final_step, self.warmup_steps)
        if projection is not None:
            metrics.update(projection.metrics())
            words.append(f"projected {projection.ppl:.3f} [{projection.low:.3f}, {projection.high:.3f}] "
                         f"at step {projection.step}")
            paper = self._end_point()
            if paper is not None:
                words.append(f"(Table 3: {paper:.2f})")
        return metrics, tags, "; ".join(words)

    def _end_point(self) -> float | None:
        if self.reference is None or self.reference.get("kind") != "end_point":
            return None
        return self.reference["points"][-1]["dev_ppl"]["mean"]

    def after_dev(self, step: int, history: list[dict], tracker) -> None:
        """Say where the run stands: to the tracker (metrics and tags) and one stderr line."""
        if not self.said_about:
            print(f"reference: {self.about}", file=sys.stderr)
            self.said_about = True
        metrics, tags, line = self.observe(step, history)
        self.said_step = step
        if metrics:
            tracker.log_metrics(metrics, step)
        if tags:
            tracker.set_tags(tags)
        print(line, file=sys.stderr)

    def finish(self, history: list[dict], tracker) -> None:
        """At the run's end: its last dev evaluation said (where ``after_dev`` did not), and its dev curve over
        its reference's band drawn beside final.json and logged as an artifact of its MLflow run."""
        from aiayn.layout import DEV_PPL_BAND_FIGURE
        from aiayn.plots import plot_reference_band

        if not history:
            return
        if history[-1]["step"] != self.said_step:
            self.after_dev(int(history[-1]["step"]), history, tracker)
        curve = [(int(entry["step"]), float(entry["dev_ppl"])) for entry in history]
        path = plot_reference_band(self.name, {self.seed: curve}, self.reference, self.run_dir / DEV_PPL_BAND_FIGURE)
        try:
            tracker.log_artifact(path)
        except Exception as error:  # the figure is on disk; a store that went away must not fail the run
            print(f"warning: the dev curve figure was not logged to MLflow ({error})", file=sys.stderr)
