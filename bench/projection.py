"""The projection's error on finished runs: fitted on the dev evaluations of the first 30% of the planned steps,
compared with the measured final dev perplexity (aiayn.projection).

    python bench/projection.py --warmup-steps 200 results/demo/train/*/seed*/final.json

Prints one row per run (projected, interval, measured, error in log perplexity, covered) and the summary.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from aiayn.projection import project


def validate(final: dict, warmup_steps: int, share: float) -> dict | None:
    planned = final["planned_steps"]
    seen = [entry for entry in final["dev_history"] if entry["step"] <= share * planned]
    projection = project(seen, planned, warmup_steps)
    measured = final["dev_ppl"]
    if projection is None:
        return None
    return {"preset": final["preset"], "seed": final["seed"], "points": projection.points,
            "projected": projection.ppl, "low": projection.low, "high": projection.high, "measured": measured,
            "log_error": math.log(projection.ppl / measured), "covered": projection.covers(measured)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("finals", type=Path, nargs="+", help="finished runs' final.json")
    parser.add_argument("--warmup-steps", type=int, required=True, help="the runs' preset warmup_steps")
    parser.add_argument("--share", type=float, default=0.3, help="the share of the planned steps fitted on")
    args = parser.parse_args(argv)
    rows = [row for path in args.finals
            if (row := validate(json.loads(path.read_text()), args.warmup_steps, args.share))]
    for row in rows:
        print(f"{row['preset']:<14} seed {row['seed']}  {row['points']:>2} points  projected {row['projected']:8.3f} "
              f"[{row['low']:8.3f}, {row['high']:8.3f}]  measured {row['measured']:8.3f}  "
              f"error {100 * (math.exp(row['log_error']) - 1):+6.1f}%  {'covered' if row['covered'] else 'MISSED'}")
    if rows:
        errors = [abs(row["log_error"]) for row in rows]
        print(f"{len(rows)} runs: mean |error| {100 * (math.exp(sum(errors) / len(errors)) - 1):.1f}%, "
              f"largest {100 * (math.exp(max(errors)) - 1):.1f}%, covered {sum(row['covered'] for row in rows)}"
              f"/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
