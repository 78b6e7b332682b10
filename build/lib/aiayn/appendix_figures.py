"""Encoder self-attention weights for the paper's appendix pictures; for visualisation only.

The model attends through torch's ``scaled_dot_product_attention``, which fuses the softmax and never
hands out the weights. To draw them, this module recomputes softmax(Q K^T / sqrt(d_k)) (the model's
Eq. 1, with V the identity) for one encoder layer from that layer's own modules: a forward pre-hook
captures the layer's input and padding mask during an ordinary ``encode``, then the attention
module's ``queries`` and ``keys_values`` project it exactly as its forward pass does. Training and
decoding never call this.

The pictures (docs/PAPER.md, "Attention pictures"): every head of encoder layer 5 of 6 on the
long-distance sentence, and the two heads of that layer that attend most from "its" to "Law" and
"application" on the anaphora sentence. A model with fewer than 5 layers is shown at its last layer,
and the title says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aiayn.checkpoint import load_model
from aiayn.errors import UserError
from aiayn.model import scaled_dot_product_attention
from aiayn.layout import ATTENTION_ANAPHORA_FIGURE, ATTENTION_LONG_DISTANCE_FIGURE
from aiayn.tokens import EOS_ID, UNK_ID

LONG_DISTANCE = ("It is in this spirit that a majority of American governments have passed new laws since 2009 "
                 "making the registration or voting process more difficult.")
ANAPHORA = ("The Law will never be perfect, but its application should be just - this is what we are missing, "
            "in my opinion.")
PAPER_LAYER = 5  # "layer 5 of 6", counted from 1 as the paper does
ANAPHORA_HEADS = 2  # the appendix shows two heads resolving "its"
WORD_START = "\u2581"  # SentencePiece's mark of a piece that begins a word


# --- the weights ---------------------------------------------------------------------------

def attention_weights(attention: torch.nn.Module, x: Tensor, key_mask: Tensor | None) -> Tensor:
    """Eq. 1's softmax(Q K^T / sqrt(d_k)) of a ``MultiHeadAttention`` attending from x to itself.

    x: (batch, len, d_model); key_mask: (batch, 1, 1, len), True where a key may be attended to
    (``model.key_padding_mask``). Returns (batch, heads, len, len); padded keys get weight 0. The
    model's own Eq. 1 with the identity for V: each query's output is then its row of weights.
    """
    queries = attention.queries(x)  # (batch, heads, len, d_head)
    keys, _ = attention.keys_values(x)  # (batch, heads, len, d_head)
    length = keys.shape[-2]
    identity = torch.eye(length, dtype=keys.dtype, device=keys.device).expand(*keys.shape[:-2], length, length)
    return scaled_dot_product_attention(queries, keys, identity, key_mask)  # (batch, heads, len, len)


def encoder_self_attention(model: torch.nn.Module, src: Tensor, layer: int) -> Tensor:
    """Self-attention weights (batch, heads, src_len, src_len) of encoder layer ``layer`` (from 0).

    Runs the encoder in eval mode (no dropout, as at translation time) and restores the mode after.
    """
    if not 0 <= layer < len(model.encoder):
        raise UserError(f"encoder layer {layer} does not exist (the model has {len(model.encoder)}, counted from 0)")
    captured: dict[str, Tensor] = {}

    def keep_input(module, args):
        captured["x"], captured["key_mask"] = args[0], args[1]

    handle = model.encoder[layer].register_forward_pre_hook(keep_input)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model.encode(src)
            return attention_weights(model.encoder[layer].self_attention, captured["x"], captured["key_mask"])
    finally:
        handle.remove()
        model.train(was_training)


def paper_layer(n_layers: int) -> tuple[int, str]:
    """The encoder layer the appendix shows (0-based) and how to say which it is in a title."""
    if n_layers >= PAPER_LAYER:
        return PAPER_LAYER - 1, f"encoder layer {PAPER_LAYER} of {n_layers}"
    return n_layers - 1, (f"encoder layer {n_layers} of {n_layers} (the last; "
                          f"the paper shows layer {PAPER_LAYER} of 6)")


# --- sentences as the encoder sees them ------------------------------------------------------

@dataclass(frozen=True)
class EncodedSentence:
    """A sentence as the decode stage feeds it to the encoder, with labels for the picture's axes."""

    ids: list[int]  # BPE ids then EOS (the binarize stage's convention, no BOS)
    pieces: list[str]  # SentencePiece pieces; an unknown piece is shown by its own text
    word_of_piece: list[int | None]  # index into `words` for each piece, None for EOS
    words: list[str]  # the sentence split on whitespace

    @property
    def unknown(self) -> int:
        return sum(piece_id == UNK_ID for piece_id in self.ids)

    def positions(self, word: str) -> list[int]:
        """Piece positions of the first word equal to ``word`` once its punctuation is stripped."""
        for index, candidate in enumerate(self.words):
            if candidate.strip(".,;:!?\"'()") == word:
                return [p for p, w in enumerate(self.word_of_piece) if w == index]
        raise UserError(f"{word!r} is not a word of the sentence {' '.join(self.words)!r}")


