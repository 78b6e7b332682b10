"""Each deliberate difference from the paper, measured against the paper's choice on real data: test BLEU of
models trained or decoded both ways, with the seed spread and sacreBLEU's paired bootstrap beside it.

Subcommands (each writes its decodes and a JSON file under ``--out``, and prints a Markdown table; a decode
already written is reused, so a stopped measurement goes on):

- ``arms``: runs trained with each choice (``--arm NAME=RUN_DIR,...``, the first arm the baseline, the same
  seeds in the same order in each). Each run's model is the average of its last ``--last`` checkpoints,
  ``--every`` steps apart, counted back from its last step, decoded with the paper's search. Per arm: test
  sacreBLEU of each seed, mean, range; against the baseline: the mean difference, and per seed the paired
  bootstrap's p (the same seed's baseline model).
- ``eos``: the same models decoded with each ``decode.eos_candidates`` rule (fairseq's top beam, the
  default, against tensor2tensor's every candidate).
- ``cadence``: the same runs' models averaged from checkpoints picked by the step cadence (every ``--every``
  steps back from the last) and by a clock (the paper's checkpoints every 10 minutes: here the last
  checkpoint and those first written after each multiple of ``--every / last step`` of the run's wall clock
  from its start). The runs must have kept checkpoints at a finer step than ``--every``.
- ``reference``: tokenized BLEU of the hypotheses with the reference through the same steps (this project's
  ``bleu_tok``) and through Moses tokenisation alone, without replace-unicode-punctuation (tensor2tensor's
  ``get_ende_bleu.sh`` scores against a reference tokenised beforehand).
- ``pieces``: BPE pieces per word of a text, and dev perplexity per piece and per word of each run.
- ``smoothing``: how far tensor2tensor's label smoothing (eps / (V - 1) to the other tokens) moves the training
  signal from this project's (eps / V to every token): on a trained model and the dev split's first batch, the
  relative distance between the two gradients, beside the distance between two dropout draws of the same
  batch (the noise every step has anyway).

From the repository root, for example (the commands of BENCHMARKS.md, "The deviations, measured")::

    python -m bench.faithful.deviations arms --out faithful --spm-model SPM --source TEST_SRC --ref TEST_REF \\
        --arm fp32=runs/fp32/seed1,runs/fp32/seed2,runs/fp32/seed3 --arm buckets=runs/buckets/seed1,...
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

import torch

from aiayn.average import average_checkpoints
from aiayn.bpe import load_processor
from aiayn.checkpoint import list_checkpoints, load_model, save_model
from aiayn.decode import hypothesis_text, translate
from aiayn.reading import read_lines
from aiayn.score import paired_bootstrap, score, split_compounds
from aiayn.search import SearchConfig
from aiayn.speed.incremental import InferenceModel
from aiayn.writing import write_lines_atomic


def checkpoints(run: Path) -> dict[int, Path]:
    """step -> window checkpoint of a run folder (its ``checkpoints/`` or the folder itself)."""
    folder = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    found = dict(list_checkpoints(folder))
    if not found:
        raise SystemExit(f"{folder}: no step_*.pt checkpoints")
    return found


def step_picks(steps: list[int], every: int, last: int) -> list[int]:
    """The step cadence: the last step and every ``every`` steps back from it, ``last`` of them."""
    end = max(steps)
    picks = [end - k * every for k in range(last)]
    missing = [step for step in picks if step not in steps]
    if missing:
        raise SystemExit(f"no checkpoint at steps {missing}: the run kept {sorted(steps)[:3]}...")
    return sorted(picks)


def clock_picks(walls: dict[int, float], every: int, last: int) -> list[int]:
    """A clock cadence of the same nominal spacing: a checkpoint at the end, and the first one written
    after each multiple of interval = wall(end) * every / end_step from the start, the last ``last - 1``."""
    end = max(walls)
    interval = walls[end] * every / end
    marks = [k * interval for k in range(1, math.ceil(walls[end] / interval))]
    timed = []
    for mark in marks:
        after = [step for step in sorted(walls) if walls[step] >= mark and step != end]
        if after:
            timed.append(after[0])
    return sorted(set(timed[-(last - 1):] + [end]))


def wall_seconds(path: Path) -> float:
    """The run's wall clock (steps, dev evaluations, checkpoints) when the checkpoint was written."""
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return float(checkpoint["progress"]["wall_seconds"])


