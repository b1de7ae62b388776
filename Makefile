# The two set-up commands: `make serve` and `make test`. Both bootstrap .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR ?= models/tiny-qwen3-moe
PORT ?= 8000

.PHONY: serve serve-single test venv model lint clean

venv: $(STAMP)

# Reinstall only when the project's dependency list changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

$(MODEL_DIR)/config.json: | $(STAMP)
	$(VENV)/bin/elasticmoe make-model --arch qwen3_moe --preset tiny --seed 0 --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

# The elastic server (Ray Serve coordinator, HMM over 2 logical devices, dp 1).
serve: $(STAMP) $(MODEL_DIR)/config.json
	$(VENV)/bin/elasticmoe serve --devices 2 --dp 1 --model $(MODEL_DIR) --port $(PORT)

# One engine in one process, no Ray.
serve-single: $(STAMP) $(MODEL_DIR)/config.json
	$(VENV)/bin/elasticmoe serve --single --model $(MODEL_DIR) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check elasticmoe hmm imm coordinator tests
	$(VENV)/bin/mypy elasticmoe hmm imm coordinator

clean:
	rm -rf $(VENV) models
