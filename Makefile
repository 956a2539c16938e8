# dscore - a distributed-training runtime for PyTorch in the spirit of DeepSpeed (see README.md).
# Two commands do everything on a fresh clone (Python >= 3.10, a C++ compiler, make):
#   make run   - set up (idempotent) and train the example GPT with 2 ranks (examples/gpt/)
#   make test  - set up (idempotent) and run the whole test suite (CI runs this, then `make lint`)
# Other targets: setup (the venv alone), lint (ruff, import contract, mypy), test-deepspeed-suite (DeepSpeed's own
# unit suite against compat/deepspeed, writes docs/deepspeed-suite.md), bench (bench/run_all.sh),
# bench-venv (a separate venv with DeepSpeed 0.19.8 for the benchmarks' side-by-side rows), clean (remove the venvs).
# After `make setup`, `source .venv/bin/activate` puts `dscore` on PATH. setup also installs compat/deepspeed
# (the `deepspeed` import name on top of dscore, for the Trainer/Accelerate tests in tests/compat/).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dscore-setup-done

.PHONY: setup run test test-deepspeed-suite lint bench bench-venv clean

setup: $(STAMP)

# A venv that also sees the system's packages, so a torch build already installed (CPU, CUDA, ROCm, ...)
# is kept; only when no torch is importable is torch 2.13.0 installed from the package index that pip
# is configured to use.
# The test device (examples/plugins/dscore-testdevice: a third-party-style accelerator and comm-backend
# plugin) is installed with the test extra so `make test` runs the device matrix (tests/testdevice/).
$(STAMP): pyproject.toml compat/deepspeed/pyproject.toml examples/plugins/dscore-testdevice/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install -e ./compat/deepspeed --no-deps
	$(PY) -m pip install --no-deps -e examples/plugins/dscore-testdevice
	touch $(STAMP)

# ARGS reach train.py, e.g. make run ARGS="--no-resume" or ARGS="--data my_text_dir --steps 1000"
ARGS ?=
run: setup
	$(VENV)/bin/dscore run --num_gpus 2 examples/gpt/train.py --deepspeed_config examples/gpt/ds_config.json $(ARGS)

test: setup
	$(PY) -m pytest

# The conformance tier (tools/deepspeed_suite.py): DeepSpeed's own tests/unit from ../shared/reference/deepspeed-tests
# against compat/deepspeed with DeepSpeed's CPU CI command (pytest --forked, then -m sequential; LOCAL_SIZE=2),
# import mode first; writes docs/deepspeed-suite.md. Skips (exit 0) when ../shared is absent. Hours on 2 cores:
# SUITE_ARGS="--budget 600" time-boxes the run mode, SUITE_ARGS=collect runs the import mode alone.
SUITE_ARGS ?=
test-deepspeed-suite: setup
	$(PY) tools/deepspeed_suite.py $(SUITE_ARGS)

# ruff; the import contract (pyproject [tool.importlinter]: the core never imports a built-in plugin,
# plugins never import a private core module); mypy over dscore/ (pyproject [tool.mypy])
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) tools/import_cycles.py
	$(VENV)/bin/mypy

bench: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash bench/run_all.sh

# dscore plus the `bench` extra (DeepSpeed 0.19.8, matplotlib) in a venv of its own, so the test venv never
# sees DeepSpeed; built like $(VENV) and checked to hold the same torch build. DS_BUILD_OPS=0: DeepSpeed
# JIT-builds the ops it loads (bench/README.md). E.g. make bench-venv BENCH_VENV=/work/bench-venv
BENCH_VENV ?= .venv-bench
TORCH_VERSION = $(PY) -c 'import torch; print(torch.__version__)'
bench-venv: $(BENCH_VENV)/.dscore-bench-done

$(BENCH_VENV)/.dscore-bench-done: pyproject.toml $(STAMP)
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -c "import torch" 2>/dev/null || $(BENCH_VENV)/bin/python -m pip install "torch==$$($(TORCH_VERSION))"
	DS_BUILD_OPS=0 $(BENCH_VENV)/bin/python -m pip install -e '.[bench]'
	test "$$($(BENCH_VENV)/bin/python -c 'import torch; print(torch.__version__)')" = "$$($(TORCH_VERSION))"
	touch $@

clean:
	rm -rf $(VENV) $(BENCH_VENV) build *.egg-info
