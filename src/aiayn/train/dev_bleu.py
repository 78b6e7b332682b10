"""Dev BLEU during training: a fixed dev sample translated by the decode stage's own search and scored
with sacreBLEU, at every dev evaluation, beside dev perplexity.

The sample is the dev split's first ``train.dev_bleu_sentences`` pairs in file order (with a learned
positional table, the first that the table holds: ``aiayn.train.steps.dev_rows``), the same at every
evaluation and for every seed, so that curves compare. Its sources and references are the binarized ids
detokenised with the run's SentencePiece model, which gives the text back (its normalisation is the
identity, ``aiayn.bpe``): no input beyond the dev split. The search is ``aiayn.decode.translate_settings``
with beam ``train.dev_bleu_beam`` (1: greedy) and the paper's length penalty and maximum length, and
the score is what ``aiayn score`` reports as ``sacrebleu``, so the number equals ``aiayn decode`` +
``aiayn score`` on the same checkpoint and sentences. The search draws no random numbers; torch's RNG
state and the model's mode are restored all the same, so that training takes the same steps with it on
or off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aiayn.config import schema_default


class DevBleu:
    """The sample's sources and references, and ``score(model)``: ``{"dev_bleu": ...}`` (``{}`` when off)."""

    def __init__(self, split, rows: np.ndarray | None, spm_model: Path, sentences: int, beam_size: int,
                 device: torch.device):
        self.device = device
        self.sources: list[str] = []
        self.references: list[str] = []
        self.beam_size = beam_size
        if split is None or rows is None or sentences == 0:
            return
        from aiayn.bpe import load_processor

        self.processor = load_processor(spm_model)
        sample = [int(row) for row in rows[:sentences]]
        self.sources = [self.processor.decode(split.src(row).tolist()) for row in sample]
        self.references = [self.processor.decode(split.tgt(row).tolist()) for row in sample]

    @classmethod
    def from_section(cls, train_section: dict, split, rows, spm_model: Path, device: torch.device) -> "DevBleu":
        """With ``train.dev_bleu_sentences`` and ``train.dev_bleu_beam`` of a section the config door filled."""
        return cls(split, rows, spm_model, train_section["dev_bleu_sentences"], train_section["dev_bleu_beam"], device)

    @property
    def enabled(self) -> bool:
        return bool(self.sources)

    def translations(self, model: torch.nn.Module) -> list[str]:
        """The sample translated by ``model`` (a ``Transformer``) as ``aiayn decode`` translates it."""
        from aiayn.decode import DecodeSettings, hypothesis_text, translate_settings
        from aiayn.search import SearchConfig
        from aiayn.speed.incremental import InferenceModel

        # a fresh one each time: fused Adam updates the weights without moving their version, by which an
        # InferenceModel would notice that its packed weights are stale
        inference = InferenceModel(model)
        settings = DecodeSettings(SearchConfig(beam_size=self.beam_size), schema_default("decode.tokens_per_batch"),
                                  workers=1, max_source_tokens=None)
        was_training = model.training
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        model.eval()
        try:
            hypotheses = translate_settings(inference, self.processor, self.sources, settings, self.device,
                                            progress=False, source="the dev sample")
        finally:
            model.train(was_training)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
        return [hypothesis_text(self.processor, best[0]) for best in hypotheses]

    def score(self, model: torch.nn.Module) -> dict[str, float]:
        """sacreBLEU (its defaults, as ``aiayn.score.score``'s ``sacrebleu``) of the sample's translations."""
        if not self.enabled:
            return {}
        from sacrebleu.metrics import BLEU

        return {"dev_bleu": BLEU().corpus_score(self.translations(model), [self.references]).score}
