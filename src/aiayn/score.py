"""The score stage: sacreBLEU, the paper's tokenized BLEU, chrF, and a paired bootstrap test.

Two BLEU numbers are reported side by side because they differ by up to a point and a half
(docs/PAPER.md, "BLEU", pitfall 1):

- ``sacrebleu``: detokenized BLEU with sacreBLEU's defaults (13a tokenizer, case-sensitive,
  exponential smoothing), printed with its signature so anyone can recompute it.
- ``bleu_tok``: the number comparable with the paper's Table 2, computed as the authors'
  tensor2tensor script ``get_ende_bleu.sh`` did it: Moses ``replace-unicode-punctuation.perl``,
  Moses ``tokenizer.perl -l de`` (XML escaping on, that script's default), hyphenated
  compounds split into ``a ##AT##-##AT## b`` by one pass of
  ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``, then ``multi-bleu.perl`` (cased,
  whitespace tokens, no smoothing). The Moses steps run through sacremoses and the BLEU
  through sacreBLEU with ``tokenize="none"`` and ``smooth_method="none"``, which is
  multi-bleu.perl's arithmetic. Hypotheses and references go through identical steps.
  The compound split is an English-German convention (t2t's script is ``get_ende_bleu.sh``): other
  target languages, French among them, get Moses-tokenised BLEU without it, as the EN-FR papers that
  Table 2 quotes computed theirs; ``bleu_tok_method`` says which was used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from aiayn.config import schema_default
from aiayn.errors import UserError, cli
from aiayn.reading import read_lines, same_file
from aiayn.writing import prepare_output, refuse_overwriting_inputs, write_json_atomic

BLEU_TOK_METHOD = (
    "moses replace-unicode-punctuation + moses tokenizer -l {lang} (escaped) + compound split "
    "s{{(\\S)-(\\S)}}{{$1 ##AT##-##AT## $2}}g; sacrebleu tokenize=none smooth=none, case-sensitive "
    "(= multi-bleu.perl; t2t get_ende_bleu.sh)"
)
BLEU_TOK_METHOD_PLAIN = (
    "moses replace-unicode-punctuation + moses tokenizer -l {lang} (escaped), no compound split; "
    "sacrebleu tokenize=none smooth=none, case-sensitive (= multi-bleu.perl on Moses tokens)"
)
# The target languages whose papers split hyphenated compounds before BLEU (t2t's get_ende_bleu.sh).
SPLITS_COMPOUNDS = frozenset({"de"})

# re.ASCII: the t2t script runs this substitution with `perl -ple` on raw UTF-8 bytes, where
# \s is ASCII whitespace only and every non-ASCII byte counts as \S. A single left-to-right
# pass, like perl's /g: in "a-b-c" the "b" is consumed by the first match, so the second
# hyphen stays joined ("a ##AT##-##AT## b-c"), exactly as the authors' numbers were made.
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)", re.ASCII)

# The XML escapes Moses' tokenizer writes (escape=True): in a hypothesis they are scored as the characters
# "&apos;", not as the apostrophe the reference holds.
_MOSES_ESCAPE = re.compile(r"&(?:apos|quot|amp|lt|gt|#124|#91|#93);")


def split_compounds(tokenized_line: str) -> str:
    """Split hyphenated compounds the way t2t's get_ende_bleu.sh did: ``a-b`` -> ``a ##AT##-##AT## b``."""
    return _COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", tokenized_line)


def bleu_tok_method(lang: str) -> str:
    """How ``bleu_tok`` is computed for target language ``lang``, in words."""
    return (BLEU_TOK_METHOD if lang in SPLITS_COMPOUNDS else BLEU_TOK_METHOD_PLAIN).format(lang=lang)


