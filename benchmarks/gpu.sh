#!/usr/bin/env bash
# The GPU measurements in one command that ends within about MINUTES minutes (default 9):
#   1. benchmarks/budget_check.py --device cuda: the GPT-2-small-shaped GPT at 80%, 60% and 50%
#      of eager's measured peak (torch.cuda.max_memory_allocated against each budget);
#   2. benchmarks/run.py --device cuda on MODELS (default: gpt), with the time that is left.
# Each writes its report after every budget or model, so a run cut short keeps what it measured.
#
#     bash benchmarks/gpu.sh [OUT_DIR] [MINUTES] [MODELS]
#
# OUT_DIR defaults to $OUT, else benchmarks/results. Needs torch with CUDA, and fxmem's
# dependencies, importable by python3.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-benchmarks/results}}
minutes=${2:-9}
models=${3:-gpt}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
start=$(date +%s)
left() { echo $((minutes * 60 - ($(date +%s) - start))); }

python3 -c "import torch, fxmem; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

# The budget check takes at most 45% of the time; it starts no budget past 35%.
timeout $((minutes * 27)) python3 benchmarks/budget_check.py --device cuda \
    --time-limit $((minutes * 21)) --out-dir "$out/budget-cuda" 2>&1 | tee "$out/budget-cuda.log"
check=${PIPESTATUS[0]}

# The benchmark stops starting configurations 90 s before the end, to leave time for its steps.
remaining=$(left)
if [ "$remaining" -gt 150 ]; then
    timeout $((remaining - 20)) python3 benchmarks/run.py --device cuda --models "$models" \
        --time-limit $((remaining - 110)) --out-dir "$out/cuda" 2>&1 | tee "$out/cuda.log"
else
    echo "benchmark not run: ${remaining} s left"
fi
echo "budget check exit status ${check}; $(($(date +%s) - start)) s in all"
exit "$check"
