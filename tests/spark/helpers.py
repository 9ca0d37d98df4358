"""What the Spark tests share: concurrent writers and every row's place (positions: tests/probes.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.enqueue import enqueue


@dataclass
class Writers:
    """Threads that keep committing small transactions (one key per thread and index) until stopped."""

    dsn: str
    table: OutboxTable
    topics: Sequence[str]
    threads: int = 2
    committed: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for n in range(self.threads):
            worker = threading.Thread(target=self._write, args=(n,), daemon=True)
            worker.start()
            self._workers.append(worker)

    def stop(self) -> list[str]:
        self._stop.set()
        for worker in self._workers:
            worker.join()
        return list(self.committed)

    def _write(self, n: int) -> None:
        with psycopg.connect(self.dsn) as conn:
            i = 0
            while not self._stop.is_set():
                topic = self.topics[i % len(self.topics)]
                with conn.transaction():
                    result = enqueue(conn, topic, {"writer": n, "i": i}, key=f"w{n}-k{i % 7}", table=self.table)
                with self._lock:
                    self.committed.append(str(result.message_id))
                i += 1
                self._stop.wait(0.002)  # pacing, so the writers leave CPU to the drain on two cores


def row_positions(db: psycopg.Connection, table: OutboxTable) -> dict[int, tuple[str, int, int]]:
    """outbox id -> (topic, partition, xid) of every row."""
    rows = db.execute(
        sql.SQL("SELECT id, topic, partition, transaction_id::text FROM {}").format(table.messages)
    ).fetchall()
    return {int(oid): (topic, part, int(xid)) for oid, topic, part, xid in rows}
