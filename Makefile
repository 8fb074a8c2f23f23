# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned to the exact CPU build available locally; a looser requirement
# would let pip resolve the CUDA wheels (gigabytes).
TORCH  := torch==2.13.0

.PHONY: demo test lint clean

$(BIN)/plait: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(BIN)/plait

demo: $(BIN)/plait
	$(BIN)/plait train --nproc 4 --metrics runs/demo/metrics.jsonl

test: $(BIN)/plait
	$(BIN)/python -m pytest -q --durations=15

lint: $(BIN)/plait
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
