"""The questions `outbox verify` asks of its workspace: lost, phantom, duplicates, order, latency. See
docs/operations.md#checking-delivery-outbox-verify."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from psycopg import sql

from .consume import Consumed
from .ledger import Ledger, range_text
from .report import Latency, MessageRef, OrderViolation, VerifyReport

log = logging.getLogger(__name__)

# How many lost / phantom messages the report names.
EXAMPLES = 5

OrderedStrategy = Literal["partitioned", "serialized", "advisory"]
ORDERED_STRATEGIES: tuple[OrderedStrategy, ...] = ("partitioned", "serialized", "advisory")


class Workspace(Ledger):
    """The ledger workspace and the questions asked of it: one report per verify run."""

    def report(
        self,
        topics: tuple[str, ...],
        *,
        ledger: str,
        dead_letters: int,
        held: int,
        consumed: Consumed,
        ordered: OrderedStrategy | None,
        since: dt.datetime | None,
        id_from: int | None,
        from_offsets: bool,
        elapsed_s: float,
    ) -> VerifyReport:
        # Records the ledger's range says nothing about (it is only a range with a table ledger).
        in_range = sql.SQL(
            "(%(since)s::timestamptz IS NULL OR c.created_at IS NULL OR c.created_at >= %(since)s::timestamptz) "
            "AND (%(id_from)s::bigint IS NULL OR c.outbox_id IS NULL OR c.outbox_id >= %(id_from)s::bigint)"
        )
        params: dict[str, Any] = {"since": since, "id_from": id_from, "examples": EXAMPLES}
        with self._transaction():
            self.conn.execute(self._sql("ANALYZE {consumed}"))

        ledger_messages = self._scalar("SELECT count(*) FROM {ledger}", params)
        ignored = self._scalar("SELECT count(*) FROM {consumed} c WHERE NOT ({in_range})", params, in_range=in_range)
        lost, lost_examples = self._lost(params)
        phantom, phantom_examples = self._phantoms(in_range, params)
        dup = self._duplicates(in_range, params)
        order_checked, order_violations, order_example = 0, 0, None
        if ordered is not None:
            order_checked, order_violations, order_example = self._order(ordered, in_range, params)
        report = VerifyReport(
            topics=topics,
            ledger=ledger,
            ledger_messages=ledger_messages,
            partitions=consumed.partitions,
            consumed_records=consumed.records,
            ignored_records=ignored,
            complete=consumed.complete,
            elapsed_s=round(elapsed_s, 3),
            lost=lost,
            phantom=phantom,
            duplicate_copies=int(dup[0]),
            duplicated_messages=int(dup[1]),
            worst_duplicate_key=dup[2],
            worst_duplicate_key_copies=int(dup[3]),
            dead_letters=dead_letters,
            held=held,
            ordered=ordered,
            order_checked=order_checked,
            order_violations=order_violations,
            order_example=order_example,
            latency=self._latency(in_range, params),
            lost_examples=lost_examples,
            phantom_examples=phantom_examples,
        )
        return replace(report, notes=_notes(report, since, id_from, from_offsets))

    def _lost(self, params: Mapping[str, Any]) -> tuple[int, tuple[MessageRef, ...]]:
        """Ledger messages no record carries, and the first few of them (by outbox id)."""
        lost = self._scalar(
            "SELECT count(*) FROM {ledger} l WHERE NOT EXISTS (SELECT 1 FROM {consumed} c "
            "WHERE c.message_id = l.message_id)",
            params,
        )
        if not lost:
            return lost, ()
        rows = self._rows(
            """
            SELECT l.message_id, l.outbox_id, l.topic, l.key FROM {ledger} l
            WHERE NOT EXISTS (SELECT 1 FROM {consumed} c WHERE c.message_id = l.message_id)
            ORDER BY l.outbox_id NULLS LAST, l.message_id LIMIT %(examples)s
            """,
            params,
        )
        return lost, tuple(MessageRef(message_id=str(r[0]), outbox_id=r[1], topic=r[2], key=r[3]) for r in rows)

    def _duplicates(self, in_range: sql.Composable, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """(extra copies, messages with copies, the key with most copies, its copies) among the records in range."""
        return self._rows(
            """
            WITH copies AS (
                SELECT c.message_id, min(c.key) AS key, count(*) - 1 AS extra
                FROM {consumed} c WHERE c.message_id IS NOT NULL AND ({in_range})
                GROUP BY c.message_id HAVING count(*) > 1
            ), per_key AS (
                SELECT key, sum(extra) AS extra FROM copies GROUP BY key ORDER BY sum(extra) DESC, key LIMIT 1
            )
            SELECT (SELECT coalesce(sum(extra), 0) FROM copies), (SELECT count(*) FROM copies),
                   (SELECT key FROM per_key), (SELECT coalesce(sum(extra), 0) FROM per_key)
            """,
            params,
            in_range=in_range,
        )[0]

    def _latency(self, in_range: sql.Composable, params: Mapping[str, Any]) -> Latency | None:
        """Commit -> broker latency of each message's first copy (its created_at header to its broker timestamp)."""
        lat = self._rows(
            """
            SELECT count(*), percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms), max(ms)
            FROM (
                SELECT min(c.broker_ms) - extract(epoch FROM min(c.created_at))::float8 * 1000 AS ms
                FROM {consumed} c
                WHERE c.message_id IS NOT NULL AND c.broker_ms IS NOT NULL AND c.created_at IS NOT NULL
                  AND ({in_range})
                GROUP BY c.message_id
            ) x
            """,
            params,
            in_range=in_range,
        )[0]
        if not lat[0]:
            return None
        return Latency(int(lat[0]), round(lat[1][0], 3), round(lat[1][1], 3), round(lat[1][2], 3), round(lat[2], 3))

    def _phantoms(self, in_range: sql.Composable, params: Mapping[str, Any]) -> tuple[int, tuple[MessageRef, ...]]:
        """Records committed nowhere in PostgreSQL: not in the ledger, nor in the outbox table as it is now
        (rows committed after the ledger was taken, rows of other topics), nor among the dead letters. A
        record without a readable message_id header matches nothing. Counted per message."""
        with self._transaction():
            self.conn.execute(
                self._sql(
                    """
                    CREATE TEMP TABLE {phantoms} AS
                    SELECT c.* FROM {consumed} c
                    WHERE ({in_range})
                      AND (c.message_id IS NULL
                           OR NOT EXISTS (SELECT 1 FROM {ledger} l WHERE l.message_id = c.message_id))
                    """,
                    in_range=in_range,
                ),
                params,
            )
            # Usually empty: the outbox table is only scanned when some record is not in the ledger.
            cur = self.conn.execute(self._sql("SELECT 1 FROM {phantoms} LIMIT 1"))
            if cur.fetchone() is not None:
                self.conn.execute(
                    self._sql(
                        """
                        DELETE FROM {phantoms} p
                        WHERE EXISTS (SELECT 1 FROM {messages} m WHERE m.message_id = p.message_id)
                           OR EXISTS (SELECT 1 FROM {dead_letters} d WHERE d.message_id = p.message_id)
                        """
                    )
                )
        count = self._scalar(
            "SELECT count(DISTINCT p.message_id) + count(*) FILTER (WHERE p.message_id IS NULL) FROM {phantoms} p",
            params,
        )
        examples = tuple(
            MessageRef(
                message_id=str(r[0]) if r[0] is not None else None,
                outbox_id=r[5],
                topic=r[1],
                key=r[4],
                partition=r[2],
                offset=r[3],
            )
            for r in (
                self._rows(
                    "SELECT p.message_id, p.topic, p.kafka_partition, p.kafka_offset, p.key, p.outbox_id "
                    "FROM {phantoms} p ORDER BY p.topic, p.kafka_partition, p.kafka_offset LIMIT %(examples)s",
                    params,
                )
                if count
                else []
            )
        )
        return count, examples

    def _order(
        self, ordered: OrderedStrategy, in_range: sql.Composable, params: Mapping[str, Any]
    ) -> tuple[int, int, OrderViolation | None]:
        """Adjacent inversions per (topic, Kafka partition, key) among each message's first copy.

        Same key -> same Kafka partition, so offsets order a key's records. Only ledger messages are
        checked (phantoms have no expected place), and never one that was dead-lettered: its retry is
        published after its successors by design.
        """
        if ordered == "partitioned":
            expected = sql.SQL("l.transaction_id AS r1, coalesce(l.outbox_id, c.outbox_id) AS r2")
            known = sql.SQL("l.transaction_id IS NOT NULL AND coalesce(l.outbox_id, c.outbox_id) IS NOT NULL")
        else:
            expected = sql.SQL("coalesce(c.outbox_id, l.outbox_id) AS r1, 0::bigint AS r2")
            known = sql.SQL("coalesce(c.outbox_id, l.outbox_id) IS NOT NULL")
        rows = self._rows(
            """
            WITH firsts AS (
                SELECT c.topic, c.kafka_partition, c.kafka_offset, c.key, coalesce(c.outbox_id, l.outbox_id) AS id,
                       {expected}
                FROM {consumed} c JOIN {ledger} l ON l.message_id = c.message_id
                WHERE c.key IS NOT NULL AND ({in_range}) AND {known}
                  AND NOT EXISTS (
                      SELECT 1 FROM {consumed} e WHERE e.message_id = c.message_id
                         AND (e.kafka_partition, e.kafka_offset) < (c.kafka_partition, c.kafka_offset))
                  AND NOT EXISTS (SELECT 1 FROM {dead_letters} d WHERE d.message_id = c.message_id)
            ), paired AS (
                SELECT f.*, lag(r1) OVER w AS p1, lag(r2) OVER w AS p2, lag(kafka_offset) OVER w AS prev_offset,
                       lag(id) OVER w AS prev_id
                FROM firsts f
                WINDOW w AS (PARTITION BY topic, kafka_partition, key ORDER BY kafka_offset)
            )
            SELECT count(*) OVER (), count(*) FILTER (WHERE (p1, p2) > (r1, r2)) OVER (),
                   topic, kafka_partition, key, prev_offset, prev_id, kafka_offset, id, (p1, p2) > (r1, r2)
            FROM paired
            ORDER BY ((p1, p2) > (r1, r2)) IS TRUE DESC, topic, kafka_partition, kafka_offset
            LIMIT 1
            """,
            params,
            in_range=in_range,
            expected=expected,
            known=known,
        )
        if not rows:
            return 0, 0, None
        checked, violations, topic, partition, key, prev_offset, prev_id, offset, oid, bad = rows[0]
        example = OrderViolation(topic, partition, key, prev_offset, prev_id, offset, oid) if bad else None
        return int(checked), int(violations), example


def _notes(report: VerifyReport, since: dt.datetime | None, id_from: int | None, from_offsets: bool) -> tuple[str, ...]:
    """What a reader needs to read the figures right: what was left out of them, and what may show as lost."""
    notes: list[str] = []
    if not report.complete:
        notes.append(
            "stopped at --max-seconds before every partition was idle: messages still arriving may show as lost"
        )
    if since is not None or id_from is not None:
        notes.append(
            f"ledger restricted to {range_text(since, id_from)}: records outside it "
            f"(by their created_at / outbox_id headers) are ignored, not phantom"
        )
    if from_offsets:
        notes.append("consumed from given offsets: ledger messages published before them count as lost")
    if report.ledger == "table" and report.ledger_messages == 0 and report.phantom:
        notes.append(
            "the outbox table holds no rows for these topics: in delete mode relayed rows are gone, "
            "give the ledger with --ledger-file"
        )
    if report.ordered is not None:
        notes.append(
            "order: each message's first copy per key and Kafka partition, against "
            + ("(transaction_id, id)" if report.ordered == "partitioned" else "outbox id")
            + "; keyless and dead-lettered messages are not checked"
        )
    return tuple(notes)
