# dscore - a distributed-training runtime for PyTorch in the spirit of DeepSpeed (see README.md).
# Two commands do everything on a fresh clone (Python >= 3.10, a C++ compiler, make):
#   make run   - set up (idempotent) and train the example GPT with 2 ranks (examples/gpt/)
#   make test  - set up (idempotent) and run the whole test suite (CI runs this, then `make lint`)
# Other targets: setup (the venv alone), lint (ruff, import contract, mypy), bench (bench/run_all.sh), clean (remove the venv).
# After `make setup`, `source .venv/bin/activate` puts `dscore` on PATH.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dscore-setup-done

.PHONY: setup run test lint bench clean

setup: $(STAMP)

# A venv that also sees the system's packages, so a torch build already installed (CPU, CUDA, ROCm, ...)
# is kept; only when no torch is importable is torch 2.13.0 installed from the package index that pip
# is configured to use.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

# ARGS reach train.py, e.g. make run ARGS="--no-resume" or ARGS="--data my_text_dir --steps 1000"
ARGS ?=
run: setup
	$(VENV)/bin/dscore run --num_gpus 2 examples/gpt/train.py --deepspeed_config examples/gpt/ds_config.json $(ARGS)

test: setup
	$(PY) -m pytest

# ruff; the import contract (pyproject [tool.importlinter]: the core never imports a built-in plugin,
# plugins never import a private core module); mypy over dscore/ (pyproject [tool.mypy])
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash bench/run_all.sh

clean:
	rm -rf $(VENV) build *.egg-info
