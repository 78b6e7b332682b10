"""The report's tables from the runs' files: the runs collected (final.json, scores, average.json), their
summaries over seeds, the paired bootstrap against the base model, the dev curves, and the tables' notes
(``aiayn.report`` writes them, draws the pictures and logs them)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aiayn.errors import UserError
from aiayn.layout import METRICS
from aiayn.reading import read_lines

BOOTSTRAP_SAMPLES = 1000  # sacreBLEU's default number of resamples
BOOTSTRAP_SEED = 12345  # fixed, so that a rerun of the report gives the same p-values
TOKENS_COLUMN = "tokens per step, real src + tgt"


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path}: missing; run the stages before the report (snakemake does this for you)")
    return json.loads(path.read_text())


def base_preset(presets: dict) -> str:
    """The row the others are compared with: the preset whose ``paper.row`` is "base", else the first."""
    if not presets:
        raise UserError("no presets to report")
    return next((name for name, preset in presets.items() if preset["paper"].get("row") == "base"),
                next(iter(presets)))


@dataclass(frozen=True)
class RunFiles:
    """The files of one training run that the report reads, as the workflow names them (its inputs)."""

    final: Path  # the run's final.json: preset, seed, training summary, dev history
    dev_score: Path
    test_score: Path
    dev_translations: Path | None = None  # needed by the paired bootstrap only
    average: Path | None = None  # the average stage's average.json: last vs averaged on dev

    @property
    def run_dir(self) -> Path:
        return self.final.parent


def collect_runs(presets: dict, run_files: Sequence[RunFiles]):
    """One row per run, in the order given: training summary and scores (preset and seed from final.json).

    Returns the table and the files of each (preset, seed)."""
    import pandas as pd

    rows, files = [], {}
    for run in run_files:
        final = _read_json(run.final)
        dev, test = _read_json(run.dev_score), _read_json(run.test_score)
        average = _read_json(run.average) if run.average is not None else {}
        name, seed = final.get("preset"), final.get("seed")
        if name not in presets:
            raise UserError(f"{run.final}: a run of preset {name!r}, which is not one of the reported presets "
                            f"({', '.join(presets)}); pass the runs of those presets only")
        if (name, seed) in files:
            raise UserError(f"{run.final}: preset {name} seed {seed} is given twice "
                            f"(also {files[(name, seed)].final}); pass each run once")
        files[(name, seed)] = run
        paper = presets[name]["paper"]  # the numbers the paper gives for the preset's row, if any
        rows.append({
            "preset": name, "seed": seed, "row": paper.get("row", name),
            "steps": final["step"], "params": final["parameters"], "train_hours": final["train_hours"],
            "train_flops_analytic": final["train_flops"], "train_cost_gpu_hours_x_peak": _gpu_cost(final),
            "real_src_tokens_per_step": final.get("real_src_tokens_per_step", math.nan),
            "real_tgt_tokens_per_step": final.get("real_tgt_tokens_per_step", math.nan), "dev_ppl": final.get("dev_ppl"),
            "dev_bleu_tok": dev["bleu_tok"], "dev_sacrebleu": dev["sacrebleu"],
            "dev_length_ratio": dev.get("length_ratio", math.nan),
            "test_bleu_tok": test["bleu_tok"], "test_sacrebleu": test["sacrebleu"],
            "test_length_ratio": test.get("length_ratio", math.nan),
            "test_chrf": test["chrf"], "sacrebleu_signature": test["sacrebleu_signature"],
            "paper_ppl_dev": paper.get("ppl_dev"), "paper_bleu_dev": paper.get("bleu_dev"),
            "paper_bleu_test": paper.get("bleu_test"), "paper_params": paper.get("params"),
            "paper_train_flops": paper.get("train_flops"), "mlflow_run_id": final.get("mlflow_run_id"),
            "dev_ppl_last": average.get("dev_ppl_last", math.nan),
            "dev_ppl_averaged": average.get("dev_ppl_averaged", math.nan),
            "averaged_steps": " ".join(str(step) for step in average.get("averaged_steps", [])),
            "reported_model": average.get("reported_model", ""),
        })
    if not rows:
        raise UserError(f"no training runs given (--runs) for {', '.join(presets)}; run the stages first")
    # the presets in config order, each preset's seeds in the order given
    order = {name: index for index, name in enumerate(presets)}
    rows.sort(key=lambda row: order[row["preset"]])
    return pd.DataFrame(rows), files


def _gpu_cost(final: dict) -> float:
    """GPU-hours x the device's dense peak for the run's precision: Table 2's training cost, counted as the
    paper did it."""
    peak = final.get("device_peak_flops")
    return final["train_hours"] * 3600 * final.get("world_size", 1) * peak if peak else math.nan


def with_tokens_column(table):
    """The mean real tokens of a step as one readable column, "src + tgt"."""
    text = [f"{src:.0f} + {tgt:.0f}" if src == src and tgt == tgt else ""
            for src, tgt in zip(table["real_src_tokens_per_step"], table["real_tgt_tokens_per_step"])]
    table.insert(table.columns.get_loc("steps"), TOKENS_COLUMN, text)
    return table


def with_run_text(table, runs, column: str, at: int | None = None):
    """A text column of the runs on each preset's row: the runs' text where the seeds agree, else each seed's
    ("seed 1: ...; seed 2: ..."); at the end, or at position ``at``."""
    texts = {preset: group[column].iloc[0] if group[column].nunique() == 1 else
             "; ".join(f"seed {seed}: {text}" for seed, text in zip(group["seed"], group[column]))
             for preset, group in runs.groupby("preset", sort=False)}
    table.insert(len(table.columns) if at is None else at, column, table["preset"].map(texts))
    return table


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


def bootstrap_against_base(runs, files: dict, dev_references: Path, base: str,
                           n_samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED):
    """Paired bootstrap of every preset's dev translations against the base preset's (detokenized BLEU).

    Each seed's translations are paired with the base's of the same seed, segment by segment, and
    the seeds are pooled into one test (with one seed this is exactly sacreBLEU's test). Returns one
    row per preset: the p-value (empty for the base itself) and the bootstrap mean BLEU with its 95%
    confidence half-width. `files` maps (preset, seed) to its RunFiles (``collect_runs``).
    """
    import pandas as pd

    from aiayn.score import paired_bootstrap

    if dev_references is None:
        raise UserError("the paired bootstrap needs the dev references (--dev-references), "
                        "or pass --bootstrap-samples 0 to skip the test")
    references = read_lines(dev_references)

    def translations(preset: str, run_seed: int) -> list[str]:
        path = files[(preset, run_seed)].dev_translations
        if path is None or not Path(path).exists():
            shown = path if path is not None else f"the dev translations of {preset} seed {run_seed}"
            raise UserError(f"{shown}: missing; the paired bootstrap needs every run's dev translations "
                            "(run the decode stage first, or pass --bootstrap-samples 0 to skip the test)")
        return read_lines(path)

    base_seeds = set(runs.loc[runs["preset"] == base, "seed"])
    columns = ["preset", "bootstrap_p_vs_base", "dev_sacrebleu_bootstrap_mean", "dev_sacrebleu_bootstrap_ci95"]
    rows = []
    for preset in dict.fromkeys(runs["preset"]):
        seeds = sorted(set(runs.loc[runs["preset"] == preset, "seed"]) & base_seeds)
        if not seeds:
            rows.append({"preset": preset})
            continue
        system = [line for run_seed in seeds for line in translations(preset, run_seed)]
        baseline = [line for run_seed in seeds for line in translations(base, run_seed)]
        result = paired_bootstrap(baseline, system, references * len(seeds), n_samples=n_samples, seed=seed)
        rows.append({
            "preset": preset,
            "bootstrap_p_vs_base": math.nan if preset == base else result["p_value"],
            "dev_sacrebleu_bootstrap_mean": result["system_mean"],
            "dev_sacrebleu_bootstrap_ci95": result["system_ci"],
        })
    return pd.DataFrame(rows, columns=columns)


def dev_perplexity_curves(files: dict) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """preset -> seed -> [(step, dev perplexity)], from final.json's dev_history, else the metrics.jsonl
    beside it. `files` maps (preset, seed) to its RunFiles."""
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for (preset, run_seed), run in files.items():
        history = _read_json(run.final).get("dev_history") or []
        points = {int(entry["step"]): float(entry["dev_ppl"]) for entry in history if "dev_ppl" in entry}
        metrics = run.run_dir / METRICS
        if not points and metrics.exists():
            # A resumed job appends to metrics.jsonl, so a step can appear twice: the last record wins.
            for line in metrics.read_text(encoding="utf-8").splitlines():
                record = json.loads(line) if line.strip() else {}
                if "dev_ppl" in record:
                    points[int(record["step"])] = float(record["dev_ppl"])
        curves.setdefault(preset, {})[int(run_seed)] = sorted(points.items())
    return curves


def markdown_columns(table):
    """The columns a reader of the .md gets, and the names of those left out.

    The two token columns are shown as one (``TOKENS_COLUMN``), and a column empty in every row goes: the
    paper's numbers (and their differences) for presets the paper has no row for, as every demo preset,
    and the GPU cost of a run on a CPU. The .csv keeps every column, so that its layout never changes;
    the paper config's tables keep their paper columns, which have numbers.
    """
    import pandas as pd

    shown = table.drop(columns=[c for c in table.columns if c.startswith(("real_src_tokens", "real_tgt_tokens"))])
    empty = [column for column in shown.columns
             if shown[column].map(lambda value: pd.isna(value) or value == "").all()]
    return shown.drop(columns=empty), empty


def table_notes(signature: str, base: str, bootstrap_samples: int) -> str:
    """The notes under a table; ``bootstrap_samples`` 0 for a table without the bootstrap's columns."""
    notes = (f"\n\nBLEU: `*_bleu_tok` is tokenized BLEU computed as the paper's script did (Moses tokenizer, "
             f"compound splitting); `*_sacrebleu` is detokenized sacreBLEU ({signature}).\n"
             "\n`*_length_ratio`: hypothesis length over reference length in sacreBLEU's tokens (below 1, "
             "the brevity penalty lowers BLEU).\n"
             f"\n`{TOKENS_COLUMN}`: the mean real (non-pad) source and target tokens of one optimizer step "
             "(the paper: about 25000 + 25000). Training cost: `paper_train_flops` is the paper's GPU-hours x "
             "9.5 TFLOPS (P100); `train_cost_gpu_hours_x_peak` is ours counted the same way, GPU-hours x the "
             "device's dense peak for the run's precision (empty on a CPU); `train_flops_analytic` counts the model's "
             "multiply-adds (x2, x3 for the backward pass) of every step.\n")
    notes += ("\nLast vs averaged (Table 3): `dev_ppl_last` and `dev_ppl_averaged` are the dev perplexities of the "
              "last checkpoint and of the averaged model, measured side by side by the average stage (`average.json`, "
              "which also says whether the average is worse by more than noise); `averaged_steps` are the steps it "
              "averaged. `reported_model` (both tables) is the model Table 2 decodes and export writes: the average, "
              "or the last checkpoint where the average was worse on dev by more than noise (`average.choose: dev`, "
              "the default; `paper` keeps the average); the choice reads dev only. Table 3's dev BLEU and "
              "perplexity are the last checkpoint's, as the paper's.\n")
    if bootstrap_samples:
        notes += (f"\n`bootstrap_p_vs_base`: sacreBLEU's paired bootstrap ({bootstrap_samples} resamples, seed "
                  f"{BOOTSTRAP_SEED}) of detokenized dev BLEU against `{base}`, each seed paired with the base's "
                  f"of the same seed and the seeds pooled (empty for `{base}` itself); "
                  "`dev_sacrebleu_bootstrap_mean` and `_ci95` are the bootstrap mean and 95% confidence half-width.\n")
    return notes
