#!/usr/bin/env bash
# The prepared check for a lent GPU (one H200): the real pipeline and its speeds, in one run of at most
# 8 minutes, each part under its own timeout and printed as it goes (a part that fails or runs out of
# time does not stop the next).
#   make gpu-wheels                   # here, once: .whl/ holds what the GPU image lacks (snakemake, MLflow, ...)
#   bash bench/gpu.sh                 # there, with `.whl` carried (README, "GPU check")
#   bash bench/gpu.sh --device cpu    # every part at toy sizes on a CPU: the smoke test (tests/test_gpu_check.py)
# Parts:
#   1. the bf16 matmul ceiling
#   2. the demo DAG at GPU size (config/gpu_check.yaml) through snakemake: training and decoding on the
#      device in bf16, MLflow into sqlite, averaging, scoring, the report; then the report's tables
#   3. DDP: 20 steps in 1 process and in 2 (torchrun) sharing the GPU (gloo); the same real tokens a step
#   4. training throughput of base and big on 25000-token steps, eager then compiled: tokens/s, MFU and
#      the projected hours for 100K (base) and 300K (big) steps
#   5. beam-search decoding speed, newstest2014-shaped (3003 sentences), beam 4, bf16
# Environment: PYTHON (default python3), WHEELS (default .whl), GPU_CHECK_WORK (default a new folder in /tmp),
# GPU_CHECK_SECONDS (the whole run's limit; default 460 on a GPU, the parts' own limits on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:?--device cpu|cuda}
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "error: no ${PYTHON:-python3}"; exit 2; }
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
failed=()

part() {  # part NAME SECONDS COMMAND...: the command's slow steps run under `t`, within SECONDS and the run's limit
  local name=$1 start=$SECONDS status
  PART_END=$((SECONDS + $2 < RUN_END ? SECONDS + $2 : RUN_END))
  shift 2
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

# The image has torch but not the workflow's own packages: install the carried wheels, without network.
if ! "$PYTHON" -c "import snakemake, mlflow, sacremoses" 2>/dev/null; then
  WHEELS=${WHEELS:-$REPO/.whl}
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "error: snakemake/MLflow missing and no wheels in $WHEELS (make gpu-wheels)"; exit 2; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="$PYTHONPATH:$WORK/site"
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $WORK/site"
fi
# What parts 2 and 3 import, with the image's own versions of what the carried wheels share with it.
"$PYTHON" - <<'PY' || echo "error: the pipeline's packages do not import here (parts 2 and 3 will fail)"
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

DAG=$WORK/dag
mkdir -p "$DAG"
cp -r Snakefile workflow config "$DAG/"
CONFIGS=(config/gpu_check.yaml)  # standalone: the demo no longer lies under every config
if [ "$DEVICE" = cuda ]; then
  CORES=$(nproc)
  MATMUL=(--size 8192 --repeats 50)
  TRAIN=(--vocab 37000 --tokens 25000 --steps 5 --warmup 2 --precision bf16 --compile --no-peer --no-warm-pass)
  BASE=(--preset base) BIG=(--preset big) DECODE=()
  T_MATMUL=30 T_DAG=200 T_DDP=60 T_TRAIN=60 T_DECODE=50
  RUN_END=${GPU_CHECK_SECONDS:-460}  # counted from the start, the wheels included
  DDP_STEPS=20
else  # the same commands at toy sizes; torch.compile traced only (its eager backend), not built
  CORES=2
  MATMUL=(--size 256 --repeats 3)
  TRAIN=(--vocab 500 --tokens 200 --steps 1 --warmup 1 --precision bf16 --compile --compile-backend eager --no-peer --no-warm-pass)
  BASE=(--preset tiny) BIG=(--preset tiny) DECODE=(--sentences 12 --layers 1 --d-model 64 --d-ff 128 --heads 2 --vocab 500 --repeats 1)
  T_MATMUL=120 T_DAG=600 T_DDP=180 T_TRAIN=120 T_DECODE=120  # guards against a hang on a shared CPU, not speeds
  RUN_END=${GPU_CHECK_SECONDS:-1800}
  DDP_STEPS=3
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
fi
echo "gpu check: device $DEVICE, $("$PYTHON" -c 'import torch; print("torch", torch.__version__)'), work folder $WORK"
[ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; }

part "1. bf16 matmul ceiling" $T_MATMUL t "$PYTHON" bench/gpu_check.py matmul --device "$DEVICE" "${MATMUL[@]}"

dag() {  # the demo DAG (or TARGETS of it); Snakemake's progress lines here, its whole log in $WORK/snakemake.log
  (cd "$DAG" && t "$PYTHON" -m snakemake "$@" --cores "$CORES" --scheduler greedy --show-failed-logs --configfile "${CONFIGS[@]}") 2>&1 |
    tee "$WORK/snakemake.log" | { grep --line-buffered -E 'steps \([0-9]+%\) done|Error' || true; }
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || tail -n 60 "$WORK/snakemake.log"
  return "$status"
}
dag_and_report() {
  dag && t "$PYTHON" bench/gpu_check.py summary --workdir "$DAG" --experiment gpu_check --expect-device "$DEVICE"
}
part "2. demo DAG on $DEVICE (snakemake, MLflow sqlite, average, decode, score, report)" $T_DAG dag_and_report

ddp() {
  local bin=results/gpu_check/bin
  [ -f "$DAG/$bin/train/meta.json" ] || dag "$bin/train" || return
  t "$PYTHON" bench/gpu_check.py ddp --workdir "$DAG" --configs "${CONFIGS[@]}" --preset gpu_base \
    --steps $DDP_STEPS --procs 2 --device "$DEVICE" --seconds $((PART_END - SECONDS - 15))
}
part "3. DDP: 1 process, then 2 under torchrun sharing one $DEVICE" $T_DDP ddp

part "4a. training throughput, base" $T_TRAIN t "$PYTHON" bench/train_cpu.py --device "$DEVICE" "${BASE[@]}" "${TRAIN[@]}" --project-steps 100000
part "4b. training throughput, big" $T_TRAIN t "$PYTHON" bench/train_cpu.py --device "$DEVICE" "${BIG[@]}" "${TRAIN[@]}" --project-steps 300000
part "5. beam-search decoding, newstest2014-shaped, beam 4" $T_DECODE t "$PYTHON" bench/decode_gpu.py --device "$DEVICE" "${DECODE[@]}"

echo "== gpu check done in $SECONDS s: ${#failed[@]} part(s) failed"
for failure in "${failed[@]}"; do echo "   $failure"; done
[ ${#failed[@]} -eq 0 ]
