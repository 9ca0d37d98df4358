# Two commands a newcomer needs: `make dev` runs everything locally, `make test` runs the tests.
# Both create the virtualenv and install the project (editable, with its dev extra) when missing
# or when pyproject.toml changed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: dev test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

dev: $(STAMP)
	$(BIN)/outbox dev

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .outbox .pytest_cache
