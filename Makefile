# Every target is idempotent and creates .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: install demo test test-quick lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned (the CPU build on disk); then the project, with hivemind from its wheel only.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q --only-binary hivemind -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sentinel-node demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -q -ra

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

bench: $(STAMP)
	$(BIN)/sentinel-node bench detection --out runs/bench

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
