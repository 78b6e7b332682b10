"""Recomputed attention weights agree with the model, and the appendix pictures are drawn."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pairs

from aiayn.appendix_figures import (ANAPHORA, LONG_DISTANCE, anaphora_heads, appendix_figures, encode_sentence,
                                    encoder_self_attention, paper_layer)
from aiayn.errors import UserError
from aiayn.model import ModelConfig, Transformer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_model(vocab_size: int = 40, n_layers: int = 2, **overrides) -> Transformer:
    torch.manual_seed(0)
    # d_value != d_head, so that a mix-up of the query/key size and the value size would show
    settings = dict(n_layers=n_layers, d_model=24, d_ff=48, n_heads=4, d_head=8, d_value=5, dropout=0.3)
    return Transformer(ModelConfig(vocab_size=vocab_size, **{**settings, **overrides}))


# Two sentences, the second padded (pad id 0) after its 4 tokens.
SOURCE = torch.tensor([[5, 9, 12, 7, 30, 3], [8, 21, 6, 3, 0, 0]])


def test_weights_times_values_reproduce_the_attention_output():
    model = tiny_model()
    layer = 1
    attention = model.encoder[layer].self_attention
    seen = {}

    def keep(module, args, output):
        seen["x"], seen["key_mask"], seen["output"] = args[0], args[2], output

    handle = attention.register_forward_hook(keep)
    try:
        weights = encoder_self_attention(model, SOURCE, layer)  # runs the encoder once, in eval mode
    finally:
        handle.remove()
    _, values = attention.keys_values(seen["x"])  # (batch, heads, len, d_value)
    heads = weights @ values  # Eq. 1, head by head
    batch, n_heads, length, d_value = heads.shape
    concatenated = heads.transpose(1, 2).reshape(batch, length, n_heads * d_value)
    recomputed = attention.output(concatenated)
    assert weights.shape == (2, 4, 6, 6)
    assert torch.allclose(recomputed, seen["output"], atol=1e-5, rtol=0)


def test_rows_sum_to_one_and_padding_gets_no_weight():
    weights = encoder_self_attention(tiny_model(), SOURCE, 0)
    assert torch.allclose(weights.sum(dim=-1), torch.ones(2, 4, 6), atol=1e-6)
    assert torch.all(weights[1, :, :, 4:] == 0)
    assert torch.all(weights[0] > 0)


def test_padding_does_not_change_the_weights_of_the_real_tokens():
    model = tiny_model()
    alone = encoder_self_attention(model, SOURCE[1:, :4], 1)
    padded = encoder_self_attention(model, SOURCE, 1)[1:, :, :4, :4]
    assert torch.allclose(alone, padded, atol=1e-6)


def test_the_model_keeps_its_training_mode():
    model = tiny_model()
    model.train()
    first = encoder_self_attention(model, SOURCE, 0)
    assert model.training
    assert torch.equal(first, encoder_self_attention(model, SOURCE, 0))  # eval inside: no dropout noise


def test_the_paper_layer_is_the_fifth_else_the_last():
    assert paper_layer(6) == (4, "encoder layer 5 of 6")
    assert paper_layer(8)[0] == 4
    index, text = paper_layer(2)
    assert index == 1 and text.startswith("encoder layer 2 of 2 (the last")


def test_the_anaphora_heads_are_those_attending_from_its_to_law_and_application(processor):
    sentence = encode_sentence(processor, ANAPHORA)
    length = len(sentence.ids)
    weights = torch.full((4, length, length), 1.0 / length)
    its, law, application = (sentence.positions(word) for word in ("its", "Law", "application"))
    for head, on_law, on_application in ((2, 0.5, 0.3), (0, 0.1, 0.4)):
        weights[head, its] = 0.0
        weights[head][torch.tensor(its)[:, None], torch.tensor(law)] = on_law / len(law)
        weights[head][torch.tensor(its)[:, None], torch.tensor(application)] = on_application / len(application)
    chosen = anaphora_heads(weights, sentence, 2)
    assert [head for head, _, _ in chosen] == [2, 0]
    assert chosen[0][1:] == pytest.approx((0.5, 0.3))


def test_pieces_belong_to_the_words_they_spell(processor):
    sentence = encode_sentence(processor, LONG_DISTANCE)
    assert sentence.ids[-1] == 3 and sentence.pieces[-1] == "</s>"  # EOS, as the decode stage feeds it
    assert len(sentence.ids) == len(sentence.pieces) == len(sentence.word_of_piece)
    for index, word in enumerate(sentence.words):
        spelled = "".join(sentence.pieces[p] for p in sentence.positions(word.strip(".")))
        assert spelled.replace("\u2581", "") == word, (index, word)
    with pytest.raises(UserError, match="not a word"):
        sentence.positions("Transformer")


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    """A tiny SentencePiece model learned here, from the shared fixture's word lists."""
    from aiayn.bpe import learn_bpe

    folder = tmp_path_factory.mktemp("vocabulary")
    pairs = make_pairs(300)
    (folder / "train.en").write_text("".join(en + "\n" for en, _ in pairs), encoding="utf-8")
    (folder / "train.de").write_text("".join(de + "\n" for _, de in pairs), encoding="utf-8")
    learn_bpe([folder / "train.en", folder / "train.de"], folder / "bpe", vocab_size=80, input_sentence_size=0,
              threads=1)
    return folder / "bpe" / "spm.model"


