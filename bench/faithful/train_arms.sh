#!/usr/bin/env bash
# Trains the arms that `python -m bench.faithful.deviations arms` compares: each ARM (bench/faithful/arms/ARM.yaml,
# layered after config/multi30k.yaml and arms/short.yaml) with seeds 1, 2 and 3, two runs at a time, one thread
# each, on the Multi30k recipe's data stages. From the repository root, after
#   snakemake --cores 2 --configfile config/multi30k.yaml --until binarize
# run, for example:
#   bench/faithful/train_arms.sh results/multi30k runs baseline shape_buckets t2t_smoothing
# Each run is RUNS/ARM/seedN/run (its checkpoints/ and metrics.jsonl); a run already finished is trained again
# only if its folder is removed first (a killed one resumes).
set -euo pipefail
results=$1 runs=$2
shift 2
train_one() {
    local arm=$1 seed=$2 results=$3 runs=$4
    mkdir -p "$runs/$arm/seed$seed"
    OMP_NUM_THREADS=1 aiayn --log "$runs/$arm/seed$seed/train.log" train \
        --config config/multi30k.yaml bench/faithful/arms/short.yaml "bench/faithful/arms/$arm.yaml" \
        --preset m30k_base --seed "$seed" --train-data "$results/bin/train" --dev-data "$results/bin/dev" \
        --spm-model "$results/bpe/spm.model" --run-dir "$runs/$arm/seed$seed/run" --threads 1 \
        > "$runs/$arm/seed$seed/stdout.log" 2>&1
    echo "$arm seed $seed: done"
}
export -f train_one
for arm in "$@"; do
    for seed in 1 2 3; do
        echo "$arm $seed"
    done
done | xargs -P 2 -L 1 bash -c 'train_one "$2" "$3" "$0" "$1"' "$results" "$runs"
