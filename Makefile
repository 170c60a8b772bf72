# Everything a newcomer needs, from a fresh Debian machine with Python >= 3.10.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvwire-installed
TORCH_STAMP := $(VENV)/.kvwire-torch

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV) || (apt-get update -q && apt-get install -y -q python3-venv && $(PYTHON) -m venv $(VENV))
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# torch (CPU build) only for the shm tests against a torch.distributed gloo group; those
# tests skip, saying so, where this wheel cannot be had.
$(TORCH_STAMP): $(STAMP)
	$(PY) -m pip install -q torch==2.13.0 || echo "kvwire: torch 2.13.0 unavailable; gloo-group tests will be skipped"
	touch $(TORCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvwire demo

test: $(STAMP) $(TORCH_STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/events.py
	$(PY) bench/subscriber.py
	$(PY) bench/shm.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
