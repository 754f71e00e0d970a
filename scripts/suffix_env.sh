#!/usr/bin/env bash
# Suffix decoding for the engine (vLLM's `method: "suffix"` imports arctic_inference.suffix_decoding): builds
# arctic-inference 0.3.0 from its sdist against .venv-vllm's own torch, without build isolation (its build pins another
# torch), with the build tools in a throwaway folder so the engine's environment only gains the package itself.
# A benchmark's optional step, never part of `make setup`:
#   bash scripts/suffix_env.sh
# Its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED is set (and needs CUDA then); suffix decoding does not use it.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv-vllm/bin/python}
WORK=${WORK:-/tmp/arctic-build}
SPEC=${SPEC:-arctic-inference==0.3.0}
mkdir -p "$WORK"
# what its build needs beside torch (protobuf as its build pins it, apart from the engine's own)
"$VPY" -m pip install -q --target "$WORK/tools" setuptools wheel ninja "cmake>=3.18" nanobind==2.9.2 \
  protobuf==5.29.6 grpcio-tools
export PYTHONPATH="$WORK/tools" PATH="$WORK/tools/bin:$PATH"
"$VPY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "$SPEC" -d "$WORK/sdist"
"$VPY" -m pip wheel -q --no-deps --no-build-isolation "$WORK"/sdist/arctic*inference-*.tar.gz -w "$WORK/wheel"
unset PYTHONPATH
"$VPY" -m pip install -q --no-deps "$WORK"/wheel/arctic_inference-*.whl
"$VPY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('suffix decoding: ok')"
