# Two entry points on a fresh machine with Python 3.11:
#   make train   set up .venv with what training needs and train the debug model (train_configs/debug_model.toml)
#   make test    add the test extras (pytest, pytest-xdist, transformers, wandb) to .venv and run the whole test suite
#   make test-fast   the same, for the edit-run loop: every unit test and a smoke test of each subsystem
#
# torch: pyproject.toml accepts the tested range (torch>=2.11,<2.14), and on Linux PyPI's torch is a
# multi-GB CUDA build. So .venv first gets $(TORCH), by default the CPU build of 2.13.0: from the
# configured package index if it has it (pip's find-links, a mirror), else from $(TORCH_INDEX).
# A GPU machine names its build, e.g. `make train TORCH=torch==2.13.0` (PyPI's CUDA build) or
# TORCH=torch==2.12.1+cu130 TORCH_INDEX=https://download.pytorch.org/whl/cu130; TORCH= (empty)
# installs no torch first (pip then resolves the range itself). The stamps below record what .venv
# has: to change its torch, `rm -r .venv` first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VENV := .venv
PIP := $(VENV)/bin/python -m pip
TRAIN_STAMP := $(VENV)/.installed-train
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup train test test-fast
# pytest-xdist's workers (one per slot by default, 1.5 slots a core); they share the cores by what each
# test keeps busy (tests/machine_share.py). TEST_WORKERS=0 runs the tests in this process, one after the other.
TEST_WORKERS ?= auto
# The suite writes Python's bytecode caches (__pycache__, ignored by git) even where the environment
# says not to (PYTHONDONTWRITEBYTECODE): without them every worker compiles and assertion-rewrites
# each test file again, and every fresh interpreter a test starts compiles the trainer again.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile
setup: $(TRAIN_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# What training needs: torch, then the project and its dependencies (the installed torch satisfies
# the range, so pip keeps it).
$(TRAIN_STAMP): pyproject.toml | $(VENV)/bin/python
ifneq ($(strip $(TORCH)),)
	$(PIP) install --quiet '$(TORCH)' 2>/dev/null || $(PIP) install --quiet '$(TORCH)' --extra-index-url '$(TORCH_INDEX)'
endif
	$(PIP) install --quiet -e .
	touch $@

# The test extras on top: after `make train`, only they are added.
$(TEST_STAMP): $(TRAIN_STAMP)
	$(PIP) install --quiet -e '.[test]'
	touch $@

train: $(TRAIN_STAMP)
	./torchrun_launch.sh

test: $(TEST_STAMP)
	$(PYTEST) tests

test-fast: $(TEST_STAMP)
	$(PYTEST) --fast tests
