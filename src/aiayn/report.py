"""The report stage: our numbers beside the paper's, as Table 2 (test) and Table 3 (dev), and pictures.

Table 2: newstest2014 BLEU of the averaged model (or of the last checkpoint, where the average stage found
the average worse on dev: ``reported_model`` says which), training cost (counted the paper's way, GPU-hours
times a rate, beside our analytic FLOPs). Table 3: dev perplexity and dev BLEU of the last checkpoint
without averaging, parameter count, a paired bootstrap test (sacreBLEU's, Koehn 2004) of each row's dev
translations against the base model's, and "last vs averaged": the dev perplexity of the last checkpoint
and of the averaged model, the steps averaged and the model reported (the average stage's ``average.json``).
Several seeds of a preset are summarised as mean and standard deviation.

Pictures (PNG): dev perplexity against step for every preset, each preset's runs over its reference's
seed band (aiayn.reference), Table 3's BLEU as bars beside the paper's, and, given the base model and vocabulary, the attention heatmaps of the paper's appendix
(aiayn.appendix_figures) and the attention explorer's page of the same model (aiayn.explore). Tables,
pictures and page are logged as artifacts of the base model's MLflow run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from aiayn.errors import UserError, cli
from aiayn.layout import ATTENTION_EXPLORER, DEV_PPL_FIGURE, TABLE3_BLEU_FIGURE, TABLES
from aiayn.report_tables import (BOOTSTRAP_SAMPLES, RunFiles, base_preset, bootstrap_against_base, collect_runs,
                                 dev_perplexity_curves, markdown_columns, summarise, table_notes, with_run_text,
                                 with_tokens_column)
from aiayn.writing import atomic_path, refuse_overwriting_inputs, write_text_atomic

if TYPE_CHECKING:
    from aiayn.decode import DecodeSettings


def build_report(presets: dict, run_files: Sequence[RunFiles], out_dir: str | Path, *,
                 dev_references: str | Path | None = None, bootstrap_samples: int = BOOTSTRAP_SAMPLES,
                 base: str | None = None, figures: bool = True, reference: str = "auto") -> dict:
    """Write table2/table3 (.csv, .md) and, with ``figures``, dev_ppl.png, table3_bleu.png and each preset's
    runs over its reference's band (``reference``: train.reference), from the given runs' files (``RunFiles``);
    the bootstrap also reads the dev references."""
    if bootstrap_samples < 0:
        raise UserError(f"--bootstrap-samples {bootstrap_samples}: give a number of resamples, "
                        "or 0 to skip the test")
    base = base or base_preset(presets)
    if base not in presets:
        raise UserError(f"--base {base}: not one of the reported presets ({', '.join(presets)})")
    runs, files = collect_runs(presets, run_files)
    table2, table3 = _tables(runs)
    if bootstrap_samples:
        bootstrap = bootstrap_against_base(runs, files, dev_references and Path(dev_references), base,
                                           bootstrap_samples)
        table3 = table3.merge(bootstrap, on="preset", how="left")
    out_dir = Path(out_dir)
    written = _write_tables(table2, table3, out_dir, runs["sacrebleu_signature"].iloc[0], base, bootstrap_samples)
    if figures:
        written += _draw_figures(table3, files, reference, out_dir)
    return {"table2": table2, "table3": table3, "runs": runs, "run_files": files, "base": base,
            "files": written}


def _tables(runs):
    """(Table 2, Table 3) of the runs, each row a preset beside the paper's figures."""
    tokens = ["real_src_tokens_per_step", "real_tgt_tokens_per_step"]
    table2 = with_run_text(with_tokens_column(summarise(
        runs, ["test_bleu_tok", "test_sacrebleu", "test_length_ratio", "test_chrf", *tokens, "steps", "train_hours",
               "train_flops_analytic", "train_cost_gpu_hours_x_peak"],
        {"test_bleu_tok": "paper_bleu_test", "train_cost_gpu_hours_x_peak": "paper_train_flops"})),
        runs, "reported_model", at=3)
    table3 = with_tokens_column(summarise(
        runs, ["dev_ppl", "dev_bleu_tok", "dev_sacrebleu", "dev_length_ratio", "params", *tokens, "steps", "train_hours",
               "dev_ppl_last", "dev_ppl_averaged"],
        {"dev_ppl": "paper_ppl_dev", "dev_bleu_tok": "paper_bleu_dev", "params": "paper_params"}))
    table3 = with_run_text(with_run_text(table3, runs, "averaged_steps"), runs, "reported_model")
    return table2, table3


