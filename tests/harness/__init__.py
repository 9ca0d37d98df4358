"""A randomized, seeded fault and operator harness in the spirit of Jepsen, against the real PostgreSQL and broker
the test kit starts (docs/faults.md, "The harness"). Read in this order: schedule.py (a seed makes the setup and the
timed events), cluster.py (servers, the run's outbox, worker slots, the operator's command line), writers.py (every
kind of writer, good rows and bad), nemesis.py (faults, and the executor that plays a schedule), operators.py (the
person on call), ledger.py (the checker), run.py (one run), __main__.py (the command line)."""
