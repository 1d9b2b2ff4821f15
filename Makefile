# make serve / make test work on a fresh machine: they create .venv, install, and run.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CKPT ?= checkpoints/kimi-k3-tiny
STAMP := $(VENV)/.installed

.PHONY: install serve generate test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

$(CKPT)/config.json: | $(STAMP)
	$(BIN)/helixserve make-checkpoint --preset kimi-k3-tiny --out $(CKPT) --seed 0

# router + ctx worker + gen world on this machine; Ctrl-C stops everything it started
serve: $(STAMP) $(CKPT)/config.json
	$(BIN)/helixserve launch -c deploy/configs/local.yaml

generate: $(STAMP) $(CKPT)/config.json
	$(BIN)/helixserve generate --model $(CKPT) --prompt "Hello, helix" --max-tokens 16

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python bench/engine.py --quick

clean:
	rm -rf $(VENV) checkpoints
