# One command each: `make test` and (later) `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
# Pinned torch. On this project's machines torch==2.13.0 is a local CPU wheel; the timm extra needs the
# torch/torchvision pair instead: make TORCH="torch==2.14.1 torchvision==0.29.1" EXTRAS=dev,timm test
TORCH  ?= torch==2.13.0
EXTRAS ?= dev
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(subst $(space),_,$(subst =,-,$(TORCH)))-$(subst $(comma),_,$(EXTRAS))
space  := $(empty) $(empty)
comma  := ,

.PHONY: install test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_rollout.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
