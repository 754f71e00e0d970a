#!/usr/bin/env bash
# The GPU tier, on a machine with CUDA (nothing here runs without one):
#   bash scripts/gpu_tier.sh            # or: make gpu-tier
# 1. pytest -m gpu: decoding equal to plain greedy, Medusa-1 bf16 kill + resume, Medusa-2 on bitsandbytes CUDA,
#    capture then training on states, flash attention where installed;
# 2. the demo on the GPU (distill -> train -> build_tree nodes=auto -> evaluate): each stage prints its peak GPU
#    memory, build_tree its verify-step cost curve up to 128 nodes and the size it chose, evaluate the speedup
#    over plain `generate` at batch 1;
# 3. the verify-step cost of the default tree's first 16/32/64 nodes by part (python -m benchmarks decode); the curve
#    to 128 nodes is build_tree's (step 2), on the fitted tree.
# Logs and figures go to outputs/gpu/; summary.md gathers the lines docs/results.md reports.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=outputs/gpu
mkdir -p "$OUT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: the GPU tier needs one')" || exit 1
"$PY" -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda)" | tee "$OUT/device.txt"

HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$PY" -m pytest -q -m gpu -rs 2>&1 | tee "$OUT/pytest-gpu.log"
tests=${PIPESTATUS[0]}
"$PY" -m medusa_train demo output_dir="$OUT/demo" 2>&1 | tee "$OUT/demo.log"
demo=${PIPESTATUS[0]}
"$PY" -m benchmarks decode device=cuda dtype=bfloat16 sizes=1,chain,16,32,64 \
    output="$OUT/decode-bf16.json" 2>&1 | tee "$OUT/decode.log"
bench=${PIPESTATUS[0]}

{
  echo "# GPU tier on $(cat "$OUT/device.txt")"
  echo; echo "## pytest -m gpu"; tail -n 3 "$OUT/pytest-gpu.log"
  echo; echo "## peak GPU memory per stage (demo)"; grep -h "peak GPU memory" "$OUT/demo.log"
  echo; echo "## tree size chosen, speedup (demo)"; grep -hiE "nodes=auto|chose|speedup|tokens/step" "$OUT/demo.log" | tail -n 20
  echo; echo "## verify-step cost by tree size (python -m benchmarks decode)"; tail -n 15 "$OUT/decode.log"
} > "$OUT/summary.md"
cat "$OUT/summary.md"
exit $(( tests || demo || bench ))
