# Two commands a newcomer needs: `make dev` runs everything locally, `make test` runs the tests.
# Both create the virtualenv and install the project (editable, with its dev extra) when missing
# or when pyproject.toml changed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: dev test test-nightly test-mutants test-pg15 test-tansu lint install clean tools

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

dev: $(STAMP)
	$(BIN)/outbox dev

# Debian's PostgreSQL 15 as users run it (JIT on, 128 MB shared_buffers): the engine and fault suites run on it too.
PG15_BIN ?= /usr/lib/postgresql/15/bin
# The two modules left out start the embedded server themselves (the dev stack and its start/stop): no second build.
PG15_SUITES := tests/engine tests/faults --ignore=tests/engine/commands/test_dev_stack.py --ignore=tests/engine/commands/test_localstack.py

# Java 17 and Maven (Apache Kafka, the tests' broker), PgBouncer (for the transaction-pooling test) and Chromium (for the headless screenshot of a partition's page
# in the `dagster dev` test) from Debian's packages, where this user may install them; without them those
# tests are skipped with the reason.
tools:
	@{ command -v java >/dev/null && command -v mvn >/dev/null; } || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null 2>&1)); } || \
	  echo "java or mvn not installed: the tests cannot have Apache Kafka and run on Tansu (each run says so)"
	@command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get install -y -qq pgbouncer >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq pgbouncer >/dev/null 2>&1)); } || \
	  echo "pgbouncer not installed: tests/engine/relay/test_pgbouncer.py will be skipped"
	@test -x $(PG15_BIN)/initdb || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    mkdir -p /etc/postgresql-common && \
	    { grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf || \
	      echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf; } && \
	    (apt-get install -y -qq postgresql-15 >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq postgresql-15 >/dev/null 2>&1)); } || \
	  echo "postgresql-15 not installed: the suites' second pass on Debian's PostgreSQL 15 will be skipped"
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
# Then Debian's PostgreSQL 15 at its defaults (tests/kit/servers.py) for what differs between servers: the
# settings the relay depends on (JIT: test_your_postgres.py), a pooler, a LATIN1 database, and the fault suite (the wal
# strategy's fault scenarios and the Kafka transactions' (a broker matter) on the 18 only: on the 15 they are `make test-pg15`'s).
# The whole engine and fault suites on the 15 are `make test-pg15` (7 minutes more on 2 cores: `make test` would
# pass its 20-minute budget; run it nightly and before a release).
PG15_CI_SUITES := tests/engine/relay/test_your_postgres.py tests/engine/relay/test_pgbouncer.py tests/engine/store/test_latin1.py tests/faults --ignore=tests/faults/test_wal_faults.py --ignore=tests/faults/test_kafka_transactions.py
# Tests marked `nightly` (runs at size: the benches' own runs, a Spark cluster, a 200k verify) are `make test-nightly`.
# The broker is Apache Kafka (OUTBOX_TEST_BROKER's default); then Tansu, `make dev`'s broker, for what differs between
# brokers: delivery and order on the ordered strategies and on the wal lane, and aborted Kafka transactions (Tansu shows
# them to read_committed consumers: test_relay_ordered.py's canary). `make test-tansu` runs any suites on it.
TANSU_CI_SUITES := tests/engine/relay/test_relay_ordered.py tests/engine/relay/test_wal_stream.py
test: $(STAMP) tools lint
	$(BIN)/python -m pytest -n 4 -m "not timing and not nightly" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m "timing and not nightly" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-pg15 PG15_SUITES="$(PG15_CI_SUITES)" PG15_TIMING=no
	$(MAKE) --no-print-directory test-tansu TANSU_SUITES="$(TANSU_CI_SUITES)"

TANSU_SUITES ?= tests/engine tests/faults
test-tansu: $(STAMP)
	OUTBOX_TEST_BROKER=tansu $(BIN)/python -m pytest -n 4 -m "not timing and not nightly" $(TANSU_SUITES) $(PYTEST_ARGS)

# What `make test` leaves out for its 20 minutes: the runs at size, the harness's six drawn seeds and today's (`make
# test` runs its chosen CI schedules), the scale-out of the strategies other than partitioned, and the whole engine and
# fault suites on the 15. The timing scenarios among them run alone, as in `make test`. The mutation runs are
# `make test-mutants`, nightly too.
test-nightly: $(STAMP) tools
	$(BIN)/python -m pytest -n 4 -m "nightly and not timing" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m "nightly and timing" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-pg15

# Mutation runs (nightly, not in `make test`): each engine mutant of tests/mutants/ applied alone to a scratch copy of
# the tree under /tmp, and the harness's CI schedules and the fault tests its patch names run against it until one
# fails. Prints each mutant killed, survived or "does not apply" (its code moved on), and the score (docs/faults.md);
# fails unless every mutant that applies is killed. About 25 minutes on 2 cores. MUTANTS="name ..." runs some.
test-mutants: $(STAMP)
	$(BIN)/python -m tests.mutants $(MUTANTS)

# The engine and fault suites again on Debian's PostgreSQL 15 at its defaults. Where the package cannot be installed
# (no apt-get, not root), this says how to run it and passes: elsewhere, set PG15_BIN to any build's bin folder, or
# run the same command with OUTBOX_TEST_PG_BIN=<bin folder>.
PG15_TIMING ?= yes
test-pg15: $(STAMP)
	@if test -x $(PG15_BIN)/initdb; then \
	  set -e; \
	  OUTBOX_TEST_PG_BIN=$(PG15_BIN) $(BIN)/python -m pytest -n 4 -m "not timing" $(PG15_SUITES) $(PYTEST_ARGS); \
	  if test "$(PG15_TIMING)" = yes; then \
	    OUTBOX_TEST_PG_BIN=$(PG15_BIN) $(BIN)/python -m pytest -m timing $(PG15_SUITES) $(PYTEST_ARGS); \
	  else \
	    echo "on PostgreSQL 15, the rest of the engine suite and the timing scenarios: make test-pg15"; \
	  fi; \
	else \
	  echo "SKIPPED the suites on PostgreSQL 15: $(PG15_BIN)/initdb is missing"; \
	  echo "  install it (Debian: apt-get install postgresql-15, as root: make tools does) and run make test-pg15,"; \
	  echo "  or run them on any build: make test-pg15 PG15_BIN=/path/to/postgresql/bin"; \
	fi

clean:
	rm -rf $(VENV) .outbox .pytest_cache
