"""What a planned workflow costs, from its config alone: the disk of each stage's files and each run's time.

``aiayn preflight`` sets these beside what a machine has. Sizes follow the project's own file formats (a
training checkpoint: ``Trainer.save_checkpoint``; a binarized split: ``aiayn.binarize``) and the sizes the
hub states for its datasets; times follow the project's FLOP count (``aiayn.train.schedule``) and the model
FLOPs utilisation measured in BENCHMARKS.md. Every figure here is an estimate with its source named.
"""

from __future__ import annotations

import functools
import glob
import math
import os
from dataclasses import dataclass

from aiayn.config import model_fields
from aiayn.model import ModelConfig
from aiayn.params import count_parameters
from aiayn.train.rendezvous import devices
from aiayn.train.schedule import forward_flops

# A training checkpoint holds the fp32 weights and Adam's two fp32 moments (12 bytes a parameter), and
# small state: the schedule, the progress, the RNG state, the config and the file's record of each tensor.
CHECKPOINT_BYTES_PER_PARAMETER = 12
CHECKPOINT_STATE_BYTES = 2**20  # an allowance for the small state, well above what it holds
MODEL_BYTES_PER_PARAMETER = 4  # final.pt and the averaged model.pt: the fp32 weights alone
# Beyond the checkpoints a run keeps, at most two more at once: a safety checkpoint (for resuming only, kept
# while it is the newest) and the newest window checkpoint, written before the oldest is removed.
EXTRA_CHECKPOINTS = 2
BPE_BYTES_PER_PIECE = 32  # spm.model and spm.vocab: each piece with its score, in protobuf and as text

# WMT-like sentence lengths in BPE tokens: log-normal with median 24 and sigma 0.6, the stand-in of
# BENCHMARKS.md ("Step shapes on a GPU") and bench/train/shapes.py. Its mean is median * exp(sigma^2 / 2).
TYPICAL_TOKENS = 24 * math.exp(0.6**2 / 2)


@dataclass(frozen=True)
class HubDataset:
    """A hub dataset's size: pairs by the hub's split name, the parquet files the download fetches into
    the hub's cache, and the dataset as Arrow (its text and offsets: about the text files written)."""

    pairs: dict
    parquet_bytes: int
    text_bytes: int

    def scaled(self, pairs: dict) -> "HubDataset":
        """Another dataset of these bytes a pair (an estimate, where the hub states the pairs alone)."""
        ratio = sum(pairs.values()) / sum(self.pairs.values())
        return HubDataset(pairs, round(self.parquet_bytes * ratio), round(self.text_bytes * ratio))


# wmt/wmt14 de-en as its dataset card states it (dataset_info: num_examples, download_size, dataset_size).
WMT14_DE_EN = HubDataset({"train": 4_508_785, "validation": 3000, "test": 3003}, 818_467_512, 1_359_920_533)
HUB_DATASETS = {
    ("wmt/wmt14", "de-en"): WMT14_DE_EN,
    # its pairs as the hub lists them (config/wmt14_en_fr.yaml: about 40.8M); its bytes at de-en's bytes a pair
    ("wmt/wmt14", "fr-en"): WMT14_DE_EN.scaled({"train": 40_836_715, "validation": 3000, "test": 3003}),
}
TEXT_BYTES_PER_PAIR = WMT14_DE_EN.text_bytes / sum(WMT14_DE_EN.pairs.values())
TEXT_BYTES_PER_PARQUET_BYTE = WMT14_DE_EN.text_bytes / WMT14_DE_EN.parquet_bytes
# The demo's text a pair: its corpus's size in BENCHMARKS.md's row of the demo DAG, over its 32,000 pairs.
DEMO_TEXT_BYTES_PER_PAIR = 5.1e6 / 32_000

# Model FLOPs utilisation measured by the project, by GPU kind and precision, from BENCHMARKS.md's section
# "GPU (`bench/gpu.sh`)" (its first row: warm eager steps of base and big, one GPU taking a whole step of
# 25000 target tokens). Each entry: the preset measured and its utilisation.
MEASURED_MFU = {("H200", "bf16"): {"base": 0.14, "big": 0.27}}
MEASURED_TOKENS_PER_GPU = 25000  # the micro-batch those steps ran: one GPU took the whole step


def model_config(preset: dict, vocab_size: int) -> ModelConfig:
    """The model a preset trains at the config's vocabulary size (as ``aiayn params`` counts it)."""
    return ModelConfig(vocab_size=vocab_size, **model_fields(preset))


def parameters(preset: dict, vocab_size: int) -> int:
    return count_parameters(model_config(preset, vocab_size))


def kept_checkpoints(preset: dict) -> int:
    """The window checkpoints a run keeps: averaging needs the last ``average_last`` (TrainSettings' rule)."""
    return max(preset["keep_checkpoints"], preset["average_last"])


def checkpoint_bytes(params: int) -> int:
    return CHECKPOINT_BYTES_PER_PARAMETER * params + CHECKPOINT_STATE_BYTES


def run_bytes(params: int, preset: dict, decode_bytes: int) -> int:
    """One run's disk at its fullest: its checkpoints (kept, plus the two more a run may hold at once),
    final.pt, the averaged model.pt and its translations of dev and test."""
    checkpoints = (kept_checkpoints(preset) + EXTRA_CHECKPOINTS) * checkpoint_bytes(params)
    return checkpoints + 2 * MODEL_BYTES_PER_PARAMETER * params + decode_bytes


def binarized_bytes(pairs: float, vocab_size: int, tokens_per_side: float = TYPICAL_TOKENS) -> int:
    """A binarized split (aiayn.binarize): each side's ids (uint16 where the vocabulary fits, else int32)
    and offsets (int64, one more than sentences), and each pair's line number (int64)."""
    id_bytes = 2 if vocab_size <= 2**16 else 4
    return round(pairs * (2 * tokens_per_side * id_bytes + 3 * 8))


def bpe_bytes(vocab_size: int) -> int:
    return BPE_BYTES_PER_PIECE * vocab_size


def step_flops(config: ModelConfig, tokens_per_step: int, tokens: float = TYPICAL_TOKENS) -> float:
    """A training step's FLOPs as the trainer counts them (forward x 3: the backward about twice the forward),
    over ``tokens_per_step`` padded tokens a side in sentences of ``tokens`` (plus EOS or BOS)."""
    length = round(tokens) + 1
    return 3.0 * forward_flops(config, tokens_per_step / length, length, length)


@functools.lru_cache(maxsize=None)
def paper_parameters(name: str) -> int:
    """A paper preset's parameters at the paper's vocabulary size (what was measured)."""
    from aiayn.params import parameter_rows, presets_from_config

    return parameter_rows(presets_from_config(None, [name]))[0]["params"]


def measured_mfu(gpu_name: str, precision: str, params: int) -> tuple[float, str] | None:
    """The utilisation measured on this kind of GPU and precision, of the measured preset nearest in size,
    and where it comes from; None where the project has no measurement."""
    for kind, table in MEASURED_MFU.items():
        if kind[0] in gpu_name and kind[1] == precision:
            nearest = min(table, key=lambda name: abs(math.log(paper_parameters(name) / params)))
            return table[nearest], f"{kind[0]} {precision}, as measured on {nearest}"
    return None


def training_hours(preset: dict, config: ModelConfig, tokens_per_step: int, peak: float, mfu: float) -> float:
    """Steps x FLOPs a step / (peak x utilisation x the run's devices): communication not counted."""
    seconds = preset["steps"] * step_flops(config, tokens_per_step) / (peak * mfu * devices(preset))
    return seconds / 3600


def _local_split_bytes(spec: dict | None) -> tuple[int, int]:
    """A data.local split's text as the download stage will write it: (source side, target side) bytes; a
    parquet split's at the hub's text bytes a parquet byte; 0 for files that are not there."""
    def size(path: str) -> int:
        return os.path.getsize(path) if os.path.isfile(path) else 0

    if not spec:
        return 0, 0
    if "parquet" in spec:
        pattern = os.path.expanduser(spec["parquet"])
        files = glob.glob(pattern) if glob.has_magic(pattern) else [pattern]
        half = sum(size(path) for path in files) * TEXT_BYTES_PER_PARQUET_BYTE / 2
        return round(half), round(half)
    return size(os.path.expanduser(spec.get("src", ""))), size(os.path.expanduser(spec.get("tgt", "")))


@dataclass(frozen=True)
class DataBytes:
    """The disk of the data stages: the hub's cached files (outside the results folder; None for other
    sources), the text the download writes, the BPE model, the binarized splits, and one run's
    translations of dev and test. ``known``: False for a hub dataset of unknown size."""

    hub_cache: int | None
    text: int
    bpe: int
    binarized: int
    decode: int
    known: bool = True


def data_bytes(data: dict, vocab_size: int) -> DataBytes:
    """The data stages' disk for a config's ``data`` section, by its source."""
    splits = ("train", "dev", "test")
    if data["source"] == "hub":
        hub = data["hub"]
        dataset = HUB_DATASETS.get((hub["path"], hub["name"]))
        if dataset is None:
            return DataBytes(0, 0, bpe_bytes(vocab_size), 0, 0, known=False)
        pairs = {split: dataset.pairs.get(hub["splits"][split], 0) for split in splits}
        text = dataset.text_bytes * sum(pairs.values()) / sum(dataset.pairs.values())
        held_out = (pairs["dev"] + pairs["test"]) * TEXT_BYTES_PER_PAIR
        return DataBytes(dataset.parquet_bytes, round(text), bpe_bytes(vocab_size),
                         binarized_bytes(sum(pairs.values()), vocab_size), round(held_out / 2))
    if data["source"] == "local":
        sides = {split: _local_split_bytes(data["local"].get(split)) for split in splits}
        text = sum(sum(pair) for pair in sides.values())
        decode = sides["dev"][1] + sides["test"][1]
    else:  # the demo's generated corpus
        text = round(sum(data["demo"][split] for split in splits) * DEMO_TEXT_BYTES_PER_PAIR)
        decode = round((data["demo"]["dev"] + data["demo"]["test"]) * DEMO_TEXT_BYTES_PER_PAIR / 2)
    return DataBytes(None, text, bpe_bytes(vocab_size), binarized_bytes(text / TEXT_BYTES_PER_PAIR, vocab_size),
                     decode)
