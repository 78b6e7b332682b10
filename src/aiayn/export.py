"""The export command: a trained model in the formats of two independent inference engines.

    aiayn export --model model.pt --spm-model spm.model --format ctranslate2 --out DIR [--quantization int8]
    aiayn export --model model.pt --spm-model spm.model --format huggingface --out DIR

``ctranslate2``: a CTranslate2 model folder built with CTranslate2's own spec API (post-norm, ReLU, one
embedding matrix for source, target and output, our position table as it is, the SentencePiece pieces
as both vocabularies), quantised by the engine where asked. ``huggingface``: a folder that
``transformers``' ``MarianMTModel`` and ``MarianTokenizer`` load with ``from_pretrained``. Marian
builds its own sinusoid table, all sines then all cosines, where ours interleaves them (Section 3.5 as
written); a post-norm Transformer computes the same function under any consistent reordering of its
model dimension, so the weights are exported with that dimension permuted to Marian's layout. Marian
has no learned or missing positions: such models are refused for it (CTranslate2 takes any table).

ctranslate2 and transformers are the ``test`` extra's, imported only here.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.errors import UserError, cli
from aiayn.model import Transformer, sinusoid_table
from aiayn.search import SearchConfig

FORMATS = ("ctranslate2", "huggingface")
# CTranslate2 4.8's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES).
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")
# The file every export writes into its folder: a later export may replace a folder that holds it, no other.
EXPORT_MARKER = "aiayn-export.json"
# Sinusoids extend to any length: the exported table has at least this many rows (ours grows on demand).
MIN_SINUSOID_ROWS = 1024


def _require(package: str, version: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise UserError(
            f"exporting to this format needs the {package} package, which is not installed; "
            f"install it with `pip install {package}=={version}` (or the project's test extra: pip install -e '.[test]')"
        ) from None


def write_marker(folder: Path, target: str) -> None:
    """Mark ``folder`` as an export of ours, so that the next export to the same --out may replace it."""
    (folder / EXPORT_MARKER).write_text(json.dumps({"written_by": "aiayn export", "format": target}) + "\n",
                                        encoding="utf-8")


def position_table(model: Transformer) -> Tensor:
    """The (rows, d_model) table our model adds to the scaled embeddings at positions 0, 1, ...

    Sinusoids at least MIN_SINUSOID_ROWS long, the learned table as trained, zeros for no positions.
    """
    config = model.config
    rows = max(config.max_positions, MIN_SINUSOID_ROWS)
    if config.positional == "sinusoidal":
        return sinusoid_table(rows, config.d_model)
    if config.positional == "learned":
        return model.positional.learned.weight.detach().float().cpu()
    return torch.zeros(rows, config.d_model)


def _check_heads(model: Transformer, target: str) -> None:
    config = model.config
    if config.head_dim != config.value_dim:
        raise UserError(
            f"the model has d_head = {config.head_dim} but d_value = {config.value_dim}; {target} gives keys and "
            "values one size per head, so this model (Table 3 row B style) cannot be exported to it"
        )


def export_ctranslate2(model: Transformer, pieces: Sequence[str], out_dir: str | Path,
                       quantization: str | None = None) -> Path:
    """Write `model` as a CTranslate2 model folder; `pieces` are the SentencePiece pieces in id order.

    The source is our pieces then "</s>" (no BOS, as the binarize stage): the model's config has
    CTranslate2 add the "</s>", so a caller gives the pieces alone; the decoder starts from "<s>".
    `quantization` is CTranslate2's weight type.
    """
    from aiayn.writing import atomic_path

    _require("ctranslate2", "4.8.5")
    _check_heads(model, "CTranslate2")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UserError(f"--quantization {quantization!r} is not one of CTranslate2's: {', '.join(QUANTIZATIONS)}")
    spec = _ctranslate2_spec(model)
    _map_ctranslate2_weights(spec, model)
    _set_ctranslate2_vocabulary(spec, list(pieces), model.encoder[0].self_attention_norm.eps)
    spec.validate()
    spec.optimize(quantization=quantization)
    with atomic_path(out_dir, directory=True) as tmp:
        tmp.mkdir()
        spec.save(str(tmp))
        write_marker(tmp, "ctranslate2")
    return Path(out_dir)


def _ctranslate2_spec(model: Transformer):
    """CTranslate2's empty TransformerSpec of our shape: post-norm, ReLU, our layers and heads."""
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    head_dim = config.head_dim if config.head_dim * config.n_heads != config.d_model else None
    shape = dict(pre_norm=False, activation=common_spec.Activation.RELU, head_dim=head_dim)
    encoder = transformer_spec.TransformerEncoderSpec(config.n_layers, config.n_heads, **shape)
    decoder = transformer_spec.TransformerDecoderSpec(config.n_layers, config.n_heads, **shape)
    return transformer_spec.TransformerSpec(encoder, decoder)


