# make serve / make test work on a fresh machine: they create .venv, install, and run.
# make serve installs the runtime only (torch's CPU build + the package + its CPU UCX transport,
# extra cu12); make test adds the test extras and the kernels' Triton interpreter.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CKPT ?= checkpoints/kimi-k3-tiny
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed
# Triton for the kernels' CPU tests (TRITON_INTERPRET=1, in a child pytest) lives outside the venv's
# site-packages: importable there, it would send transformers' and fla's KDA to GPU-only kernels
TRITON_INTERP := $(VENV)/triton-interp

.PHONY: install serve generate test bench docs docs-reference flashmla clean

# torch first, pinned: the package's range (torch>=2.11,<2.14) then keeps this CPU build
$(RUNTIME_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cu12]'
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install -q -e '.[cu12,test]'
	$(BIN)/pip install -q --no-deps --target $(TRITON_INTERP) 'triton==3.6.*'
	touch $(STAMP)

install: $(STAMP)

$(CKPT)/config.json: | $(RUNTIME_STAMP)
	$(BIN)/helixserve make-checkpoint --preset kimi-k3-tiny --out $(CKPT) --seed 0

# router + ctx worker + gen world on this machine (runtime dependencies only); Ctrl-C stops
# everything it started
serve: $(RUNTIME_STAMP) $(CKPT)/config.json
	$(BIN)/helixserve launch -c deploy/configs/local.yaml

generate: $(RUNTIME_STAMP) $(CKPT)/config.json
	$(BIN)/helixserve generate --model $(CKPT) --prompt "Hello, helix" --max-tokens 16

test: $(STAMP)
	HELIXSERVE_TRITON_INTERP=$(TRITON_INTERP) $(BIN)/python -m pytest -q tests

# every bench in its quick form (each prints a table; JSON lands in bench/results/)
bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	mkdir -p bench/results
	$(BIN)/python bench/engine.py --quick --out bench/results/engine.json
	$(BIN)/python bench/helix_step.py --quick --out bench/results/helix_step.json
	$(BIN)/python bench/transceiver.py --quick --out bench/results/transceiver.json
	$(BIN)/python bench/serve.py --quick --out bench/results/serve.json --plot bench/results/serve.png
	$(BIN)/python bench/kernels.py --quick --out bench/results/kernels.json

# the manual (docs/, mkdocs.yml) into site/; --strict fails on a broken link or anchor
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install -q -e '.[cu12,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

# regenerate docs/configuration-reference.md from the config models (after adding a config key)
docs-reference: $(RUNTIME_STAMP)
	$(BIN)/python docs/gen_config_reference.py

# optional FlashMLA MLA decode backend (Hopper): builds ~/.cache/helixserve/flashmla/libflashmla_dense.so
# with nvcc (cloning FlashMLA + CUTLASS; FLASHMLA_SRC=DIR uses a checkout instead, FLASHMLA_OUT=DIR elsewhere)
flashmla:
	deploy/flashmla/build.sh $(if $(FLASHMLA_SRC),--src $(FLASHMLA_SRC)) $(if $(FLASHMLA_OUT),--out $(FLASHMLA_OUT))

clean:
	rm -rf $(VENV) checkpoints site