def _write_tables(table2, table3, out_dir: Path, signature: str, base: str, bootstrap_samples: int) -> list[Path]:
    """Each table as .csv (every column) and .md (the columns with a value, and the notes); the files written."""
    written = []
    for name, table, title in zip(TABLES, (table2, table3), (
        "Table 2: the test split (newstest2014 in the paper), averaged checkpoints (or the last, where worse on dev)",
        "Table 3: the dev split (newstest2013 in the paper), no averaging",
    )):
        with atomic_path(out_dir / f"{name}.csv") as tmp:
            table.to_csv(tmp, index=False)
        shown, left_out = markdown_columns(table)
        if "bootstrap_p_vs_base" in shown:  # the base against itself: an empty cell, not nan
            shown = shown.astype({"bootstrap_p_vs_base": object})
            shown.loc[shown["preset"] == base, "bootstrap_p_vs_base"] = None
        markdown = shown.to_markdown(index=False, floatfmt=".4g")
        notes = table_notes(signature, base, bootstrap_samples if "bootstrap_p_vs_base" in table else 0)
        left_out_note = (f"\nLeft out here, empty in every row (`{name}.csv` keeps them): "
                         f"{', '.join(f'`{column}`' for column in left_out)}.\n" if left_out else "")
        write_text_atomic(out_dir / f"{name}.md", f"# {title}\n\n{markdown}{notes}{left_out_note}")
        written += [out_dir / f"{name}.csv", out_dir / f"{name}.md"]
    return written


def _draw_figures(table3, files: dict, reference: str, out_dir: Path) -> list[Path]:
    """dev_ppl.png, each preset's runs over its reference's band, and table3_bleu.png; the files written."""
    from aiayn import plots
    from aiayn.reference import band_figures

    written = [plots.plot_dev_perplexity(dev_perplexity_curves(files), out_dir / DEV_PPL_FIGURE)]
    written += band_figures({key: run.final for key, run in files.items()}, reference, out_dir)
    std = table3["dev_bleu_tok_std"] if "dev_bleu_tok_std" in table3 else None
    labels = [preset if row == preset else f"{preset}\n({row})"
              for preset, row in zip(table3["preset"], table3["row"])]
    written.append(plots.plot_table3_bleu(labels, table3["dev_bleu_tok"], std,
                                        table3["paper_bleu_dev"], out_dir / TABLE3_BLEU_FIGURE,
                                        ylabel="dev BLEU (tokenized, as the paper's)"))
    return written


def base_run_file(report: dict) -> Path | None:
    """final.json of the base preset's first reported run: the MLflow run the report is logged into."""
    seeds = report["runs"].loc[report["runs"]["preset"] == report["base"], "seed"]
    return report["run_files"][(report["base"], seeds.iloc[0])].final if len(seeds) else None


def run_files_from_arguments(args: argparse.Namespace) -> list[RunFiles]:
    """--runs, --dev-scores, --test-scores (and --dev-translations): one file per run, in the same order."""
    lists = {"--dev-scores": args.dev_scores, "--test-scores": args.test_scores}
    if args.dev_translations is not None:
        lists["--dev-translations"] = args.dev_translations
    if args.averages is not None:
        lists["--averages"] = args.averages
    for option, paths in lists.items():
        if len(paths) != len(args.runs):
            raise UserError(f"{option} names {len(paths)} files but --runs names {len(args.runs)}; give one per "
                            "run, in the order of --runs")
    translations = args.dev_translations or [None] * len(args.runs)
    averages = args.averages or [None] * len(args.runs)
    return [RunFiles(final, dev, test, translated, average) for final, dev, test, translated, average
            in zip(args.runs, args.dev_scores, args.test_scores, translations, averages)]


def attention_explorer(args: argparse.Namespace, search: DecodeSettings) -> Path:
    """The attention explorer's page of --attention-model (aiayn.explore), on the paper's two sentences and the
    first of --explorer-dev (those first where the vocabulary cannot read the paper's), translated with the
    decode stage's ``search``."""
    from aiayn.explore import default_sentences, write_explorer

    sentences = default_sentences(args.explorer_dev, vocabulary=args.spm_model)
    written = write_explorer(args.attention_model, args.spm_model, sentences, Path(args.out_dir) / ATTENTION_EXPLORER,
                             search)
    return written["path"]