def t2t_tokenize(lines: Sequence[str], lang: str = "de") -> list[str]:
    """Apply get_ende_bleu.sh's preprocessing to each line: unicode punctuation, Moses tokens, and for a
    language in SPLITS_COMPOUNDS (German) the compound split."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    # Only replace-unicode-punctuation.perl, not the full normalize-punctuation.perl:
    # the t2t script ran just that one.
    normalizer = MosesPunctNormalizer(lang)
    tokenizer = MosesTokenizer(lang)
    split = split_compounds if lang in SPLITS_COMPOUNDS else str
    return [split(tokenizer.tokenize(normalizer.replace_unicode_punct(line), return_str=True, escape=True))
            for line in lines]


def score(hypotheses: list[str], references: list[str], lang: str = "de") -> dict:
    """Score detokenized hypotheses against one reference each; returns the JSON-able result."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise UserError(
            f"{len(hypotheses)} hypotheses but {len(references)} references; "
            "each hypothesis needs exactly one reference on the same line"
        )
    if not hypotheses:
        raise UserError("nothing to score: no hypotheses and no references")

    bleu = BLEU()
    sacre = bleu.corpus_score(hypotheses, [references])
    # force: the input is tokenized on purpose, so sacreBLEU's "forgot to detokenize" warning is noise
    tokenized_bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    tok = tokenized_bleu.corpus_score(t2t_tokenize(hypotheses, lang), [t2t_tokenize(references, lang)])
    chrf = CHRF()
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "sacrebleu": sacre.score,
        "sacrebleu_signature": str(bleu.get_signature()),
        "bleu_tok": tok.score,
        "bleu_tok_method": bleu_tok_method(lang),
        "chrf": chrf_score.score,
        "chrf_signature": str(chrf.get_signature()),
        # hypothesis / reference length in sacreBLEU's tokens; under 1 is what the brevity penalty punishes
        "length_ratio": sacre.sys_len / sacre.ref_len if sacre.ref_len else float("nan"),
        "brevity_penalty": sacre.bp,
        "n_segments": len(hypotheses),
    }


def score_files(hyp_path: str | os.PathLike, ref_path: str | os.PathLike, lang: str = "de") -> dict:
    """Score a hypothesis file against a reference file, one segment per ``\\n``-terminated line.

    The two must be different files; hypotheses that copy the references, or hold Moses escapes the
    references lack, are scored with a warning on stderr (``score_warnings``)."""
    if same_file(hyp_path, ref_path):
        raise UserError(f"--hyp {hyp_path} and --ref {ref_path} are one file: scored against itself, any text gets "
                        "BLEU 100; give the system's translations as --hyp")
    hypotheses = read_lines(hyp_path)
    references = read_lines(ref_path)
    if len(hypotheses) != len(references):
        raise UserError(
            f"{hyp_path} has {len(hypotheses)} lines but {ref_path} has {len(references)}; "
            "the hypothesis file must have one line per reference line (was decoding interrupted, "
            "or was it run on a different test set?)"
        )
    if not hypotheses:
        raise UserError(f"{hyp_path} and {ref_path} are empty; there is nothing to score")
    for note in score_warnings(hyp_path, ref_path, hypotheses, references):
        print(f"warning: {note}", file=sys.stderr)
    return score(hypotheses, references, lang)


def score_warnings(hyp_path, ref_path, hypotheses: list[str], references: list[str]) -> list[str]:
    """One line for each way the hypotheses look like something other than a system's raw output."""
    notes = []
    if hypotheses == references:
        notes.append(f"every line of {hyp_path} equals its line of {ref_path}: a copy of the references, not "
                     "a system's translations? (the scores below are those of a perfect system)")
    escaped = [number for number, (hypothesis, reference) in enumerate(zip(hypotheses, references), start=1)
               if set(_MOSES_ESCAPE.findall(hypothesis)) - set(_MOSES_ESCAPE.findall(reference))]
    if escaped:
        notes.append(f"{len(escaped)} lines of {hyp_path} hold Moses escapes (&apos; &quot; &amp; ...) that their "
                     f"references do not, the first line {escaped[0]}: they are scored as those characters; score "
                     "the raw text (sacremoses' MosesDetokenizer unescapes it)")
    return notes


@contextlib.contextmanager
def _sacrebleu_seed(seed: int) -> Iterator[None]:
    # sacreBLEU's PairedTest reads its seed only from this environment variable.
    previous = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = previous


