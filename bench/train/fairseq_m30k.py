"""Learning-curve parity with fairseq on Multi30k: the same model, schedule, batch size and seed, dev perplexity at fixed steps.

Ours runs as the workflow runs it (snakemake: BPE, binarise, train with config/multi30k.yaml and a
preset that matches fairseq's standard small recipe); fairseq (installed in a scratch environment,
`pip install torch==2.13.0 fairseq-fixed==0.12.3.1`) trains on the same SentencePiece pieces of the
same pairs. Both: 3+3 layers, d_model 256, ffn 1024, 4 heads of 64, post-norm, all embeddings shared,
dropout 0.1 (none on attention weights or ReLU), fairseq's initialisation (``--init t2t``: ours,
tensor2tensor's, as the paper's presets), label smoothing 0.1, Adam (0.9, 0.98, 1e-9), linear
warmup over 1000 steps to 1e-3 then inverse square root (ours: the paper's formula with
lr_scale = 1e-3 * sqrt(256 * 1000)), fp32, seed 1, dev = val (1,014 sentences). Batches: fairseq's
`--max-tokens 4096`; ours `tokens_per_step` chosen to give the same target tokens a step (both printed).
Perplexity: exp of the dev NLL per target token (EOS counted), fairseq's base-2 NLL converted.

    python -m bench.train.fairseq_m30k --data ../shared/data/multi30k --fairseq-python /tmp/fsenv/bin/python

The two trainings run side by side (``--threads`` each) unless ``--one-at-a-time``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PEAK_LR, WARMUP, D_MODEL = 1e-3, 1000, 256


def our_config(data: Path, steps: int, every: int, threads: int, tokens_per_step: int, max_tokens: int,
               init: str = "fairseq") -> dict:
    """A config layered after config/multi30k.yaml: fairseq's model, initialisation and schedule as one preset."""
    split = {"train": "train", "dev": "val"}
    return {
        "experiment": "parity",
        "data": {"source": "local", "local": {
            name: {"src": str(data / f"{stem}.en"), "tgt": str(data / f"{stem}.de")} for name, stem in split.items()}
            | {"test": {"src": str(data / "val.en"), "tgt": str(data / "val.de")}}},
        "binarize": {"max_tokens": max_tokens},
        "train": {"tokens_per_step": tokens_per_step, "device_tokens": tokens_per_step, "dev_every": every,
                  "log_every": 50, "threads": threads, "precision": "fp32", "max_minutes": None},
        "seeds": [1],
        "models": ["parity"],
        "presets": {"parity": {
            "inherit": "m30k_base", "n_heads": 4, "d_head": 64, "d_value": 64, "dropout": 0.1, "init": init,
            "label_smoothing": 0.1, "steps": steps, "warmup_steps": WARMUP,
            "lr_scale": PEAK_LR * math.sqrt(D_MODEL * WARMUP), "average_last": 1, "runtime_minutes": 600,
            # a checkpoint at every dev evaluation, kept, for bench.decode.lengths to decode early models
            "checkpoint_steps": every, "keep_checkpoints": max(1, steps // every)}},
    }


def fairseq_train_args(data_bin: Path, save: Path, steps: int, every: int, max_tokens: int) -> list[str]:
    return [str(data_bin), "--arch", "transformer", "--encoder-layers", "3", "--decoder-layers", "3",
            "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
            "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
            "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings",
            "--dropout", "0.1", "--attention-dropout", "0", "--activation-dropout", "0",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9", "--clip-norm", "0",
            "--lr", str(PEAK_LR), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(WARMUP),
            "--warmup-init-lr", "0", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", str(max_tokens), "--seed", "1", "--max-update", str(steps),
            "--validate-interval-updates", str(every), "--validate-interval", "100000", "--no-save",
            "--save-dir", str(save), "--cpu", "--num-workers", "0", "--log-format", "json",
            "--log-interval", "50", "--max-source-positions", "256", "--max-target-positions", "256"]


def fairseq_curve(log: str) -> tuple[dict[int, float], float | None]:
    """{update: dev perplexity} from fairseq's JSON log (its NLL is in bits), and mean target tokens an update."""
    curve, wpb = {}, []
    for line in log.splitlines():
        found = re.search(r"\|\s*(valid|train_inner)\s*\|\s*(\{.*\})\s*$", line)
        if not found:
            continue
        stats = json.loads(found.group(2))
        if found.group(1) == "valid":
            curve[int(stats["valid_num_updates"])] = 2.0 ** float(stats["valid_nll_loss"])
        else:
            wpb.append(float(stats["wpb"]))
    return curve, (sum(wpb) / len(wpb) if wpb else None)


def our_curve(metrics: Path) -> tuple[dict[int, float], float | None]:
    """{step: dev perplexity} from our run's metrics.jsonl, and mean real target tokens a step."""
    curve, tokens = {}, []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "dev_ppl" in row:
            curve[row["step"]] = row["dev_ppl"]
        if "real_tgt_tokens_per_step" in row:
            tokens.append(row["real_tgt_tokens_per_step"])
    return curve, (sum(tokens) / len(tokens) if tokens else None)


def comparison(ours: dict[int, float], theirs: dict[int, float], at: list[int], tolerance: float) -> tuple[list[str], bool]:
    lines = ["| step | aiayn dev PPL | fairseq dev PPL | ratio | within |", "|---|---|---|---|---|"]
    holds = True
    for step in at:
        a, b = ours.get(step), theirs.get(step)
        if a is None or b is None:
            lines.append(f"| {step} | {a if a is None else f'{a:.2f}'} | {b if b is None else f'{b:.2f}'} | - | missing |")
            holds = False
            continue
        ok = a <= b * (1 + tolerance)
        holds &= ok
        lines.append(f"| {step} | {a:.2f} | {b:.2f} | {a / b:.3f} | {'yes' if ok else 'NO'} |")
    return lines, holds


def encode_pairs(spm_model: Path, data: Path, out: Path, max_tokens: int) -> dict[str, int]:
    """fairseq's text: our download stage's pairs (``data``: train and dev, trimmed and checked) as the
    pieces of our SentencePiece model, train pairs over ``max_tokens`` dropped as our binarize drops them."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(spm_model))
    counts = {}
    for stem, name in (("train", "train"), ("dev", "valid")):
        src = (data / f"{stem}.en").read_text(encoding="utf-8").splitlines()
        tgt = (data / f"{stem}.de").read_text(encoding="utf-8").splitlines()
        src_p, tgt_p = processor.encode(src, out_type=str), processor.encode(tgt, out_type=str)
        kept = [(s, t) for s, t in zip(src_p, tgt_p)
                if stem != "train" or (0 < len(s) <= max_tokens and 0 < len(t) <= max_tokens)]
        (out / f"{name}.en").write_text("".join(" ".join(s) + "\n" for s, _ in kept), encoding="utf-8")
        (out / f"{name}.de").write_text("".join(" ".join(t) + "\n" for _, t in kept), encoding="utf-8")
        counts[name] = len(kept)
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="folder with train.{en,de} and val.{en,de}")
    parser.add_argument("--fairseq-python", required=True, help="the Python of an environment with fairseq")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fairseq_m30k"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=250, help="dev perplexity every this many steps")
    parser.add_argument("--at", type=int, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--threads", type=int, default=1, help="threads of each training")
    parser.add_argument("--max-tokens", type=int, default=4096, help="fairseq's --max-tokens")
    parser.add_argument("--tokens-per-step", type=int, default=3600,
                        help="ours: padded tokens a side a step, set to give fairseq's target tokens a step")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--init", choices=("fairseq", "t2t"), default="fairseq",
                        help="our model's initialisation (fairseq's, to compare like with like; t2t: the paper presets')")
    parser.add_argument("--one-at-a-time", action="store_true")
    args = parser.parse_args(argv)
    data, work = args.data.resolve(), args.work.resolve()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    work.mkdir(parents=True, exist_ok=True)
    for name in ("Snakefile", "workflow", "config"):
        target = work / name
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, target)
    (work / "parity.yaml").write_text(yaml.safe_dump(
        our_config(data, args.steps, args.every, args.threads, args.tokens_per_step, 128, args.init), sort_keys=False))
    def snakemake(*targets: Path) -> list[str]:  # the targets first: --configfile takes every word after it
        return [sys.executable, "-m", "snakemake", *map(str, targets), "--cores", str(args.threads),
                "--configfile", "config/multi30k.yaml", "parity.yaml"]

    run = Path("results/parity")
    subprocess.run(snakemake(run / "data/stats.json", run / "bpe/spm.model", run / "bin/train", run / "bin/dev"),
                   cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)

    fs = work / "fairseq"
    shutil.rmtree(fs, ignore_errors=True)
    (fs / "text").mkdir(parents=True)
    counts = encode_pairs(work / run / "bpe/spm.model", work / run / "data", fs / "text", 128)
    subprocess.run([args.fairseq_python, "-m", "fairseq_cli.preprocess", "--source-lang", "en", "--target-lang", "de",
                    "--trainpref", str(fs / "text/train"), "--validpref", str(fs / "text/valid"),
                    "--destdir", str(fs / "bin"), "--joined-dictionary", "--workers", "1"],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    started = time.time()
    ours_cmd = snakemake(run / "train/parity/seed1/final.json")
    theirs_cmd = [args.fairseq_python, "-m", "fairseq_cli.train"] + fairseq_train_args(
        fs / "bin", fs / "save", args.steps, args.every, args.max_tokens)
    fs_log = open(fs / "train.log", "w")
    if args.one_at_a_time:
        subprocess.run(ours_cmd, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(theirs_cmd, env=env, check=True, stdout=fs_log, stderr=subprocess.STDOUT)
    else:
        procs = [subprocess.Popen(ours_cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                 subprocess.Popen(theirs_cmd, env=env, stdout=fs_log, stderr=subprocess.STDOUT)]
        for name, proc in zip(("aiayn", "fairseq"), procs):
            if proc.wait() != 0:
                print(f"error: {name}'s training failed (status {proc.returncode}); see {work}", file=sys.stderr)
                return 1
    fs_log.close()

    ours, our_tokens = our_curve(work / run / "train/parity/seed1/metrics.jsonl")
    theirs, their_tokens = fairseq_curve((fs / "train.log").read_text())
    lines, holds = comparison(ours, theirs, args.at, args.tolerance)
    print(f"Multi30k, {counts['train']} training pairs (fairseq's; ours in {work / run / 'bin/train'}), "
          f"{args.steps} steps, {args.threads} thread(s) each, our init {args.init}, {time.time() - started:.0f} s")
    print(f"target tokens a step: aiayn {our_tokens:.0f}, fairseq {their_tokens:.0f}")
    print("\n".join(lines))
    print(f"aiayn within {args.tolerance:.0%} of fairseq at steps {args.at}: {'holds' if holds else 'does NOT hold'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
