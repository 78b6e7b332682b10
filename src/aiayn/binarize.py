"""The binarize stage: every split as compact token-id arrays with offsets.

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
import collections
import concurrent.futures
import contextlib
import itertools
import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from aiayn.bpe import load_processor, vocab_fingerprint
from aiayn.errors import UserError, cli
from aiayn.reading import count_lines, fingerprint_files, iter_lines, same_file
from aiayn.writing import atomic_path, refuse_overwriting_inputs, refuse_replacing_a_folder
from aiayn.layout import SPLIT_ARRAYS, SPLIT_META

CHUNK_PAIRS = 20_000
# A training split that keeps less than this share of its pairs is refused: a max_tokens or a vocabulary
# that leaves a tenth of the data is never what a run meant (the paper's setting drops well under 1%
# of WMT), and training on the rest would look like a weak model, not like a wrong setting.
MIN_KEPT_SHARE = 0.1
_LENGTH_BINS = 4096  # longer sides are counted in the last bin (for the advice on max_tokens)
_processor = None  # one SentencePiece processor per worker process


def _init_worker(model_path: str) -> None:
    global _processor
    import sentencepiece as spm

    _processor = spm.SentencePieceProcessor(model_file=model_path)


def _encode_chunk(chunk: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    src_lines, tgt_lines = chunk
    out = []
    for lines in (src_lines, tgt_lines):
        # a line of whitespace alone is empty (as the download stage strips it), not a sentence of spaces
        lines = [line if line.strip() else "" for line in lines]
        # one thread: SentencePiece's batch encode would otherwise start a thread per core of the machine
        # in every worker, using cores the job did not ask for; the workers are the parallelism
        pieces = _processor.encode(lines, out_type=int, num_threads=1)
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32, count=int(lengths.sum()))
        out += [flat, lengths]
    return tuple(out)


def _chunks(src_path: str | Path, tgt_path: str | Path) -> Iterator[tuple[list[str], list[str]]]:
    src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
    while src := list(itertools.islice(src_lines, CHUNK_PAIRS)):
        yield src, list(itertools.islice(tgt_lines, len(src)))


def encode_chunks(src_path: str | Path, tgt_path: str | Path, model_path: str | Path, workers: int,
                  pairs: int | None = None, desc: str = "binarize") -> Iterator[tuple[np.ndarray, ...]]:
    """Flat ids and lengths of both sides, one chunk of ``CHUNK_PAIRS`` pairs at a time, in order.

    The parent reads the text chunk by chunk while ``workers`` processes encode, one thread each
    (so ``workers`` is the number of cores used); at most two chunks per worker are in flight, so
    memory does not grow with the corpus.
    """
    from tqdm import tqdm

    with tqdm(total=pairs, desc=desc, unit=" pairs", mininterval=2.0, disable=None) as progress:
        if workers <= 1:
            _init_worker(str(model_path))
            for chunk in _chunks(src_path, tgt_path):
                yield _encode_chunk(chunk)
                progress.update(len(chunk[0]))
            return
        # spawn, not fork: the parent may hold threads (torch, tqdm) that fork would copy mid-lock.
        # A process pool from concurrent.futures, not multiprocessing.Pool: a worker that dies (killed,
        # or failing in its initializer) breaks it and ends the stage, where Pool would start a new
        # worker and wait forever for the lost chunk.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                    initargs=(str(model_path),)) as pool:
            in_flight: collections.deque = collections.deque()
            try:
                for chunk in _chunks(src_path, tgt_path):
                    in_flight.append((len(chunk[0]), pool.submit(_encode_chunk, chunk)))
                    while len(in_flight) >= 2 * workers or (in_flight and in_flight[0][1].done()):
                        size, result = in_flight.popleft()
                        yield result.result()
                        progress.update(size)
                for size, result in in_flight:
                    yield result.result()
                    progress.update(size)
            except concurrent.futures.process.BrokenProcessPool:
                raise RuntimeError(
                    f"a binarize worker process died (killed, out of memory?) while encoding {src_path}; "
                    "rerun the stage, with fewer --workers if memory is short"
                ) from None
            finally:
                for _, result in in_flight:  # an error in the parent: don't encode the rest first
                    result.cancel()


class NpyWriter:
    """A one-dimensional ``.npy`` file written piece by piece, byte-identical to ``np.save`` of the whole.

    numpy pads the header so that the length can grow in place; the header is written first
    and rewritten with the final length on ``close``.
    """

    def __init__(self, path: str | Path, dtype):
        self.dtype = np.dtype(dtype)
        self.length = 0
        self.file = open(path, "wb")
        self.header_size = self._write_header()

    def _write_header(self) -> int:
        self.file.seek(0)
        np.lib.format.write_array_header_1_0(
            self.file, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                        "shape": (self.length,)})
        return self.file.tell()

    def append(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.file.write(values.data)
        self.length += values.size

    def close(self) -> None:
        if self.file.closed:
            return
        end = self.file.tell()
        if self._write_header() != self.header_size:
            raise RuntimeError(f"{self.file.name}: the .npy header changed size")
        self.file.seek(end)
        self.file.close()

    def __enter__(self) -> "NpyWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def binarize_split(
    split: str,
    src_path: str | Path,
    tgt_path: str | Path,
    model_path: str | Path,
    out_dir: str | Path,
    max_tokens: int | None = None,
    workers: int = 1,
) -> dict:
    """Encode one split into ``out_dir``; ``max_tokens`` filters pairs (use it for train only).

    Streams: each chunk's kept ids are appended to the arrays' files as it comes back, in a
    temporary folder renamed onto ``out_dir`` only when every array is complete.
    """
    vocab_size, pairs = _check_split(split, src_path, tgt_path, model_path, out_dir, max_tokens, workers)
    out_dir = Path(out_dir)
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    counts = dict.fromkeys(("pairs_in", "dropped_too_long", "dropped_empty", "src_tokens", "tgt_tokens"), 0)
    longer_sides = np.zeros(_LENGTH_BINS + 1, dtype=np.int64)  # pairs by their longer side's tokens
    with atomic_path(out_dir, directory=True) as tmp:
        tmp.mkdir()
        chunks = encode_chunks(src_path, tgt_path, model_path, workers, pairs, desc=f"binarize {split}")
        _write_arrays(tmp, chunks, dtype, max_tokens, counts, longer_sides)
        if counts["pairs_in"] != pairs:  # a file that changed while it was read
            raise UserError(f"{src_path}: {pairs} lines counted but {counts['pairs_in']} read; was it being written?")
        kept = counts["pairs_in"] - counts["dropped_too_long"] - counts["dropped_empty"]
        if max_tokens is not None and kept < MIN_KEPT_SHARE * counts["pairs_in"]:
            raise _too_few_kept(split, src_path, tgt_path, counts, kept, max_tokens, longer_sides)
        if max_tokens is None and not counts["src_tokens"]:  # an evaluation split keeps every pair, blank or not
            raise UserError(
                f"{src_path}: every one of its {pairs} lines is blank, so the {split} split has no source sentence "
                f"to translate or score; give the {split} split's source-language text as --src "
                f"(data.local.{split}.src in the config), line for line with {tgt_path}"
            )
        meta = {
            "split": split,
            "pairs_in": counts["pairs_in"],
            "pairs_kept": counts["pairs_in"] - counts["dropped_too_long"] - counts["dropped_empty"],
            "dropped_too_long": counts["dropped_too_long"],
            "dropped_empty": counts["dropped_empty"],
            "max_tokens": max_tokens,
            "src_tokens": counts["src_tokens"],
            "tgt_tokens": counts["tgt_tokens"],
            "dtype": np.dtype(dtype).name,
            "vocab_size": vocab_size,
            "vocab_fingerprint": vocab_fingerprint(model_path),
            "data_fingerprint": fingerprint_files(src_path, tgt_path),
            "src_file": str(src_path),
            "tgt_file": str(tgt_path),
        }
        (tmp / SPLIT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def _check_split(split: str, src_path: str | Path, tgt_path: str | Path, model_path: str | Path,
                 out_dir: str | Path, max_tokens: int | None, workers: int) -> tuple[int, int]:
    """Refuse what cannot be binarized before any work: outputs that are inputs, one file for both sides,
    a folder the stage did not write, files of different lengths, an empty split. Returns the vocabulary's
    size and the pairs."""
    refuse_overwriting_inputs({}, {"--src": src_path, "--tgt": tgt_path, "--spm-model": model_path},
                              {"--out-dir": out_dir})  # the folder is replaced as a whole
    if same_file(src_path, tgt_path):
        raise UserError(f"--src {src_path} and --tgt {tgt_path} are one file: a parallel corpus pairs each "
                        "sentence with its translation; give the target language's file as --tgt")
    refuse_replacing_a_folder("--out-dir", out_dir, SPLIT_META, "aiayn binarize")
    if workers < 1:
        raise UserError(f"--workers {workers} must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"binarize.max_tokens = {max_tokens} must be at least 1")
    # the model first, in this process: workers that cannot load it would fail where no one sees
    vocab_size = load_processor(model_path).get_piece_size()
    pairs, tgt_pairs = count_lines(src_path), count_lines(tgt_path)
    if pairs != tgt_pairs:
        raise UserError(f"{src_path} has {pairs} lines but {tgt_path} has {tgt_pairs}; they must be parallel")
    if not pairs:
        raise UserError(f"{src_path}: the {split} split is empty")
    return vocab_size, pairs


def _write_arrays(folder: Path, chunks: Iterator, dtype, max_tokens: int | None, counts: dict,
                  longer_sides: np.ndarray) -> None:
    """The encoded chunks' kept pairs appended to the split's arrays in ``folder``, as they come; ``counts``
    and ``longer_sides`` (pairs by their longer side's tokens) count what was read and dropped."""
    with contextlib.ExitStack() as stack:
        arrays = {name: stack.enter_context(NpyWriter(folder / f"{name}.npy", kind))
                  for name, kind in zip(SPLIT_ARRAYS, (dtype, np.int64, dtype, np.int64, np.int64))}
        arrays["src.offsets"].append(np.zeros(1))
        arrays["tgt.offsets"].append(np.zeros(1))
        for src_flat, src_len, tgt_flat, tgt_len in chunks:
            if max_tokens is None:  # evaluation splits: every sentence stays
                empty = too_long = np.zeros(len(src_len), dtype=bool)
            else:
                empty = (src_len == 0) | (tgt_len == 0)
                too_long = ~empty & ((src_len > max_tokens) | (tgt_len > max_tokens))
            keep = ~(empty | too_long)
            for side, flat, lengths in (("src", src_flat, src_len), ("tgt", tgt_flat, tgt_len)):
                arrays[f"{side}.ids"].append(flat[np.repeat(keep, lengths)])
                arrays[f"{side}.offsets"].append(counts[f"{side}_tokens"] + np.cumsum(lengths[keep]))
                counts[f"{side}_tokens"] += int(lengths[keep].sum())
            arrays["lines"].append(counts["pairs_in"] + np.flatnonzero(keep))
            counts["pairs_in"] += len(keep)
            counts["dropped_too_long"] += int(too_long.sum())
            counts["dropped_empty"] += int(empty.sum())
            longer_sides += np.bincount(np.minimum(np.maximum(src_len, tgt_len), _LENGTH_BINS),
                                        minlength=_LENGTH_BINS + 1)


def _too_few_kept(split: str, src_path, tgt_path, counts: dict, kept: int, max_tokens: int,
                  longer_sides: np.ndarray) -> UserError:
    """The refusal of a split that keeps under MIN_KEPT_SHARE of its pairs, naming why the rest went."""
    share = f"{kept} of {counts['pairs_in']} pairs" if kept else f"none of its {counts['pairs_in']} pairs"
    causes = []
    if counts["dropped_too_long"]:
        # the max_tokens that would keep nine pairs in ten of those with text on both sides
        cumulative = np.cumsum(longer_sides[1:])
        wanted = int(np.searchsorted(cumulative, 0.9 * cumulative[-1])) + 1 if cumulative[-1] else 0
        causes.append(f"{counts['dropped_too_long']} have a side of more than binarize.max_tokens = {max_tokens} "
                      f"BPE tokens (max_tokens = {wanted}{'+' if wanted > _LENGTH_BINS else ''} would keep 90% "
                      "of them: raise it, or check that the text has one sentence a line)")
    if counts["dropped_empty"]:
        causes.append(f"{counts['dropped_empty']} have an empty side (check that {tgt_path} is the translation "
                      f"of {src_path}, line for line)")
    return UserError(
        f"{src_path}, {tgt_path}: the {split} split keeps {share} (at least {MIN_KEPT_SHARE:.0%} must be kept): "
        f"{'; '.join(causes)}"
    )


@dataclass
class TokenizedSplit:
    """A binarized split, memory-mapped; sentence ``i`` is ``src(i)`` / ``tgt(i)``."""

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
    if not (path / SPLIT_META).exists():
        raise UserError(f"{path}: not a binarized split (no {SPLIT_META}); run the binarize stage")
    mode = "r" if mmap else None
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode=mode) for name in SPLIT_ARRAYS}
    return TokenizedSplit(arrays["src.ids"], arrays["src.offsets"], arrays["tgt.ids"], arrays["tgt.offsets"],
                          arrays["lines"], json.loads((path / SPLIT_META).read_text()))


