"""The attention explorer's data: every module's Eq. 1 weights, the decoder fed the beam search's own output,
and a page that holds it all and fetches nothing."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import config_file
from test_appendix_figures import processor, save_tiny_model, tiny_model, vocabulary  # noqa: F401 (fixtures)

from aiayn.appendix_figures import ANAPHORA, LONG_DISTANCE
from aiayn.decode import DecodeSettings, translate
from aiayn.explore import (KINDS, decode_float32_base64, default_sentences, explorer_data, read_page_data,
                           render_page)
from aiayn.speed.incremental import InferenceModel
from aiayn.tokens import BOS_ID, EOS_ID

SENTENCES = ["the dog sees a cat .", "a big red house </script> today ."]
# A short search, so that the untrained model's translations stay a few pieces long.
SEARCH = {"beam_size": 2, "length_penalty": 0.6, "max_len_a": 0.0, "max_len_b": 6, "tokens_per_batch": 2000,
          "workers": 1}


def settings() -> DecodeSettings:
    from aiayn.config import read_config

    return DecodeSettings.from_section(read_config(None, "decode", {f"decode.{key}": (key, value)
                                                                    for key, value in SEARCH.items()}))


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=80).eval()


@pytest.fixture(scope="module")
def data(model, processor):  # noqa: F811 (the fixture imported above)
    return explorer_data(model, processor, SENTENCES, settings())


def module_calls(model, src, tgt_in) -> dict[str, list[dict]]:
    """The inputs and output of every attention module in one teacher-forced pass, as the model ran it."""
    modules = {"encoder": [layer.self_attention for layer in model.encoder],
               "decoder_self": [layer.self_attention for layer in model.decoder],
               "cross": [layer.cross_attention for layer in model.decoder]}
    calls = {kind: [None] * len(listed) for kind, listed in modules.items()}
    handles = []
    for kind, listed in modules.items():
        for index, module in enumerate(listed):
            def keep(module, args, kwargs, output, kind=kind, index=index):
                x, source = args[0], args[1]
                key_mask = args[2] if len(args) > 2 else kwargs.get("key_mask")
                calls[kind][index] = {"x": x, "source": source, "key_mask": key_mask,
                                      "causal": kwargs.get("causal", False), "output": output}
            handles.append(module.register_forward_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(src, tgt_in)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def reference_weights(module, call) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k)) with the call's masks, written out by hand (batch, heads, queries, keys)."""
    queries = module.queries(call["x"])
    keys, _ = module.keys_values(call["source"])
    scores = queries @ keys.transpose(-1, -2) / math.sqrt(queries.shape[-1])
    if call["key_mask"] is not None:
        scores = scores.masked_fill(~call["key_mask"], float("-inf"))
    if call["causal"]:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1)


def page_weights(sentence: dict, kind: str) -> torch.Tensor:
    return decode_float32_base64(sentence["weights"][kind])  # (layers, heads, queries, keys)


def test_every_weight_is_the_models_attention_for_every_module_layer_and_head(model, data):
    modules = {"encoder": [layer.self_attention for layer in model.encoder],
               "decoder_self": [layer.self_attention for layer in model.decoder],
               "cross": [layer.cross_attention for layer in model.decoder]}
    for sentence in data["sentences"]:
        src, tgt_in = torch.tensor([sentence["source_ids"]]), torch.tensor([sentence["target_in_ids"]])
        calls = module_calls(model, src, tgt_in)
        for kind in KINDS:
            shown = page_weights(sentence, kind)
            assert shown.shape[:2] == (model.config.n_layers, model.config.n_heads)
            for layer, (module, call) in enumerate(zip(modules[kind], calls[kind])):
                with torch.no_grad():
                    expected = reference_weights(module, call)[0]
                    assert torch.allclose(shown[layer], expected, atol=1e-6, rtol=0), (kind, layer)
                    # Eq. 1 with the module's own values and W^O gives back what the module returned
                    _, values = module.keys_values(call["source"])
                    heads = shown[layer][None] @ values  # (1, heads, queries, d_value)
                    assert torch.allclose(module.output(module.merge_heads(heads)), call["output"], atol=1e-5), (
                        kind, layer)


