"""Key-scoped quarantine for the ordered strategies: a dead letter holds its key's later rows while every other key
flows, so the key's stream has no hole. See docs/strategies.md#poison-messages-keep-their-keys-order-quarantine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import psycopg
from psycopg import sql

from .. import settings
from ..config import OutboxTable
from ..model import DeliveryFailure, OutboxRecord, PublishOutcome
from .base import DEAD_LETTER_MOVED, RECORD_COLUMNS, StrategyConfig, fetch_records

# What an ordered strategy does with the rest of a key when one of its rows is dead-lettered:
# "quarantine" holds them until an operator retries or discards the dead letter; "skip" publishes them
# without it (a hole in the key's stream; retrying the dead letter publishes it after them).
OnPoison = Literal["quarantine", "skip"]
ON_POISON_CHOICES: tuple[OnPoison, ...] = ("quarantine", "skip")


def on_poison_from_env(env: Mapping[str, str] | None = None) -> OnPoison:
    """OUTBOX_ON_POISON: ``quarantine`` (default) or ``skip``; see OnPoison. Only the ordered strategies use it."""
    return settings.ON_POISON.read(env)  # type: ignore[return-value]


# The message columns a held row keeps (the record columns the relay publishes, and the dead letters').
_COLUMNS = (
    "id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority, transaction_id, "
    "created_at, "
    "attempts, last_error"
)


@dataclass(frozen=True, slots=True)
class HoldView:
    """The holds of one partition (or outbox) as a claim sees them."""

    keys: frozenset[tuple[str, bytes]]  # (topic, UTF-8 key), as OutboxRecord carries them
    released: bool  # some hold is released and ready: its held rows go out before anything else

    def split(self, records: Sequence[OutboxRecord]) -> tuple[list[OutboxRecord], list[OutboxRecord]]:
        """(to publish, to withhold): rows of held keys are withheld."""
        if not self.keys:
            return list(records), []
        publish: list[OutboxRecord] = []
        withheld: list[OutboxRecord] = []
        for record in records:
            held = record.key is not None and (record.topic, record.key) in self.keys
            (withheld if held else publish).append(record)
        return publish, withheld


NO_HOLDS = HoldView(frozenset(), False)


class Quarantine:
    """The holds of one strategy instance. ``read_order`` orders held rows as the strategy reads rows."""

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig, read_order: str) -> None:
        self.conn = conn
        self.config = config
        self.read_order = read_order
        # Bumped whenever this worker creates or deletes a hold: a claim read under an older version may
        # publish a row that is held now (or withhold one that no longer is) and is given back instead.
        self.version = 0

    @property
    def table(self) -> OutboxTable:
        return self.config.table

    @property
    def enabled(self) -> bool:
        return self.config.on_poison == "quarantine"

    def view(self, topic: str | None = None, partition: int | None = None) -> HoldView:
        rows = self.conn.execute(
            sql.SQL(
                """
                SELECT h.topic, convert_to(h.key, 'UTF8'), h.released_at IS NOT NULL AND h.available_after <= now()
                FROM {holds} h
                WHERE (%(topic)s::text IS NULL OR (h.topic = %(topic)s AND h.partition = %(partition)s))
                """
            ).format(holds=self.table.holds),
            {"topic": topic, "partition": partition},
            binary=True,
        ).fetchall()
        return HoldView(frozenset((t, bytes(k)) for t, k, _ in rows), any(r for _, _, r in rows))

    def any_holds(self, topic: str | None = None, partition: int | None = None) -> bool:
        return bool(self.view(topic, partition).keys)

    # -- the ack of an ordinary batch ------------------------------------------------------------------

    def hold(self, dead: Sequence[DeliveryFailure]) -> set[tuple[str, bytes]]:
        """Hold the keys of rows just dead-lettered (already in the dead letters); returns the keys held."""
        keyed = [f.record.id for f in dead if f.record.key is not None]
        if not self.enabled or not keyed:
            return set()
        self.conn.execute(
            sql.SQL(
                """
                INSERT INTO {holds} (topic, key, partition, dead_letter_id)
                SELECT d.topic, d.key, d.partition, d.id FROM {dead_letters} d WHERE d.id = ANY(%(ids)s::bigint[])
                ON CONFLICT (topic, key) DO UPDATE SET
                    dead_letter_id = excluded.dead_letter_id, held_since = now(), released_at = NULL,
                    release = NULL, released_by = NULL, available_after = now()
                """
            ).format(holds=self.table.holds, dead_letters=self.table.dead_letters),
            {"ids": keyed},
        )
        self.version += 1
        return {(f.record.topic, f.record.key) for f in dead if f.record.key is not None}

    def move_to_held(self, records: Sequence[OutboxRecord], *, delete: bool) -> None:
        """Put rows of held keys into ``outbox_held``; ``delete`` takes them out of the message table too (the
        row strategies, whose pending rows are the table's unsent rows; position strategies never touch it)."""
        if not records:
            return
        if delete:
            moved = "DELETE FROM {messages} m WHERE m.id = ANY(%(ids)s::bigint[]) RETURNING m.*"
        else:
            moved = "SELECT * FROM {messages} m WHERE m.id = ANY(%(ids)s::bigint[])"
        statement = (
            f"WITH moved AS ({moved}) INSERT INTO {{held}} ({_COLUMNS}) SELECT {_COLUMNS} FROM moved "
            "ON CONFLICT (id) DO NOTHING"
        )
        self.conn.execute(
            sql.SQL(statement).format(messages=self.table.messages, held=self.table.held),
            {"ids": [r.id for r in records]},
        )

    # -- releases ---------------------------------------------------------------------------------------

    def read_released(self, limit: int, topic: str | None = None, partition: int | None = None) -> list[OutboxRecord]:
        """Held rows of released holds, in the strategy's read order (per key, the order they were written)."""
        query = sql.SQL(
            """
            SELECT {columns}
            FROM {held} m JOIN {holds} h ON h.topic = m.topic AND h.key = m.key
            WHERE h.released_at IS NOT NULL AND h.available_after <= now()
              AND (%(topic)s::text IS NULL OR (h.topic = %(topic)s AND h.partition = %(partition)s))
            ORDER BY {order}
            LIMIT %(limit)s
            """
        ).format(
            columns=sql.SQL(RECORD_COLUMNS),
            held=self.table.held,
            holds=self.table.holds,
            order=sql.SQL(self.read_order),
        )
        return fetch_records(self.conn, query, {"topic": topic, "partition": partition, "limit": limit})

    def ack_released(
        self,
        records: Sequence[OutboxRecord],
        outcome: PublishOutcome,
        topic: str | None = None,
        partition: int | None = None,
    ) -> tuple[int, int, int]:
        """Apply a release batch's outcome: (acked, retried, dead-lettered). Call inside the ack's transaction.

        Per key, everything before its first failure is done; from the failure on the key stays held: a row
        out of attempts (or that can never be delivered) becomes the hold's new dead letter, a transient
        failure backs the hold off. Rows after it that Kafka confirmed go out again after it.
        """
        delivered = {r.id for r in outcome.delivered}
        failures = {f.record.id: f for f in outcome.failed}
        done: list[int] = []
        stopped: dict[tuple[str, bytes | None], DeliveryFailure] = {}
        for record in records:
            key = (record.topic, record.key)
            if key in stopped:
                continue
            if record.id in delivered:
                done.append(record.id)
            else:
                stopped[key] = failures[record.id]
        if done:
            self.conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s::bigint[])").format(self.table.held), (done,))
        dead = [
            f
            for f in stopped.values()
            if f.permanent or (f.counts and f.record.attempts + 1 >= self.config.max_attempts)
        ]
        retry = [f for f in stopped.values() if f not in dead]
        self._dead_letter_held(dead)
        self._back_off(retry)
        self.finish_releases(topic, partition)
        return len(done), len(retry), len(dead)

    def _dead_letter_held(self, dead: Sequence[DeliveryFailure]) -> None:
        dead_letter_held(self.conn, self.table, dead, self.config.worker_id)

    def _back_off(self, retry: Sequence[DeliveryFailure]) -> None:
        if not retry:
            return
        self.conn.execute(
            sql.SQL(
                """
                WITH failed AS (
                    UPDATE {held} x SET attempts = x.attempts + f.counts::int, last_error = f.error
                    FROM unnest(%(ids)s::bigint[], %(errors)s::text[], %(counts)s::boolean[]) AS f(id, error, counts)
                    WHERE x.id = f.id
                    RETURNING x.topic, x.key, x.attempts
                )
                UPDATE {holds} h SET available_after = clock_timestamp() + make_interval(
                    secs => least(%(max)s, %(base)s * power(2, greatest(failed.attempts - 1, 0)))
                            * (0.5 + random() / 2))
                FROM failed WHERE h.topic = failed.topic AND h.key = failed.key
                """
            ).format(held=self.table.held, holds=self.table.holds),
            {
                "ids": [f.record.id for f in retry],
                "errors": [f.error for f in retry],
                "counts": [f.counts for f in retry],
                "max": self.config.backoff_max_s,
                "base": self.config.backoff_base_s,
            },
        )

    def finish_releases(self, topic: str | None = None, partition: int | None = None) -> int:
        """Delete the released holds with no held row left; their keys flow again. Only in the partition this
        worker owns (another owner may have a batch in flight that withheld rows of its holds)."""
        cur = self.conn.execute(
            sql.SQL(
                """
                DELETE FROM {holds} h
                WHERE h.released_at IS NOT NULL
                  AND (%(topic)s::text IS NULL OR (h.topic = %(topic)s AND h.partition = %(partition)s))
                  AND NOT EXISTS (SELECT 1 FROM {held} x WHERE x.topic = h.topic AND x.key = h.key)
                """
            ).format(holds=self.table.holds, held=self.table.held),
            {"topic": topic, "partition": partition},
        )
        if cur.rowcount:
            self.version += 1
        return cur.rowcount


def dead_letter_held(
    conn: psycopg.Connection, table: OutboxTable, dead: Sequence[DeliveryFailure], worker_id: str
) -> None:
    """Held rows Kafka refused at release: dead letters again, and their keys held behind them again (the wal relay's
    holds use it too)."""
    if not dead:
        return
    conn.execute(
        sql.SQL(
            """
            WITH moved AS (
                DELETE FROM {held} x USING unnest(%(ids)s::bigint[], %(errors)s::text[]) AS f(id, error)
                WHERE x.id = f.id RETURNING x.*, f.error
            ), dead AS (
                {dead_letter}
                RETURNING id, topic, key
            )
            UPDATE {holds} h SET dead_letter_id = dead.id, held_since = now(), released_at = NULL,
                                 release = NULL, released_by = NULL, available_after = now()
            FROM dead WHERE h.topic = dead.topic AND h.key = dead.key
            """
        ).format(
            held=table.held,
            dead_letter=sql.SQL(DEAD_LETTER_MOVED).format(dead_letters=table.dead_letters),
            holds=table.holds,
        ),
        {"ids": [f.record.id for f in dead], "errors": [f.error for f in dead], "worker": worker_id},
    )
