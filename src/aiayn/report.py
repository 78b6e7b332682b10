"""The report stage: our numbers beside the paper's, as Table 2 (test) and Table 3 (dev).

Table 2: newstest2014 BLEU of the averaged model, training cost. Table 3: dev perplexity and
dev BLEU of the last checkpoint without averaging, parameter count. Several seeds of a
preset are summarised as mean and standard deviation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aiayn.errors import UserError, cli
from aiayn.fileio import atomic_path, write_text_atomic


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path}: missing; run the stages before the report (snakemake does this for you)")
    return json.loads(path.read_text())


def collect_runs(presets: dict, results: str | Path, seeds: list[int] | None = None):
    """One row per (preset, seed) run found under ``results``: training summary and scores."""
    import pandas as pd

    results = Path(results)
    rows = []
    for name, preset in presets.items():
        run_root = results / "train" / name
        found_seeds = seeds or sorted(int(p.name[4:]) for p in run_root.glob("seed*") if p.name[4:].isdigit())
        for seed in found_seeds:
            final = _read_json(run_root / f"seed{seed}" / "final.json")
            dev = _read_json(results / "score" / name / f"seed{seed}" / "dev.json")
            test = _read_json(results / "score" / name / f"seed{seed}" / "test.json")
            paper = preset.get("paper") or {}
            rows.append({
                "preset": name, "seed": seed, "row": paper.get("row", name),
                "steps": final["step"], "params": final["parameters"], "train_hours": final["train_hours"],
                "train_flops": final["train_flops"], "dev_ppl": final.get("dev_ppl"),
                "dev_bleu_tok": dev["bleu_tok"], "dev_sacrebleu": dev["sacrebleu"],
                "test_bleu_tok": test["bleu_tok"], "test_sacrebleu": test["sacrebleu"],
                "test_chrf": test["chrf"], "sacrebleu_signature": test["sacrebleu_signature"],
                "paper_ppl_dev": paper.get("ppl_dev"), "paper_bleu_dev": paper.get("bleu_dev"),
                "paper_bleu_test": paper.get("bleu_test"), "paper_params": paper.get("params"),
                "paper_train_flops": paper.get("train_flops"), "mlflow_run_id": final.get("mlflow_run_id"),
            })
    return pd.DataFrame(rows)


def summarise(runs, columns: list[str], paper_pairs: dict[str, str]):
    """Mean (and std over seeds) per preset, in config order, with the paper's value and the difference."""
    import pandas as pd

    order = list(dict.fromkeys(runs["preset"]))
    grouped = runs.groupby("preset", sort=False)
    table = grouped[columns].mean()
    table.insert(0, "row", grouped["row"].first())
    table.insert(1, "seeds", grouped["seed"].count())
    for column in columns:
        if grouped["seed"].count().max() > 1:
            table[f"{column}_std"] = grouped[column].std(ddof=1)
    for ours, paper in paper_pairs.items():
        table[paper] = grouped[paper].first()
        table[f"{ours}_diff"] = table[ours] - pd.to_numeric(table[paper], errors="coerce")
    return table.loc[order].reset_index()


def build_report(presets: dict, results: str | Path, out_dir: str | Path, seeds: list[int] | None = None) -> dict:
    runs = collect_runs(presets, results, seeds)
    table2 = summarise(runs, ["test_bleu_tok", "test_sacrebleu", "test_chrf", "steps", "train_hours", "train_flops"],
                       {"test_bleu_tok": "paper_bleu_test", "train_flops": "paper_train_flops"})
    table3 = summarise(runs, ["dev_ppl", "dev_bleu_tok", "dev_sacrebleu", "params", "steps", "train_hours"],
                       {"dev_ppl": "paper_ppl_dev", "dev_bleu_tok": "paper_bleu_dev", "params": "paper_params"})
    out_dir = Path(out_dir)
    signature = runs["sacrebleu_signature"].iloc[0] if len(runs) else ""
    notes = (f"\n\nBLEU: `*_bleu_tok` is tokenized BLEU computed as the paper's script did (Moses tokenizer, "
             f"compound splitting); `*_sacrebleu` is detokenized sacreBLEU ({signature}).\n")
    for name, table, title in (("table2", table2, "Table 2: newstest2014 (test), averaged checkpoints"),
                               ("table3", table3, "Table 3: newstest2013 (dev), no averaging")):
        with atomic_path(out_dir / f"{name}.csv") as tmp:
            table.to_csv(tmp, index=False)
        write_text_atomic(out_dir / f"{name}.md", f"# {title}\n\n" + table.to_markdown(index=False, floatfmt=".4g") + notes)
    return {"table2": table2, "table3": table3, "runs": runs}


@cli
def main(argv=None):
    parser = argparse.ArgumentParser(prog="aiayn report", description=__doc__.splitlines()[0])
    parser.add_argument("--presets-json", required=True, help="resolved presets by name (what the Snakefile passes)")
    parser.add_argument("--results", required=True, help="the experiment's results folder")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds to report (default: every seed found)")
    args = parser.parse_args(argv)
    tables = build_report(json.loads(args.presets_json), args.results, args.out_dir, args.seeds)
    print(tables["table3"].to_string(index=False))
    print()
    print(tables["table2"].to_string(index=False))


if __name__ == "__main__":
    raise SystemExit(main())