def _map_ctranslate2_weights(spec, model: Transformer) -> None:
    """Our weights into ``spec``, layer by layer: one embedding matrix for source, target and output."""

    def array(tensor: Tensor):
        return tensor.detach().float().cpu().numpy()

    def linear(target, *sources: torch.nn.Linear) -> None:  # several sources: one fused matrix, as CT2 keeps Q, K, V
        target.weight = array(torch.cat([source.weight for source in sources]))
        target.bias = array(torch.cat([source.bias for source in sources]))

    def norm(target, source: torch.nn.LayerNorm) -> None:
        target.gamma, target.beta = array(source.weight), array(source.bias)

    def self_attention(target, layer) -> None:
        attention = layer.self_attention
        linear(target.self_attention.linear[0], attention.query, attention.key, attention.value)
        linear(target.self_attention.linear[1], attention.output)
        norm(target.self_attention.layer_norm, layer.self_attention_norm)

    def feed_forward(target, layer) -> None:
        linear(target.linear_0, layer.feed_forward.inner)
        linear(target.linear_1, layer.feed_forward.outer)
        norm(target.layer_norm, layer.feed_forward_norm)

    embedding, positions = array(model.embedding.weight), array(position_table(model))
    for stack in (spec.encoder, spec.decoder):
        stack.scale_embeddings = True  # Section 3.4: times sqrt(d_model)
        stack.position_encodings.encodings = positions
    spec.encoder.embeddings[0].weight = embedding
    spec.decoder.embeddings.weight = embedding
    spec.decoder.projection.weight = embedding  # the tied pre-softmax layer, no bias (CTranslate2 stores it once)
    for target, layer in zip(spec.encoder.layer, model.encoder):
        self_attention(target, layer)
        feed_forward(target.ffn, layer)
    for target, layer in zip(spec.decoder.layer, model.decoder):
        self_attention(target, layer)
        cross = layer.cross_attention
        linear(target.attention.linear[0], cross.query)
        linear(target.attention.linear[1], cross.key, cross.value)
        linear(target.attention.linear[2], cross.output)
        norm(target.attention.layer_norm, layer.cross_attention_norm)
        feed_forward(target.ffn, layer)


def _set_ctranslate2_vocabulary(spec, pieces: list[str], layer_norm_epsilon: float) -> None:
    """The pieces as both vocabularies, our special tokens, and "</s>" added to each source (not "<s>")."""
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = pieces[UNK_ID], pieces[BOS_ID], pieces[EOS_ID]
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_bos, spec.config.add_source_eos = False, True
    spec.config.layer_norm_epsilon = layer_norm_epsilon


