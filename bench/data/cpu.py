"""Data-stage speed and memory: download (local text and parquet), BPE, and binarize with 1, 2 and all cores.

Each stage runs as its CLI in a subprocess, as the workflow runs it; the peak resident memory
is that of the stage and all its worker processes together (their RSS summed, sampled every
0.2 s from /proc), in all and without memory-mapped files' pages. The corpus is generated (seeded): sentence pairs over a Zipf-distributed
lexicon of pseudo-words with German-like umlauts and lengths like WMT's, big enough for a
37000-piece vocabulary, which the small demo language is not. Run it at two sizes to see how
time and memory grow with the corpus:

    PYTHONPATH=src .venv/bin/python -m bench.data.cpu --pairs 1000000
    PYTHONPATH=src .venv/bin/python -m bench.data.cpu --pairs 10000000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SYLLABLES = ["ka", "ri", "to", "mo", "ne", "sa", "lu", "ve", "schu", "ber", "ung", "ich", "ä", "ö", "ü", "ge", "ein",
             "st", "an", "or", "in", "al", "er", "ha", "ze", "wi", "pro", "tra", "de", "ß"]


def lexicon(size: int, rng: random.Random) -> list[str]:
    words = set()
    while len(words) < size:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 5))))
    return sorted(words)


def write_corpus(folder: Path, pairs: int, seed: int = 1, lexicons: tuple[int, int] = (60000, 80000)) -> tuple[Path, Path]:
    """``raw.en`` / ``raw.de``; the first 1M pairs are the same at every size (the generator is streamed).

    ``lexicons``: the English and German word list sizes; the number of word types the corpus
    holds grows with them (real WMT text has millions, which drive the BPE trainer's memory).
    """
    rng = random.Random(seed)
    source_words, target_words = lexicon(lexicons[0], rng), lexicon(lexicons[1], rng)
    np_rng = np.random.default_rng(seed)
    src_path, tgt_path = folder / "raw.en", folder / "raw.de"
    with open(src_path, "w", encoding="utf-8") as src, open(tgt_path, "w", encoding="utf-8") as tgt:
        for start in range(0, pairs, 1_000_000):
            lengths = np.clip(np_rng.gamma(2.5, 9.0, min(1_000_000, pairs - start)).astype(int), 1, 120)
            for length in lengths:
                src_ids = np.minimum(np_rng.zipf(1.2, length), len(source_words)) - 1
                tgt_ids = np.minimum(np_rng.zipf(1.2, max(1, length + int(np_rng.integers(-2, 3)))),
                                     len(target_words)) - 1
                src.write(" ".join(source_words[i] for i in src_ids) + " .\n")
                tgt.write(" ".join(target_words[i] for i in tgt_ids) + " .\n")
    return src_path, tgt_path


def write_parquet(src_path: Path, tgt_path: Path, out: Path, rows_per_group: int = 100_000) -> None:
    """The same pairs in the hub's ``translation`` layout, written in row groups (as the hub's files are)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("translation", pa.struct([("de", pa.string()), ("en", pa.string())]))])
    with open(src_path, encoding="utf-8") as src, open(tgt_path, encoding="utf-8") as tgt, \
            pq.ParquetWriter(out, schema) as writer:
        while True:
            en = [line.rstrip("\n") for _, line in zip(range(rows_per_group), src)]
            if not en:
                break
            de = [tgt.readline().rstrip("\n") for _ in en]
            translation = pa.StructArray.from_arrays([pa.array(de), pa.array(en)], ["de", "en"])
            writer.write_table(pa.table({"translation": translation}, schema=schema))


def tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of a process and all its descendants (from /proc): all, and anonymous only
    (without the pages of memory-mapped files, which the kernel can drop and reread)."""
    total, anonymous, stack = 0, 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "RssAnon")))
            total += int(fields["VmRSS"].split()[0]) * 1024
            anonymous += int(fields["RssAnon"].split()[0]) * 1024
            with open(f"/proc/{current}/task/{current}/children") as children:
                stack += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError, KeyError):
            continue
    return total, anonymous


def run_stage(name: str, command: list[str], log: Path, env: dict | None = None) -> dict:
    """Run one stage's CLI; its wall time and the peak of its process tree's resident memory."""
    start = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        peak, peak_anonymous = 0, 0
        done = threading.Event()

        def sample():  # from the start, and often: a stage may last less than a second
            nonlocal peak, peak_anonymous
            while True:
                total, anonymous = tree_rss(process.pid)
                peak, peak_anonymous = max(peak, total), max(peak_anonymous, anonymous)
                if done.wait(0.05):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait()
        done.set()
        sampler.join()
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{name} failed ({code}); see {log}:\n{log.read_text()[-2000:]}")
    return {"stage": name, "seconds": round(seconds, 1), "peak_rss_mb": round(peak / 1e6),
            "peak_anonymous_mb": round(peak_anonymous / 1e6)}


def data_section(local: dict | None = None, hub: dict | None = None) -> dict:
    return {"source": "hub" if hub else "local", "src_lang": "en", "tgt_lang": "de", "max_chars": 1000,
            "max_length_ratio": None, "hub": hub or {}, "local": local or {}, "demo": {}}


def config(path: Path, **sections) -> list[str]:
    """``--config FILE`` for a stage: a config file at ``path`` holding ``sections`` (JSON, which is YAML)."""
    path.write_text(json.dumps({"models": ["base"], **sections}), encoding="utf-8")
    return ["--config", str(path)]


def write_hub_folder(folder: Path, train_parquet: Path, small: dict) -> dict:
    """A dataset folder in the layout of the hub's wmt/wmt14 (one config, its parquet files, a README
    naming them), so that the hub source runs ``datasets.load_dataset`` without a network."""
    (folder / "de-en").mkdir(parents=True)
    train_parquet.rename(folder / "de-en" / "train-00000-of-00001.parquet")
    for split in ("validation", "test"):
        write_parquet(Path(small["src"]), Path(small["tgt"]), folder / "de-en" / f"{split}-00000-of-00001.parquet")
    splits = "".join(f"  - split: {split}\n    path: de-en/{split}-*\n" for split in ("train", "validation", "test"))
    (folder / "README.md").write_text(f"---\nconfigs:\n- config_name: de-en\n  data_files:\n{splits}---\n")
    return {"path": str(folder), "name": "de-en", "revision": "main",
            "splits": {"train": "train", "dev": "validation", "test": "test"}}


STAGES = ("download-parquet", "download-hub", "download-text", "bpe", "binarize")


def word_types(path: Path, lines: int) -> int:
    """Distinct whitespace-separated words in the first ``lines`` lines of a file."""
    types = set()
    with open(path, encoding="utf-8") as handle:
        for _, line in zip(range(lines), handle):
            types.update(line.split())
    return len(types)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--vocab", type=int, default=37000)
    parser.add_argument("--input-sentence-size", type=int, default=2_000_000)
    parser.add_argument("--workers", type=int, nargs="*", default=sorted({1, 2, os.cpu_count() or 1}),
                        help="binarize with each of these process counts (default: 1, 2 and all cores; none: skip)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--lexicons", type=int, nargs=2, default=(60000, 80000), metavar=("EN", "DE"),
                        help="word list sizes of the generator (more: more word types, as real text has)")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="keep the generated corpus in this folder and reuse it on later runs of the same size")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES,
                        help="measure only these (bpe without download-text learns from the generated text)")
    args = parser.parse_args(argv)
    aiayn = [sys.executable, "-m", "aiayn.cli"]
    results = {"pairs": args.pairs, "cpus": os.cpu_count(), "stages": []}
    with tempfile.TemporaryDirectory(prefix="aiayn-bench-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        corpus = {"pairs": args.pairs, "lexicons": list(args.lexicons), "seed": 1}
        corpus_dir = args.corpus or folder  # --corpus: generated once, reused (not timed again) at the same size
        corpus_dir.mkdir(parents=True, exist_ok=True)
        marker = corpus_dir / "corpus.json"
        if not (marker.exists() and json.loads(marker.read_text()) == corpus):
            write_corpus(corpus_dir, args.pairs, lexicons=tuple(args.lexicons))
            marker.write_text(json.dumps(corpus))
        src, tgt = corpus_dir / "raw.en", corpus_dir / "raw.de"
        if {"download-parquet", "download-hub"} & set(args.stages):
            write_parquet(src, tgt, folder / "train.parquet")
        results["text_mb"] = round((src.stat().st_size + tgt.stat().st_size) / 1e6)
        sample = args.input_sentence_size // 2 if args.input_sentence_size else args.pairs
        results["word_types"] = {"en": word_types(src, sample), "de": word_types(tgt, sample), "in_pairs": sample}
        print(f"corpus of {args.pairs} pairs ready in {time.perf_counter() - start:.1f} s ({results['text_mb']} MB of text; "
              f"word types in the first {sample} pairs: {results['word_types']['en']} en, "
              f"{results['word_types']['de']} de)", flush=True)
        for lang, path in (("en", src), ("de", tgt)):  # dev and test: the first 3000 pairs (not what is measured)
            with open(path, encoding="utf-8") as handle:
                (folder / f"small.{lang}").write_text("".join(line for _, line in zip(range(3000), handle)),
                                                      encoding="utf-8")
        small = {"src": str(folder / "small.en"), "tgt": str(folder / "small.de")}
        stages = results["stages"]

        def measure(name: str, command: list[str], log: str, env: dict | None = None) -> dict:
            result = run_stage(name, aiayn + command, folder / log, env)
            print(json.dumps(result), flush=True)
            stages.append(result)
            return result

        if "download-parquet" in args.stages:
            measure("download (local parquet)", [
                "download", *config(folder / "data-parquet.json", data=data_section(
                    {"train": {"parquet": str(folder / "train.parquet")}, "dev": small, "test": small})),
                "--out-dir", str(folder / "data-parquet")], "download-parquet.log")
            shutil.rmtree(folder / "data-parquet")
        if "download-hub" in args.stages:
            hub = write_hub_folder(folder / "hub", folder / "train.parquet", small)
            measure("download (hub source: datasets on a local folder in the hub's layout)", [
                "download", *config(folder / "data-hub.json", data=data_section(hub=hub)), "--out-dir", str(folder / "data-hub")],
                "download-hub.log",
                {"HF_DATASETS_CACHE": str(folder / "hf-cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
            for path in (folder / "data-hub", folder / "hf-cache", folder / "hub"):
                shutil.rmtree(path, ignore_errors=True)  # free the disk for the larger runs
        (folder / "train.parquet").unlink(missing_ok=True)
        train = (src, tgt)  # the stages after download read the download's output where it was measured
        if "download-text" in args.stages:
            measure("download (local text)", [
                "download", *config(folder / "data-text.json", data=data_section(
                    {"train": {"src": str(src), "tgt": str(tgt)}, "dev": small, "test": small})),
                "--out-dir", str(folder / "data")], "download.log")
            train = (folder / "data" / "train.en", folder / "data" / "train.de")
        spm_model = folder / "bpe" / "spm.model"
        if "bpe" in args.stages or "binarize" in args.stages:
            bpe = {"vocab_size": args.vocab, "input_sentence_size": args.input_sentence_size,
                   "character_coverage": 1.0, "seed": 1}
            name = "bpe" if "bpe" in args.stages else "bpe (for binarize, not measured)"
            result = measure(name, ["bpe", *config(folder / "bpe.json", bpe=bpe), "--threads", str(os.cpu_count()),
                                    "--out-dir", str(folder / "bpe"), str(train[0]), str(train[1])], "bpe.log")
            result["word_types"] = results["word_types"]
        for workers in args.workers if "binarize" in args.stages else []:
            result = run_stage(f"binarize ({workers} process{'es' if workers > 1 else ''})", aiayn + [
                "binarize", *config(folder / "binarize.json", binarize={"max_tokens": 250, "workers": workers}), "--split",
                "train",
                "--workers", str(workers), "--src", str(train[0]),
                "--tgt", str(train[1]), "--spm-model", str(spm_model),
                "--out-dir", str(folder / f"bin{workers}")], folder / f"binarize{workers}.log")
            result["pairs_per_s"] = round(args.pairs / result["seconds"])
            meta = json.loads((folder / f"bin{workers}" / "meta.json").read_text())
            result["tokens"] = meta["src_tokens"] + meta["tgt_tokens"]
            result["arrays_mb"] = round(sum(f.stat().st_size for f in (folder / f"bin{workers}").glob("*.npy")) / 1e6)
            print(json.dumps(result), flush=True)
            stages.append(result)
            shutil.rmtree(folder / f"bin{workers}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
