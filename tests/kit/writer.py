"""Test kit: writers that commit outbox rows the way services do and remember what they committed."""

from __future__ import annotations

import threading

import psycopg

from outbox_pipeline import Enqueued, Message, OutboxTable, enqueue, enqueue_many

from .relay import drain


class Writer(threading.Thread):
    """Writes ``per_tx`` messages per transaction (keys round-robin) until ``total`` committed messages,
    ``transactions`` transactions or ``stop``, and keeps the message_ids of what it committed and of what it rolled
    back: every ``rollback_every``-th transaction rolls back, every ``savepoint_rollback_every``-th commits with one
    more message in a rolled-back savepoint."""

    def __init__(
        self,
        dsn: str,
        table: OutboxTable,
        topic: str,
        *,
        serialized: bool,
        name: str = "w",
        keys: int = 8,
        per_tx: int = 5,
        total: int | None = None,
        transactions: int | None = None,
        pause_s: float = 0.0,
        rollback_every: int = 0,
        savepoint_rollback_every: int = 0,
        stop: threading.Event | None = None,
    ) -> None:
        super().__init__(name=f"writer-{name}", daemon=True)
        self.dsn, self.table, self.topic, self.serialized = dsn, table, topic, serialized
        self.label, self.keys, self.per_tx, self.total, self.pause_s = name, keys, per_tx, total, pause_s
        self.transactions = transactions
        self.rollback_every = rollback_every
        self.savepoint_rollback_every = savepoint_rollback_every
        self.stop = stop or threading.Event()
        self.committed: list[str] = []
        self.rolled_back: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as conn:
                n = 0
                while (
                    not self.stop.is_set()
                    and (self.total is None or len(self.committed) < self.total)
                    and (self.transactions is None or n < self.transactions)
                ):
                    n += 1
                    count = self.per_tx if self.total is None else min(self.per_tx, self.total - len(self.committed))
                    rollback = self.rollback_every > 0 and n % self.rollback_every == 0
                    messages = [
                        Message(self.topic, {"w": self.label, "tx": n, "i": i}, key=f"k{(n + i) % self.keys}")
                        for i in range(count)
                    ]
                    with conn.transaction(force_rollback=rollback):
                        written = enqueue_many(conn, messages, serialized=self.serialized, table=self.table)
                        if self.savepoint_rollback_every and n % self.savepoint_rollback_every == 0:
                            # One more message in a savepoint that is rolled back; the transaction commits.
                            with conn.transaction(force_rollback=True):
                                undone = enqueue_many(
                                    conn,
                                    [Message(self.topic, {"w": self.label, "tx": n, "savepoint": True})],
                                    serialized=self.serialized,
                                    table=self.table,
                                )
                            self.rolled_back.append(str(undone[0].message_id))
                    (self.rolled_back if rollback else self.committed).extend(str(w.message_id) for w in written)
                    if self.pause_s:
                        self.stop.wait(self.pause_s)
        except BaseException as exc:  # reported by check()
            self.error = exc

    def check(self) -> None:
        if self.is_alive():
            raise AssertionError(f"writer {self.label} is still running")
        if self.error is not None:
            raise AssertionError(f"writer {self.label} failed: {self.error!r}") from self.error


def write(dsn: str, table: OutboxTable, topic: str, count: int, *, serialized: bool, keys: int = 8) -> list[str]:
    """``count`` messages in one transaction; their message_ids."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        messages = [Message(topic, {"n": i}, key=f"k{i % keys}") for i in range(count)]
        return [str(w.message_id) for w in enqueue_many(conn, messages, serialized=serialized, table=table)]


def enqueued_behind_the_serialized_position(
    db: psycopg.Connection, slow: psycopg.Connection, table: OutboxTable, topic: str, bootstrap: str
) -> Enqueued:
    """A "write first, enqueue last" writer (``slow``) on a serialized outbox: its transaction begins (an older xid),
    another writer's row is committed and relayed by ``serialized``, then it enqueues and commits. Its row has a
    higher id and a lower transaction id than a row already relayed: pending for serialized, behind the position in
    partitioned's (xid, id) order. Returns it."""
    slow.execute("BEGIN")
    slow.execute("SELECT pg_current_xact_id()")  # its business write: the older transaction id
    enqueue(db, topic, {"n": 1}, key="k", serialized=True, table=table)
    drain(db.info.dsn, table, bootstrap, "serialized")  # the position passes that row
    late = enqueue(slow, topic, {"n": 2}, key="k", serialized=True, table=table)
    slow.execute("COMMIT")
    return late
