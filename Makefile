# Everything a newcomer needs, from a fresh Debian machine with Python >= 3.10.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvwire-installed
TORCH_STAMP := $(VENV)/.kvwire-torch
BROWSER_STAMP := $(VENV)/.kvwire-browser

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV) || (apt-get update -q && apt-get install -y -q python3-venv && $(PYTHON) -m venv $(VENV))
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# torch (CPU build) only for the shm tests against a torch.distributed gloo group. The stamp
# is written only when the install worked, so a failed one is retried by the next run; until
# then those tests skip and pytest's summary lists each of them with the reason.
$(TORCH_STAMP): $(STAMP)
	@if $(PY) -m pip install -q torch==2.13.0; then touch $(TORCH_STAMP); else \
	  echo "kvwire: WARNING: torch 2.13.0 could not be installed (see pip's error above)." >&2; \
	  echo "kvwire: WARNING: the torch.distributed tests (tests/test_shm_group.py) will be SKIPPED;" >&2; \
	  echo "kvwire: WARNING: the next 'make test' retries the install." >&2; fi

# Debian's chromium, headless, for the test that looks at `kvwire serve`'s status page. Like
# torch: the stamp only on success, a loud warning and a retry next time otherwise.
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null 2>&1 || \
	   ( (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null) 2>&1 ); then \
	  touch $(BROWSER_STAMP); else \
	  echo "kvwire: WARNING: chromium could not be installed (apt-get as root is needed)." >&2; \
	  echo "kvwire: WARNING: tests/test_serve.py::test_status_page_in_headless_chromium will be SKIPPED;" >&2; \
	  echo "kvwire: WARNING: the next 'make test' retries the install." >&2; fi

demo: $(STAMP)
	$(VENV)/bin/kvwire demo

test: $(STAMP) $(TORCH_STAMP) $(BROWSER_STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q

bench: $(STAMP)
	@command -v wrk >/dev/null 2>&1 || (apt-get install -y -q wrk >/dev/null 2>&1) || \
	  echo "kvwire: wrk (Debian package) unavailable: bench/route.py skips its wrk rows" >&2
	$(PY) bench/events.py
	$(PY) bench/subscriber.py
	$(PY) bench/shm.py
	$(PY) bench/index.py
	$(PY) bench/route.py
	$(PY) bench/sim.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