def test_the_shapes_follow_the_source_and_the_translation(model, data):
    layers, heads = model.config.n_layers, model.config.n_heads
    for sentence in data["sentences"]:
        source, target = len(sentence["source_ids"]), len(sentence["target_out_ids"])
        assert page_weights(sentence, "encoder").shape == (layers, heads, source, source)
        assert page_weights(sentence, "decoder_self").shape == (layers, heads, target, target)
        assert page_weights(sentence, "cross").shape == (layers, heads, target, source)
        assert len(sentence["source_pieces"]) == source and sentence["source_pieces"][-1] == "</s>"
        assert len(sentence["target_in_pieces"]) == len(sentence["target_out_pieces"]) == target


def test_rows_sum_to_one_and_the_decoder_never_sees_a_future_position(data):
    for sentence in data["sentences"]:
        for kind in KINDS:
            weights = page_weights(sentence, kind)
            assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5), kind
        future = torch.ones(page_weights(sentence, "decoder_self").shape[-2:], dtype=torch.bool).triu(1)
        assert torch.all(page_weights(sentence, "decoder_self")[..., future] == 0)


def test_the_decoder_is_fed_the_beam_search_translation(model, processor, data):  # noqa: F811
    search = settings()
    hypotheses = translate(InferenceModel(model), processor, SENTENCES, search.search, search.tokens_per_batch,
                           progress=False)
    for sentence, best in zip(data["sentences"], hypotheses):
        tokens = best[0].tokens
        assert sentence["target_in_ids"] == [BOS_ID, *tokens]
        assert sentence["target_out_ids"] == [*tokens, EOS_ID]
        assert sentence["translation"] == (processor.decode(tokens) if tokens else "")
        assert sentence["target_out_pieces"] == [processor.id_to_piece(t) for t in [*tokens, EOS_ID]]
    assert data["search"]["beam_size"] == 2 and data["search"]["max_len_b"] == 6


def test_the_page_holds_the_data_and_fetches_nothing(data):
    page = render_page(data)
    assert read_page_data(page) == data  # a sentence with </script> does not end the data early
    assert "__EXPLORER_DATA__" not in page
    assert "default-src 'none'" in page  # the page's own policy forbids every request
    lowered = page.lower()
    for remote in ("http://", "https://", "<link", " src=", "fetch(", "xmlhttprequest", "import(", "@import"):
        assert remote not in lowered, remote


def test_the_default_sentences_are_the_papers_two_then_the_first_dev_lines(tmp_path):
    dev = tmp_path / "dev.en"
    dev.write_text("one .\n\ntwo .\nthree .\nfour .\n", encoding="utf-8")
    assert default_sentences() == [LONG_DISTANCE, ANAPHORA]
    assert default_sentences(dev) == [LONG_DISTANCE, ANAPHORA, "one .", "two .", "three ."]
    assert default_sentences(dev, 1) == [LONG_DISTANCE, ANAPHORA, "one ."]


