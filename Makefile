# Quickstart: `make tiny` runs the whole tiny pipeline on the CPU; `make test` runs the tests.
# Both create ./.venv on first use. CPU machines get the CPU build of torch (TORCH=torch==2.13.0, the default);
# GPU users pass their own, e.g. `make tiny TORCH=torch` (CUDA wheel from PyPI) or a ROCm index URL (README).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install tiny test clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH)
	$(BIN)/python -m pip install -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

tiny: $(STAMP)
	$(BIN)/python tiny_pipeline.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs/tiny
