"""Why a model's outputs are short: the search, the length penalty, or the model itself.

For a trained model and a dev or test set this decodes with several search settings (beam, GNMT
alpha, and whether a sentence's search also ends once beam_size hypotheses have finished, fairseq's
rule, or by tensor2tensor's bound alone) and prints, for each, sacreBLEU, the hypothesis/reference
length ratio and the time.
Then, for the first setting (the paper's: beam 4, alpha 0.6), it scores every reference and every
output under the model by teacher forcing (one forward pass for both), and sorts the outputs that are
shorter than their reference:

- ``search``: the reference has the better search objective, log P / lp(|y| + 1): the search missed a
  longer hypothesis that it would have preferred;
- ``model``: the short output has the better objective: the model (with this length penalty) prefers
  it. For these the alpha at which the reference's objective would catch up is printed: near 1 the
  penalty is the lever, far above it the model itself is short.

    python -m bench.decode.lengths --model results/multi30k/train/m30k_base/seed1/checkpoints/step_1000.pt \\
        --spm-model results/multi30k/bpe/spm.model --src results/multi30k/data/dev.en \\
        --ref results/multi30k/data/dev.de
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn.bpe import load_processor
from aiayn.checkpoint import load_model
from aiayn.decode import _pad, hypothesis_text, translate
from aiayn.score import score
from aiayn.search import SearchConfig, length_penalty
from aiayn.speed.incremental import InferenceModel
from aiayn.tokens import BOS_ID, EOS_ID, PAD_ID


@torch.no_grad()
def sequence_log_probs(model, sources: list[list[int]], outputs: list[list[int]], batch_size: int = 64) -> list[float]:
    """log P(output + EOS | source) under teacher forcing, one float per pair (sources end in EOS)."""
    result = [0.0] * len(sources)
    order = sorted(range(len(sources)), key=lambda i: (len(sources[i]), len(outputs[i])))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        src = _pad([sources[i] for i in rows], "cpu")
        tgt_in = _pad([[BOS_ID] + outputs[i] for i in rows], "cpu")
        target = _pad([outputs[i] + [EOS_ID] for i in rows], "cpu")
        log_probs = F.log_softmax(model(src, tgt_in).float(), dim=-1)
        picked = log_probs.gather(2, target[:, :, None]).squeeze(2).masked_fill(target.eq(PAD_ID), 0.0)
        for row, value in zip(rows, picked.sum(dim=1).tolist()):
            result[row] = value
    return result


def classify(hyp_log_prob: float, hyp_len: int, ref_log_prob: float, ref_len: int, alpha: float) -> tuple[str, float] | None:
    """Why an output shorter than its reference won: ("search", nan) or ("model", the alpha at which the
    reference's objective equals the output's); None when it is not shorter. Lengths without EOS."""
    if hyp_len >= ref_len:
        return None
    if ref_log_prob / length_penalty(ref_len + 1, alpha) > hyp_log_prob / length_penalty(hyp_len + 1, alpha):
        return "search", math.nan
    # log P_ref / lp_ref(a) = log P_hyp / lp_hyp(a)  <=>  ((6 + ref_len) / (6 + hyp_len)) ** a = log P_ref / log P_hyp
    needed = math.log(ref_log_prob / hyp_log_prob) / math.log((6 + ref_len) / (6 + hyp_len)) if hyp_log_prob < 0 else math.inf
    return "model", needed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--spm-model", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--settings", nargs="+", default=["4:0.6", "4:0.6:bound", "4:1.0", "4:1.0:bound", "1:0.6"],
                        help="beam:alpha to decode with, or beam:alpha:bound to end a sentence's search by "
                             "tensor2tensor's bound alone (not also when beam_size hypotheses have finished, "
                             "fairseq's rule); the first is the one analysed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lang", default="de")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    processor = load_processor(args.spm_model)
    model = load_model(args.model, "cpu", spm_model=args.spm_model)
    search_model = InferenceModel(model)
    sources_text = Path(args.src).read_text(encoding="utf-8").splitlines()
    references = Path(args.ref).read_text(encoding="utf-8").splitlines()

    print(f"# {args.model}: {len(sources_text)} sentences of {args.src}")
    print("| beam | alpha | search ends | sacreBLEU | length ratio | brevity penalty | seconds |")
    print("|---|---|---|---|---|---|---|")
    results, analysed = [], None
    for setting in args.settings:
        beam, alpha, *rule = setting.split(":")
        config = SearchConfig(beam_size=int(beam), length_penalty=float(alpha), stop_when_beam_finished=rule != ["bound"])
        started = time.perf_counter()
        hypotheses = [best[0] for best in translate(search_model, processor, sources_text, config, progress=False,
                                                    workers=args.threads)]
        seconds = time.perf_counter() - started
        scores = score([hypothesis_text(processor, h) for h in hypotheses], references, args.lang)
        ends = "bound" if rule == ["bound"] else "bound or beam finished"
        results.append({"beam": int(beam), "alpha": float(alpha), "search_ends": ends, "sacrebleu": scores["sacrebleu"],
                        "length_ratio": scores["length_ratio"], "brevity_penalty": scores["brevity_penalty"],
                        "seconds": seconds})
        print(f"| {beam} | {alpha} | {ends} | {scores['sacrebleu']:.2f} | {scores['length_ratio']:.3f} | "
              f"{scores['brevity_penalty']:.3f} | {seconds:.1f} |", flush=True)
        if analysed is None:
            analysed = (config, hypotheses)

    config, hypotheses = analysed
    sources = [ids + [EOS_ID] for ids in processor.encode(sources_text, out_type=int)]
    reference_ids = processor.encode(references, out_type=int)
    hyp_ids = [list(h.tokens) for h in hypotheses]
    hyp_lp = sequence_log_probs(model, sources, hyp_ids)
    ref_lp = sequence_log_probs(model, sources, reference_ids)
    causes, needed = {"search": 0, "model": 0}, []
    for h, hl, r, rl in zip(hyp_ids, hyp_lp, reference_ids, ref_lp):
        found = classify(hl, len(h), rl, len(r), config.length_penalty)
        if found:
            causes[found[0]] += 1
            if found[0] == "model":
                needed.append(found[1])
    shorter = sum(causes.values())
    hyp_tokens, ref_tokens = sum(map(len, hyp_ids)), sum(map(len, reference_ids))
    print(f"\nbeam {config.beam_size}, alpha {config.length_penalty}: {hyp_tokens / ref_tokens:.3f} of the "
          f"references' BPE tokens; {shorter} of {len(hyp_ids)} outputs shorter than their reference, of which")
    print(f"  search (the reference has the better objective): {causes['search']} ({causes['search'] / max(shorter, 1):.0%})")
    median = statistics.median(needed) if needed else math.nan
    print(f"  model (the short output has the better objective): {causes['model']} "
          f"({causes['model'] / max(shorter, 1):.0%}); alpha that would make the reference's equal: median {median:.2f}")
    print(f"mean log P per sentence: outputs {sum(hyp_lp) / len(hyp_lp):.2f}, references {sum(ref_lp) / len(ref_lp):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": results, "shorter": shorter, "causes": causes,
                                         "median_alpha_needed": median,
                                         "bpe_length_ratio": hyp_tokens / ref_tokens}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
