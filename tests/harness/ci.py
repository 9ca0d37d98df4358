"""The schedules `make test` runs (tests/faults/test_harness.py): chosen, not drawn, so that every strategy it
relays meets each kind of fault while it relays, aimed where a defect of that kind shows (a seed's 20 s schedule
catches such a defect only when it happens to draw that fault: docs/faults.md, mutation runs). The setup (batch
size, encoding, ack mode...) is still the seed's.

- ``partitioned``, then ``advisory`` (mark-sent) after a switch of strategy at 11.5 s (its events are timed from the
  switch's end, Schedule.chosen): in each stretch a worker cut off from Kafka long enough for its messages to
  time out (each error report must keep its row unacked) and killed while still cut off (what it handed to Kafka
  never arrives), a frozen broker, sessions ended; ``partitioned`` also a worker frozen past its lease (its
  partitions are taken over), the broker killed -9 and started again, a kill and a PostgreSQL crash;
- ``wal``: slot 0 streams first (relays.py starts it first). Its streamer cut off from Kafka, its walsender ended
  meanwhile (the stream restarts with a batch Kafka did not take), killed while still cut off (nothing past what
  Kafka acked may have been confirmed); the relay that took over frozen past the takeover time while a transaction
  stays open; a PostgreSQL crash just after a checkpoint; the broker killed -9 and started again under the streamer;
  the next streamer killed; a frozen broker and a cut; dead letters retried and
  discarded, a drain beside the streamer, ``status`` and ``init-db``;
- ``wal-edges`` (issue 50, edges.py), in a LATIN1 database (a writer whose client speaks UTF8 beside the others): a
  storage snapshot restored under the relays, a forged emit by a role without grants, rows INSERTed with
  ``session_replication_role = replica``, ``switch-strategy`` tried on the wal outbox, the streamer frozen past the
  takeover time while ``wal_sender_timeout`` is shorter, and a streamer frozen while it hands a batch to its producer
  and thawed after its successor published newer values of the same keys.
"""

from __future__ import annotations

from collections.abc import Mapping

from .nemesis import KILL_WHILE_CUT
from .schedule import Event, Registered, Relaying, Schedule, chosen_schedule

SECONDS = {"partitioned": 38.0, "wal": 25.0, "wal-edges": 36.0}
# The setup's: batch size, encoding, ack mode, bad rows, load. 18: LATIN1, batch 20, the producers' 2 s timeout.
SEEDS = {"partitioned": 286, "wal": 777, "wal-edges": 18}
STRATEGY = {"wal-edges": "wal"}  # a schedule's strategy, where its name is not one
KILLED = KILL_WHILE_CUT  # a kafka-cut that ends with its worker killed while still cut off

_PARTITIONED = (
    # partitioned: nobody serves from 2.5 s to 8.5 s (slot 0 cut off, slot 1 frozen past its lease), then slot 0's
    # replacement takes every partition whose lease ran out, slot 1 among them, before slot 1 thaws
    Event(2.5, "kafka-cut", 0, 6.0, choice=KILLED),  # long enough for its messages to time out: each error counts
    Event(2.5, "freeze", 1, 7.0),
    Event(3.0, "dead-letter-retry"),
    Event(4.0, "terminate-backends", choice=1),  # one worker's sessions (the frozen one's)
    Event(5.0, "broker-freeze", duration_s=2.0),
    Event(5.5, "status"),
    Event(9.0, "broker-restart"),  # kill -9, its log kept: slot 0's replacement relays (slot 1 still frozen)
    Event(10.0, "kill", 1),
    Event(10.5, "pg-restart", duration_s=0.5, choice=1),  # immediate: a crash
    Event(11.5, "switch-strategy", duration_s=10.0, choice=0, to=Relaying("advisory", "mark-sent")),
    # advisory, timed from the switch's end (planned at 21.5 s): the active worker is either slot, so both are cut off
    # 10 s (batch after batch times out: every error report must keep its row unsent) and killed at the end of it,
    # then the broker frozen, every relay session ended, a short freeze
    Event(22.0, "kafka-cut", 0, 10.0, choice=KILLED),
    Event(22.0, "kafka-cut", 1, 10.0, choice=KILLED),
    Event(22.5, "dead-letter-discard"),
    Event(23.5, "status"),
    Event(33.0, "broker-freeze", duration_s=2.0),
    Event(34.0, "freeze", 0, 1.0),
    Event(35.5, "terminate-backends", choice=0),  # every relay's sessions
)

_WAL = (
    # slot 0 streams first (relays.py): cut off from Kafka 9 s (batch after batch times out), its walsender ended
    # meanwhile (the stream restarts with a batch Kafka did not take), killed at the end of the cut: slot 1 takes over
    Event(2.5, "kafka-cut", 0, 9.0, choice=KILLED),
    Event(3.0, "dead-letter-retry"),
    Event(4.0, "terminate-backends", choice=1),  # the walsender alone
    Event(5.5, "long-transaction", duration_s=6.0, choice=1),  # committed (choice % 4 != 0)
    Event(12.0, "freeze", 1, 7.5),  # the streamer now, past the takeover time: slot 0's replacement takes over
    Event(12.5, "dead-letter-discard"),
    Event(13.0, "drain", duration_s=6.0),
    # a crash just after a checkpoint: the slot keeps what was confirmed (a confirm past what Kafka did not take at
    # 2.5-11.5 s stays visible; without the checkpoint the crash would take the slot back and hide it)
    Event(13.0, "pg-restart", duration_s=1.0, choice=3),
    Event(17.5, "broker-restart"),  # kill -9, its log kept, while slot 0's replacement streams
    Event(19.5, "status"),  # the operator lane is free again at 19.5 s
    Event(20.0, "kill", 0),  # the streamer: slot 1, thawed, takes over
    Event(20.5, "broker-freeze", duration_s=2.0),
    Event(20.5, "kafka-cut", 1, 2.5),
    Event(21.0, "dead-letter-retry"),
    Event(22.0, "init-db"),
    Event(23.0, "terminate-backends", choice=0),  # every wal relay session
)

_WAL_EDGES = (
    Event(2.5, "storage-snapshot", duration_s=3.0),  # restored 3 s later, once the relays confirmed past it
    Event(3.0, "forged-emit", choice=5),
    Event(4.5, "replica-insert", choice=2),
    Event(8.0, "switch-from-wal", choice=3),  # after the restore (the relays confirm past the snapshot first)
    Event(10.0, "sender-timeout", duration_s=9.0),  # the streamer frozen 9 s, wal_sender_timeout 2 s meanwhile
    Event(12.0, "dead-letter-retry"),
    Event(21.0, "stale-thaw", duration_s=9.0, choice=7),
    Event(24.0, "dead-letter-discard"),
    Event(32.0, "status"),
)

EVENTS = {"partitioned": _PARTITIONED, "wal": _WAL, "wal-edges": _WAL_EDGES}
# The schedules that give each strategy `make test` relays every kind of fault (tests/faults/test_harness.py holds
# them to it); wal-edges adds the wal lane's own edges.
FAULT_SCHEDULES = ("partitioned", "wal")


def ci_schedule(name: str, catalogue: Mapping[str, Registered], *, lease_s: float = 5.0) -> Schedule:
    """The chosen schedule ``name`` (a strategy, or ``wal-edges``)."""
    strategy = STRATEGY.get(name, name)
    return chosen_schedule(SEEDS[name], strategy, catalogue, EVENTS[name], seconds=SECONDS[name], lease_s=lease_s)
