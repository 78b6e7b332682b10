"""Reference curves: dev perplexity (and dev BLEU) against step of known-good runs, with their seed band.

A reference file is JSON (``FORMAT``)::

    {"format": "aiayn-reference/1",
     "references": [{
        "preset": "demo_base", "experiment": "demo", "kind": "curve",      # or "end_point"
        "data_fingerprint": "...", "vocab_fingerprint": "...",             # the runs' data ("" where unknown)
        "seeds": [1, 2, 3], "planned_steps": 360, "warmup_steps": 200,
        "tolerance": 0.0,     # the band is widened by this share either side before a run is placed
        "note": "...",
        "points": [{"step": 20, "target_tokens": 61000,                    # the seeds' mean tokens per step x step
                    "dev_ppl": {"low": 410.2, "mean": 415.0, "high": 421.9},
                    "dev_bleu": {"low": ..., "mean": ..., "high": ...}}]  # where every run has it
     }]}

The band at a step is the lowest and highest of the seeds there; between points it is interpolated linearly in
step (``band_at``); outside the points there is none. A run is placed against it by ``band_position``: +1 above
the band (a higher perplexity: worse), 0 inside, -1 below (better). The paper's Table 3 gives one point per row,
its end point (``paper_end_points``, read from presets.yaml): the comparison there is the projection's.

``aiayn reference --runs RUN_DIR... --out FILE`` makes a reference from finished runs of one preset.
"""

from __future__ import annotations

import argparse
import json
import math
from importlib import resources
from pathlib import Path
from typing import Sequence

from aiayn.errors import UserError, cli
from aiayn.layout import FINAL_SUMMARY
from aiayn.writing import write_json_atomic

FORMAT = "aiayn-reference/1"
SHIPPED = resources.files("aiayn") / "references"  # <experiment>.json, measured with this code
POSITION_NAMES = {1: "above", 0: "inside", -1: "below"}


# --- making one -------------------------------------------------------------------------------

def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"low": min(values), "mean": sum(values) / len(values), "high": max(values)}


def reference_from_runs(finals: Sequence[dict], sources: Sequence[str], experiment: str = "",
                        allow_single: bool = False) -> dict:
    """One reference from the final.json summaries of finished runs of one preset on the same data, one per seed.

    The points are the steps every run evaluated. One run makes a band of zero width only with ``allow_single``."""
    if not finals:
        raise UserError("no runs given; pass the run folders (or their final.json) of one preset, one per seed")
    first, first_source = finals[0], sources[0]
    for final, source in zip(finals[1:], sources[1:]):
        for key in ("preset", "data_fingerprint", "vocab_fingerprint"):
            if final.get(key) != first.get(key):
                raise UserError(f"{source}: {key} {final.get(key)!r} differs from {first_source}'s {first.get(key)!r}; "
                                "a reference is made from runs of one preset on the same data and vocabulary")
    seeds = [final.get("seed") for final in finals]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"seeds {seeds}: each seed once; a band is the spread over different seeds")
    if len(finals) < 2 and not allow_single:
        raise UserError(f"{first_source}: one run makes no seed band; give the runs of 2 or more seeds "
                        "(or --allow-single for a band of zero width)")
    histories = [{int(entry["step"]): entry for entry in final.get("dev_history") or []} for final in finals]
    steps = sorted(set.intersection(*(set(history) for history in histories)))
    if not steps:
        raise UserError(f"{', '.join(sources)}: no dev evaluation at a step all runs share; the runs need a "
                        "dev split and the same train.dev_every")
    per_step = [final["target_tokens"] / final["step"] for final in finals if final.get("step")]
    tokens = sum(per_step) / len(per_step) if per_step else math.nan
    points = []
    for step in steps:
        entries = [history[step] for history in histories]
        point = {"step": step, "target_tokens": round(step * tokens) if tokens == tokens else None,
                 "dev_ppl": _spread([float(entry["dev_ppl"]) for entry in entries])}
        if all(entry.get("dev_bleu") is not None for entry in entries):
            point["dev_bleu"] = _spread([float(entry["dev_bleu"]) for entry in entries])
        points.append(point)
    note = (f"{len(finals)} seeds: the band is their lowest and highest at each step" if len(finals) > 1 else
            "one seed: a band of zero width, the run itself")
    return {"preset": first.get("preset"), "experiment": experiment or first.get("experiment", ""), "kind": "curve",
            "data_fingerprint": first.get("data_fingerprint", ""), "vocab_fingerprint": first.get("vocab_fingerprint", ""),
            "seeds": seeds, "planned_steps": first.get("planned_steps", steps[-1]),
            "warmup_steps": first.get("warmup_steps"), "tolerance": 0.0, "note": note, "points": points}


