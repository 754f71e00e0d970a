#!/usr/bin/env bash
# One point of the learning curve (docs/results.md#learning-curve): train RECIPE/EXPERIMENT on the first N conversations
# of the curve's distilled file, the demo's training settings (bf16 where native). Resumes from its checkpoints when
# run again; skipped when its export exists.
#   scripts/curve_train.sh eagle3 eagle3 1200        scripts/curve_train.sh medusa1 served 300
#   NAME=peagle scripts/curve_train.sh peagle eagle3 1200   (a recipe sharing another's preset: its own folder)
set -euo pipefail
RECIPE=$1 EXPERIMENT=$2 N=$3
DATA=${DATA:-outputs/curve/distill-vllm-2800.jsonl}
OUT=outputs/curve/${NAME:-$EXPERIMENT}-$N
DTYPE=${DTYPE:-bfloat16}
if [ -f "$OUT/export/config.json" ]; then echo "$OUT: done"; exit 0; fi
exec .venv/bin/python -m medusa_train train +recipe="$RECIPE" experiment="$EXPERIMENT" \
  model.name_or_path=packaged:smollm2-135m-instruct model.dtype="$DTYPE" \
  trainer.mixed_precision="$([ "$DTYPE" = bfloat16 ] && echo bfloat16 || echo no)" \
  trainer.save_every=20 trainer.eval_every=100 data.source="$DATA" data.max_samples="$N" trainer.output_dir="$OUT"
