# Every target creates or reuses the environment in .venv/ first (scripts/setup_env.sh).
VENV   := .venv
PYTHON := $(VENV)/bin/python
NP     ?= 2

.PHONY: setup test test-slow demo bench-compress clean-venv

setup:
	@bash scripts/setup_env.sh

## The default test run (what CI runs): unit and multi-process tests, no slow benchmarks.
test: setup
	$(PYTHON) -m pytest -m "not slow" -q

## Convergence runs and other long checks.
test-slow: setup
	$(PYTHON) -m pytest -m slow -q

## A short 2-worker training run with DGC, printing accuracy and the compression ratio.
demo: setup
	TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PYTHON) examples/pytorch_mnist1d.py --compression dgc --epochs 8

## Time the selection of one ResNet-50-sized gradient with each method.
bench-compress: setup
	$(PYTHON) examples/bench_compress.py

clean-venv:
	rm -rf $(VENV)
