#!/usr/bin/env bash
# The check of one GPU node (docs/gpu-check.md): the real pipeline and its speeds, in one run of at most
# 8 minutes, each part under its own time and printed as it goes (a part that fails or runs out of its time
# does not stop the next).
#   srun --gres=gpu:1 --cpus-per-task=16 --time=00:15:00 env PYTHON=.venv/bin/python MULTI30K=... bash bench/gpu.sh
#   make gpu-wheels                   # on the login node, only where the GPU node's Python lacks the packages
#   bash bench/gpu.sh --device cpu    # every part at toy sizes on a CPU: the smoke test (tests/test_gpu_check.py)
# Parts, in the order they run, with their time on a GPU (sized from the 2026-12-04 run on an H200,
# BENCHMARKS.md "GPU"; its figure in brackets):
#   0. ~25 s  the wheels' install (only where .whl is needed) and the import check [21 s]
#   1.  12 s  the bf16 matmul ceiling [6 s]
#   2. 135 s  the demo DAG at GPU size (config/gpu_check.yaml, 300 steps) through snakemake: training and
#             decoding on the device in bf16, MLflow into sqlite, averaging, scoring, the report's tables
#             [167 s at 600 steps and 1000-sentence dev and test sets, now 500]
#   3.  75 s  DDP: 8 steps in 1 process, then in 2 (torchrun) sharing the GPU; the same real tokens a step,
#             every process exited, and how long after its final.json [20 steps: 26 s, then stopped at 29 s]
#   4a. 45 s  training steps cold and warm (bench.train.gpu): base and big on the trainer's real batches,
#             each train.attention choice on base, then bench.train.cpu's synthetic batches; MFU
#   5.  45 s  beam-search decoding speed, newstest2014-shaped (3003 sentences), beam 4, bf16 [39 s]
#   6. 130 s  the Multi30k recipe end to end (config/multi30k.yaml, gpus: 1, bf16) through snakemake, its
#             training stopped by a time budget (max_minutes) where it would not leave the rest of the
#             recipe its time; steps, training time and test sacreBLEU [2000 steps trained in 108 s]
#   4b.       the compiled step of base, then big, each with what the run's time leaves (skipped under
#             60 s: compiling base took over 105 s) [not done in 105 s]
#   then the table of parts 4a and 4b.
# Environment: PYTHON (default python3), WHEELS (default .whl), MULTI30K (Multi30k's plain text; default
# .m30k, on a CPU a toy corpus made here), GPU_CHECK_WORK (default a new folder in /tmp), GPU_CHECK_SECONDS
# (the whole run's limit; default 470 on a GPU, 1800 on a CPU), GPU_CHECK_PARTS (the parts to run, for a
# rerun: "3 6", say; default all).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:?--device cpu|cuda}
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "error: no ${PYTHON:-python3}"; exit 2; }
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
failed=()

part() {  # part ID NAME SECONDS COMMAND...: the command's slow steps run under `t`, within SECONDS and the run's limit
  local id=$1 name="$1. $2" start=$SECONDS status
  PART_END=$((SECONDS + $3 < RUN_END ? SECONDS + $3 : RUN_END))
  shift 3
  if [ -n "${GPU_CHECK_PARTS:-}" ] && [[ " $GPU_CHECK_PARTS " != *" $id "* ]]; then
    echo "== $name: not asked for (GPU_CHECK_PARTS=$GPU_CHECK_PARTS)"
    return
  fi
  if [ $PART_END -le $SECONDS ]; then
    echo "== $name: skipped, the run's $RUN_END s are spent"
    failed+=("$name: skipped")
    return
  fi
  echo "== $name (at most $((PART_END - start)) s)"
  "$@"
  status=$?
  [ $status -eq 124 ] || [ $status -eq 137 ] && echo "(stopped: out of time)"
  [ $status -ne 0 ] && failed+=("$name: status $status")
  echo "-- $name: $((SECONDS - start)) s"
}
t() {  # the command, stopped when the current part's time is up
  local left=$((PART_END - SECONDS))
  timeout -k 10 $((left > 1 ? left : 1)) "$@"
}

# A Python with torch but not the workflow's own packages: install the wheels of `make gpu-wheels`, without network.
if ! "$PYTHON" -c "import snakemake, mlflow, sacremoses" 2>/dev/null; then
  WHEELS=${WHEELS:-$REPO/.whl}
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "error: snakemake/MLflow missing and no wheels in $WHEELS (make gpu-wheels)"; exit 2; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $WORK/site in $SECONDS s"
fi
# What parts 2, 3 and 6 import, with the Python's own versions of what the wheels share with it.
"$PYTHON" - <<'PY' || echo "error: the pipeline's packages do not import here (parts 2, 3 and 6 will fail)"
import importlib.metadata as md
import mlflow.store.tracking.sqlalchemy_store, sacremoses, snakemake  # noqa: F401
print("imports ok:", ", ".join(f"{name} {md.version(name)}" for name in
      ("snakemake", "mlflow-skinny", "sqlalchemy", "torch", "numpy", "pandas", "protobuf", "pyyaml", "sacrebleu")))
