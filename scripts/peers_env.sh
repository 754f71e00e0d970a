#!/usr/bin/env bash
# The peers' environment (.venv-peers), made from nothing, for `python -m benchmarks peers`:
#   bash scripts/peers_env.sh            # then: .venv-peers/bin/python -m benchmarks peers data=<distilled .jsonl>
# A venv of its own, never a dependency of the product: the CPU torch the Makefile pins (installed FIRST: an
# unpinned torch pulls a multi-GB CUDA build), this checkout editable with the project's constraints (the benchmark
# tokenises with our data pipeline and writes folders our loaders read), then NVIDIA Model Optimizer, whose extra
# dependencies (PuLP, ninja, nvidia-ml-py, scipy) leave torch and transformers where they are.
# A full venv rather than a .pth onto .venv's site-packages: `make setup` upgrading .venv can then not break it, and
# pip here never sees (or uninstalls) the other environment's packages. About 1-2 minutes from the local wheels.
# Env: PYTHON (python3), TORCH_SPEC (torch==2.13.0), TORCH_INDEX_URL (empty: pip's own index), MODELOPT_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-peers
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
MODELOPT_SPEC=${MODELOPT_SPEC:-nvidia-modelopt==0.47.0}
PIP=(-m pip install -q --disable-pip-version-check)
test -x $VENV/bin/python || "$PYTHON" -m venv $VENV
$VENV/bin/python "${PIP[@]}" --upgrade pip
$VENV/bin/python "${PIP[@]}" "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
$VENV/bin/python "${PIP[@]}" -c constraints.txt -e .
# the torch already installed stays (pip keeps a satisfied requirement); the check below says if it did not
$VENV/bin/python "${PIP[@]}" "$MODELOPT_SPEC" "$TORCH_SPEC"
# for tests/benchmarks/test_peers_smoke.py (it skips where modelopt is missing, so it runs only here)
$VENV/bin/python "${PIP[@]}" -c constraints.txt pytest pytest-timeout
$VENV/bin/python - <<'PY'
import importlib.metadata as md
import modelopt.torch.speculative  # noqa: F401  (fails here, not in the benchmark, when the install is broken)
import torch
print(f"peers environment: torch {torch.__version__}, transformers {md.version('transformers')}, "
      f"nvidia-modelopt {md.version('nvidia-modelopt')}")
PY
touch $VENV/.installed
