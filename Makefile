# Two commands do everything on a fresh machine:
#   make run   - set up (idempotent) and run the main job
#   make test  - set up (idempotent) and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dscore-setup-done

.PHONY: setup run test lint bench clean

setup: $(STAMP)

# A venv that also sees the system's packages, so a user's own torch build is kept; only when no torch
# is importable do we install the CPU build (on this machine kind `pip install torch==2.13.0` takes it
# from local disk).
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

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash bench/run_all.sh

clean:
	rm -rf $(VENV) build *.egg-info
