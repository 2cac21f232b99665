# Two entry points for a fresh machine: `make demo` and `make test`.
# constraints.txt pins the CPU torch these machines cache; the package itself does not pin torch.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR ?= runs/demo
# The official nuscenes-devkit pins numpy<2: it gets an environment of its own, which the tests read exports with.
DEVKIT := .venv-nuscenes-devkit
# Waymo's generated protos (E2EDFrame, E2EDChallengeSubmission) for the tests to write records and read submissions
# with; their wheel depends on tensorflow, which is not installed: the protos alone, in a folder of their own.
WAYMO_PROTOS := .waymo-protos

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $@

$(DEVKIT)/.installed:
	$(PYTHON) -m venv $(DEVKIT)
	$(DEVKIT)/bin/pip install -q "nuscenes-devkit==1.2.0" "numpy<2"
	touch $@

$(WAYMO_PROTOS)/.installed: | $(BIN)/python
	$(BIN)/pip install -q --no-deps --target $(WAYMO_PROTOS) "waymo-open-dataset-tf-2-12-0==1.6.7"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/fastddrive demo --out $(DEMO_DIR)

# Two worker processes, a test file each at a time (its module fixtures made once): the suite's models are
# small, so one process leaves a 2-core machine's second core idle most of the time.
test: $(VENV)/.installed-test $(DEVKIT)/.installed $(WAYMO_PROTOS)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	NUSCENES_DEVKIT_PYTHON=$(abspath $(DEVKIT))/bin/python WAYMO_PROTOS=$(abspath $(WAYMO_PROTOS)) HF_HUB_OFFLINE=1 \
		$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) $(DEVKIT) runs
