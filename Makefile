# Two commands a newcomer needs: `make dev` runs everything locally, `make test` runs the tests.
# Both create the virtualenv and install the project (editable, with its dev extra) when missing
# or when pyproject.toml changed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: dev test lint install clean tools

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

dev: $(STAMP)
	$(BIN)/outbox dev

# PgBouncer (for the transaction-pooling test) and Chromium (for the headless screenshot of a partition's page
# in the `dagster dev` test) from Debian's packages, where this user may install them; without them those
# tests are skipped with the reason.
tools:
	@command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -qq pgbouncer >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq pgbouncer >/dev/null 2>&1)); } || \
	  echo "pgbouncer not installed: tests/engine/test_pgbouncer.py will be skipped"
	@command -v chromium >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -qq chromium >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)); } || \
	  echo "chromium not installed: the dagster dev screenshot test will be skipped"

# Lint and types first: CI (`.ci/run` = `make test`) fails on a style or type error before any test runs.
lint: $(STAMP)
	$(BIN)/ruff check outbox_pipeline resources assets tests
	$(BIN)/ruff format --check outbox_pipeline resources assets tests
	$(BIN)/mypy

# Two parts: everything but the `timing` scenarios on four pytest-xdist workers, then those alone (no parallel
# load moves what they measure). Each part fails the target on its own, pytest's exit 5 (no test ran) included.
test: $(STAMP) tools lint
	$(BIN)/python -m pytest -n 4 -m "not timing" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m timing $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .outbox .pytest_cache
