# The two set-up commands: `make serve` and `make test`. Both bootstrap .venv idempotently.
# `make serve BACKEND=vllm` serves with vLLM as the engine backend, from a second venv (.venv-vllm)
# that holds the project with its `vllm` extra; `make test-vllm` runs the vLLM backend's tests there
# (CI runs both; neither `make serve` nor `make test` needs vLLM).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
BACKEND ?= native
ifeq ($(BACKEND),vllm)
MODEL_DIR ?= models/tiny-vllm-qwen3-moe
PRESET := tiny-vllm
SERVE_VENV := $(VLLM_VENV)
SERVE_STAMP := $(VLLM_STAMP)
else
MODEL_DIR ?= models/tiny-qwen3-moe
PRESET := tiny
SERVE_VENV := $(VENV)
SERVE_STAMP := $(STAMP)
endif
VLLM_MODEL_DIR := models/tiny-vllm-qwen3-moe
PORT ?= 8000
TEST_WORKERS ?= 2

.PHONY: serve serve-single test test-vllm venv venv-vllm model lint clean

venv: $(STAMP)

# Reinstall only when the project's dependency list changes. scripts/venv_install.py installs with uv
# (~65 s, bytecode compiled; pip took ~110 s here), handing it pip's configuration, and falls back to pip.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/venv_install.py -- -e '.[test]'
	@touch $(STAMP)

# The project with its `vllm` extra, beside .venv rather than in it: vLLM pins transformers<5.20 and
# fastapi<0.137 (inside our ranges, but older than what .venv resolves), and pulls torchvision,
# torchaudio and torchcodec built for other torch releases, which break beside the CPU torch.
$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/python scripts/venv_install.py --uninstall torchvision torchaudio torchcodec -- -e '.[test,vllm]'
	@touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

$(MODEL_DIR)/config.json: | $(SERVE_STAMP)
	$(SERVE_VENV)/bin/elasticmoe make-model --arch qwen3_moe --preset $(PRESET) --seed 0 --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

# The elastic server (Ray Serve coordinator, HMM over 2 logical devices, dp 1).
serve: $(SERVE_STAMP) $(MODEL_DIR)/config.json
	$(SERVE_VENV)/bin/elasticmoe serve --devices 2 --dp 1 --model $(MODEL_DIR) --port $(PORT) --backend $(BACKEND)

# One engine in one process, no Ray.
serve-single: $(STAMP) $(MODEL_DIR)/config.json
	$(VENV)/bin/elasticmoe serve --single --model $(MODEL_DIR) --port $(PORT)

# The whole suite in .venv (tests/vllm_backend skip there: vLLM is not installed in it). The
# slowest tests are listed at the end: the suite must stay under 15 minutes on 2 cores.
test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=15

# The vLLM backend's tests, in .venv-vllm (about 80 s to create it the first time).

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -ra tests/vllm_backend

lint: $(STAMP)
	$(VENV)/bin/ruff check elasticmoe hmm imm coordinator tests
	$(VENV)/bin/mypy elasticmoe hmm imm coordinator

clean:
	rm -rf $(VENV) $(VLLM_VENV) models
