"""Is the run on course? At each dev evaluation: its place against its reference's seed band and the projected
final dev perplexity, to MLflow (``dev_ppl_band``, ``dev_ppl_projected*``, tags ``dev_ppl_band`` and
``dev_ppl_projected_by``) and the log; and a run off course (above the band by ``train.off_course_margin`` at
``train.off_course_evaluations`` dev evaluations in a row) warned of, or stopped (``train.off_course: stop``).

Which reference: ``train.reference`` (``aiayn.reference.choose_reference``); the projection: ``aiayn.projection``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from aiayn.errors import UserError
from aiayn.projection import projection_for
from aiayn.reference import POSITION_NAMES, band_at, band_position, choose_reference


class TrainingOffCourse(UserError):
    """Dev perplexity stayed far above the reference band (train.off_course: stop)."""


@dataclass(frozen=True)
class OffCourseRule:
    """``train.off_course``, ``off_course_margin`` and ``off_course_evaluations``."""

    action: str = "warn"
    margin: float = 0.5
    evaluations: int = 3

    @classmethod
    def from_section(cls, train_section: dict) -> "OffCourseRule":
        return cls(train_section["off_course"], train_section["off_course_margin"],
                   train_section["off_course_evaluations"])

    def streak(self, reference: dict, history: list[dict]) -> list[dict]:
        """The dev evaluations at the end of ``history`` that are each above the band by more than the margin
        (read from the history, so a resumed run counts as an uninterrupted one)."""
        streak = []
        for entry in reversed(history):
            band = band_at(reference, int(entry["step"]))
            ppl = float(entry["dev_ppl"])
            if band is None or (math.isfinite(ppl) and ppl <= band[1] * (1 + self.margin)):
                break
            streak.append(entry)
        return streak[::-1]


class DevMonitor:
    """The trainer's reference and projection, said at every dev evaluation."""

    def __init__(self, reference: dict | None, about: str, final_step: int, warmup_steps: int,
                 name: str = "", seed: int = 0, run_dir: Path | None = None, off_course: OffCourseRule = OffCourseRule()):
        self.reference, self.about = reference, about
        self.final_step, self.warmup_steps = final_step, warmup_steps
        self.name, self.seed, self.run_dir = name, seed, run_dir
        self.off_course = off_course
        self.said_about, self.said_step = False, None
        self.stop_reason: str | None = None  # set where train.off_course: stop fired; the trainer stops on it

    @classmethod
    def for_run(cls, train_section: dict, preset: dict, experiment: str, seed: int, run_dir: Path,
                data_fingerprint: str) -> "DevMonitor":
        """The monitor of one run of ``preset``: train.reference picks its reference curve, train.off_course*
        its rule."""
        curve, about = choose_reference(train_section["reference"], preset["name"], experiment, data_fingerprint)
        return cls(curve, about, preset["steps"], preset["warmup_steps"], preset["name"], seed, run_dir,
                   OffCourseRule.from_section(train_section))

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
        projection = projection_for(history, self.final_step, self.warmup_steps, self.reference)
        if projection is not None:
            metrics.update(projection.metrics())
            tags["dev_ppl_projected_by"] = projection.method
            words.append(f"projected {projection.ppl:.3f} [{projection.low:.3f}, {projection.high:.3f}] "
                         f"at step {projection.step} (by the {projection.method})")
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
        self.check_course(history, tracker)

    def check_course(self, history: list[dict], tracker) -> None:
        """Warn, once a streak reaches ``off_course.evaluations``, or ask the trainer to stop (``stop_reason``)."""
        if self.reference is None:
            return
        streak = self.off_course.streak(self.reference, history)
        if len(streak) < self.off_course.evaluations:
            return
        last = streak[-1]
        low, high = band_at(self.reference, int(last["step"]))
        steps = ", ".join(str(entry["step"]) for entry in streak)
        text = (f"{self.name} seed {self.seed} is off course: its dev perplexity ({float(last['dev_ppl']):.3f} at "
                f"step {last['step']}) has been more than {self.off_course.margin:.0%} above its reference's band "
                f"([{low:.3f}, {high:.3f}] there; {self.about}) at {len(streak)} dev evaluations in a row (steps "
                f"{steps}). The settings most often at fault: lr_scale and warmup_steps (the learning rate), "
                "label_smoothing, the data or vocabulary (a reference made on other data), train.precision; compare "
                "the run's config with its reference's runs")
        tracker.set_tags({"off_course": f"step {last['step']}"})
        if self.off_course.action == "stop":
            self.stop_reason = text
        elif len(streak) == self.off_course.evaluations:  # once a streak
            print(f"warning: {text}. It runs on (train.off_course: warn; stop ends such a run at exit 2).",
                  file=sys.stderr)

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
