"""The decode stage: beam-search translation of text (paper, Section 6.1), in batches and threads.

The search itself is ``aiayn.search``; this module feeds it: sentences encoded with the run's
SentencePiece model, grouped by length into batches of a token budget (``decode.tokens_per_batch``; its
``auto`` by the device's memory, ``aiayn.memory``), searched by worker threads on the CPU (``decode.workers``)
or one at a time on a GPU (a batch that runs out of its memory in halves), and written back in input order.
``translate`` is the library function, ``main`` the ``aiayn decode`` CLI.

Imports torch alone at module level; sentencepiece and tqdm are imported where they are used.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from aiayn.batching import length_sorted_batches
from aiayn.checkpoint import load_model
from aiayn.config import read_config
from aiayn.device import choose_device
from aiayn.errors import UserError, cli
from aiayn.memory import BatchHalving, tokens_per_batch_for_device
from aiayn.model import ModelConfig
from aiayn.search import Hypothesis, SearchConfig, beam_search
from aiayn.search_contract import SearchModel
from aiayn.speed.decoder_cache import ScratchBuffers
from aiayn.speed.incremental import InferenceModel
from aiayn.speed.search_steps import FAST_STEPS
from aiayn.tokens import EOS_ID, PAD_ID
from aiayn.speed.precision import autocast_context, inference_precision


def translate(
    model: SearchModel,
    processor: Any,
    sentences: Sequence[str],
    config: SearchConfig | None = None,
    tokens_per_batch: int | str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
    workers: int | None = None,
    source: str = "the input",
    max_source_tokens: int | None = None,
) -> list[list[Hypothesis]]:
    """Beam-search each sentence; its config.n_best hypotheses, best first, in input order
    (``hypothesis_text`` turns one into text). The Python API: the values given are checked by the
    schema's rules for their `decode` keys; what is left out is the schema's default (no
    ``max_source_tokens``: no limit). ``translate_settings`` does the work.
    """
    section = read_config(None, "decode", {
        f"decode.{key}": (key, value) for key, value in (("tokens_per_batch", tokens_per_batch), ("workers", workers),
                                                         ("max_source_tokens", max_source_tokens))})
    settings = DecodeSettings(config or SearchConfig(), section["tokens_per_batch"], section["workers"],
                              max_source_tokens)
    return translate_settings(model, processor, sentences, settings, device, progress, source)


def translate_settings(model: SearchModel, processor: Any, sentences: Sequence[str], settings: DecodeSettings,
                       device: torch.device | str = "cpu", progress: bool = True,
                       source: str = "the input") -> list[list[Hypothesis]]:
    """``translate`` with settings that came through the door (``DecodeSettings.from_section``), not checked
    again. A blank line is not decoded: it gets one empty hypothesis with score 0. Sentences longer than a
    learned positional table, or of more than ``settings.max_source_tokens`` BPE tokens, are refused before
    any is searched, by line of ``source`` (``check_lengths``)."""
    from tqdm import tqdm

    device = torch.device(device)
    config = settings.search
    tokens_per_batch = tokens_per_batch_for_device(settings.tokens_per_batch, device, getattr(model, "config", None),
                                                   config, "auto")
    results: list[list[Hypothesis]] = [[Hypothesis(tokens=[], score=0.0, log_prob=0.0)] for _ in sentences]
    to_decode = [index for index, sentence in enumerate(sentences) if sentence.strip()]
    if not to_decode:
        return results
    # Source sequences are BPE ids then EOS, no BOS (the binarize stage's convention).
    encoded = [ids + [EOS_ID] for ids in processor.encode([sentences[i] for i in to_decode], out_type=int)]
    check_lengths(model, [len(ids) for ids in encoded], to_decode, source, settings.max_source_tokens)
    batches = length_sorted_batches([len(ids) for ids in encoded], tokens_per_batch, config.beam_size)
    padded = [_pad([encoded[i] for i in batch], device) for batch in batches]

    def where(index: int, row: int) -> str:  # a sentence of a batch, by its line
        position = batches[index][row]
        return f"{source}, line {to_decode[position] + 1} ({len(encoded[position]) - 1} BPE tokens)"

    with tqdm(total=len(encoded), unit="sent", desc="decode", disable=not progress, file=sys.stderr) as bar:
        searched = _search_batches(model, padded, config, search_workers(settings.workers, device), bar.update, where)
    for batch, hypotheses in zip(batches, searched):
        for position, sentence_hypotheses in zip(batch, hypotheses):
            results[to_decode[position]] = sentence_hypotheses
    return results


def _named_lines(too_long: Sequence[tuple[int, int]]) -> str:
    """``line 3 (812 tokens)``, or the first five of several and how many more (lengths with EOS)."""
    shown = ", ".join(f"{line} ({length - 1} tokens)" for line, length in too_long[:5])
    more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
    return f"line{'s' if len(too_long) > 1 else ''} {shown}{more}"


def check_lengths(model: SearchModel, lengths: Sequence[int], lines: Sequence[int], source: str,
                  max_source_tokens: int | None = None) -> None:
    """Refuse sources longer than the model's learned positional table (Table 3 row E), naming their lines
    (0-based ``lines``, named from 1), before anything is searched: the search would fail at the first
    batch that holds one, after the batches before it, and writing the others alone would break the one
    line per input line that scoring needs. fairseq-generate refuses them too, unless told to skip them.
    Sinusoids (Section 3.5) extend to any length, so those models take any sentence; there a source of
    more than ``max_source_tokens`` BPE tokens (``decode.max_source_tokens``) is refused the same way: its
    search, an encoder over it and then its length + max_len_b steps, would run for hours."""
    config = getattr(model, "config", None)
    if getattr(config, "positional", None) == "learned":
        _refuse_learned_overflow(config.max_positions, lengths, lines, source)
    if max_source_tokens is None:
        return
    too_long = [(line + 1, length) for line, length in zip(lines, lengths) if length - 1 > max_source_tokens]
    if too_long:
        raise UserError(
            f"{source}: {len(too_long)} sentence{'s' if len(too_long) > 1 else ''} of more than "
            f"decode.max_source_tokens = {max_source_tokens} BPE tokens, {_named_lines(too_long)}; nothing was "
            "translated: split those lines into sentences (one a line), or raise decode.max_source_tokens "
            "(aiayn translate: --max-source-tokens) if they are meant to be searched whole"
        )


def _refuse_learned_overflow(limit: int, lengths: Sequence[int], lines: Sequence[int], source: str) -> None:
    # a source is its tokens and EOS, at positions 0 .. length - 1
    too_long = [(line + 1, length) for line, length in zip(lines, lengths) if length > limit]
    if not too_long:
        return
    raise UserError(
        f"{source}: {len(too_long)} sentence{'s' if len(too_long) > 1 else ''} longer than the model's learned "
        f"positional table (max_positions = {limit}: at most {limit - 1} BPE tokens and the end-of-sentence), "
        f"{_named_lines(too_long)}; nothing was translated: split or shorten those "
        "lines (the model cannot read past its table; a model with positional = sinusoidal has no such limit)"
    )


def hypothesis_text(processor: Any, hypothesis: Hypothesis) -> str:
    """A hypothesis detokenised ("" for an empty one)."""
    return processor.decode(hypothesis.tokens) if hypothesis.tokens else ""


def resolve_tokens_per_batch(tokens_per_batch: int | str | None, device: torch.device | str,
                             model: ModelConfig | None = None, search: SearchConfig | None = None) -> int:
    """decode.tokens_per_batch as the Python API gives it (None: the schema's default), checked by the
    schema's rule, as a number: ``auto`` on a GPU for ``model`` searched by ``search`` (default: the paper's)
    in that GPU's memory, 8000 elsewhere (``aiayn.memory.tokens_per_batch_for_device``)."""
    section = read_config(None, "decode", {"decode.tokens_per_batch": ("tokens_per_batch", tokens_per_batch)})
    return tokens_per_batch_for_device(section["tokens_per_batch"], torch.device(device), model,
                                       search or SearchConfig(), "auto")


