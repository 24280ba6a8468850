# Set-up, demo and tests. Every target is idempotent and does its own set-up on a fresh Debian machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export XDG_RUNTIME_DIR ?= /tmp
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEFAULT_MODELS := SmolLM2-135M-Instruct-Q4_1 all-MiniLM-L6-v2

.PHONY: setup venv driver models demo test test-fast bench browser-setup browser-demo clean

setup: venv driver models

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $@

venv: $(VENV)/.installed

# Mesa's software Vulkan (lavapipe) when the machine has no WebGPU adapter.
driver: venv
	@$(PY) scripts/check_adapter.py || { \
	  if command -v apt-get >/dev/null; then \
	    echo "installing mesa-vulkan-drivers"; \
	    $(SUDO) apt-get install -y -q mesa-vulkan-drivers || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q mesa-vulkan-drivers; }; \
	    $(PY) scripts/check_adapter.py; \
	  else echo "no WebGPU adapter and no apt-get: install a Vulkan/Metal/DX12 driver" >&2; exit 1; fi; }

models: venv
	$(PY) -m webgpu_engine.cache download $(DEFAULT_MODELS)

demo: setup
	$(PY) -m webgpu_engine info
	$(PY) demo/chat_and_rag.py

# two pytest phases: the latency-bound tests alone on a quiet machine (marker serial), then the rest
# on TEST_WORKERS processes (a module stays on one worker, with its shared engines; the longest modules
# start first: tests/conftest.py); each prints its wall time and the peak RSS of its processes together
TEST_WORKERS ?= 2
test: setup browser-setup
	@start=$$(date +%s); rc=0; \
	$(PY) -m pytest -q -ra -m serial || rc=$$?; \
	$(PY) -m pytest -q -ra --durations=40 -n $(TEST_WORKERS) --dist loadfile -m "not serial" || rc=$$?; \
	echo "make test: both phases took $$(( $$(date +%s) - start )) s"; exit $$rc

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow and not browser"

bench: setup
	$(PY) bench/kernels.py
	$(PY) bench/llm.py
	$(PY) bench/embeddings.py

browser-setup: venv
	bash scripts/browser_setup.sh

browser-demo: setup browser-setup
	$(PY) demo/browser/serve.py

clean:
	rm -rf $(VENV) build dist *.egg-info