PY
# The rules call `aiayn`; without the package installed, a stand-in that runs its CLI.
if ! command -v aiayn >/dev/null; then
  mkdir -p "$WORK/bin"
  printf '#!/bin/sh\nexec "%s" -m aiayn.cli "$@"\n' "$PYTHON" >"$WORK/bin/aiayn"
  chmod +x "$WORK/bin/aiayn"
  export PATH="$WORK/bin:$PATH"
fi

DAG=$WORK/dag M30K=$WORK/m30k STEPS_RESULTS=$WORK/steps.jsonl
mkdir -p "$DAG" "$M30K/data"
cp -r Snakefile workflow config "$DAG/"
cp -r Snakefile workflow config "$M30K/"
CONFIGS=(config/gpu_check.yaml)  # standalone: the demo no longer lies under every config
M30K_CONFIGS=(config/multi30k.yaml config/m30k_check.yaml)
if [ "$DEVICE" = cuda ]; then
  CORES=$(nproc)
  MATMUL=(--size 8192 --repeats 50)
  STEPS=(--vocab 37000 --tokens 25000 --pairs 200000 --cold 3 --warm-passes 2 --precision bf16 --presets base big)
  COMPILE=(--compile-backend inductor --min-seconds 60)
  DECODE=()
  T_MATMUL=12 T_DAG=135 T_DDP=75 T_STEPS=45 T_DECODE=45 T_M30K=130
  RUN_END=${GPU_CHECK_SECONDS:-470}  # counted from the start, the wheels included; 10 s under 8 minutes for the table
  DDP_STEPS=8
  # Multi30k: the recipe's stages other than the training loop (data, BPE, binarize, the trainer's start and
  # its last dev loss, average, decode, score, report): about 60 s on the H200, by the 2026-12-04 logs
  M30K_OVERHEAD=70
  MULTI30K=${MULTI30K:-$REPO/.m30k}
  M30K_SECTIONS="train: {device: cuda, precision: auto, threads: 4}
decode: {workers: 1, tokens_per_batch: auto}"
  M30K_PRESET="gpus: 1"
else  # the same commands at toy sizes; torch.compile traced only (its eager backend), not built
  CORES=2
  MATMUL=(--size 256 --repeats 3)
  STEPS=(--vocab 500 --tokens 200 --pairs 3000 --cold 1 --warm-passes 1 --precision bf16 --presets tiny)
  COMPILE=(--compile-backend eager --min-seconds 0)
  DECODE=(--sentences 12 --layers 1 --d-model 64 --d-ff 128 --heads 2 --vocab 500 --repeats 1)
  T_MATMUL=120 T_DAG=600 T_DDP=180 T_STEPS=180 T_DECODE=120 T_M30K=600  # guards against a hang on a shared CPU, not speeds
  RUN_END=${GPU_CHECK_SECONDS:-1800}
  DDP_STEPS=3
  M30K_OVERHEAD=120
  cat >"$DAG/config/gpu_check_cpu.yaml" <<'YAML'
data: {demo: {seed: 3, train: 1200, dev: 30, test: 30}}
bpe: {vocab_size: 300}
binarize: {workers: 1}
train: {device: cpu, tokens_per_step: 1000, device_tokens: 500, log_every: 5, dev_every: 0, threads: 1}
decode: {beam_size: 2, tokens_per_batch: 2000, max_len_b: 10}
models: [gpu_base]
presets:
  gpu_base: {steps: 6, warmup_steps: 3, checkpoint_steps: 2, n_layers: 1, d_model: 32, d_ff: 64, n_heads: 2}
YAML
  CONFIGS+=(config/gpu_check_cpu.yaml)
  # Multi30k's format (train, val and test_2016_flickr, .en and .de) with the demo's sentences, at toy sizes
  MULTI30K=$WORK/m30k_toy
  "$PYTHON" -m aiayn.demo --seed 5 --train 500 --dev 20 --test 20 --out-dir "$MULTI30K" >/dev/null &&
    for lang in en de; do
      mv "$MULTI30K/dev.$lang" "$MULTI30K/val.$lang" && mv "$MULTI30K/test.$lang" "$MULTI30K/test_2016_flickr.$lang"
    done
  M30K_SECTIONS="bpe: {vocab_size: 250}
binarize: {workers: 1}
train: {device: cpu, tokens_per_step: 1000, device_tokens: 500, log_every: 5, dev_every: 0, threads: 1}
decode: {beam_size: 2, tokens_per_batch: 2000, max_len_b: 10, workers: 1}"
  M30K_PRESET="steps: 6, warmup_steps: 3, checkpoint_steps: 2, average_last: 2, keep_checkpoints: 2, n_layers: 1, \
d_model: 32, d_ff: 64, n_heads: 2, d_head: null, d_value: null"
fi
echo "gpu check: device $DEVICE, $("$PYTHON" -c 'import torch; print("torch", torch.__version__)'), work folder $WORK"
[ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; }
echo "parts' time (s): 1: $T_MATMUL, 2: $T_DAG, 3: $T_DDP, 4a: $T_STEPS, 5: $T_DECODE, 6: $T_M30K, 4b: what is left; the run: $RUN_END"

