"""The projection's error on finished runs: fitted on the dev evaluations of the first 30% of the planned steps
(and at every dev evaluation after warmup, as the trainer does), against the measured final dev perplexity
(aiayn.projection).

    python -m bench.train.projection --warmup-steps 200 results/demo/train/*/seed*/final.json

Prints one row per run (projected, interval, measured, error, covered) and the summaries.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from aiayn.projection import project


def validate(final: dict, warmup_steps: int, upto: float) -> dict:
    """The projection from the dev evaluations up to step ``upto``, against the measured final dev perplexity."""
    planned, measured = final["planned_steps"], final["dev_ppl"]
    projection = project([entry for entry in final["dev_history"] if entry["step"] <= upto], planned, warmup_steps)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("finals", type=Path, nargs="+", help="finished runs' final.json")
    parser.add_argument("--warmup-steps", type=int, required=True, help="the runs' preset warmup_steps")
    parser.add_argument("--share", type=float, default=0.3, help="the share of the planned steps fitted on")
    args = parser.parse_args(argv)
    finals = [json.loads(path.read_text()) for path in args.finals]
    at_share = [validate(final, args.warmup_steps, args.share * final["planned_steps"]) for final in finals]
    for row in at_share:
        print(show(row))
    print(summary(at_share, f"from the first {args.share:.0%} of the steps"))
    # every dev evaluation after warmup, as the trainer projects at each
    every = [validate(final, args.warmup_steps, entry["step"]) for final in finals for entry in final["dev_history"]
             if args.warmup_steps <= entry["step"] < final["planned_steps"]]
    print(summary(every, "from every dev evaluation after warmup"))
    for row in every:
        if row["projection"] is not None and not row["covered"]:
            print("  missed:", show(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