def paper_end_points() -> list[dict]:
    """Table 3's dev perplexity and dev BLEU of every paper preset, at the preset's last step (end points only)."""
    from aiayn.presets import paper_presets

    presets = paper_presets()

    def setting(name: str, key: str):
        while key not in presets[name]:
            name = presets[name]["inherit"]
        return presets[name][key]

    references = []
    for name, preset in presets.items():
        paper = preset.get("paper") or {}
        if paper.get("ppl_dev") is None:
            continue
        point = {"step": setting(name, "steps"), "target_tokens": None,
                 "dev_ppl": _spread([paper["ppl_dev"]])}
        if paper.get("bleu_dev") is not None:
            point["dev_bleu"] = _spread([paper["bleu_dev"]])
        references.append({
            "preset": name, "experiment": "", "kind": "end_point", "data_fingerprint": "", "vocab_fingerprint": "",
            "seeds": [], "planned_steps": point["step"], "warmup_steps": setting(name, "warmup_steps"),
            "tolerance": 0.0, "points": [point],
            "note": f"the paper's Table 3, row {paper.get('row', name)}, newstest2013: an end point only"})
    return references


# --- reading one ------------------------------------------------------------------------------

def read_references(path: str | Path) -> list[dict]:
    """The references of a reference file (``FORMAT``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such reference file (train.reference: auto, none, or a file that "
                        "`aiayn reference` wrote)") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not JSON ({error}); give a file that `aiayn reference` wrote") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("references"), list):
        raise UserError(f"{path}: not a reference file (its format is not {FORMAT!r}); make one with "
                        "`aiayn reference --runs RUN_DIR... --out FILE`")
    return data["references"]


def shipped_references(experiment: str) -> list[dict]:
    """The curves this project measured for ``experiment`` (empty where it measured none)."""
    path = SHIPPED / f"{experiment}.json"
    return read_references(path) if experiment and path.is_file() else []


def choose_reference(setting: str, preset: str, experiment: str, data_fingerprint: str) -> tuple[dict | None, str]:
    """The reference a run of ``preset`` is compared with under ``train.reference`` (auto, none or a file: its
    reference of the preset, else auto's), and a line that says which (or why none)."""
    if setting == "none":
        return None, "no reference (train.reference: none)"
    if setting == "auto":
        curves = [ref for ref in shipped_references(experiment) if ref["preset"] == preset]
        for ref in curves:
            if ref.get("data_fingerprint") in ("", data_fingerprint):
                return ref, f"the shipped reference of {experiment}/{preset} ({ref['note']})"
        paper = [ref for ref in paper_end_points() if ref["preset"] == preset]
        if paper:
            return paper[0], paper[0]["note"]
        why = "on other data" if curves else "none shipped"
        return None, f"no reference for preset {preset} ({why}; make one with `aiayn reference`, train.reference)"
    matching = [ref for ref in read_references(setting) if ref["preset"] == preset]
    if not matching:
        reference, about = choose_reference("auto", preset, experiment, data_fingerprint)
        return reference, f"{setting} has no reference of preset {preset}; auto: {about}"
    ref = matching[0]
    text = f"{setting} (preset {preset}, {ref.get('note', '')})"
    if ref.get("data_fingerprint") not in ("", data_fingerprint):
        text += "; warning: made on other data"
    return ref, text


# --- placing a run ----------------------------------------------------------------------------

def _bracket(reference: dict, step: int, metric: str) -> tuple[dict, dict, float] | None:
    """The reference's points either side of ``step`` that have ``metric``, and how far between them ``step``
    lies (0 at the left, 1 at the right); None outside its points."""
    points = [point for point in reference["points"] if point.get(metric) is not None]
    for left, right in zip(points, points[1:] + points[-1:]):
        if left["step"] <= step <= right["step"]:
            share = 0.0 if right["step"] == left["step"] else (step - left["step"]) / (right["step"] - left["step"])
            return left, right, share
    return None


def band_at(reference: dict, step: int, metric: str = "dev_ppl") -> tuple[float, float] | None:
    """The band's (low, high) at ``step``, interpolated linearly between the reference's points, widened by
    its tolerance; None outside its points or where it has no band of ``metric``."""
    bracket = _bracket(reference, step, metric)
    if bracket is None:
        return None
    left, right, share = bracket
    low, high = (left[metric][side] + share * (right[metric][side] - left[metric][side]) for side in ("low", "high"))
    tolerance = reference.get("tolerance", 0.0)
    return low * (1 - tolerance), high * (1 + tolerance)


def mean_at(reference: dict, step: int, metric: str = "dev_ppl") -> float | None:
    """The seeds' mean at ``step``, interpolated between the reference's points linearly in log perplexity;
    None outside its points."""
    bracket = _bracket(reference, step, metric)
    if bracket is None:
        return None
    left, right, share = bracket
    low, high = math.log(left[metric]["mean"]), math.log(right[metric]["mean"])
    return math.exp(low + share * (high - low))


def band_position(reference: dict, step: int, dev_ppl: float) -> int | None:
    """+1 above the band (worse perplexity), 0 inside, -1 below (better); None where the reference has no band
    at ``step`` (an end point's reference has one at its last step only)."""
    band = band_at(reference, step)
    if band is None:
        return None
    low, high = band
    if not math.isfinite(dev_ppl) or dev_ppl > high:
        return 1
    return -1 if dev_ppl < low else 0


def reference_curve(reference: dict, metric: str = "dev_ppl") -> list[tuple[int, float, float, float]]:
    """(step, low, mean, high) of each point that has ``metric``: what the report draws."""
    return [(point["step"], point[metric]["low"], point[metric]["mean"], point[metric]["high"])
            for point in reference["points"] if point.get(metric) is not None]


def band_figures(finals: dict, setting: str, out_dir: str | Path) -> list[Path]:
    """One figure per preset: its runs' dev curves over the band of the reference ``setting`` picks (the report's).

    ``finals``: (preset, seed) -> final.json path."""
    from aiayn.layout import band_figure_name
    from aiayn.plots import plot_reference_band

    summaries = {key: json.loads(Path(path).read_text(encoding="utf-8")) for key, path in finals.items()}
    written = []
    for preset in dict.fromkeys(name for name, _ in summaries):
        runs = {seed: summary for (name, seed), summary in summaries.items() if name == preset}
        first = next(iter(runs.values()))
        reference, _ = choose_reference(setting, preset, first.get("experiment", ""), first.get("data_fingerprint", ""))
        curves = {int(seed): [(int(entry["step"]), float(entry["dev_ppl"])) for entry in summary.get("dev_history") or []]
                  for seed, summary in runs.items()}
        written.append(plot_reference_band(preset, curves, reference, Path(out_dir) / band_figure_name(preset)))
    return written


# --- the command ------------------------------------------------------------------------------

def _final_of(path: Path) -> Path:
    return path / FINAL_SUMMARY if path.is_dir() else path


@cli
def main(argv=None):
    from aiayn.config import config_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn reference", description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once): their experiment")
    parser.add_argument("--runs", type=Path, nargs="+", required=True,
                        help="finished runs of one preset, one per seed: their folders or final.json")
    parser.add_argument("--out", type=Path, required=True, help="the reference file to write (JSON)")
    parser.add_argument("--experiment",
                        help="the experiment the runs belong to (default: --config's, else final.json's)")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="widen the band by this share either side before a run is placed (default 0)")
    parser.add_argument("--allow-single", action="store_true", help="accept one run: a band of zero width")
    args = parser.parse_args(argv)
    # neither --config nor --experiment: "", the runs' own (final.json's)
    experiment = (config_from_arguments(args, {"experiment": ("--experiment", "experiment")})["experiment"]
                  if args.config or args.experiment else "")
    finals, sources = [], []
    for run in args.runs:
        path = _final_of(run)
        if not path.is_file():
            raise UserError(f"{path}: missing; give finished runs (the train stage writes {FINAL_SUMMARY} at the end)")
        finals.append(json.loads(path.read_text(encoding="utf-8")))
        sources.append(str(path))
    if not 0 <= args.tolerance < 1:
        raise UserError(f"--tolerance {args.tolerance}: give a share between 0 and 1")
    reference = reference_from_runs(finals, sources, experiment, args.allow_single)
    reference["tolerance"] = args.tolerance
    write_json_atomic(args.out, {"format": FORMAT, "references": [reference]})
    print(f"{args.out}: {reference['preset']}, {len(reference['seeds'])} seed(s), {len(reference['points'])} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
