"""The parts of bench/gpu.sh that need more than a command line.

    matmul   the device's bf16 matrix-product ceiling (TFLOP/s)
    summary  what the demo DAG left: where each run trained and decoded, the MLflow runs in the sqlite
             store, then the report's tables
    ddp      the same few training steps in 1 process and in N (`aiayn train --processes N`, torchrun;
             on one GPU they share it, over gloo): each must see the same real tokens per optimizer step,
             and every process must have exited; prints how long after its final.json each run exited
    recipe   what a recipe's DAG left (the Multi30k part): each run's steps, training and wall time, tokens/s,
             MFU and shape costs, and its test (and dev) sacreBLEU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path


def matmul(args: argparse.Namespace) -> int:
    import torch

    size = args.size
    a = torch.randn(size, size, device=args.device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=args.device, dtype=torch.bfloat16)

    def drain():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        a @ b
    drain()
    start = time.perf_counter()
    for _ in range(args.repeats):
        a @ b
    drain()
    seconds = time.perf_counter() - start
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"bf16 matmul ceiling: {args.repeats * 2 * size ** 3 / seconds / 1e12:.1f} TFLOP/s "
          f"({size}x{size}x{size}, mean of {args.repeats}; {name}, torch {torch.__version__})")
    return 0


def shape_costs(final: dict) -> str:
    """What first-seen micro-batch shapes cost the run, where its final.json says (issue 45's trainer)."""
    if "distinct_shapes" not in final:
        return ""
    return (f", {final['distinct_shapes']} distinct shapes (new on {final['new_shape_steps']} steps, "
            f"{final['new_shape_seconds']:.1f} s)")


def runs(args: argparse.Namespace, results: Path, problems: list[str]) -> list[tuple[Path, dict]]:
    """One line per run's final.json; the runs."""
    print("runs (final.json):")
    found = []
    for final_path in sorted(results.glob("train/*/seed*/final.json")):
        final = json.loads(final_path.read_text())
        seconds = final["train_hours"] * 3600
        peak = final.get("device_peak_flops")
        mfu = f", MFU {final['train_flops'] / max(seconds, 1e-9) / peak:.1%}" if peak else ""
        print(f"  {final['preset']} seed {final['seed']}: {final['step']} of {final['planned_steps']} steps "
              f"(stopped by {final['stopped_by']}) on {final['device']} in {seconds:.1f} s of training "
              f"({final['wall_hours'] * 3600:.1f} s wall), {final['real_src_tokens_per_step']:.0f} + "
              f"{final['real_tgt_tokens_per_step']:.0f} real tokens a step, "
              f"{final['target_tokens'] / max(seconds, 1e-9):.0f} target tokens/s{mfu}{shape_costs(final)}, "
              f"dev ppl {final.get('dev_ppl', float('nan')):.2f}, mlflow run {final.get('mlflow_run_id')}")
        if (final["device"] == "cpu") != (args.expect_device == "cpu"):
            problems.append(f"{final_path}: trained on {final['device']}, not {args.expect_device}")
        found.append((final_path, final))
    if not found:
        problems.append(f"{results}: no run's final.json")
    return found


def decoding(args: argparse.Namespace, results: Path, problems: list[str]) -> None:
    print("decoding (last line of each log):")
    for log in sorted(results.glob("logs/decode/*/seed*/*.log")):
        lines = [line for line in log.read_text().splitlines() if line.startswith("decoded")]
        print(f"  {log.relative_to(results / 'logs' / 'decode')}: {lines[-1] if lines else '(no decoded line)'}")
        if lines and f" on {args.expect_device}" not in lines[-1]:
            problems.append(f"{log}: did not decode on {args.expect_device}")


def tracking(args: argparse.Namespace, problems: list[str]) -> None:
    database = args.workdir / "results" / "mlflow.db"
    if database.exists():
        with sqlite3.connect(database) as connection:
            rows = connection.execute(
                "SELECT e.name, r.status, COUNT(*), (SELECT COUNT(*) FROM metrics) FROM runs r "
                "JOIN experiments e ON e.experiment_id = r.experiment_id GROUP BY e.name, r.status").fetchall()
        for experiment, status, count, metrics in rows:
            print(f"mlflow ({database.name}): experiment {experiment}: {count} runs {status}, {metrics} metric rows")
    else:
        problems.append(f"{database}: no MLflow store")


def reported(problems: list[str]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def summary(args: argparse.Namespace) -> int:
    results = args.workdir / "results" / args.experiment
    problems: list[str] = []
    runs(args, results, problems)
    decoding(args, results, problems)
    tracking(args, problems)
    for table in ("table2", "table3"):
        path = results / "report" / f"{table}.md"
        print(f"== {path.relative_to(args.workdir)}")
        if path.exists():
            print(path.read_text().rstrip())
        else:
            problems.append(f"{path}: missing")
    return reported(problems)


def recipe(args: argparse.Namespace) -> int:
    """A recipe's DAG end to end: its runs, decoding, MLflow, and each run's sacreBLEU (the averaged
    model's, which the report's Table 2 gives)."""
    results = args.workdir / "results" / args.experiment
    problems: list[str] = []
    found = runs(args, results, problems)
    decoding(args, results, problems)
    tracking(args, problems)
    for final_path, final in found:
        scores = {}
        for split in ("test", "dev"):
            path = results / "score" / final["preset"] / f"seed{final['seed']}" / f"{split}.json"
            if path.exists():
                scores[split] = json.loads(path.read_text())["sacrebleu"]
            else:
                problems.append(f"{path}: missing")
        if "test" in scores:
            print(f"{args.experiment} {final['preset']} seed {final['seed']}: {final['step']} of "
                  f"{final['planned_steps']} steps in {final['train_hours'] * 3600:.1f} s of training, test sacreBLEU "
                  f"{scores['test']:.2f}" + (f" (dev {scores['dev']:.2f})" if "dev" in scores else "")
                  + " (the averaged model)")
    if not (results / "report" / "table2.md").exists():
        problems.append(f"{results / 'report' / 'table2.md'}: missing")
    return reported(problems)


def ddp(args: argparse.Namespace) -> int:
    import yaml

    from aiayn.config import load_config, resolve_preset

    workdir = args.workdir
    config = load_config([workdir / path for path in args.configs])
    results = workdir / "results" / config["experiment"]
    preset = resolve_preset(config, args.preset)
    # the preset laid out for N processes: a step is split into a multiple of N micro-batches, the same
    # micro-batches whether 1 process accumulates them or N share them
    preset.update(steps=args.steps, checkpoint_steps=args.steps, keep_checkpoints=1, gpus=args.procs)
    # the processes share the node's GPU(s) on purpose: this part checks DDP's arithmetic, not its speed
    train = {**config["train"], "dev_every": 0, "log_every": args.steps, "device": args.device, "share_gpus": True}
    settings = workdir / "ddp" / "config.yaml"  # the preset and the train section, as a config
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(yaml.safe_dump({"models": [args.preset], "presets": {args.preset: {
        key: value for key, value in preset.items() if key != "name"}}, "train": train}), encoding="utf-8")
    common = [sys.executable, "-m", "aiayn.train", "--config", str(settings), "--preset", args.preset,
              "--seed", "1", "--train-data", str(results / "bin" / "train"),
              "--spm-model", str(results / "bpe" / "spm.model"), "--no-tracking", "--threads", str(args.threads)]
    per_step = {}
    began = time.perf_counter()
    for world in (1, args.procs):  # --processes N > 1: aiayn train relaunches itself under torchrun
        run_dir = workdir / "ddp" / f"world{world}"
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "train.log"
        start = time.perf_counter()
        left = None if args.seconds is None else args.seconds - (time.perf_counter() - began)
        summary_path = run_dir / "final.json"
        status = run_with_stacks_on_timeout([*common, "--processes", str(world), "--run-dir", str(run_dir)], log, left)
        ended = time.time()
        written = (f"; its final.json was written {ended - summary_path.stat().st_mtime:.1f} s before"
                   if summary_path.exists() else "; it wrote no final.json")
        if status is None:
            print(f"{world} process(es): still running after {time.perf_counter() - start:.0f} s, stopped{written}; "
                  f"every process's Python stacks at that moment, then the end of {log}:\n{log.read_text()[-6000:]}")
            return 124
        if status != 0:
            print(f"{world} process(es): exit status {status}{written}; the end of {log}:\n{log.read_text()[-3000:]}")
            return 1
        final = json.loads(summary_path.read_text())
        steps = final["step"]
        source, target = final["real_src_tokens_per_step"], final["real_tgt_tokens_per_step"]
        per_step[world] = (source, target)
        print(f"{final['world_size']} process(es) on {final['device']}: {steps} steps, real tokens per step "
              f"{source:.1f} source + {target:.1f} target, {final['train_hours'] * 3600:.1f} s training "
              f"({time.perf_counter() - start:.0f} s with start-up){shape_costs(final)}; every process exited, "
              f"{ended - summary_path.stat().st_mtime:.1f} s after its final.json", flush=True)
    same = per_step[1] == per_step[args.procs]
    print(f"DDP: {'the same' if same else 'DIFFERENT'} real tokens per step in 1 and {args.procs} processes")
    return 0 if same else 1


def run_with_stacks_on_timeout(command: list[str], log: Path, seconds: float | None) -> int | None:
    """Run ``command`` in a process group of its own, output to ``log``; its exit status, or None if it
    was still running after ``seconds``: then every Python process in the group (the launcher, torchrun,
    the workers) is sent SIGABRT, which faulthandler turns into its thread stacks in ``log``, so a hang
    says where it hung."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with log.open("w") as handle:
        child = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return child.wait(timeout=None if seconds is None else max(seconds, 1))
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGABRT, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(child.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(grace)
            child.wait()
            return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("matmul")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=50)
    p = commands.add_parser("summary")
    p.add_argument("--workdir", type=Path, required=True, help="where snakemake ran")
    p.add_argument("--experiment", required=True)
    p.add_argument("--expect-device", choices=["cpu", "cuda"], required=True)
    p = commands.add_parser("recipe")
    p.add_argument("--workdir", type=Path, required=True, help="where snakemake ran")
    p.add_argument("--experiment", required=True)
    p.add_argument("--expect-device", choices=["cpu", "cuda"], required=True)
    p = commands.add_parser("ddp")
    p.add_argument("--workdir", type=Path, required=True, help="where snakemake ran (its bin/ and bpe/ are used)")
    p.add_argument("--configs", nargs="+", required=True, help="config files, relative to --workdir, in order")
    p.add_argument("--preset", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seconds", type=float, default=None,
                   help="stop both runs after this long in all, showing where each process was")
    args = parser.parse_args(argv)
    return {"matmul": matmul, "summary": summary, "recipe": recipe, "ddp": ddp}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