def test_a_vocabulary_that_cannot_read_the_papers_sentences_opens_on_a_dev_sentence(vocabulary, tmp_path):  # noqa: F811
    """As the demo's: learned on lowercase text, it has no "I" for "It", the paper's first word."""
    from aiayn.bpe import learn_bpe, load_processor
    from aiayn.tokens import UNK_ID

    assert UNK_ID in load_processor(vocabulary).encode(LONG_DISTANCE, out_type=int)
    dev = tmp_path / "dev.en"
    dev.write_text("the dog .\na cat .\n", encoding="utf-8")
    assert default_sentences(dev, vocabulary=vocabulary) == ["the dog .", "a cat .", LONG_DISTANCE, ANAPHORA]
    assert default_sentences(vocabulary=vocabulary) == [LONG_DISTANCE, ANAPHORA]  # no dev: nothing else to open on
    # a vocabulary that reads them keeps the paper's first
    (tmp_path / "paper.en").write_text((LONG_DISTANCE + "\n" + ANAPHORA + "\n") * 20, encoding="utf-8")
    learn_bpe([tmp_path / "paper.en", dev], tmp_path / "bpe", vocab_size=60, input_sentence_size=0, threads=1)
    reads = tmp_path / "bpe" / "spm.model"
    assert default_sentences(dev, vocabulary=reads) == [LONG_DISTANCE, ANAPHORA, "the dog .", "a cat ."]


def run_explore(*args, cwd):
    return subprocess.run([sys.executable, "-m", "aiayn.cli", "explore", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_command_writes_a_page_of_the_given_sentences(vocabulary, tmp_path):  # noqa: F811
    model = save_tiny_model(tmp_path / "model.pt", vocabulary)
    (tmp_path / "input.en").write_text("the dog sees a cat .\na big house .\n", encoding="utf-8")
    result = run_explore("--model", str(model), "--spm-model", str(vocabulary), "--input", "input.en",
                         "--config", config_file(tmp_path / "c.yaml", decode=SEARCH), "--device", "cpu",
                         "--out", "out/page.html", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = read_page_data((tmp_path / "out" / "page.html").read_text(encoding="utf-8"))
    assert [sentence["source"] for sentence in data["sentences"]] == ["the dog sees a cat .", "a big house ."]
    assert "out/page.html" in result.stdout and "2 sentences" in result.stdout


@pytest.mark.parametrize("arguments, message", [
    (["--input", "input.en"], "--input input.en: line 2 is blank"),
    (["--sentence", "a cat .", "--input", "input.en"], "not allowed with argument"),
    (["--sentence", "a cat .", "--dev", "input.en"], "--dev adds dev sentences to the default page only"),
    (["--sentence", "  "], "--sentence: a blank sentence"),
    (["--sentence", "a cat .", "--config", "bad.yaml"], "decode.beam_size"),
], ids=["blank line", "input and sentence", "dev with sentence", "blank sentence", "bad search"])
def test_bad_input_is_one_error_line_and_nothing_written(vocabulary, tmp_path, arguments, message):  # noqa: F811
    model = save_tiny_model(tmp_path / "model.pt", vocabulary)
    (tmp_path / "input.en").write_text("the dog .\n\na cat .\n", encoding="utf-8")
    config_file(tmp_path / "bad.yaml", decode={"beam_size": 0})
    result = run_explore("--model", str(model), "--spm-model", str(vocabulary), *arguments, "--out", "page.html",
                         cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "page.html").exists()


def test_the_report_writes_the_page_of_the_paper_and_dev_sentences_with_the_runs_search(vocabulary, tmp_path):  # noqa: F811
    import argparse

    from aiayn.report import attention_explorer

    model = save_tiny_model(tmp_path / "model.pt", vocabulary)
    dev = tmp_path / "dev.en"
    dev.write_text("the dog .\na cat .\nthe house .\nthe garden .\n", encoding="utf-8")
    arguments = argparse.Namespace(attention_model=model, spm_model=vocabulary, explorer_dev=dev,
                                   out_dir=tmp_path / "report")
    page = attention_explorer(arguments, settings())
    assert page == tmp_path / "report" / "attention_explorer.html"
    data = read_page_data(page.read_text(encoding="utf-8"))
    # the dev sentences first: the test's vocabulary, lowercase, cannot read the paper's "It"
    assert [sentence["source"] for sentence in data["sentences"]] == ["the dog .", "a cat .", "the house .",
                                                                      LONG_DISTANCE, ANAPHORA]
    assert data["search"]["beam_size"] == SEARCH["beam_size"]