def marian_permutation(d_model: int) -> Tensor:
    """Marian's model dimension in terms of ours: its column k is our column permutation[k].

    Ours: PE(pos, 2i) = sin, PE(pos, 2i + 1) = cos of the same angle; Marian: the sines of every i,
    then the cosines. So Marian's order is our even columns, then our odd ones.
    """
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our weights under MarianMTModel's names, with the model dimension permuted to Marian's layout.

    Vectors in the model dimension (embedding columns, LayerNorm parameters, the outputs of W^O and of
    the feed-forward's second layer) are permuted; so are the inputs of every map that reads the model
    dimension (Q, K, V and the feed-forward's first layer). LayerNorm and the residual sums commute
    with the permutation, and attention's inner dimensions are untouched, so the function is the same.
    """
    order = marian_permutation(model.config.d_model)
    state: dict[str, Tensor] = {}

    def reads(name: str, linear: torch.nn.Linear) -> None:  # input in the model dimension
        state[f"{name}.weight"] = linear.weight[:, order]
        state[f"{name}.bias"] = linear.bias

    def writes(name: str, linear: torch.nn.Linear) -> None:  # output in the model dimension
        state[f"{name}.weight"] = linear.weight[order, :]
        state[f"{name}.bias"] = linear.bias[order]

    def norm(name: str, layer_norm: torch.nn.LayerNorm) -> None:
        state[f"{name}.weight"] = layer_norm.weight[order]
        state[f"{name}.bias"] = layer_norm.bias[order]

    def attention(name: str, module) -> None:
        reads(f"{name}.q_proj", module.query)
        reads(f"{name}.k_proj", module.key)
        reads(f"{name}.v_proj", module.value)
        writes(f"{name}.out_proj", module.output)

    def feed_forward(name: str, layer) -> None:
        reads(f"{name}.fc1", layer.feed_forward.inner)
        writes(f"{name}.fc2", layer.feed_forward.outer)
        norm(f"{name}.final_layer_norm", layer.feed_forward_norm)

    embedding = model.embedding.weight[:, order]
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens", "lm_head"):
        state[f"{name}.weight"] = embedding
    for index, layer in enumerate(model.encoder):
        prefix = f"model.encoder.layers.{index}"
        attention(f"{prefix}.self_attn", layer.self_attention)
        norm(f"{prefix}.self_attn_layer_norm", layer.self_attention_norm)
        feed_forward(prefix, layer)
    for index, layer in enumerate(model.decoder):
        prefix = f"model.decoder.layers.{index}"
        attention(f"{prefix}.self_attn", layer.self_attention)
        norm(f"{prefix}.self_attn_layer_norm", layer.self_attention_norm)
        attention(f"{prefix}.encoder_attn", layer.cross_attention)
        norm(f"{prefix}.encoder_attn_layer_norm", layer.cross_attention_norm)
        feed_forward(prefix, layer)
    return {name: tensor.detach().float().cpu().contiguous() for name, tensor in state.items()}


def export_huggingface(model: Transformer, spm_model: str | Path, out_dir: str | Path,
                       search: SearchConfig | None = None) -> Path:
    """Write `model` and its SentencePiece vocabulary as a MarianMTModel / MarianTokenizer folder.

    The generation defaults are the search of `aiayn decode` where Marian can express it: ``search``'s beam
    (default: the schema's decode section, the paper's), pad and BOS never generated, EOS forced at the length limit (transformers' length penalty is len ** alpha,
    not ours, so it is left at transformers' default).
    """
    _require("transformers", "5.23.0")
    import sentencepiece as spm

    _check_marian_can_hold(model)
    processor = spm.SentencePieceProcessor(model_file=str(spm_model))
    pieces = [processor.id_to_piece(index) for index in range(processor.get_piece_size())]
    positions = max(model.config.max_positions, MIN_SINUSOID_ROWS)
    marian = _marian_model(model, positions)
    marian.generation_config = _marian_generation_config(positions, search or SearchConfig())
    _write_marian_folder(marian, spm_model, pieces, positions, out_dir)
    return Path(out_dir)


def _check_marian_can_hold(model: Transformer) -> None:
    """Refuse what Marian cannot express: learned or no positions, keys and values of different sizes,
    heads that do not split d_model evenly."""
    config = model.config
    if config.positional != "sinusoidal":
        raise UserError(
            f"the model has positional = {config.positional}, but MarianMTModel always adds its own fixed "
            "sinusoid table (it has no learned positions and cannot leave them out); export this model with "
            "--format ctranslate2, which takes any position table"
        )
    _check_heads(model, "Marian")
    if config.head_dim * config.n_heads != config.d_model:
        raise UserError(
            f"the model has n_heads * d_head = {config.n_heads} * {config.head_dim} != d_model = {config.d_model}; "
            "Marian's heads always split d_model evenly; export this model with --format ctranslate2"
        )


def _marian_model(model: Transformer, positions: int):
    """A MarianMTModel of our shape holding our weights (``marian_state_dict``)."""
    from transformers import MarianConfig, MarianMTModel

    config = model.config
    marian_config = MarianConfig(
        vocab_size=config.vocab_size, decoder_vocab_size=config.vocab_size, d_model=config.d_model,
        encoder_layers=config.n_layers, decoder_layers=config.n_layers,
        encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
        encoder_attention_heads=config.n_heads, decoder_attention_heads=config.n_heads,
        activation_function="relu", scale_embedding=True, max_position_embeddings=positions,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
    )
    marian = MarianMTModel(marian_config)
    missing, unexpected = marian.load_state_dict(marian_state_dict(model), strict=False)
    # Marian builds its position tables and a zero final_logits_bias itself.
    left = [name for name in missing if not name.endswith("embed_positions.weight") and name != "final_logits_bias"]
    if left or unexpected:
        raise RuntimeError(f"Marian's weights do not match ours: missing {left}, unexpected {unexpected}")
    return marian


def _marian_generation_config(positions: int, search: SearchConfig):
    """transformers' generation defaults for the folder: `aiayn decode`'s search where Marian can express it."""
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=BOS_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        forced_eos_token_id=EOS_ID, bad_words_ids=[[PAD_ID], [BOS_ID]], max_length=positions,
        num_beams=search.beam_size,  # as `aiayn decode` searches: decode.beam_size
    )


def _write_marian_folder(marian, spm_model: str | Path, pieces: list[str], positions: int,
                         out_dir: str | Path) -> None:
    """The model, its tokenizer (our SentencePiece model for both sides) and our marker, written as one folder."""
    from transformers import MarianTokenizer

    from aiayn.writing import atomic_path

    with atomic_path(out_dir, directory=True) as tmp:
        marian.save_pretrained(tmp)
        tmp_spm = tmp / "spm.model"
        shutil.copyfile(spm_model, tmp_spm)
        (tmp / "vocab.json").write_text(json.dumps({piece: index for index, piece in enumerate(pieces)},
                                                   ensure_ascii=False), encoding="utf-8")
        tokenizer = MarianTokenizer(source_spm=str(tmp_spm), target_spm=str(tmp_spm), vocab=str(tmp / "vocab.json"),
                                    unk_token=pieces[UNK_ID], eos_token=pieces[EOS_ID], pad_token=pieces[PAD_ID],
                                    model_max_length=positions)
        tokenizer.save_pretrained(tmp)
        tmp_spm.unlink()
        write_marker(tmp, "huggingface")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn export", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an averaged model.pt or a training checkpoint")
    parser.add_argument("--spm-model", required=True, help="the run's SentencePiece model (spm.model)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True,
                        help=f"a new folder to write (or a previous export, which holds {EXPORT_MARKER} and is replaced)")
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once): huggingface's generation config "
                             "searches with their decode.beam_size (default: the schema's, the paper's)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="ctranslate2 only: the engine's weight type (default: float32, as trained)")
    return parser


@cli
def main(argv: Sequence[str] | None = None) -> None:
    from aiayn.bpe import load_processor
    from aiayn.checkpoint import load_model
    from aiayn.config import read_config
    from aiayn.writing import prepare_output, refuse_overwriting_inputs, refuse_replacing_a_folder

    args = arguments().parse_args(argv)
    search = SearchConfig.from_section(read_config(args.config, "decode"))  # the decode stage's search
    if args.quantization is not None and args.format != "ctranslate2":
        raise UserError(f"--quantization {args.quantization} is for --format ctranslate2 only; "
                        "a Hugging Face export keeps the trained float32 weights (drop --quantization)")
    # all before the work: the folder is replaced as a whole, so it may hold no input and nothing of the user's;
    # its folder is made only when the export is written, so that a failed export leaves nothing behind
    refuse_overwriting_inputs({}, {"--model": args.model, "--spm-model": args.spm_model, "--config": args.config},
                              {"--out": args.out})
    refuse_replacing_a_folder("--out", args.out, EXPORT_MARKER, "aiayn export")
    prepare_output(args.out, directory=True, create=False)
    model = load_model(args.model, "cpu", spm_model=args.spm_model)
    if args.format == "ctranslate2":
        processor = load_processor(args.spm_model)
        pieces = [processor.id_to_piece(index) for index in range(processor.get_piece_size())]
        export_ctranslate2(model, pieces, args.out, args.quantization)
    else:
        export_huggingface(model, args.spm_model, args.out, search)
    print(f"exported {args.model} as {args.format} to {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
