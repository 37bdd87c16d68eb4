# Two commands set everything up on a fresh machine (Python 3.11, no torch):
#   make demo   create .venv, install attnkit, run the main job
#   make test   install the test dependencies too, run the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of this exact release is served locally; any other spec pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test install bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# numpy only silences torch's import-time warning; attnkit itself never imports it.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH) numpy
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install --quiet $(TORCH) -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/attnkit explain

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/sdpa.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
