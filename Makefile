# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch: an unpinned `torch` would pull a multi-GB CUDA build onto CPU-only machines.
# Where a torch is already importable (a GPU machine's system install), it is used as is.
TORCH_CPU := torch==2.13.0
# torchvision 0.N pairs with torch 2.(N-15); installed with --no-deps so that pip keeps the torch there is.
TORCHVISION_FOR_TORCH := import torch; print("torchvision==0.%d.*" % (int(torch.__version__.split(".")[1]) + 15))

.PHONY: demo test test-gpu lint bench-cpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/python -c "import torchvision" 2>/dev/null || $(BIN)/pip install -q --no-deps "$$($(BIN)/python -c '$(TORCHVISION_FOR_TORCH)')"
	$(BIN)/pip install -q -e ".[test,plot,zoo]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fuser.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench-cpu: $(STAMP)
	$(BIN)/python -m benchmarks.cpu_models

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