@dataclass(frozen=True)
class ReportSettings:
    """What the stage reads of a config, built once: the reported presets, the explorer's search, the
    reference each preset's runs are drawn over, and where the report is tracked."""

    presets: dict  # resolved, by name, in the order of `models` (the tables' order)
    decode: DecodeSettings  # the explorer's translations are searched as the decode stage's
    reference: str  # train.reference
    tracking_uri: str

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ReportSettings:
        """Through the door: --config's files, --tracking-uri winning."""
        from aiayn.config import config_from_arguments, resolve_presets
        from aiayn.decode import DecodeSettings

        config = config_from_arguments(args, {"tracking_uri": ("--tracking-uri", "tracking_uri")})
        return cls(presets=resolve_presets(config, args.config), decode=DecodeSettings.from_section(config["decode"]),
                   reference=config["train"]["reference"], tracking_uri=config["tracking_uri"])


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn report", description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", metavar="FILE", required=True,
                        help="config files (merged in order, validated once): their models' presets, their decode "
                             "section (the explorer's search), train.reference and tracking_uri")
    parser.add_argument("--runs", type=Path, nargs="+", required=True,
                        help="each run's final.json (the train stage's output)")
    parser.add_argument("--dev-scores", type=Path, nargs="+", required=True,
                        help="each run's dev score JSON, in the order of --runs")
    parser.add_argument("--test-scores", type=Path, nargs="+", required=True,
                        help="each run's test score JSON, in the order of --runs")
    parser.add_argument("--dev-translations", type=Path, nargs="+",
                        help="each run's dev translations, in the order of --runs (for the paired bootstrap)")
    parser.add_argument("--averages", type=Path, nargs="+",
                        help="each run's average.json (the average stage's), in the order of --runs: Table 3's "
                             "last vs averaged")
    parser.add_argument("--dev-references", type=Path, help="the dev split's references (for the paired bootstrap)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--base", help="preset the others are tested against (default: paper.row base, else the first)")
    parser.add_argument("--bootstrap-samples", type=int, default=BOOTSTRAP_SAMPLES,
                        help=f"paired bootstrap resamples (default: {BOOTSTRAP_SAMPLES}; 0 skips the test)")
    parser.add_argument("--no-figures", action="store_true", help="tables only")
    parser.add_argument("--attention-model", type=Path,
                        help="the base model (model.pt or final.pt): draw the appendix's attention heatmaps")
    parser.add_argument("--spm-model", type=Path, help="the vocabulary of --attention-model")
    parser.add_argument("--explorer-dev", type=Path,
                        help="dev source text: its first sentences join the paper's two on the attention explorer's page")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: tracking_uri's; MLFLOW_TRACKING_URI "
                                               "wins)")
    parser.add_argument("--no-tracking", action="store_true", help="do not log the report to MLflow")
    return parser


def _refuse_overwriting_inputs(args: argparse.Namespace) -> None:
    """None of the files the report writes into --out-dir may be one it reads."""
    refuse_overwriting_inputs(
        {"--out-dir": [Path(args.out_dir) / name for name in ("table2.csv", "table2.md", "table3.csv", "table3.md",
                       "dev_ppl.png", "table3_bleu.png", "attention_long_distance.png", "attention_anaphora.png",
                       ATTENTION_EXPLORER)]},
        {"--runs": args.runs, "--dev-scores": args.dev_scores, "--test-scores": args.test_scores,
         "--dev-translations": args.dev_translations, "--dev-references": args.dev_references,
         "--averages": args.averages,
         "--attention-model": args.attention_model, "--spm-model": args.spm_model, "--explorer-dev": args.explorer_dev,
         "--config": args.config})


def _log_report(report: dict, files: list[Path], tracking_uri: str) -> None:
    """The report's files as artifacts of the base preset's run; a warning, not a failure, where that cannot be."""
    run_file = base_run_file(report)
    if run_file is None:
        print(f"warning: no run of the base preset {report['base']} to log the report into", file=sys.stderr)
        return
    from aiayn.tracking import log_to_existing_run

    try:
        log_to_existing_run(run_file, tracking_uri, metrics={}, artifacts=files, artifact_path="report")
    except Exception as error:  # the tables and pictures are written; a store that went away must not undo them
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"warning: the report was not logged to MLflow ({reason})", file=sys.stderr)


@cli
def main(argv=None):
    args = arguments().parse_args(argv)
    settings = ReportSettings.from_arguments(args)
    _refuse_overwriting_inputs(args)
    if args.attention_model is not None and args.spm_model is None:
        raise UserError("--attention-model needs --spm-model, the vocabulary the model was trained with")
    report = build_report(settings.presets, run_files_from_arguments(args), args.out_dir,
                          dev_references=args.dev_references, bootstrap_samples=args.bootstrap_samples, base=args.base,
                          figures=not args.no_figures, reference=settings.reference)
    files = report["files"]
    if args.attention_model is not None and not args.no_figures:
        from aiayn.appendix_figures import appendix_figures

        drawn = appendix_figures(args.attention_model, args.spm_model, args.out_dir)
        files += [drawn["long_distance"], drawn["anaphora"]]
        files.append(attention_explorer(args, settings.decode))
    if not args.no_tracking:
        _log_report(report, files, settings.tracking_uri)
    print(report["table3"].to_string(index=False))
    print()
    print(report["table2"].to_string(index=False))


if __name__ == "__main__":
    raise SystemExit(main())
