# Every target is idempotent and creates .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: install demo test test-suite test-network test-swarms test-swarms-isolated test-isolated test-long test-image image-smoke image-cuda test-quick fuzz lint format bench soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned (the CPU build on disk); then the project, with hivemind from its wheel only. pip byte-compiles
# what it installs one file after another (100 of a fresh install's 154 s here); compileall does it on every core
# (48 s on two), with the project's own modules, which an editable install leaves to each import (to every one where
# PYTHONDONTWRITEBYTECODE is set, as on this machine). Its status is ignored: a file that only newer Pythons parse
# (torch ships one) fails, as it does silently under pip, and a module without bytecode is imported from source
# (docs/decisions.md, "The suite's time at 2026-12-08").
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --no-compile $(TORCH_PIN)
	$(BIN)/pip install -q --no-compile --only-binary hivemind -e '.[dev]'
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib sentinel_node dht peers || true
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

# `make test` runs three pytest streams side by side: make -j3 starts them, --output-sync prints each one's output
# whole when it ends, and make fails if any fails.
# - test-network: the network tests but the training swarms (DHT nodes, subprocesses, network namespaces), which
#   mostly wait;
# - test-swarms-isolated: the modules that train a swarm of real processes for many steps (tests/conftest.py,
#   SWARMS), then the isolated modules (in-process only: the simulator, verification, the CLI's simulate and bench;
#   tests/conftest.py, ISOLATED) in two worker processes (pytest-xdist), niced, so that once alone they finish on
#   both cores;
# - test-image, niced (so the network tests' timing keeps the cores): scripts/image_smoke.sh makes a Debian base
#   with mmdebstrap, builds the cpu image with buildah and runs docker-compose.yml's bootstrap and a verifier in it
#   (230 CPU-s in 246 s alone, one serial chain).
# The isolated modules used to follow the image test; the swarms end first (492 s against 673 at d9f0788), so they
# follow the swarms now (docs/decisions.md, "The suite's time at 2026-12-08"). Each stream runs without pytest's
# cache, which the others would write meanwhile. test-suite runs the whole suite but the image test in one process.
test: lint
	@$(MAKE) --no-print-directory -j3 --output-sync=target test-network test-swarms-isolated test-image

test-suite: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=30 -m "not image and not long"

test-network: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=20 -p no:cacheprovider -m "not image and not long and not isolated and not swarm"

SWARM_TESTS := $(BIN)/python -m pytest -q -ra --durations=10 -p no:cacheprovider -m "swarm and not long"
test-swarms: $(STAMP)
	$(SWARM_TESTS)

IMAGE_TESTS := nice -n 10 $(BIN)/python -m pytest -q -rA -p no:cacheprovider -m image
ISOLATED_TESTS := nice -n 10 $(BIN)/python -m pytest -q -ra --durations=15 -p no:cacheprovider -n 2 --dist loadfile \
	-m "isolated and not long"

# one after the other (as prerequisites, -j3 could start them side by side with the other streams); the isolated
# modules run even when a swarm test failed, and the target fails if either did
test-swarms-isolated: $(STAMP)
	$(SWARM_TESTS); swarms=$$?; $(ISOLATED_TESTS) && exit $$swarms

test-image: $(STAMP)
	$(IMAGE_TESTS)

test-isolated: $(STAMP)
	$(ISOLATED_TESTS)

# The longest network proofs (tests marked long: stage placement and moves, recomputation audits through real
# processes, a 90-step clean swarm of single replicas, a short churn soak, a verifier that stops checking). With the
# first three the suite needed 2,623 CPU seconds, 22 minutes of two cores at the least, against make test's budget
# of 15; they run here, on their own (about 12 minutes then; the soak and quiet-verifier swarms add about 4 each on
# idle cores, estimated, not measured).
test-long: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m long

# The smoke script alone, without pytest (needs root; installs buildah and debootstrap with apt when missing).
image-smoke:
	scripts/image_smoke.sh

# The cuda image (the Dockerfile's default), built from PyPI on a debootstrapped Debian and checked without a GPU:
# docker-compose.yml's GPU reservations, torch's CUDA build and bundled runtime, bitsandbytes' CUDA binary, the
# CLI, and a compose stage's `--device auto` fallback to the CPU (scripts/image_cuda.sh). Not part of `make test`:
# it downloads ~3 GB of wheels and took 24 minutes on 2 busy cores (README). Needs root, like image-smoke.
image-cuda:
	nice -n 10 scripts/image_cuda.sh

test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

# The fuzz tests at volume: 10,000 derandomized examples per record type and per wire target (tests/fuzzing.py;
# make test runs the same tests with a few hundred). Outcomes go to runs/fuzz/*.json; docs/reliability.md has them.
fuzz: $(STAMP)
	SENTINEL_FUZZ=volume SENTINEL_FUZZ_REPORT=runs/fuzz nice -n 10 $(BIN)/python -m pytest -q -ra -p no:cacheprovider \
		--timeout 7200 tests/test_fuzz_records.py tests/test_fuzz_wire.py

bench: $(STAMP)
	$(BIN)/sentinel-node bench detection --out runs/bench

# The churn soak (issue 14, item 5; figures in docs/reliability.md): the demo swarm trains for 30 minutes while a
# stage replica, a verifier or the trainer is SIGKILLed and restarted, or SIGSTOPped and continued, every minute.
# Exits non-zero when an invariant fails. Not part of `make test`: it takes about 35 minutes with the swarm's start.
soak: $(STAMP)
	nice -n 5 $(BIN)/sentinel-node bench soak --minutes 30 --interval 60 --out runs/soak

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
