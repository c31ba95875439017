# Two entry points on a fresh machine with Python 3.11:
#   make train   set up .venv and train the debug model (train_configs/debug_model.toml)
#   make test    set up .venv with test extras and run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup train test
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	./torchrun_launch.sh

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests
