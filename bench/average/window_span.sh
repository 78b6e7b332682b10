#!/usr/bin/env bash
# The run behind bench/average/window_span.py: the DAG with a safety checkpoint every minute, every checkpoint the
# run writes kept (hard links, polled), then test BLEU of averages over several shares of the run. From the
# repository root, nothing else running (a time-budgeted run trains as far as the machine lets it):
#   bench/average/window_span.sh m30k_30min config/multi30k.yaml config/multi30k_30min.yaml
set -euo pipefail
model=$1
shift
experiment=$(python -c "import sys; from aiayn.config import load_config; print(load_config(sys.argv[1:])['experiment'])" "$@")
results=results/$experiment
kept=$results/window_span/kept
extra=$(mktemp --suffix=.yaml)
printf 'presets:\n  %s:\n    checkpoint_minutes: 1.0\n' "$model" >"$extra"
mkdir -p "$kept"
checkpoints=$results/train/$model/seed1/checkpoints
( while true; do
    for f in "$checkpoints"/*.pt; do
      [ -e "$f" ] && [ ! -e "$kept/${f##*/}" ] && ln "$f" "$kept/${f##*/}" 2>/dev/null
    done
    sleep 2
  done ) &
keeper=$!
trap 'kill $keeper 2>/dev/null; rm -f "$extra"' EXIT
snakemake --cores all --configfile "$@" "$extra"
python -m bench.average.window_span --kept "$kept" --results "$results" --model "$model" --config "$@" "$extra"
