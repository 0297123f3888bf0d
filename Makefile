# Two entry points for a fresh machine: `make demo` and `make test`.
# TORCH_SPEC picks the torch build to install when none is present, e.g.
#   make demo TORCH_SPEC="torch==2.11.0 --index-url <the CUDA wheel index you use>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: env demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Installs torch first (only when missing) so that the `torch>=2.11` requirement of the
# package is already met and pip does not fetch a multi-GB CUDA build on a CPU machine.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH_SPEC)
	$(BIN)/pip install -e ".[test]"
	touch $@

env: $(VENV)/.installed

demo: env
	$(BIN)/phalanx train

# lint-imports first: a change that crosses a floor (docs/architecture.md) fails, naming the import.
test: env
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) runs
