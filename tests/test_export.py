"""Tests for aiayn.export: the exported models, run by independent engines, compute what ours computes.

A small model is trained here for a few seconds on the `prepared` corpus (word-for-word English to
German-like pairs), so that its output distributions are not the near-uniform ones of random weights. transformers'
MarianMTModel must give our logits under teacher forcing and our greedy translations; CTranslate2 must
give our greedy and beam-4 translations. The length penalty is alpha = 0 where beams are compared:
ours is GNMT's ((5 + len) / 6) ** alpha, CTranslate2's len ** alpha, which rank some finished
hypotheses differently for alpha > 0 (BENCHMARKS.md, "Decoding against CTranslate2").

These tests skip where ctranslate2 or transformers is not installed, except under CI (``CI`` set),
where they fail: they are the test extra's.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from aiayn.bpe import load_processor
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID
from aiayn.errors import UserError
from aiayn.export import export_ctranslate2, export_huggingface, main, marian_permutation
from aiayn.speed.incremental import InferenceModel
from aiayn.model import ModelConfig, Transformer, sinusoid_table
from aiayn.search import SearchConfig, beam_search, greedy_search
from test_decode import save_model_file


def need(package: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the export tests: {package} is not installed (pip install -e '.[test]')")
        pytest.skip(f"{package} is not installed (the test extra's)")


def pad(sequences: list[list[int]]) -> torch.Tensor:
    longest = max(len(sequence) for sequence in sequences)
    return torch.tensor([sequence + [PAD_ID] * (longest - len(sequence)) for sequence in sequences])


def read_pairs(prepared, split: str) -> list[tuple[str, str]]:
    sources = (prepared / "data" / f"{split}.en").read_text(encoding="utf-8").splitlines()
    targets = (prepared / "data" / f"{split}.de").read_text(encoding="utf-8").splitlines()
    return list(zip(sources, targets))


@pytest.fixture(scope="module")
def trained(prepared):
    """(model, spm.model path): 2 layers of d_model 32 taught the corpus' word-for-word mapping by Adam."""
    spm_model = prepared / "bpe" / "spm.model"
    processor = load_processor(spm_model)
    pairs = read_pairs(prepared, "train")
    sources = [processor.encode(source) + [EOS_ID] for source, _ in pairs]
    targets = [processor.encode(target) for _, target in pairs]
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=processor.get_piece_size(), n_layers=2, d_model=32, d_ff=64, n_heads=4,
                         dropout=0.0, max_positions=128)
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        batch = torch.randint(0, len(pairs), (48,), generator=generator).tolist()
        src = pad([sources[i] for i in batch])
        tgt_in = pad([[BOS_ID] + targets[i] for i in batch])
        tgt_out = pad([targets[i] + [EOS_ID] for i in batch])
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), spm_model


@pytest.fixture(scope="module")
def test_sources(prepared, trained) -> list[list[int]]:
    """The held-out sentences as source ids (pieces then EOS)."""
    processor = load_processor(trained[1])
    return [processor.encode(source) + [EOS_ID] for source, _ in read_pairs(prepared, "dev")[:12]]


def pieces_of(spm_model) -> list[str]:
    processor = load_processor(spm_model)
    return [processor.id_to_piece(index) for index in range(processor.get_piece_size())]


def ctranslate2_outputs(folder, spm_model, sources: list[list[int]], beam: int, alpha: float) -> list[list[int]]:
    """CTranslate2's best translation of each source as ids, with our search's limits: no pad or BOS, an
    empty translation allowed, at most source length + 50 tokens before EOS. The source goes without
    its EOS: the exported config has CTranslate2 add it."""
    ctranslate2 = need("ctranslate2")
    processor = load_processor(spm_model)
    translator = ctranslate2.Translator(str(folder), device="cpu", inter_threads=1, intra_threads=1)
    outputs = []
    for source in sources:  # one at a time: the length limit is per sentence, as ours
        result = translator.translate_batch(
            [[processor.id_to_piece(index) for index in source[:-1]]], beam_size=beam, length_penalty=alpha,
            max_decoding_length=len(source) + 50, min_decoding_length=0,
            suppress_sequences=[[processor.id_to_piece(PAD_ID)], [processor.id_to_piece(BOS_ID)]],
        )
        outputs.append([processor.piece_to_id(piece) for piece in result[0].hypotheses[0]])
    return outputs


def our_outputs(model, sources: list[list[int]], beam: int, alpha: float) -> list[list[int]]:
    searched = beam_search(InferenceModel(model), pad(sources), SearchConfig(beam_size=beam, length_penalty=alpha))
    return [hypotheses[0].tokens for hypotheses in searched]