@pytest.fixture(scope="module")
def processor(vocabulary):
    from aiayn.bpe import load_processor

    return load_processor(vocabulary)


def save_tiny_model(path, vocabulary, n_layers=2, fingerprint=None):
    from aiayn.bpe import vocab_fingerprint
    from aiayn.checkpoint import MODEL_FORMAT, save_model

    model = tiny_model(vocab_size=80, n_layers=n_layers)
    save_model({"format": MODEL_FORMAT, "model_config": model.config.to_dict(), "model": model.state_dict(),
                "vocab_fingerprint": fingerprint or vocab_fingerprint(vocabulary), "data_fingerprint": "test",
                "averaged_steps": [1]}, path)
    return path


def test_the_appendix_pictures_are_png_files(vocabulary, tmp_path):
    model = save_tiny_model(tmp_path / "model.pt", vocabulary)
    drawn = appendix_figures(model, vocabulary, tmp_path / "report")
    assert drawn["layer"] == 1  # two layers: the last
    assert len(set(drawn["anaphora_heads"])) == 2
    for name in ("attention_long_distance.png", "attention_anaphora.png"):
        data = (tmp_path / "report" / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 20_000, name


def test_a_model_of_another_vocabulary_is_refused(vocabulary, tmp_path):
    model = save_tiny_model(tmp_path / "model.pt", vocabulary, fingerprint="0123456789abcdef")
    with pytest.raises(UserError, match="another vocabulary"):
        appendix_figures(model, vocabulary, tmp_path / "report")


def test_a_title_wider_than_the_figure_is_wrapped_inside_it_above_the_panels():
    from aiayn.plots import attention_figure

    # a short sentence makes narrow panels; the anaphora picture's title at its longest (a small model)
    tokens = ["\u2581The", "\u2581Law", "\u2581its", "\u2581application", "</s>"]
    weights = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(0)).softmax(-1).numpy()
    title = ("Anaphora resolution: the heads of encoder layer 2 of 2 (the last; the paper shows layer 5 of 6) that "
             "attend most from \"its\" to \"Law\" and \"application\"\n(the row of \"its\" is outlined; 3 of 53 pieces "
             "unknown to the vocabulary)")
    figure = attention_figure(weights, tokens, title, ["head 3: its \u2192 Law 0.36", "head 2: its \u2192 Law 0.01"],
                              highlight_rows=[2])
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    shown = figure.get_suptitle()
    assert shown.split() == title.split()  # every word, only the line breaks differ
    box = figure._suptitle.get_window_extent(renderer)
    assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1
    for axes in figure.axes[:2]:  # the heatmaps, not the colour bar
        assert box.y0 > axes.title.get_window_extent(renderer).y1


def test_the_heatmaps_say_which_axis_attends_and_label_every_piece_at_a_readable_size():
    from aiayn.plots import ATTENTION_TICK_FONTSIZE, attention_figure

    tokens = [f"\u2581w{index}" for index in range(60)]  # as long as the demo's long-distance sentence
    weights = torch.rand(4, 60, 60, generator=torch.Generator().manual_seed(0)).softmax(-1).numpy()
    figure = attention_figure(weights, tokens, "title", [f"head {head}" for head in range(4)])
    for axes in figure.axes[:4]:  # the heatmaps, not the colour bar
        assert axes.get_xlabel().startswith("attending to") and axes.get_ylabel().startswith("attending from")
        labels = axes.get_xticklabels() + axes.get_yticklabels()
        assert len(labels) == 120 and {label.get_fontsize() for label in labels} == {ATTENTION_TICK_FONTSIZE}
    assert ATTENTION_TICK_FONTSIZE >= 8


def test_a_vocabulary_of_near_character_pieces_is_named_in_the_pictures(processor):
    from aiayn.appendix_figures import EncodedSentence, vocabulary_note

    split = encode_sentence(processor, LONG_DISTANCE)  # a vocabulary of 80 pieces: letters and a few pairs
    assert "near-character pieces" in vocabulary_note(split) and "expect no pattern like the paper's" in vocabulary_note(split)
    words = LONG_DISTANCE.split()
    whole_words = EncodedSentence(list(range(4, 4 + len(words))) + [3], [f"\u2581{w}" for w in words] + ["</s>"],
                                  list(range(len(words))) + [None], words)
    assert vocabulary_note(whole_words) == ""
