"""The binarise stage: every split as compact token-id arrays with offsets.

One folder per split holding ``src.ids.npy`` / ``tgt.ids.npy`` (all sentences' BPE ids end
to end, uint16 when the vocabulary fits), ``src.offsets.npy`` / ``tgt.offsets.npy``
(sentence ``i`` is ``ids[offsets[i]:offsets[i+1]]``), ``lines.npy`` (the kept sentences'
line numbers in the text files) and ``meta.json`` (counts, what was dropped and why, and
the fingerprints of the text and vocabulary it came from). Arrays are memory-mapped by
the trainer, so every process of a multi-GPU job shares one copy in the page cache.
Ids carry no bos/eos: the batcher adds them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiayn.bpe import load_processor, vocab_fingerprint
from aiayn.errors import UserError, cli
from aiayn.fileio import atomic_path, fingerprint_files, read_lines

CHUNK_PAIRS = 20_000
_processor = None  # one SentencePiece processor per worker process


def _init_worker(model_path: str) -> None:
    global _processor
    import sentencepiece as spm

    _processor = spm.SentencePieceProcessor(model_file=model_path)


def _encode_chunk(chunk: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    src_lines, tgt_lines = chunk
    out = []
    for lines in (src_lines, tgt_lines):
        pieces = _processor.encode(lines, out_type=int)
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32, count=int(lengths.sum()))
        out += [flat, lengths]
    return tuple(out)


def encode_pairs(src: list[str], tgt: list[str], model_path: str | Path, workers: int, desc: str = "binarise"):
    """Encode both sides with ``workers`` processes; returns flat ids and lengths per side."""
    from tqdm import tqdm

    chunks = [(src[i:i + CHUNK_PAIRS], tgt[i:i + CHUNK_PAIRS]) for i in range(0, len(src), CHUNK_PAIRS)]
    results = []
    with tqdm(total=len(src), desc=desc, unit=" pairs", mininterval=2.0, disable=None) as progress:
        if workers <= 1:
            _init_worker(str(model_path))
            for chunk in chunks:
                results.append(_encode_chunk(chunk))
                progress.update(len(chunk[0]))
        else:
            # spawn, not fork: the parent may hold threads (torch, tqdm) that fork would copy mid-lock
            context = multiprocessing.get_context("spawn")
            with context.Pool(workers, initializer=_init_worker, initargs=(str(model_path),)) as pool:
                for chunk, result in zip(chunks, pool.imap(_encode_chunk, chunks)):
                    results.append(result)
                    progress.update(len(chunk[0]))
    if not results:
        empty = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
        return empty + empty
    return tuple(np.concatenate([r[k] for r in results]) for k in range(4))


def _select(flat: np.ndarray, lengths: np.ndarray, keep: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    ids = flat[np.repeat(keep, lengths)].astype(dtype)
    offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(lengths[keep], out=offsets[1:])
    return ids, offsets


def binarize_split(
    split: str,
    src_path: str | Path,
    tgt_path: str | Path,
    model_path: str | Path,
    out_dir: str | Path,
    max_tokens: int | None = None,
    workers: int = 1,
) -> dict:
    """Encode one split into ``out_dir``; ``max_tokens`` filters pairs (use it for train only)."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise UserError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; they must be parallel")
    if not src:
        raise UserError(f"{src_path}: the {split} split is empty")
    src_flat, src_len, tgt_flat, tgt_len = encode_pairs(src, tgt, model_path, workers, desc=f"binarise {split}")
    vocab_size = load_processor(model_path).get_piece_size()
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    if max_tokens is None:  # evaluation splits: every sentence stays
        empty = too_long = np.zeros(len(src), dtype=bool)
    else:
        empty = (src_len == 0) | (tgt_len == 0)
        too_long = ~empty & ((src_len > max_tokens) | (tgt_len > max_tokens))
    keep = ~(empty | too_long)
    src_ids, src_offsets = _select(src_flat, src_len, keep, dtype)
    tgt_ids, tgt_offsets = _select(tgt_flat, tgt_len, keep, dtype)
    meta = {
        "split": split,
        "pairs_in": len(src),
        "pairs_kept": int(keep.sum()),
        "dropped_too_long": int(too_long.sum()),
        "dropped_empty": int(empty.sum()),
        "max_tokens": max_tokens,
        "src_tokens": int(src_ids.size),
        "tgt_tokens": int(tgt_ids.size),
        "dtype": np.dtype(dtype).name,
        "vocab_size": vocab_size,
        "vocab_fingerprint": vocab_fingerprint(model_path),
        "data_fingerprint": fingerprint_files(src_path, tgt_path),
        "src_file": str(src_path),
        "tgt_file": str(tgt_path),
    }
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        np.save(tmp / "src.ids.npy", src_ids)
        np.save(tmp / "src.offsets.npy", src_offsets)
        np.save(tmp / "tgt.ids.npy", tgt_ids)
        np.save(tmp / "tgt.offsets.npy", tgt_offsets)
        np.save(tmp / "lines.npy", np.flatnonzero(keep).astype(np.int64))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


@dataclass
class TokenizedSplit:
    """A binarised split, memory-mapped; sentence ``i`` is ``src(i)`` / ``tgt(i)``."""

    src_ids: np.ndarray
    src_offsets: np.ndarray
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray
    lines: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lengths(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    @property
    def tgt_lengths(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i]:self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i]:self.tgt_offsets[i + 1]]


def load_split(path: str | Path, mmap: bool = True) -> TokenizedSplit:
    path = Path(path)
    if not (path / "meta.json").exists():
        raise UserError(f"{path}: not a binarised split (no meta.json); run the binarise stage")
    mode = "r" if mmap else None
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode=mode)
              for name in ("src.ids", "src.offsets", "tgt.ids", "tgt.offsets", "lines")}
    return TokenizedSplit(arrays["src.ids"], arrays["src.offsets"], arrays["tgt.ids"], arrays["tgt.offsets"],
                          arrays["lines"], json.loads((path / "meta.json").read_text()))


@cli
def main(argv=None):
    from aiayn.config import add_config_arguments, section_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn binarise", description=__doc__.splitlines()[0])
    add_config_arguments(parser, "binarize")
    parser.add_argument("--split", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)
    parser.add_argument("--spm-model", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: binarize.workers)")
    args = parser.parse_args(argv)
    settings = section_from_arguments(args, "binarize")
    max_tokens = settings["max_tokens"] if args.split == "train" else None  # never drop evaluation sentences
    meta = binarize_split(args.split, args.src, args.tgt, args.spm_model, args.out_dir, max_tokens,
                          args.workers or settings["workers"])
    print(f"{args.split}: {meta['pairs_kept']}/{meta['pairs_in']} pairs kept "
          f"({meta['dropped_too_long']} over {max_tokens} tokens, {meta['dropped_empty']} empty), "
          f"{meta['src_tokens']} + {meta['tgt_tokens']} tokens, {meta['dtype']}")


if __name__ == "__main__":
    raise SystemExit(main())
