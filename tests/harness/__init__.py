"""A randomized, seeded fault and operator harness in the spirit of Jepsen, against the real PostgreSQL and broker
the test kit starts (docs/faults.md, "The harness"). Read in this order: schedule.py (a seed makes the setup and the
timed events), cluster.py (the servers and the run's outbox), relays.py (worker processes in slots), context.py (the
timeline and the operator's command line), writers.py (every kind of writer, good rows and bad), nemesis.py (faults,
and the executor that plays a schedule), operators.py (the person on call), ledger.py and silences.py (the checker),
run.py (one run), __main__.py (the command line). isolation.py cuts one process off from the broker; worker_main.py
runs a kit worker with its log on. ``--strategy wal`` runs the wal strategy (issue 42): writers that emit, relays
that take turns on one replication slot, and a checker that reads the writers' ledger (ledger.py's docstring)."""
