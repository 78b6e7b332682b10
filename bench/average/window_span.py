"""How wide the averaging window of one finished run should be: test BLEU of the average of ``--count``
checkpoints spread evenly over the last share of the run, for several shares, beside its last checkpoint.

The run must have kept more checkpoints than its window (``bench/average/window_span.sh`` keeps every one it
writes); each average takes, for each of its ``--count`` evenly spaced target steps, the nearest kept
checkpoint not taken yet. One training run, so the shares differ by the window alone. From the repository
root, after the DAG:

    python -m bench.average.window_span --kept KEPT_DIR --results results/multi30k_30min --model m30k_30min \\
        --config config/multi30k.yaml config/multi30k_30min.yaml
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path


def kept_steps(folder: Path) -> dict[int, Path]:
    """step -> checkpoint file, a window checkpoint before a safety one of the same step."""
    found: dict[int, Path] = {}
    for path in sorted(folder.glob("*.pt"), key=lambda p: not p.name.startswith("step_")):
        match = re.fullmatch(r"(?:step|safety)_(\d+)\.pt", path.name)
        if match:
            found.setdefault(int(match.group(1)), path)
    return found


def spread(steps: list[int], last: int, share: float, count: int) -> list[int]:
    """``count`` kept steps nearest to ``last - k * share * last / (count - 1)``, k = count-1 .. 0, each once."""
    chosen: list[int] = []
    for k in range(count - 1, -1, -1):
        target = last - k * share * last / max(count - 1, 1)
        left = [step for step in steps if step not in chosen]
        chosen.append(min(left, key=lambda step: (abs(step - target), step)))
    return sorted(chosen)


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def test_bleu(model: Path, results: Path, config: list[str], out: Path) -> float:
    hyp = out.with_suffix(".de")
    run("aiayn", "decode", "--config", *config, "--model", str(model), "--spm-model", str(results / "bpe" / "spm.model"),
        "--input", str(results / "data" / "test.en"), "--output", str(hyp))
    return json.loads(run("aiayn", "score", "--hyp", str(hyp), "--ref", str(results / "data" / "test.de"),
                          "--config", *config, "--json"))["sacrebleu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kept", type=Path, required=True, help="every checkpoint the run wrote")
    parser.add_argument("--results", type=Path, required=True, help="the experiment's results folder")
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", nargs="+", required=True, help="the config files the DAG was given")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.06, 0.15, 0.3, 0.5])
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="default: RESULTS/window_span/MODEL")
    args = parser.parse_args()
    kept = kept_steps(args.kept)
    final = json.loads((args.results / "train" / args.model / "seed1" / "final.json").read_text())
    last = final["step"]
    out = args.out or args.results / "window_span" / args.model
    out.mkdir(parents=True, exist_ok=True)
    dag = json.loads((args.results / "score" / args.model / "seed1" / "test.json").read_text())["sacrebleu"]
    averaged = json.loads((args.results / "average" / args.model / "seed1" / "average.json").read_text())
    rows = [("last checkpoint", str(last), test_bleu(kept[last], args.results, args.config, out / "last"))]
    rows.append(("the DAG's average", " ".join(map(str, averaged["averaged_steps"])), dag))
    for share in args.shares:
        steps = spread(sorted(kept), last, share, args.count)
        model = out / f"share_{share:g}.pt"
        run("aiayn", "average", *(str(kept[step]) for step in steps), "--output", str(model))
        rows.append((f"{args.count} over the last {share:.0%}", " ".join(map(str, steps)),
                     test_bleu(model, args.results, args.config, out / f"share_{share:g}")))
    print("| averaged | steps | test sacreBLEU | - last |\n|---|---|---|---|")
    for name, steps, bleu in rows:
        print(f"| {name} | {steps} | {bleu:.2f} | {bleu - rows[0][2]:+.2f} |")


if __name__ == "__main__":
    main()
