# Two entry points for a fresh machine: `make demo` and `make test`.
# constraints.txt pins the CPU torch these machines cache; the package itself does not pin torch.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR ?= runs/demo

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/fastddrive data highway --out $(DEMO_DIR) --episodes 10 --workers 2 --overwrite
	$(BIN)/fastddrive data stats $(DEMO_DIR)
	$(BIN)/fastddrive data show $(DEMO_DIR) --split test --index 0 --png $(DEMO_DIR)/scene.png

test: $(VENV)/.installed-test
	$(BIN)/ruff check src tests
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) runs
