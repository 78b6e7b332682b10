#!/usr/bin/env bash
# Issue 37's "last vs averaged" row for one finished run of the DAG: test sacreBLEU of the averaged model
# (the DAG's score/.../test.json) and of the last checkpoint (final.pt, decoded and scored here with the
# same decode settings), beside the dev perplexities the average stage wrote to average.json.
# From the repository root, after the DAG, with the config files the DAG was given:
#   bench/average/last_vs_averaged.sh results/multi30k_30min m30k_30min config/multi30k.yaml config/multi30k_30min.yaml
set -euo pipefail
results=$1 model=$2
shift 2
run=$results/train/$model/seed1
out_dir=$results/last_vs_averaged/$model
mkdir -p "$out_dir"
aiayn decode --config "$@" --model "$run/final.pt" --spm-model "$results/bpe/spm.model" \
    --input "$results/data/test.en" --output "$out_dir/test_last.de"
aiayn score --hyp "$out_dir/test_last.de" --ref "$results/data/test.de" --lang de --output "$out_dir/test_last.json" >/dev/null
python - "$results" "$model" "$out_dir" <<'PY'
import json, sys
from pathlib import Path

results, model, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
final = json.loads((results / "train" / model / "seed1" / "final.json").read_text())
average = json.loads((results / "average" / model / "seed1" / "average.json").read_text())
averaged = json.loads((results / "score" / model / "seed1" / "test.json").read_text())
last = json.loads((out / "test_last.json").read_text())
print("| steps | stopped by | averaged steps | dev ppl last | dev ppl averaged | test sacreBLEU last | "
      "test sacreBLEU averaged | averaged - last |")
print("|---|---|---|---|---|---|---|---|")
print(f"| {final['step']} | {final['stopped_by']} | {' '.join(map(str, average['averaged_steps']))} | "
      f"{average['dev_ppl_last']:.2f} | {average['dev_ppl_averaged']:.2f} | {last['sacrebleu']:.2f} | "
      f"{averaged['sacrebleu']:.2f} | {averaged['sacrebleu'] - last['sacrebleu']:+.2f} |")
PY
