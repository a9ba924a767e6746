# The commands: `make demo`, `make test` and `make bench`. Each sets everything up itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench jars binaries clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

# Kafka's jars from Maven Central, cached under ~/.cache/gpuledger (once).
jars: $(STAMP)
	$(BIN)/python -c "from gpuledger.dev.localkafka import ensure_jars; from gpuledger.settings import default_cache_dir; print('Kafka jars in', ensure_jars(default_cache_dir()))"

setup: $(STAMP) jars

# The real cluster's binaries (kube-apiserver/controller-manager/scheduler, KWOK, Kueue) and the
# kustomize CLI that renders deploy/k8s, built
# from the Go module proxy once per pin into the cache (docs/real-cluster.md). Standard library
# only, so .ci/run starts it in the background before the virtualenv exists.
CACHE_DIR ?= $(or $(GPULEDGER_CACHE_DIR),$(HOME)/.cache/gpuledger)
binaries:
	$(PYTHON) -m gpuledger.dev.kubebin $(CACHE_DIR)

# The incident-rollback exercise through the real pipeline (docs/exercises.md).
demo: setup
	$(BIN)/gpuledger exercise incident-rollback

test: setup
	$(BIN)/pytest -q -ra

# Throughput, latency and replay of one worker against its baselines (benchmarks/bench.py);
# e.g. make bench BENCH_ARGS="--events 5000 --latency-seconds 15 --json bench.json"
BENCH_ARGS ?=
bench: setup
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