@cli
def main(argv=None):
    from aiayn.config import add_config_arguments, section_from_arguments

    parser = argparse.ArgumentParser(prog="aiayn binarize", description=__doc__.splitlines()[0])
    add_config_arguments(parser, "binarize")
    parser.add_argument("--split", required=True, choices=("train", "dev", "test"),
                        help="train is filtered by binarize.max_tokens; dev and test keep every pair")
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)
    parser.add_argument("--spm-model", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: binarize.workers)")
    args = parser.parse_args(argv)
    settings = section_from_arguments(args, "binarize", {"workers": ("--workers", args.workers)})
    max_tokens = settings["max_tokens"] if args.split == "train" else None  # never drop evaluation sentences
    meta = binarize_split(args.split, args.src, args.tgt, args.spm_model, args.out_dir, max_tokens,
                          settings["workers"])
    print(f"{args.split}: {binarized_summary(meta)}")


def binarized_summary(meta: dict) -> str:
    """What the log says of a split: what was kept, and why the rest was dropped (train) or that
    nothing was (evaluation splits, which keep every pair)."""
    if meta["max_tokens"] is None:
        kept = f"all {meta['pairs_in']} pairs kept (an evaluation split: none is dropped)"
    else:
        kept = (f"{meta['pairs_kept']}/{meta['pairs_in']} pairs kept ({meta['dropped_too_long']} over "
                f"{meta['max_tokens']} tokens, {meta['dropped_empty']} with an empty side dropped)")
    return f"{kept}, {meta['src_tokens']} + {meta['tgt_tokens']} tokens, {meta['dtype']}"


if __name__ == "__main__":
    raise SystemExit(main())