def test_the_permutation_turns_our_interleaved_sinusoids_into_marians_sines_then_cosines():
    need("transformers")
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for d_model in (32, 33):
        marian = MarianSinusoidalPositionalEmbedding(64, d_model).create_weight()
        ours = sinusoid_table(64, d_model)[:, marian_permutation(d_model)]
        assert torch.allclose(ours, marian, atol=1e-6)


def test_huggingface_export_gives_our_logits_under_teacher_forcing(tmp_path, prepared, trained):
    need("transformers")
    from transformers import MarianMTModel, MarianTokenizer

    model, spm_model = trained
    export_huggingface(model, spm_model, tmp_path / "hf")
    marian = MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    tokenizer = MarianTokenizer.from_pretrained(tmp_path / "hf")
    processor = load_processor(spm_model)
    pairs = read_pairs(prepared, "dev")[:16]
    src = pad([processor.encode(source) + [EOS_ID] for source, _ in pairs])
    tgt_in = pad([[BOS_ID] + processor.encode(target) for _, target in pairs])
    assert tokenizer([source for source, _ in pairs], padding=True)["input_ids"] == src.tolist()
    with torch.no_grad():
        ours = model(src, tgt_in)
        theirs = marian(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in).logits
    real = tgt_in.ne(PAD_ID)
    assert (ours - theirs)[real].abs().max() < 1e-4


def test_huggingface_export_beam_size_is_the_schemas_decode_beam_size(tmp_path, trained):
    need("transformers")
    from transformers import GenerationConfig

    from aiayn.config import schema_default

    model, spm_model = trained
    export_huggingface(model, spm_model, tmp_path / "hf")
    assert GenerationConfig.from_pretrained(tmp_path / "hf").num_beams == schema_default("decode.beam_size") == 4


def test_export_cli_searches_with_the_configs_beam_size(tmp_path, trained, capsys):
    need("transformers")
    from transformers import GenerationConfig

    model, spm_model = trained
    save_model_file(tmp_path / "model.pt", model, spm_model)
    (tmp_path / "c.yaml").write_text("models: [base]\ndecode: {beam_size: 6}\n")
    assert main(["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--format", "huggingface",
                 "--out", str(tmp_path / "hf"), "--config", str(tmp_path / "c.yaml")]) == 0
    assert GenerationConfig.from_pretrained(tmp_path / "hf").num_beams == 6


