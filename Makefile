# Two commands do all set-up on a fresh machine:
#   make demo   -- run the main job on the embedded default
#   make test   -- run the whole test suite
# Both create .venv when missing and install torch==2.13.0 from pip when no torch is present.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.commsched-installed

.PHONY: demo test lint clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation deepspeed
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/commsched demo

# two pytest workers, a test file per worker at a time (its module fixtures spawn once);
# TEST_JOBS=0 runs the suite in one process
TEST_JOBS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check commsched kernels tests

clean-venv:
	rm -rf $(VENV)
