"""Shared fixtures: small corpora in the real on-disk formats, made by the tests themselves."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

# No network in tests: the hub libraries must fail at once instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

EN_WORDS = "the a man woman dog cat sees likes house garden big small red old runs sleeps quickly today".split()
DE_WORDS = "der die das mann frau hund katze sieht mag haus garten groß klein rot alt läuft schläft schnell heute".split()


def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Word-for-word pairs with umlauts and varied lengths: enough for BPE and binarization."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        idx = [rng.randrange(len(EN_WORDS)) for _ in range(rng.randint(2, 14))]
        pairs.append((" ".join(EN_WORDS[i] for i in idx) + " .", " ".join(DE_WORDS[i] for i in idx) + " ."))
    return pairs


def write_text_corpus(folder: Path, sizes=(("train", 400), ("dev", 40), ("test", 40))) -> dict:
    """``<split>.en`` / ``<split>.de`` files; returns the `data.local` config that points at them."""
    folder.mkdir(parents=True, exist_ok=True)
    local = {}
    for seed, (split, n) in enumerate(sizes):
        pairs = make_pairs(n, seed)
        (folder / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        (folder / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
        local[split] = {"src": str(folder / f"{split}.en"), "tgt": str(folder / f"{split}.de")}
    return local


def corpus_with_bpe(root: Path, held_out: int = 10) -> Path:
    """``root/raw``: 200 train pairs and ``held_out`` dev and test pairs; ``root/bpe``: a 100-piece shared
    SentencePiece model learned from train. What the catalogue tests of bad input share, read and never changed."""
    from aiayn.bpe import learn_bpe

    write_text_corpus(root / "raw", (("train", 200), ("dev", held_out), ("test", held_out)))
    learn_bpe([root / "raw" / "train.en", root / "raw" / "train.de"], root / "bpe", vocab_size=100,
              input_sentence_size=0, threads=1)
    return root


def data_section(**overrides) -> dict:
    section = {"source": "local", "src_lang": "en", "tgt_lang": "de", "max_chars": 1000,
               "hub": {"path": "wmt/wmt14", "name": "de-en", "revision": "main",
                       "splits": {"train": "train", "dev": "validation", "test": "test"}},
               "local": {}, "demo": {"seed": 1, "train": 100, "dev": 10, "test": 10}}
    section.update(overrides)
    return section


def tiny_preset(**overrides) -> dict:
    """A resolved preset small enough to train a few steps in seconds."""
    preset = {"name": "tiny", "n_layers": 2, "d_model": 32, "d_ff": 64, "n_heads": 4, "d_head": None, "d_value": None,
              "dropout": 0.1, "label_smoothing": 0.1, "positional": "sinusoidal", "max_positions": 128, "steps": 6,
              "warmup_steps": 4, "lr_scale": 1.0, "average_last": 2, "keep_checkpoints": 3, "checkpoint_minutes": None,
              "checkpoint_steps": 2, "gpus": 0, "runtime_minutes": 5, "paper": {}}
    preset.update(overrides)
    return preset


def config_file(path: Path, **sections) -> str:
    """A config file at ``path`` holding ``sections`` (and ``models: [base]`` where they name none), as a user
    writes one: what a command reads through ``--config``."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"models": ["base"], **sections}), encoding="utf-8")
    return str(path)


def train_settings(folder: Path, preset: dict, train: dict | None = None) -> list[str]:
    """``--config FILE --preset NAME`` for ``aiayn train``: a config in ``folder`` that trains ``preset`` (a
    resolved one, as ``tiny_preset`` gives) with the ``train`` section given (else the schema's)."""
    name = preset.get("name", "tiny")
    own = {key: value for key, value in preset.items() if key != "name"}
    path = config_file(Path(folder) / f"{name}.yaml", models=[name], presets={name: own}, **({"train": train} if train else {}))
    return ["--config", path, "--preset", name]


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A small corpus taken through download, bpe and binarize (train and dev)."""
    from aiayn.binarize import binarize_split
    from aiayn.bpe import learn_bpe
    from aiayn.data import download

    root = tmp_path_factory.mktemp("prepared")
    local = write_text_corpus(root / "raw", (("train", 1200), ("dev", 60), ("test", 60)))
    download(data_section(local=local), root / "data")
    learn_bpe([root / "data" / "train.en", root / "data" / "train.de"], root / "bpe", vocab_size=120,
              input_sentence_size=0, threads=1)
    for split in ("train", "dev"):
        binarize_split(split, root / "data" / f"{split}.en", root / "data" / f"{split}.de", root / "bpe" / "spm.model",
                       root / "bin" / split, max_tokens=64 if split == "train" else None, workers=1)
    return root
