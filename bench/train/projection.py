"""The projection's error on finished runs, against the measured final dev perplexity (aiayn.projection): from
the dev evaluations of the first 30% of the planned steps, and from every dev evaluation the trainer projects at.

    python -m bench.train.projection --warmup-steps 200 results/demo/train/*/seed*/final.json

Both methods: the power law on the run's own curve (after warmup), and by the reference, where each run is held
against a reference made of the other seeds of its preset (left out of it: out of sample as to the run).
Prints one row per run (projected, interval, measured, error, covered) and the summaries.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from aiayn.projection import project, project_by_reference
from aiayn.reference import reference_from_runs


def validate(final: dict, warmup_steps: int, upto: float, reference: dict | None = None) -> dict:
    """The projection from the dev evaluations up to step ``upto`` (by ``reference`` where given, else the power
    law), against the measured final dev perplexity."""
    planned, measured = final["planned_steps"], final["dev_ppl"]
    seen = [entry for entry in final["dev_history"] if entry["step"] <= upto]
    projection = (project_by_reference(seen, reference, planned) if reference is not None
                  else project(seen, planned, warmup_steps))
    row = {"preset": final["preset"], "seed": final["seed"], "upto": upto, "measured": measured,
           "projection": projection}
    if projection is not None:
        row.update(log_error=math.log(projection.ppl / measured), covered=projection.covers(measured))
    return row


def show(row: dict) -> str:
    head = f"{row['preset']:<14} seed {row['seed']}  up to step {row['upto']:>6.0f}"
    projection = row["projection"]
    if projection is None:
        return f"{head}  no projection (before the warmup's end, or fewer than 4 points)"
    return (f"{head}  {projection.points:>2} points  projected {projection.ppl:8.3f} [{projection.low:8.3f}, "
            f"{projection.high:8.3f}]  measured {row['measured']:8.3f}  error {100 * math.expm1(row['log_error']):+6.1f}%"
            f"  {'covered' if row['covered'] else 'MISSED'}")


def summary(rows: list[dict], what: str) -> str:
    made = [row for row in rows if row["projection"] is not None]
    if not made:
        return f"{what}: no projection"
    errors = [abs(row["log_error"]) for row in made]
    return (f"{what}: {len(made)} projections, mean |error| {100 * math.expm1(sum(errors) / len(errors)):.1f}%, "
            f"largest {100 * math.expm1(max(errors)):.1f}%, covered {sum(row['covered'] for row in made)}/{len(made)}")


def others(final: dict, finals: list[dict]) -> dict | None:
    """A reference of the other seeds of ``final``'s preset (None with no other seed)."""
    rest = [other for other in finals if other["preset"] == final["preset"] and other["seed"] != final["seed"]]
    return reference_from_runs(rest, [str(other["seed"]) for other in rest], allow_single=True) if rest else None


def report(finals: list[dict], warmup_steps: int, share: float, by_reference: bool) -> None:
    references = [others(final, finals) if by_reference else None for final in finals]
    at_share = [validate(final, warmup_steps, share * final["planned_steps"], reference)
                for final, reference in zip(finals, references)]
    for row in at_share:
        print(show(row))
    print(summary(at_share, f"from the first {share:.0%} of the steps"))
    # every dev evaluation the trainer projects at (the power law: after warmup only)
    every = [validate(final, warmup_steps, entry["step"], reference)
             for final, reference in zip(finals, references) for entry in final["dev_history"]
             if (0 if by_reference else warmup_steps) <= entry["step"] < final["planned_steps"]]
    print(summary(every, "from every dev evaluation" + ("" if by_reference else " after warmup")))
    for row in every:
        if row["projection"] is not None and not row["covered"]:
            print("  missed:", show(row))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("finals", type=Path, nargs="+", help="finished runs' final.json")
    parser.add_argument("--warmup-steps", type=int, required=True, help="the runs' preset warmup_steps")
    parser.add_argument("--share", type=float, default=0.3, help="the share of the planned steps fitted on")
    args = parser.parse_args(argv)
    finals = [json.loads(path.read_text()) for path in args.finals]
    for by_reference in (False, True):
        print(f"== {'by the reference of the other seeds' if by_reference else 'the power law'}")
        report(finals, args.warmup_steps, args.share, by_reference)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
