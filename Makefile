# Two newcomer commands: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Profile the default example (resnet50 from configs/resnet50.yaml) on this machine.
demo: $(STAMP)
	$(BIN)/monet profile resnet50 --batch-size 8 --input-shape 3,128,128

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
