"""Parameter counts from the config alone, set beside the paper's params column (Table 3).

``count_parameters`` is the formula, so the big model and every Table 3 row are counted without
building them; ``main`` prints the counts of a list of presets: the paper's by name without a config
(all of them when none is named), or those a config trains. At vocab_size 37000 the faithful model
comes out about 2M under most of the paper's figures (63.1M for base against 65M): the paper rounds,
and its exact vocabulary size is not given; the gap is reported, not fitted away.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Mapping, Sequence

from aiayn.errors import UserError, cli
from aiayn.model import ModelConfig


def count_parameters(config: ModelConfig) -> int:
    """The number of distinct parameters of ``Transformer(config)``, from the formula."""
    d_model, d_ff = config.d_model, config.d_ff
    query_key_size = config.n_heads * config.head_dim
    value_size = config.n_heads * config.value_dim
    # Section 3.2.2: W^Q, W^K, W^V per head, stacked, and W^O; all with biases.
    attention = 2 * (d_model * query_key_size + query_key_size) + (d_model * value_size + value_size)
    attention += value_size * d_model + d_model
    feed_forward = (d_model * d_ff + d_ff) + (d_ff * d_model + d_model)  # Eq. 2
    layer_norm = 2 * d_model  # gain and bias
    encoder_layer = attention + feed_forward + 2 * layer_norm
    decoder_layer = 2 * attention + feed_forward + 3 * layer_norm
    embedding = config.vocab_size * d_model  # Section 3.4: shared by both stacks and the output, counted once
    positions = config.max_positions * d_model if config.positional == "learned" else 0
    return embedding + positions + config.n_layers * (encoder_layer + decoder_layer)


def parameter_rows(presets: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """[{preset, model, paper_params}] (``presets_from_config``) -> [{preset, params, paper_params}]."""
    return [{"preset": entry["preset"], "params": count_parameters(ModelConfig.from_dict(entry["model"])),
             "paper_params": entry["paper_params"]} for entry in presets]


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table: preset, params, paper_params, diff% (relative to the paper)."""
    lines = [("preset", "params", "paper_params", "diff%")]
    for row in rows:
        paper = row["paper_params"]
        lines.append(
            (
                str(row["preset"]),
                f"{row['params']:,}",
                "-" if paper is None else f"{paper:,.0f}",
                "-" if not paper else f"{100.0 * (row['params'] - paper) / paper:+.1f}",
            )
        )
    widths = [max(len(line[column]) for line in lines) for column in range(4)]
    formatted = []
    for line in lines:
        # Names flush left, numbers flush right, so the digits line up.
        cells = [line[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(line[1:], widths[1:])]
        formatted.append("  ".join(cells))
    return "\n".join(formatted)


def presets_from_config(paths: Sequence[str] | None, names: Sequence[str] = (),
                        vocab_size: int | None = None) -> list[dict[str, Any]]:
    """The presets ``names`` as {preset, model, paper_params} (every preset a config trains when none is
    named), from the config files ``paths`` or, without them, the paper's presets at its vocabulary size."""
    from aiayn.config import model_fields, read_config, resolve_preset
    from aiayn.presets import paper_presets, paper_vocab_size

    if paths:
        config = read_config(paths)
        models = list(names) or config["models"]
        vocab_size = vocab_size or config["bpe"]["vocab_size"]
    else:
        models = list(names) or list(paper_presets())
        unknown = [name for name in models if name not in paper_presets()]
        if unknown:
            raise UserError(f"aiayn params: no preset of the paper is named {', '.join(map(repr, unknown))} (the "
                            f"paper's: {', '.join(paper_presets())}; a preset of your own: add --config FILE)")
        config = read_config(merged={"models": models}, sources=["aiayn params"])
        vocab_size = vocab_size or paper_vocab_size()
    entries = []
    for name in models:
        preset = resolve_preset(config, name, paths or ["aiayn params"])
        model = {"vocab_size": vocab_size, **model_fields(preset)}
        entries.append({"preset": name, "model": model, "paper_params": preset["paper"].get("params")})
    return entries


@cli
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aiayn.params",
        description="Count model parameters and compare them with the paper's params column (Table 3).",
    )
    parser.add_argument("names", nargs="*", metavar="PRESET",
                        help="presets by name (without --config: the paper's, all of them when none is named)")
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order): every preset in `models`, at bpe.vocab_size")
    parser.add_argument("--vocab-size", type=int, metavar="N",
                        help="the shared vocabulary the embeddings are counted at (default: the config's "
                             "bpe.vocab_size, or the paper's 37000 without a config)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of {preset, params, paper_params}")
    args = parser.parse_args(argv)
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size} must be at least 1")
    rows = parameter_rows(presets_from_config(args.config, args.names, args.vocab_size))
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
