"""aiayn explore: one self-contained HTML page of what a trained model attends to, sentence by sentence.

    aiayn explore --model model.pt --spm-model spm.model --out attention.html

For each sentence the page shows the model's translation (the decode stage's beam search, with the run's
``decode`` settings) and the weights of every attention module, every layer and every head: encoder
self-attention, the decoder's masked self-attention and encoder-decoder attention. The weights are the
model's own Eq. 1, recomputed from each module's parts as the report's pictures are
(``aiayn.appendix_figures``); the decoder's are taken under teacher forcing on the model's own translation,
so that they are the weights with which it wrote that translation.

The page is hand-written (``explore_page.html``, package data) and filled with the data as JSON: canvases
and a little JavaScript, nothing fetched from anywhere, so that it opens offline from a cluster's file
system or an MLflow artifact. A plotting library would inline megabytes of JavaScript for a heatmap
(docs/explorer.md). The weights travel as little-endian float32 in base64: exact, and smaller
than their decimal digits.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch

from aiayn.appendix_figures import ANAPHORA, LONG_DISTANCE, encode_sentence, every_attention
from aiayn.errors import UserError, cli
from aiayn.tokens import BOS_ID, EOS_ID, UNK_ID

DEV_SENTENCES = 3  # the dev sentences the default page shows after the paper's two
KINDS = ("encoder", "decoder_self", "cross")  # the keys of every_attention, in the page's order
PAGE_TEMPLATE = "explore_page.html"
DATA_MARK = "__EXPLORER_DATA__"  # where the template takes the JSON
DATA_FORMAT = 1


# --- which sentences -------------------------------------------------------------------------

def default_sentences(dev: str | Path | None = None, count: int = DEV_SENTENCES,
                      vocabulary: str | Path | None = None) -> list[str]:
    """The paper's two appendix sentences, then the first ``count`` non-blank lines of ``dev`` if given.

    The dev lines come first where ``vocabulary`` (the model's spm.model) cannot read the paper's sentences,
    a piece of them unknown to it: the demo's, learned on its synthetic language, has no capital "I" for
    "It". The page opens on its first sentence, and should open on one that the model can read.
    """
    from aiayn.reading import read_lines

    paper = [LONG_DISTANCE, ANAPHORA]
    lines = [line for line in read_lines(dev) if line.strip()][:count] if dev is not None else []
    if lines and vocabulary is not None:
        from aiayn.bpe import load_processor

        processor = load_processor(vocabulary)
        if any(UNK_ID in processor.encode(sentence, out_type=int) for sentence in paper):
            return lines + paper
    return paper + lines


def sentences_from_file(path: str | Path) -> list[str]:
    """Every line of ``path``, one sentence a line; a blank line is refused (it has nothing to attend to)."""
    from aiayn.reading import read_lines

    lines = read_lines(path)
    if not lines:
        raise UserError(f"--input {path}: the file is empty; give one sentence a line")
    blank = [number for number, line in enumerate(lines, 1) if not line.strip()]
    if blank:
        shown = ", ".join(map(str, blank[:5])) + (f" and {len(blank) - 5} more" if len(blank) > 5 else "")
        raise UserError(f"--input {path}: line{'s' if len(blank) > 1 else ''} {shown} {'are' if len(blank) > 1 else 'is'} "
                        "blank, and a blank sentence has no attention to show; remove the blank lines")
    return lines


# --- the data the page holds -----------------------------------------------------------------

def float32_base64(weights: torch.Tensor) -> dict[str, Any]:
    """A tensor as its shape and its values, little-endian float32 in base64 (the page decodes it exactly)."""
    values = weights.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4")
    return {"shape": list(values.shape), "float32": base64.b64encode(values.tobytes()).decode("ascii")}


def decode_float32_base64(encoded: dict[str, Any]) -> torch.Tensor:
    """``float32_base64`` undone: what the page draws, as a tensor."""
    import numpy as np

    values = np.frombuffer(base64.b64decode(encoded["float32"]), dtype="<f4")
    return torch.from_numpy(values.copy()).reshape(encoded["shape"])


def explore_sentence(model: torch.nn.Module, processor: Any, sentence: str, output: Sequence[int],
                     translation: str) -> dict[str, Any]:
    """One sentence's entry of the page: its pieces and ids, the translation's, and every attention weight.

    ``output``: the translation's ids without BOS and EOS (a ``Hypothesis``'s tokens). The decoder is fed
    BOS and ``output`` (teacher forcing) and writes ``output`` and EOS; its rows are named by the piece each
    position writes. Weights per kind: (layers, heads, queries, keys).
    """
    device = model.embedding.weight.device
    source = encode_sentence(processor, sentence)
    fed = [BOS_ID, *output]
    written = [*output, EOS_ID]
    weights = every_attention(model, torch.tensor([source.ids], device=device), torch.tensor([fed], device=device))
    return {
        "source": sentence,
        "translation": translation,
        "source_ids": source.ids,
        "source_pieces": source.pieces,
        "target_in_ids": fed,
        "target_in_pieces": [processor.id_to_piece(piece) for piece in fed],
        "target_out_ids": written,
        "target_out_pieces": [processor.id_to_piece(piece) for piece in written],
        "weights": {kind: float32_base64(torch.stack([layer[0] for layer in weights[kind]])) for kind in KINDS},
    }


def explorer_data(model: torch.nn.Module, processor: Any, sentences: Sequence[str], settings: Any,
                  model_name: str = "") -> dict[str, Any]:
    """Everything the page shows: each sentence translated by beam search (``settings``: a
    ``DecodeSettings``), then its attention under teacher forcing on that translation."""
    from aiayn.decode import hypothesis_text, translate_settings
    from aiayn.speed.incremental import InferenceModel

    device = model.embedding.weight.device
    hypotheses = translate_settings(InferenceModel(model), processor, sentences, settings, device, progress=False,
                                    source="the sentences")
    config = model.config
    return {
        "format": DATA_FORMAT,
        "model": {"name": model_name, "n_layers": config.n_layers, "n_heads": config.n_heads,
                  "d_model": config.d_model, "d_head": config.head_dim, "vocab_size": config.vocab_size,
                  "positional": config.positional, "parameters": model.num_parameters()},
        "search": dataclasses.asdict(settings.search),
        "kinds": list(KINDS),
        "sentences": [explore_sentence(model, processor, sentence, best[0].tokens, hypothesis_text(processor, best[0]))
                      for sentence, best in zip(sentences, hypotheses)],
    }


def render_page(data: dict[str, Any]) -> str:
    """The page: the template with ``data`` as JSON in its data script (``<`` escaped, so that no text of a
    sentence can end the script)."""
    template = resources.files("aiayn").joinpath(PAGE_TEMPLATE).read_text(encoding="utf-8")
    blob = json.dumps(data, ensure_ascii=True, separators=(",", ":")).replace("<", "\\u003c")
    return template.replace(DATA_MARK, blob, 1)


def read_page_data(page: str) -> dict[str, Any]:
    """The data a page written by ``render_page`` holds."""
    start = page.index('<script id="explorer-data" type="application/json">')
    start = page.index(">", start) + 1
    return json.loads(page[start:page.index("</script>", start)])


def write_explorer(model_path: str | Path, spm_model: str | Path, sentences: Sequence[str], out: str | Path,
                   settings: Any = None, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Load the model (refused with another vocabulary), build the page's data and write the page to ``out``
    (atomically). ``settings``: a ``DecodeSettings``, by default the schema's ``decode`` section."""
    from aiayn.bpe import load_processor
    from aiayn.checkpoint import load_model
    from aiayn.config import section_defaults
    from aiayn.decode import DecodeSettings
    from aiayn.writing import write_text_atomic

    if not sentences:
        raise UserError("no sentences to explore; give --sentence or --input")
    settings = settings or DecodeSettings.from_section(section_defaults("decode"))
    model = load_model(model_path, device, spm_model)
    processor = load_processor(spm_model)
    data = explorer_data(model, processor, sentences, settings, model_name=str(model_path))
    page = render_page(data)
    write_text_atomic(out, page)
    return {"path": Path(out), "bytes": len(page.encode("utf-8")), "sentences": len(sentences)}