def paired_bootstrap(
    baseline_hyps: list[str],
    system_hyps: list[str],
    refs: list[str],
    n_samples: int = 1000,
    seed: int = 12345,
) -> dict:
    """sacreBLEU's paired bootstrap resampling (Koehn 2004) of detokenized BLEU, system vs baseline.

    Returns both scores, the p-value of the null hypothesis that the system is no different
    from the baseline, and each system's bootstrap mean and 95% confidence half-width.
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if not (len(baseline_hyps) == len(system_hyps) == len(refs)):
        raise UserError(
            f"paired bootstrap needs aligned segments: {len(baseline_hyps)} baseline hypotheses, "
            f"{len(system_hyps)} system hypotheses, {len(refs)} references"
        )
    if not refs:
        raise UserError("paired bootstrap needs at least one segment")
    if seed < 1:
        # sacreBLEU treats a seed of 0 as "no seed" and would draw from the OS.
        raise UserError(f"paired bootstrap seed must be a positive integer, got {seed}")
    if n_samples < 1:
        raise UserError(f"paired bootstrap needs at least one resample, got n_samples = {n_samples}")

    with _sacrebleu_seed(seed):
        test = PairedTest(
            [("baseline", baseline_hyps), ("system", system_hyps)],
            {"BLEU": BLEU()},
            references=[refs],
            test_type="bs",
            n_samples=n_samples,
        )
        signatures, results = test()
    baseline, system = results["BLEU"]
    return {
        "metric": "BLEU",
        "signature": str(signatures["BLEU"]),
        "baseline_bleu": float(baseline.score),
        "baseline_mean": float(baseline.mean),
        "baseline_ci": float(baseline.ci),
        "system_bleu": float(system.score),
        "system_mean": float(system.mean),
        "system_ci": float(system.ci),
        "p_value": float(system.p_value),
        "n_samples": n_samples,
        "seed": seed,
    }


def format_scores(result: dict) -> str:
    """The human-readable block that `aiayn score` prints."""
    return "\n".join([
        f"sacreBLEU       {result['sacrebleu']:6.2f}  {result['sacrebleu_signature']}",
        f"tokenized BLEU  {result['bleu_tok']:6.2f}  {result['bleu_tok_method']}",
        f"chrF            {result['chrf']:6.2f}  {result['chrf_signature']}",
        f"length ratio    {result['length_ratio']:6.3f}  hypothesis / reference (brevity penalty {result['brevity_penalty']:.3f})",
        f"segments        {result['n_segments']}",
    ])


@dataclass(frozen=True)
class ScoreSettings:
    """What the stage reads of a config, built once: the target language (Moses' tokenizer, and whether
    hyphenated compounds are split) and where the run is tracked."""

    lang: str  # data.tgt_lang
    tracking_uri: str

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ScoreSettings:
        """Through the door: --config's files (else the schema's defaults), --lang and --tracking-uri winning."""
        from aiayn.config import config_from_arguments

        config = config_from_arguments(args, {"lang": ("--lang", "data.tgt_lang"),
                                              "tracking_uri": ("--tracking-uri", "tracking_uri")})
        return cls(lang=config["data"]["tgt_lang"], tracking_uri=config["tracking_uri"])


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn score", description=__doc__.splitlines()[0])
    parser.add_argument("--hyp", required=True, help="detokenized hypotheses, one segment per line")
    parser.add_argument("--ref", required=True, help="detokenized references, one segment per line")
    parser.add_argument("--config", nargs="+", metavar="FILE",
                        help="config files (merged in order, validated once): --lang is their data.tgt_lang")
    parser.add_argument("--lang", help=f"target language for the Moses tokenizer (default: data.tgt_lang's, "
                                       f"{schema_default('data.tgt_lang')})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text block")
    parser.add_argument("--output", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--log-to-run", type=Path, metavar="FINAL_JSON",
                        help="log the scores as metrics (and the hypotheses as an artifact) into the MLflow run "
                             "of this training run's final.json")
    parser.add_argument("--split", default="test", help="metric name prefix with --log-to-run (dev or test)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: tracking_uri's; MLFLOW_TRACKING_URI "
                                               "wins)")
    return parser


@cli
def main(argv=None):
    args = arguments().parse_args(argv)
    settings = ScoreSettings.from_arguments(args)
    refuse_overwriting_inputs({"--output": args.output, "stdout": sys.stdout},
                              {"--hyp": args.hyp, "--ref": args.ref, "--log-to-run": args.log_to_run,
                               "--config": args.config})
    if args.log_to_run is not None:  # read before the work: a wrong path costs nothing and leaves nothing
        from aiayn.tracking import read_run_file

        read_run_file(args.log_to_run)
    if args.output is not None:
        prepare_output(args.output, create=False)  # refused before scoring, not after; its folder made when written
    result = score_files(args.hyp, args.ref, settings.lang)
    if args.output is not None:
        write_json_atomic(args.output, result)
    if args.log_to_run is not None:
        from aiayn.tracking import log_to_existing_run

        metrics = {f"{args.split}_{key}": result[key] for key in ("sacrebleu", "bleu_tok", "chrf", "length_ratio")}
        params = {f"{args.split}_sacrebleu_signature": result["sacrebleu_signature"],
                  "bleu_tok_method": result["bleu_tok_method"]}
        log_to_existing_run(args.log_to_run, settings.tracking_uri, metrics, [args.hyp] + ([args.output] if args.output else []),
                            artifact_path=f"translations/{args.split}", params=params)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_scores(result))


if __name__ == "__main__":
    raise SystemExit(main())