def test_the_workflows_export_generates_with_the_configs_decode_beam_size(tmp_path, trained):
    """The export rule's command, formatted as Snakemake formats it, hands the export the resolved config
    (SETTINGS): a Hugging Face export then generates with its decode.beam_size, not the paper's 4."""
    need("transformers")
    import shlex
    import subprocess
    import sys
    from types import SimpleNamespace

    from conftest import REPO
    from transformers import GenerationConfig

    from aiayn.config import read_config, write_resolved

    model, spm_model = trained
    save_model_file(tmp_path / "model.pt", model, spm_model)
    (tmp_path / "c.yaml").write_text("models: [base]\ndecode: {beam_size: 2}\n")
    settings = write_resolved(read_config([tmp_path / "c.yaml"]), tmp_path / "config" / "resolved.yaml")
    rule = (REPO / "workflow" / "rules" / "export.smk").read_text()
    shell = eval("(" + rule.split("shell:", 1)[1] + ")", {"SETTINGS": settings})  # the rule's pieces, joined
    command = shell.format(log=tmp_path / "export.log", resources=SimpleNamespace(attempt=1),
                           input=SimpleNamespace(model=tmp_path / "model.pt", spm_model=spm_model),
                           wildcards=SimpleNamespace(format="huggingface"), output=tmp_path / "hf")
    aiayn, *arguments = shlex.split(command)
    assert aiayn == "aiayn" and "--config" in arguments
    done = subprocess.run([sys.executable, "-m", "aiayn.cli", *arguments], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (tmp_path / "export.log").read_text()[-3000:]
    assert GenerationConfig.from_pretrained(tmp_path / "hf").num_beams == 2


def test_huggingface_greedy_generate_translates_as_our_greedy_search(tmp_path, trained, test_sources):
    need("transformers")
    from transformers import MarianMTModel

    model, spm_model = trained
    export_huggingface(model, spm_model, tmp_path / "hf")
    marian = MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    ours = greedy_search(InferenceModel(model), pad(test_sources), length_penalty_alpha=0.0)
    for source, hypothesis in zip(test_sources, ours):
        # One at a time: max_new_tokens is per call; ours is per sentence (source length + 50, then EOS).
        generated = marian.generate(torch.tensor([source]), num_beams=1, do_sample=False,
                                    max_new_tokens=len(source) + 51)[0].tolist()
        assert generated[0] == BOS_ID
        output = generated[1:]
        assert output[output.index(EOS_ID) - 1] != PAD_ID
        assert output[: output.index(EOS_ID)] == hypothesis.tokens


def test_ctranslate2_export_translates_as_our_greedy_and_beam_search(tmp_path, trained, test_sources):
    """Token for token, except where a beam runs to the length limit (source length + 50) without EOS.

    There the engines rank differently by design: ours forces EOS at the limit and counts its log-prob
    (as fairseq does); CTranslate2 stops without it. Such outputs are the degenerate loops of a barely
    trained model; which of them each engine keeps depends on the CPU's arithmetic (on an AVX2-only
    CPU the trained weights differ and some do). Both must then have hit the limit, and most sentences
    must still be compared."""
    need("ctranslate2")
    model, spm_model = trained
    export_ctranslate2(model, pieces_of(spm_model), tmp_path / "ct2")
    limits = [len(source) + 50 for source in test_sources]  # the source counts its EOS, as ours does
    for beam in (1, 4):
        ours = our_outputs(model, test_sources, beam, alpha=0.0)
        assert sum(len(output) for output in ours) > 3 * len(ours)  # real translations, not empty ones
        theirs = ctranslate2_outputs(tmp_path / "ct2", spm_model, test_sources, beam, alpha=0.0)
        if beam == 1:  # one hypothesis: the forced EOS changes no choice, so every sentence must agree
            assert theirs == ours
            continue
        at_limit = {index for index, limit in enumerate(limits)
                    if len(ours[index]) == limit or len(theirs[index]) == limit}
        for index in at_limit:
            assert len(ours[index]) == len(theirs[index]) == limits[index], f"sentence {index}"
        compared = [index for index in range(len(ours)) if index not in at_limit]
        assert len(compared) >= 2 * len(ours) // 3
        assert [theirs[index] for index in compared] == [ours[index] for index in compared]


def test_ctranslate2_int8_export_is_smaller_and_still_translates(tmp_path, trained, test_sources):
    need("ctranslate2")
    model, spm_model = trained
    export_ctranslate2(model, pieces_of(spm_model), tmp_path / "fp32")
    export_ctranslate2(model, pieces_of(spm_model), tmp_path / "int8", quantization="int8")
    assert (tmp_path / "int8" / "model.bin").stat().st_size < (tmp_path / "fp32" / "model.bin").stat().st_size
    # int8 rounds the weights, so its translations may differ from ours; it must still translate.
    theirs = ctranslate2_outputs(tmp_path / "int8", spm_model, test_sources[:4], 4, alpha=0.0)
    assert all(output and PAD_ID not in output for output in theirs)


@pytest.mark.parametrize("positional", ["learned", "none"])
def test_ctranslate2_takes_learned_or_no_positions_and_marian_refuses_them(tmp_path, trained, test_sources,
                                                                           positional):
    need("ctranslate2")
    _, spm_model = trained
    torch.manual_seed(3)
    model = Transformer(ModelConfig(vocab_size=len(pieces_of(spm_model)), n_layers=2, d_model=32, d_ff=64,
                                    n_heads=4, dropout=0.0, positional=positional, max_positions=128)).eval()
    export_ctranslate2(model, pieces_of(spm_model), tmp_path / "ct2")
    sources = test_sources[:8]
    assert ctranslate2_outputs(tmp_path / "ct2", spm_model, sources, 1, 0.0) == our_outputs(model, sources, 1, 0.0)
    with pytest.raises(UserError, match=f"positional = {positional}.*--format ctranslate2"):
        export_huggingface(model, spm_model, tmp_path / "hf")


def test_marian_refuses_keys_and_values_of_different_sizes(tmp_path, trained):
    _, spm_model = trained
    model = Transformer(ModelConfig(vocab_size=len(pieces_of(spm_model)), n_layers=1, d_model=32, d_ff=64,
                                    n_heads=4, d_head=4, d_value=8))
    with pytest.raises(UserError, match="d_head = 4 but d_value = 8"):
        export_huggingface(model, spm_model, tmp_path / "hf")


def test_export_cli_writes_a_ctranslate2_folder(tmp_path, trained, capsys):
    need("ctranslate2")
    model, spm_model = trained
    save_model_file(tmp_path / "model.pt", model, spm_model)
    assert main(["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--format", "ctranslate2",
                 "--out", str(tmp_path / "ct2"), "--quantization", "int8"]) in (0, None)
    assert {"model.bin", "config.json", "shared_vocabulary.json"} <= {path.name for path in (tmp_path / "ct2").iterdir()}
    assert "exported" in capsys.readouterr().out


def test_export_cli_refuses_quantization_for_huggingface_with_exit_status_2(tmp_path, trained, capsys):
    model, spm_model = trained
    save_model_file(tmp_path / "model.pt", model, spm_model)
    status = main(["--model", str(tmp_path / "model.pt"), "--spm-model", str(spm_model), "--format", "huggingface",
                   "--out", str(tmp_path / "hf"), "--quantization", "int8"])
    assert status == 2
    assert "--quantization int8 is for --format ctranslate2 only" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