part 1 "bf16 matmul ceiling" $T_MATMUL t "$PYTHON" -m bench.gpu.check matmul --device "$DEVICE" "${MATMUL[@]}"

snake() {  # snake DIR ARGUMENTS...: snakemake in DIR; its progress lines here, its whole log in DIR/snakemake.log
  local dir=$1
  shift
  (cd "$dir" && t "$PYTHON" -m snakemake --cores "$CORES" --scheduler greedy --show-failed-logs "$@") 2>&1 |
    tee "$dir/snakemake.log" | { grep --line-buffered -E 'steps \([0-9]+%\) done|Error' || true; }
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || tail -n 60 "$dir/snakemake.log"
  return "$status"
}
dag() {  # the demo DAG, or TARGETS of it
  snake "$DAG" "$@" --configfile "${CONFIGS[@]}"
}
dag_and_report() {
  dag && t "$PYTHON" -m bench.gpu.check summary --workdir "$DAG" --experiment gpu_check --expect-device "$DEVICE"
}
part 2 "demo DAG on $DEVICE (snakemake, MLflow sqlite, average, decode, score, report)" $T_DAG dag_and_report

ddp() {
  local bin=results/gpu_check/bin
  [ -f "$DAG/$bin/train/meta.json" ] || dag "$bin/train" || return
  t "$PYTHON" -m bench.gpu.check ddp --workdir "$DAG" --configs "${CONFIGS[@]}" --preset gpu_base \
    --steps $DDP_STEPS --procs 2 --device "$DEVICE" --seconds $((PART_END - SECONDS - 12))
}
part 3 "DDP: 1 process, then 2 under torchrun sharing one $DEVICE" $T_DDP ddp

part 4a "training steps, eager: cold and warm, real and synthetic batches, each train.attention" $T_STEPS \
  t "$PYTHON" -m bench.train.gpu measure --device "$DEVICE" "${STEPS[@]}" --results "$STEPS_RESULTS"

part 5 "beam-search decoding, newstest2014-shaped, beam 4" $T_DECODE t "$PYTHON" -m bench.decode.gpu --device "$DEVICE" "${DECODE[@]}"

m30k() {
  local file
  for file in train.en train.de val.en val.de test_2016_flickr.en test_2016_flickr.de; do
    [ -s "$MULTI30K/$file" ] || { echo "error: no $MULTI30K/$file: set MULTI30K to the folder of Multi30k's plain text (train, val and test_2016_flickr, .en and .de; docs/gpu-check.md)"; return 2; }
  done
  ln -sfn "$(cd "$MULTI30K" && pwd)" "$M30K/data/multi30k"  # where config/multi30k.yaml reads it
  # a time budget for the training, so that the stages after it keep their time; its window checkpoints
  # every tenth of the run, so that the last 5 span the same share as the recipe's (steps 1200 to 2000)
  local seconds=$((PART_END - SECONDS - M30K_OVERHEAD))
  [ $seconds -ge 20 ] || { echo "error: $seconds s left for training, too little"; return 1; }
  printf '%s\npresets:\n  m30k_base: {%s, max_minutes: %s, budget_intervals: 10}\n' "$M30K_SECTIONS" "$M30K_PRESET" \
    "$(awk "BEGIN { printf \"%.2f\", $seconds / 60 }")" >"$M30K/config/m30k_check.yaml"
  echo "Multi30k from $MULTI30K; training stopped after $seconds s at the latest"
  snake "$M30K" --configfile "${M30K_CONFIGS[@]}" &&
    t "$PYTHON" -m bench.gpu.check recipe --workdir "$M30K" --experiment multi30k --expect-device "$DEVICE"
}
part 6 "the Multi30k recipe end to end on $DEVICE (snakemake, config/multi30k.yaml)" $T_M30K m30k

compiled_steps() {
  t "$PYTHON" -m bench.train.gpu measure --device "$DEVICE" "${STEPS[@]}" --batches real --compile "${COMPILE[@]}" \
    --seconds $((PART_END - SECONDS - 5)) --results "$STEPS_RESULTS"
}
part 4b "training steps, compiled: cold and warm, real batches (the time left)" $((RUN_END - SECONDS)) compiled_steps

if [ -s "$STEPS_RESULTS" ]; then
  echo "== training steps (parts 4a and 4b): s a step; MFU of the sentences' own FLOPs; $STEPS_RESULTS"
  timeout 30 "$PYTHON" -m bench.train.gpu table --results "$STEPS_RESULTS"
fi
echo "== gpu check done in $SECONDS s: ${#failed[@]} part(s) failed"
for failure in "${failed[@]}"; do echo "   $failure"; done
[ ${#failed[@]} -eq 0 ]