def _pad(sequences: Sequence[Sequence[int]], device: torch.device | str) -> Tensor:
    longest = max(len(sequence) for sequence in sequences)
    batch = torch.full((len(sequences), longest), PAD_ID, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    return batch.to(device)


def search_workers(workers: int, device: torch.device) -> int:
    """The workers search_batches uses: as asked on the CPU; 1 on an accelerator, which runs one search
    at a time (larger batches keep it busy), so that CPU configs also run there."""
    return workers if device.type == "cpu" else 1


def search_batches(
    model: SearchModel,
    batches: Sequence[Tensor],
    config: SearchConfig | None = None,
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[list[list[Hypothesis]]]:
    """beam_search on each padded batch (all on one device, most sentences first), returning each
    batch's results in the order of `batches`.

    With workers > 1 on the CPU (elsewhere it is 1) that many batches are searched at the same time,
    each in its own thread with torch.get_num_threads() // workers intra-op threads (at least 1);
    CTranslate2 calls these inter_threads. torch releases the GIL inside its operators, so
    the threads run on separate cores. A search step is hundreds of small operators, which one
    thread runs with less overhead than two sharing each operator, so workers of one thread each
    decode faster than one worker with all the threads (BENCHMARKS.md).
    on_done(sentences) is called as each batch finishes (from the calling thread).
    Under inference_mode, on a GPU under the autocast of its precision (``inference_precision``: bf16,
    fp16 or fp32 by its compute capability), with the search's fast steps (``FAST_STEPS``); a batch that
    runs out of CUDA memory is searched in halves (``aiayn.memory.BatchHalving``).
    The Python API: workers is checked by the schema's rule (None: the schema's default).
    """
    workers = read_config(None, "decode", {"decode.workers": ("workers", workers)})["workers"]
    return _search_batches(model, batches, config or SearchConfig(), workers, on_done)


def _search_batches(model: SearchModel, batches: Sequence[Tensor], config: SearchConfig, workers: int,
                    on_done: Callable[[int], None] | None = None,
                    where: Callable[[int, int], str] | None = None) -> list[list[list[Hypothesis]]]:
    """``where(batch index, row)`` names a sentence, for the error where its search alone runs out of memory."""
    if not batches:
        return []
    device = batches[0].device
    workers = search_workers(workers, device)
    per_thread = threading.local()  # each thread's ScratchBuffers: its searches reuse one cache memory
    precision = inference_precision(device)
    # where a search runs out of memory, its scratch memory goes with it
    halving = BatchHalving(lambda: per_thread.__dict__.pop("scratch", None),
                           where or (lambda index, row: f"sentence {row + 1} of batch {index + 1}"))

    def search(batch: Tensor) -> list[list[Hypothesis]]:
        if not hasattr(per_thread, "scratch"):
            per_thread.scratch = ScratchBuffers()
        # On a GPU bf16, fp16 or fp32 as training's `auto` there; the log-softmax stays float32 in beam_search.
        # inference_mode and autocast are per thread, so each worker enters them itself.
        with torch.inference_mode(), autocast_context(device, precision):
            return beam_search(model, batch, config, per_thread.scratch, FAST_STEPS)

    results: list[list[list[Hypothesis]]] = [[] for _ in batches]
    # Most sentences first (each costs a decoder row per beam and step; source length matters less): a
    # thread's first search sizes the scratch memory that its later ones reuse, and with workers the
    # last batches to start are small ones, so that the workers finish close together.
    largest_first = sorted(range(len(batches)), key=lambda index: (-batches[index].shape[0], -batches[index].numel()))
    if workers == 1:
        for index in largest_first:
            results[index] = halving.run(search, batches[index], index)
            if on_done is not None:
                on_done(batches[index].shape[0])
        return results

    from concurrent.futures import ThreadPoolExecutor, as_completed

    threads = torch.get_num_threads()
    per_worker = max(1, threads // workers)

    def initialise() -> None:
        torch.set_num_threads(per_worker)  # OpenMP's thread count is per calling thread: set it in each

    try:
        with ThreadPoolExecutor(max_workers=workers, initializer=initialise, thread_name_prefix="aiayn-search") as pool:
            futures = {pool.submit(search, batches[index]): index for index in largest_first}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if on_done is not None:
                    on_done(batches[futures[future]].shape[0])
    finally:
        torch.set_num_threads(threads)
    return results


def load_runtime(args: argparse.Namespace) -> tuple[InferenceModel, Any, torch.device]:
    """The model prepared for search, its SentencePiece processor and the device, from the arguments of
    ``add_runtime_arguments``; the model is refused if it was trained with another vocabulary."""
    from aiayn.bpe import load_processor

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads {args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    processor = load_processor(args.spm_model)
    model = InferenceModel(load_model(args.model, device, spm_model=args.spm_model))
    return model, processor, device


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="an averaged model.pt or a training checkpoint")
    parser.add_argument("--spm-model", required=True, help="the run's SentencePiece model (spm.model)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


@dataclass(frozen=True)
class DecodeSettings:
    """The ``decode`` section, built once at the CLI boundary: the search itself and how it is fed."""

    search: SearchConfig
    tokens_per_batch: int | str  # a number, or "auto" (``resolve_tokens_per_batch``)
    workers: int
    max_source_tokens: int | None  # None: no limit (the Python API's ``translate`` without one)

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> DecodeSettings:
        """From a section the config reader checked and filled (``aiayn.config``): not checked again."""
        return cls(search=SearchConfig.from_section(section), tokens_per_batch=section["tokens_per_batch"],
                   workers=section["workers"], max_source_tokens=section["max_source_tokens"])


@cli
def main(argv: Sequence[str] | None = None) -> None:
    from aiayn.config import add_config_arguments, section_from_arguments
    from aiayn.reading import read_lines
    from aiayn.writing import prepare_output, refuse_overwriting_inputs, write_lines_atomic

    parser = argparse.ArgumentParser(prog="aiayn decode", description=__doc__.splitlines()[0])
    add_config_arguments(parser, "decode")
    add_runtime_arguments(parser)
    parser.add_argument("--input", required=True, help="source text, one sentence a line")
    parser.add_argument("--output", required=True, help="where to write the translations, one a line")
    parser.add_argument("--workers", type=int, help="overrides decode.workers")
    parser.add_argument("--max-source-tokens", type=int, help="overrides decode.max_source_tokens")
    args = parser.parse_args(argv)
    refuse_overwriting_inputs({"--output": args.output, "stdout": sys.stdout},
                              {"--input": args.input, "--model": args.model, "--spm-model": args.spm_model,
                               "--config": args.config})

    settings = DecodeSettings.from_section(section_from_arguments(args, "decode", {
        "workers": ("--workers", args.workers), "max_source_tokens": ("--max-source-tokens", args.max_source_tokens)}))
    config = settings.search
    prepare_output(args.output, create=False)  # refused before decoding, not after; its folder made when written
    sentences = read_lines(args.input)
    model, processor, device = load_runtime(args)
    tokens_per_batch = tokens_per_batch_for_device(settings.tokens_per_batch, device, model.config, config,
                                                   "auto")
    workers = search_workers(settings.workers, device)

    start = time.perf_counter()
    hypotheses = translate_settings(model, processor, sentences, settings, device, source=args.input)
    seconds = max(time.perf_counter() - start, 1e-9)
    # Target tokens count each non-empty output's EOS, as fairseq's generated-token counts do.
    target_tokens = sum(len(best[0].tokens) + 1 for best, line in zip(hypotheses, sentences) if line.strip())
    write_lines_atomic(args.output, [hypothesis_text(processor, best[0]) for best in hypotheses])
    print(
        f"decoded {len(sentences)} sentences ({target_tokens} target tokens) in {seconds:.1f} s on {device}: "
        f"{len(sentences) / seconds:.1f} sentences/s, {target_tokens / seconds:.0f} target tokens/s "
        f"(beam {config.beam_size}, alpha {config.length_penalty}, max length "
        f"{config.max_len_a:g} * source + {config.max_len_b}, tokens_per_batch {tokens_per_batch}, workers {workers})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