def averaged_model(run: Path, picks: list[int], out_dir: Path) -> Path:
    """The average of the run's checkpoints at ``picks``, written once under ``out_dir`` (named by the run's
    path and the steps, so that every measurement of the same average shares one file and its decodes)."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", str(run.resolve())).strip("_") + "_" + "-".join(map(str, picks))
    out = out_dir / "models" / f"{name}.pt"
    if not out.exists():
        found = checkpoints(run)
        out.parent.mkdir(parents=True, exist_ok=True)
        save_model(average_checkpoints([found[step] for step in picks]), out)
    return out


def decode(model_path: Path, spm_model: Path, sentences: list[str], search: SearchConfig, out_dir: Path) -> list[str]:
    """Translations of ``sentences`` by the model, written once under ``out_dir`` (named by the model and the
    EOS rule, the one search setting these measurements vary) and read back where they exist."""
    out = out_dir / "decodes" / f"{model_path.stem}_{search.eos_candidates}.txt"
    if out.exists():
        return read_lines(out)
    processor = load_processor(spm_model)
    model = InferenceModel(load_model(model_path, "cpu", spm_model=spm_model))
    hypotheses = translate(model, processor, sentences, search, tokens_per_batch=6000, progress=False, workers=1)
    lines = [hypothesis_text(processor, best[0]) for best in hypotheses]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(out, lines)
    return lines


def parse_arms(values: list[str]) -> dict[str, list[Path]]:
    arms = {}
    for value in values:
        name, _, runs = value.partition("=")
        if not runs:
            raise SystemExit(f"--arm {value!r}: NAME=RUN_DIR[,RUN_DIR...]")
        arms[name] = [Path(run) for run in runs.split(",")]
    if len({len(runs) for runs in arms.values()}) > 1:
        raise SystemExit("every --arm needs the same number of runs (the same seeds, in the same order)")
    return arms


def compare(name: str, variants: dict[str, list[list[str]]], refs: list[str], lang: str, samples: int) -> dict:
    """Per variant: each seed's sacreBLEU and bleu_tok, mean and range; against the first variant the mean
    difference and each seed's paired-bootstrap p."""
    base_name = next(iter(variants))
    table = {}
    for variant, seeds in variants.items():
        scores = [score(hyps, refs, lang) for hyps in seeds]
        row = {"sacrebleu": [s["sacrebleu"] for s in scores], "bleu_tok": [s["bleu_tok"] for s in scores]}
        if variant != base_name:
            row["p"] = [paired_bootstrap(base, hyps, refs, n_samples=samples)["p_value"]
                        for base, hyps in zip(variants[base_name], seeds)]
            row["changed_lines"] = [sum(a != b for a, b in zip(base, hyps))
                                    for base, hyps in zip(variants[base_name], seeds)]
        table[variant] = row
    return {"measure": name, "baseline": base_name, "variants": table}


def print_table(result: dict) -> None:
    base = result["variants"][result["baseline"]]
    print(f"\n{result['measure']}: test sacreBLEU per seed, mean [range]; bleu_tok mean; against "
          f"{result['baseline']}: mean difference, paired bootstrap p per seed")
    print("| variant | sacreBLEU per seed | mean [range] | bleu_tok mean | difference | p per seed | outputs changed |")
    print("|---|---|---|---|---|---|---|")
    for variant, row in result["variants"].items():
        values = row["sacrebleu"]
        difference = statistics.mean(values) - statistics.mean(base["sacrebleu"])
        p = " / ".join(f"{p:.3f}" for p in row.get("p", [])) or "-"
        print(f"| {variant} | {' / '.join(f'{v:.2f}' for v in values)} | {statistics.mean(values):.2f} "
              f"[{min(values):.2f}, {max(values):.2f}] | {statistics.mean(row['bleu_tok']):.2f} | "
              f"{difference:+.2f} | {p} | {' / '.join(map(str, row.get('changed_lines', []))) or '-'} |")


def run_arms(args: argparse.Namespace) -> dict:
    arms = parse_arms(args.arm)
    sentences, refs = read_lines(args.source), read_lines(args.ref)
    variants = {}
    for name, runs in arms.items():
        variants[name] = []
        for run in runs:
            picks = step_picks(list(checkpoints(run)), args.every, args.last)
            model = averaged_model(run, picks, args.out)
            variants[name].append(decode(model, args.spm_model, sentences, SearchConfig(), args.out))
    return compare("training choices", variants, refs, args.lang, args.samples)


