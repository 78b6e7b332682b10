"""The average stage's cost at a paper preset's size, on the CPU: what its cluster request is sized from.

Writes ``--checkpoints`` training checkpoints of ``--preset`` (the trainer's format: fp32 weights and
Adam's two moments), drops them from the page cache, and runs ``aiayn average`` on them as the DAG does
(``--last K --checkpoint-dir``, with a small binarized dev split for the comparison), in a subprocess:
its wall time and peak resident memory. Then once more with the files in the page cache, which leaves
the disk out. The time per checkpoint and per GB read scales to the preset's ``average_last``; the peak
memory does not grow with the count (one checkpoint is held at a time). docs/cluster.md has the results.

    PYTHONPATH=src .venv/bin/python -m bench.average.cpu --preset big --checkpoints 3
    PYTHONPATH=src .venv/bin/python -m bench.average.cpu --preset base --checkpoints 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_checkpoints(preset: str, count: int, folder: Path) -> tuple[int, list[Path]]:
    """``count`` window checkpoints of the preset's model, as the trainer writes them; (parameters, paths)."""
    from aiayn.checkpoint import CHECKPOINT_FORMAT, checkpoint_path, save_model
    from aiayn.model import ModelConfig, Transformer
    from aiayn.params import count_parameters, presets_from_config

    (entry,) = presets_from_config(None, [preset])
    config = ModelConfig.from_dict(entry["model"])
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    paths = []
    for index in range(count):
        for parameter in model.parameters():  # a real Adam step, so that its moments are in the state
            parameter.grad = torch.randn_like(parameter) * 1e-3
        optimizer.step()
        step = 1000 * (index + 1)
        path = checkpoint_path(folder, step)
        save_model({"format": CHECKPOINT_FORMAT, "step": step, "model_config": config.to_dict(),
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(), "window": True,
                    "vocab_fingerprint": "bench", "data_fingerprint": "bench"}, path)
        paths.append(path)
    return count_parameters(config), paths


def dev_split(folder: Path, pairs: int) -> Path:
    """A binarized dev split of ``pairs`` demo sentence pairs (its ids fit any vocabulary)."""
    from aiayn.binarize import binarize_split
    from aiayn.bpe import learn_bpe
    from aiayn.demo.corpus import generate_corpus
    from aiayn.writing import write_lines_atomic

    raw = folder / "raw"
    for split, split_pairs in generate_corpus(1, {"train": 400, "dev": pairs}).items():
        write_lines_atomic(raw / f"{split}.en", [en for en, _ in split_pairs])
        write_lines_atomic(raw / f"{split}.de", [de for _, de in split_pairs])
    learn_bpe([raw / "train.en", raw / "train.de"], folder / "bpe", vocab_size=120, input_sentence_size=0, threads=1)
    binarize_split("dev", raw / "dev.en", raw / "dev.de", folder / "bpe" / "spm.model", folder / "dev", workers=1)
    return folder / "dev"


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (this process's files only), so that they are read
    from the disk again."""
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def run_average(checkpoint_dir: Path, count: int, dev: Path, out: Path) -> dict:
    """``aiayn average`` as the DAG runs it, on the CPU: wall seconds and the peak RSS of the process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    command = [sys.executable, "-m", "aiayn.average", "--last", str(count), "--checkpoint-dir", str(checkpoint_dir),
               "--output", str(out / "model.pt"), "--dev-data", str(dev), "--summary", str(out / "average.json"),
               "--device", "cpu", "--precision", "fp32", "--choose", "paper"]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    for path in out.iterdir():
        path.unlink()
    return {"seconds": round(seconds, 1), "peak_rss_mb": round(peak / 1024) if peak > before else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="big")
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--dev-pairs", type=int, default=20)
    parser.add_argument("--folder", type=Path, default=None, help="where the checkpoints go (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as scratch:
        scratch = Path(scratch)
        started = time.perf_counter()
        parameters, paths = write_checkpoints(args.preset, args.checkpoints, scratch / "checkpoints")
        written = time.perf_counter() - started
        dev = dev_split(scratch / "data", args.dev_pairs)
        (scratch / "out").mkdir()
        size = sum(path.stat().st_size for path in paths) / len(paths)
        evict(paths)
        cold = run_average(scratch / "checkpoints", args.checkpoints, dev, scratch / "out")
        warm = run_average(scratch / "checkpoints", args.checkpoints, dev, scratch / "out")
        gigabytes = size * args.checkpoints / 1e9
        print(json.dumps({
            "preset": args.preset, "parameters": parameters, "checkpoints": args.checkpoints,
            "checkpoint_bytes": int(size), "bytes_per_parameter": round(size / parameters, 3),
            "written_seconds": round(written, 1), "dev_pairs": args.dev_pairs,
            "cold": cold, "warm": warm,
            "cold_seconds_per_gb": round(cold["seconds"] / gigabytes, 2),
            "warm_seconds_per_gb": round(warm["seconds"] / gigabytes, 2),
            "peak_rss_bytes_per_parameter": round(cold["peak_rss_mb"] * 2**20 / parameters, 1),
            "torch_threads": torch.get_num_threads(), "cpu": _cpu_model(),
        }, indent=1))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
