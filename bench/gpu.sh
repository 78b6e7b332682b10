#!/usr/bin/env bash
# The prepared check for a lent GPU (one H200 here): under 5 minutes, torch and this repo only.
#   PYTHONPATH=src bash bench/gpu.sh
# Prints: the measured bf16 matmul ceiling; training tokens/s and model FLOPs utilisation for base
# and big on 25000-token batches, eager and compiled, with the projected hours to 100K / 300K steps;
# the MarianMT peer at base size when `transformers` is importable (carry its wheels, see
# ../.library/device/README.md); and beam-search decoding speed when bench/decode_gpu.py is present.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-src}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(50):
    a @ b
torch.cuda.synchronize()
seconds = time.perf_counter() - start
print(f"bf16 matmul ceiling: {50 * 2 * 8192 ** 3 / seconds / 1e12:.0f} TFLOP/s (torch {torch.__version__})")
PY
peer=--no-peer
python -c "import transformers" 2>/dev/null && peer=""
echo "== train step, base, 25000 target tokens/step, bf16 (eager, compiled${peer:+; no peer})"
timeout 120 python bench/train_cpu.py --device cuda --preset base --vocab 37000 --tokens 25000 --steps 8 --warmup 3 \
  --precision bf16 --compile --project-steps 100000 $peer
echo "== train step, big, 25000 target tokens/step, bf16 (eager, compiled)"
timeout 120 python bench/train_cpu.py --device cuda --preset big --vocab 37000 --tokens 25000 --steps 8 --warmup 3 \
  --precision bf16 --compile --project-steps 300000 --no-peer
if [ -f bench/decode_gpu.py ]; then
  echo "== beam search, base, 3003 sentences of news-like lengths, beam 4, bf16"
  timeout 50 python bench/decode_gpu.py
fi