# --- the command -----------------------------------------------------------------------------

def arguments() -> argparse.ArgumentParser:
    from aiayn.decode import add_runtime_arguments

    parser = argparse.ArgumentParser(prog="aiayn explore", description=__doc__.splitlines()[0])
    add_runtime_arguments(parser)
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--input", help="sentences to show, one a line")
    given.add_argument("--sentence", action="append", help="a sentence to show (repeatable)")
    parser.add_argument("--dev", help="source text whose first sentences the default page shows after the paper's "
                                      "two appendix sentences, or before them where the vocabulary cannot read those "
                                      f"(default: none; with --dev-count {DEV_SENTENCES})")
    parser.add_argument("--dev-count", type=int, default=DEV_SENTENCES,
                        help=f"how many of --dev's sentences (default: {DEV_SENTENCES})")
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files whose `decode` section sets the search (default: the schema's)")
    parser.add_argument("--out", required=True, help="the HTML page to write")
    return parser


@cli
def main(argv: Sequence[str] | None = None) -> None:
    from aiayn.config import read_config
    from aiayn.decode import DecodeSettings
    from aiayn.device import choose_device
    from aiayn.writing import prepare_output, refuse_overwriting_inputs

    args = arguments().parse_args(argv)
    refuse_overwriting_inputs({"--out": args.out}, {
        "--model": args.model, "--spm-model": args.spm_model, "--input": args.input, "--dev": args.dev,
        "--config": args.config})
    if (args.input or args.sentence) and args.dev:
        raise UserError("--dev adds dev sentences to the default page only; with --input or --sentence leave it out")
    if args.dev_count < 0:
        raise UserError(f"--dev-count {args.dev_count}: give a number of sentences, 0 or more")
    if args.sentence is not None and not all(sentence.strip() for sentence in args.sentence):
        raise UserError("--sentence: a blank sentence has no attention to show; give words")
    prepare_output(args.out, create=False)  # refused before the model is loaded, not after
    settings = DecodeSettings.from_section(read_config(args.config, "decode"))
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads {args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    sentences = (sentences_from_file(args.input) if args.input else args.sentence
                 or default_sentences(args.dev, args.dev_count, args.spm_model))
    written = write_explorer(args.model, args.spm_model, sentences, args.out, settings, choose_device(args.device))
    print(f"wrote {written['path']}: {written['sentences']} sentences, {written['bytes']} bytes; open it in a browser "
          "(it needs no network)")


if __name__ == "__main__":
    raise SystemExit(main())
