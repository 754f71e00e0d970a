#!/usr/bin/env bash
# The step-cost table on a GPU (issue 58): random-weight Llama shapes built on the device (135M, 1B, 8B: no weights
# to carry), bf16, batch 1, context 256: a plain step and a verify step over 2-64 nodes, eager (as HF `generate` and
# our decoder run by default) and replayed from CUDA graphs over a static cache (decoding/graphs.py), against the
# memory limit (weight bytes over the copy rate measured there); the 8B shape's passes compiled by inductor before
# their capture (graphs=compiled); then the graphed-decoding parity tests, the compiled one's too.
#   bash scripts/gpu_step_cost.sh prepare     # here: the wheels the device image lacks into .gpu/steps (git-ignored)
#   device call: carry [".gpu/steps"], command: bash scripts/gpu_step_cost.sh run   (about 7 minutes; timeout_s 590)
# Figures: $OUT/steps/decode-<shape>.json and the tables in the call's output.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu/steps
case "${1:-}" in
  prepare)
    mkdir -p $G/wheels
    (cd $G/wheels && for p in hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
        gguf==0.19.0; do [ -n "$(ls ${p%%==*}* ${p%%==*//-/_}* 2>/dev/null)" ] || python3 -m pip download -q --no-deps \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform any \
        --only-binary=:all: "$p"; done
      ls antlr4* >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3)
    du -sh $G;;
  run)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $G/wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
    out="${OUT:-outputs}/steps" && mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    for shape in 8b 1b 135m; do
      timeout 150 python3 -m benchmarks decode shape=$shape dtype=bfloat16 device=cuda graphs=true repeats=20 \
          sizes=1,2,4,8,16,32,64 output="$out/decode-$shape.json" || echo "shape $shape: exit $?"
    done
    timeout 150 python3 -m benchmarks decode shape=8b dtype=bfloat16 device=cuda graphs=compiled repeats=10 \
        sizes=1,16,64 output="$out/decode-8b-compiled.json" || echo "shape 8b compiled: exit $?"
    timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_graphs.py || echo "graphs test: exit $?";;
  *) sed -n 2,8p "$0"; exit 2;;
esac