def run_eos(args: argparse.Namespace) -> dict:
    sentences, refs = read_lines(args.source), read_lines(args.ref)
    variants: dict[str, list[list[str]]] = {"top_beam": [], "all": []}
    for run in args.runs:
        picks = step_picks(list(checkpoints(run)), args.every, args.last)
        model = averaged_model(run, picks, args.out)
        for rule in variants:
            variants[rule].append(decode(model, args.spm_model, sentences, SearchConfig(eos_candidates=rule),
                                         args.out))
    return compare("EOS candidates (decode.eos_candidates)", variants, refs, args.lang, args.samples)


def run_cadence(args: argparse.Namespace) -> dict:
    sentences, refs = read_lines(args.source), read_lines(args.ref)
    variants: dict[str, list[list[str]]] = {"steps": [], "clock": []}
    picked = []
    for run in args.runs:
        found = checkpoints(run)
        walls = {step: wall_seconds(path) for step, path in sorted(found.items())}
        picks = {"steps": step_picks(list(found), args.every, args.last), "clock": clock_picks(walls, args.every,
                                                                                               args.last)}
        picked.append({cadence: steps for cadence, steps in picks.items()})
        for cadence, steps in picks.items():
            model = averaged_model(run, steps, args.out)
            variants[cadence].append(decode(model, args.spm_model, sentences, SearchConfig(), args.out))
        print(f"{run}: step cadence {picks['steps']}, clock cadence {picks['clock']}", file=sys.stderr)
    result = compare("checkpoint cadence", variants, refs, args.lang, args.samples)
    result["picked"] = picked
    return result


def run_reference(args: argparse.Namespace) -> dict:
    """bleu_tok as this project computes it (both sides normalised, tokenised, split) and as t2t's script
    does (the reference tokenised and split, not normalised)."""
    from sacrebleu.metrics import BLEU
    from sacremoses import MosesTokenizer

    from aiayn.score import t2t_tokenize

    refs = read_lines(args.ref)
    tokenizer = MosesTokenizer(args.lang)
    t2t_refs = [split_compounds(tokenizer.tokenize(line, return_str=True, escape=True)) for line in refs]
    ours_refs = t2t_tokenize(refs, args.lang)
    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    rows = []
    for hyp_path in args.hyp:
        hyps = t2t_tokenize(read_lines(hyp_path), args.lang)
        rows.append({"hyp": str(hyp_path), "same_steps": bleu.corpus_score(hyps, [ours_refs]).score,
                     "reference_tokenised_only": bleu.corpus_score(hyps, [t2t_refs]).score})
    changed = sum(a != b for a, b in zip(ours_refs, t2t_refs))
    print(f"\nreference side: {changed} of {len(refs)} reference lines differ between the two methods")
    print("| hypotheses | both sides the same steps (ours) | reference tokenised only (t2t) | difference |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['hyp']} | {row['same_steps']:.2f} | {row['reference_tokenised_only']:.2f} | "
              f"{row['reference_tokenised_only'] - row['same_steps']:+.2f} |")
    return {"measure": "reference side", "reference_lines_changed": changed, "lines": len(refs), "rows": rows}


def run_pieces(args: argparse.Namespace) -> dict:
    """Pieces per word of ``--text`` under ``--spm-model``; each run's final dev perplexity per piece and
    per word (exp of the same summed NLL over words instead of pieces, the EOS counted as a piece)."""
    processor = load_processor(args.spm_model)
    lines = read_lines(args.text)
    pieces = sum(len(ids) + 1 for ids in processor.encode(lines))  # + EOS, as the dev perplexity counts it
    words = sum(len(line.split()) + 1 for line in lines)
    rows = []
    for final in args.final:
        summary = json.loads(final.read_text())
        nll = summary["dev_nll"]
        rows.append({"run": str(final), "dev_ppl_per_piece": math.exp(nll),
                     "dev_ppl_per_word": math.exp(nll * pieces / words)})
    print(f"\n{args.text}: {pieces} pieces, {words} words (EOS counted in both): {pieces / words:.3f} pieces a word")
    for row in rows:
        print(f"{row['run']}: dev perplexity {row['dev_ppl_per_piece']:.2f} per piece, "
              f"{row['dev_ppl_per_word']:.2f} per word")
    return {"measure": "pieces", "pieces": pieces, "words": words, "rows": rows}