def encode_sentence(processor, sentence: str) -> EncodedSentence:
    """Encode one sentence with a SentencePiece processor and map each piece to the word it belongs to."""
    words = sentence.split()
    ids = processor.encode(sentence, out_type=int)
    pieces = processor.encode(sentence, out_type=str)  # an unknown piece comes back as its own text
    # SentencePiece never joins pieces across a space and marks each word's first piece with "▁"
    # (U+2581), so counting those marks numbers the words.
    word_of_piece, word = [], -1
    for piece in pieces:
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        word_of_piece.append(min(word, len(words) - 1))
    return EncodedSentence(ids + [EOS_ID], pieces + ["</s>"], word_of_piece + [None], words)


# --- the appendix pictures -------------------------------------------------------------------

def anaphora_heads(weights: Tensor, sentence: EncodedSentence,
                   count: int = ANAPHORA_HEADS) -> list[tuple[int, float, float]]:
    """The ``count`` heads whose attention from "its" puts the most weight on "Law" and "application".

    weights: (heads, len, len) of one sentence. Returns (head, weight on Law, weight on application),
    best first; a word of several pieces counts the sum over its pieces, averaged over the pieces of "its".
    """
    its, law, application = (sentence.positions(word) for word in ("its", "Law", "application"))
    from_its = weights[:, its, :].mean(dim=1)  # (heads, len)
    on_law = from_its[:, law].sum(dim=-1)
    on_application = from_its[:, application].sum(dim=-1)
    order = torch.argsort(on_law + on_application, descending=True)[:count].tolist()
    return [(head, on_law[head].item(), on_application[head].item()) for head in order]


def appendix_figures(model_path: str | Path, spm_model: str | Path, out_dir: str | Path) -> dict:
    """Write ``attention_long_distance.png`` and ``attention_anaphora.png`` into ``out_dir``."""
    from aiayn import plots
    from aiayn.bpe import load_processor

    model = load_model(model_path, "cpu", spm_model)
    processor = load_processor(spm_model)
    layer, layer_text = paper_layer(model.config.n_layers)
    out_dir = Path(out_dir)

    def weights_of(sentence: EncodedSentence) -> Tensor:
        return encoder_self_attention(model, torch.tensor([sentence.ids]), layer)[0]  # (heads, len, len)

    def unknown_note(sentence: EncodedSentence) -> str:
        if not sentence.unknown:
            return ""
        return f"; {sentence.unknown} of {len(sentence.ids)} pieces unknown to the vocabulary"

    long_distance = encode_sentence(processor, LONG_DISTANCE)
    weights = weights_of(long_distance)
    making = long_distance.positions("making")
    long_path = plots.plot_attention(
        weights.numpy(), long_distance.pieces, out_dir / ATTENTION_LONG_DISTANCE_FIGURE,
        title=f"Long-distance dependencies: every head of {layer_text}\n"
              f"(the paper: heads attend from \"making\" to \"more difficult\"; its row is outlined"
              f"{unknown_note(long_distance)})",
        panel_titles=[f"head {head + 1}" for head in range(weights.shape[0])], highlight_rows=making)

    anaphora = encode_sentence(processor, ANAPHORA)
    weights = weights_of(anaphora)
    chosen = anaphora_heads(weights, anaphora, min(ANAPHORA_HEADS, weights.shape[0]))
    anaphora_path = plots.plot_attention(
        weights[[head for head, _, _ in chosen]].numpy(), anaphora.pieces, out_dir / ATTENTION_ANAPHORA_FIGURE,
        title=f"Anaphora resolution: the heads of {layer_text} that attend most from \"its\" to \"Law\" and "
              f"\"application\"\n(the row of \"its\" is outlined{unknown_note(anaphora)})",
        panel_titles=[f"head {head + 1}: its \u2192 Law {law:.2f}, \u2192 application {app:.2f}"
                      for head, law, app in chosen],
        highlight_rows=anaphora.positions("its"))
    return {"long_distance": long_path, "anaphora": anaphora_path, "layer": layer,
            "anaphora_heads": [head for head, _, _ in chosen]}
