"""The schedules `make test` runs (tests/faults/test_harness.py): chosen, not drawn, so that every strategy it
relays meets each kind of fault while it relays, aimed where a defect of that kind shows (a seed's 20 s schedule
catches such a defect only when it happens to draw that fault: docs/faults.md, mutation runs). The setup (batch
size, encoding, ack mode...) is still the seed's.

- ``partitioned``, then ``advisory`` (mark-sent) after a switch of strategy at 9 s (its events are timed from the
  switch's end, Schedule.after_switch): in each stretch a worker cut off
  from Kafka while it relays (its batches fail: each error report must keep its row unacked), a worker frozen past
  its lease (``partitioned``: its partitions are taken over) or killed, every relay's sessions or one worker's ended,
  a PostgreSQL crash, a frozen broker with the relays killed while their batches wait for it;
- ``wal``: slot 0 streams first (relays.py starts it first). Its streamer cut off from Kafka and its walsender ended
  meanwhile (the stream restarts with a batch Kafka did not take: nothing past it may have been confirmed), frozen
  past the takeover time while a transaction stays open (slot 1 takes over), the relay that took over killed, a
  PostgreSQL crash, a frozen broker with both relays killed one after the other while their batches wait for it,
  dead letters retried and discarded, a drain beside the streamer, ``status`` and ``init-db``.
"""

from __future__ import annotations

from collections.abc import Mapping

from .schedule import Event, Registered, Relaying, Schedule, chosen_schedule

SECONDS = {"partitioned": 30.0, "wal": 24.0}
SEEDS = {"partitioned": 286, "wal": 777}  # the setup's: batch size, encoding, ack mode, bad rows, load

_PARTITIONED = (
    # partitioned
    Event(2.5, "kafka-cut", 0, 3.0),
    Event(2.5, "freeze", 1, 6.0),  # past lease_s: slot 0 takes its partitions once its cut ends
    Event(3.0, "dead-letter-retry"),
    Event(4.0, "terminate-backends", choice=1),  # one worker's sessions (the frozen one's)
    Event(5.0, "broker-freeze", duration_s=2.5),
    Event(5.5, "status"),
    Event(6.0, "kill", 0),  # while the broker is frozen and slot 1 frozen: its batch was in flight
    Event(8.0, "pg-restart", duration_s=0.5, choice=1),  # immediate: a crash
    Event(9.0, "switch-strategy", duration_s=10.0, choice=0, to=Relaying("advisory", "mark-sent")),
    # advisory, timed from the switch's end (planned at 19 s): either slot may be the active worker, so both are cut
    # off, killed, frozen briefly
    Event(19.5, "kafka-cut", 0, 3.0),
    Event(19.5, "kafka-cut", 1, 3.0),
    Event(20.0, "dead-letter-discard"),
    Event(21.0, "status"),
    Event(23.0, "broker-freeze", duration_s=3.0),
    Event(24.0, "kill", 0),  # while the broker is frozen: a batch in flight
    Event(24.5, "kill", 1),
    Event(27.0, "terminate-backends", choice=0),  # every relay's sessions
    Event(27.0, "freeze", 0, 1.0),
)

_WAL = (
    Event(2.5, "kafka-cut", 0, 3.0),  # the streamer
    Event(3.0, "dead-letter-retry"),
    Event(4.0, "terminate-backends", choice=1),  # its walsender alone, while it is cut off: the stream restarts
    Event(6.0, "long-transaction", duration_s=6.0, choice=1),  # committed (choice % 4 != 0)
    Event(7.0, "freeze", 0, 8.0),  # past the takeover time: slot 1 takes the slot over
    Event(8.0, "dead-letter-discard"),
    Event(9.0, "drain", duration_s=6.0),
    Event(13.0, "kill", 1),  # the relay that took over: its replacement, or slot 0 once thawed, streams
    Event(13.0, "pg-restart", duration_s=1.0, choice=1),
    Event(16.0, "status"),
    Event(17.0, "broker-freeze", duration_s=3.0),
    Event(18.0, "kill", 1),  # whichever streams, killed while its batch waits for the frozen broker, then the other
    Event(19.0, "kill", 0),
    Event(20.0, "dead-letter-retry"),
    Event(21.0, "terminate-backends", choice=0),  # every wal relay session
    Event(21.5, "init-db"),
)

EVENTS = {"partitioned": _PARTITIONED, "wal": _WAL}


def ci_schedule(strategy: str, catalogue: Mapping[str, Registered], *, lease_s: float = 5.0) -> Schedule:
    return chosen_schedule(
        SEEDS[strategy], strategy, catalogue, EVENTS[strategy], seconds=SECONDS[strategy], lease_s=lease_s
    )