def run_smoothing(args: argparse.Namespace) -> dict:
    from aiayn.batching import collate, length_batches
    from aiayn.binarize import load_split
    from aiayn.loss import teacher_forced_loss

    model = load_model(args.model, "cpu")
    split = load_split(args.dev_data)
    rows = length_batches(split.src_lengths, split.tgt_lengths, args.tokens)[0]
    batch = collate(split, rows)
    vocab = model.embedding.weight.shape[0]

    def gradient(epsilon: float, train: bool, seed: int) -> torch.Tensor:
        model.train(train)
        model.zero_grad()
        torch.manual_seed(seed)
        loss, _ = teacher_forced_loss(model, batch.src, batch.tgt_in, batch.tgt_out, epsilon, tgt_real=batch.tgt_real)
        loss.backward()
        return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    t2t_epsilon = args.epsilon * vocab / (vocab - 1)
    result = {"measure": "label smoothing", "vocab": vocab, "epsilon": args.epsilon, "t2t_epsilon": t2t_epsilon,
              "target_tokens": batch.tgt_tokens,
              "forms_no_dropout": distance(gradient(t2t_epsilon, False, 1), gradient(args.epsilon, False, 1)),
              "forms_same_dropout": distance(gradient(t2t_epsilon, True, 1), gradient(args.epsilon, True, 1)),
              "two_dropout_draws": distance(gradient(args.epsilon, True, 2), gradient(args.epsilon, True, 1))}
    print(f"\nlabel smoothing on {batch.tgt_tokens} target tokens, V = {vocab}: eps {args.epsilon} against "
          f"tensor2tensor's form (eps {t2t_epsilon:.10f} in torch's): gradients' relative distance "
          f"{result['forms_no_dropout']:.2e} without dropout, {result['forms_same_dropout']:.2e} with the same "
          f"dropout; two dropout draws of the same batch: {result['two_dropout_draws']:.2e}")
    return result


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.faithful.deviations", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("arms", "eos", "cadence"):
        sub = commands.add_parser(name)
        if name == "arms":
            sub.add_argument("--arm", action="append", required=True, metavar="NAME=RUN_DIR,...")
        else:
            sub.add_argument("runs", nargs="+", type=Path, help="run folders (their checkpoints/)")
        sub.add_argument("--spm-model", type=Path, required=True)
        sub.add_argument("--source", type=Path, required=True, help="test source text")
        sub.add_argument("--every", type=int, default=50, help="the preset's checkpoint_steps")
        sub.add_argument("--last", type=int, default=5, help="the preset's average_last")
        sub.add_argument("--samples", type=int, default=1000, help="paired bootstrap resamples")
    sub = commands.add_parser("reference")
    sub.add_argument("--hyp", type=Path, nargs="+", required=True, help="detokenized hypotheses")
    sub = commands.add_parser("pieces")
    sub.add_argument("--spm-model", type=Path, required=True)
    sub.add_argument("--text", type=Path, required=True, help="the dev target text")
    sub.add_argument("final", nargs="+", type=Path, help="final.json of each run")
    sub = commands.add_parser("smoothing")
    sub.add_argument("--model", type=Path, required=True, help="a trained model or checkpoint")
    sub.add_argument("--dev-data", type=Path, required=True, help="the binarized dev split (results/.../bin/dev)")
    sub.add_argument("--epsilon", type=float, default=0.1)
    sub.add_argument("--tokens", type=int, default=4000, help="the batch's tokens per side")
    for sub in commands.choices.values():
        if sub.prog.split()[-1] not in ("pieces", "smoothing"):
            sub.add_argument("--ref", type=Path, required=True, help="test reference text")
            sub.add_argument("--lang", default="de", help="target language")
        sub.add_argument("--out", type=Path, required=True, help="folder for decodes, models and JSON")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    torch.set_num_threads(1)
    result = {"arms": run_arms, "eos": run_eos, "cadence": run_cadence, "reference": run_reference,
              "pieces": run_pieces, "smoothing": run_smoothing}[args.command](args)
    if "variants" in result:
        print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.command}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
