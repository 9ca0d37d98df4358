"""Who is alive: a session advisory lock per worker, so a crashed worker's leases are freed in about a second, not a
lease length. See docs/operations.md#crashed-workers."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import psycopg
from psycopg import sql

from .. import settings
from ..config import OutboxTable

log = logging.getLogger(__name__)

# First key of the workers' session locks: distinct from the advisory strategy's ("OA") and the
# transaction-scoped migration and serialized-writer classes.
WORKER_LOCK_CLASS = 0x4F57  # "OW"
# What the registry records: how this worker's leases end when it dies.
Liveness = Literal["session", "expiry"]
# What an operator asks for (OUTBOX_LIVENESS): ``auto`` is ``session`` on a verified direct connection.
LivenessMode = Literal["auto", "session", "expiry"]


def lock_key(schema: sql.Composable, worker: sql.Composable) -> sql.Composed:
    """The two-int4 key of a worker's session lock; ``schema`` and ``worker`` are SQL expressions."""
    return sql.SQL("{cls}, hashtext({schema} || '/' || {worker})").format(
        cls=sql.Literal(WORKER_LOCK_CLASS), schema=schema, worker=worker
    )


def lock_held(worker: sql.Composable, *, mine: bool = False) -> sql.Composed:
    """SQL: whether a session of *this database* holds the lock of worker ``worker`` (an SQL expression) of the
    outbox schema ``%(schema)s``; ``mine``: this very session."""
    return sql.SQL(
        """
        EXISTS (
            SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
              AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
              AND l.classid = {cls}::oid AND l.objid = hashtext(%(schema)s || '/' || {worker})::oid {mine})
        """
    ).format(
        cls=sql.Literal(WORKER_LOCK_CLASS),
        worker=worker,
        mine=sql.SQL("AND l.pid = pg_backend_pid()" if mine else ""),
    )


# Dead: registered as session-bound and nobody holds its lock. Freed in one statement.
_REAP = """
    WITH dead AS (
        DELETE FROM {workers} w
        WHERE w.liveness = 'session' AND NOT {alive}
        RETURNING w.worker_id
    ),
    partitions AS (
        UPDATE {offsets} o SET locked_by = NULL, available_after = now(), updated_at = now()
        FROM dead WHERE o.locked_by = dead.worker_id
        RETURNING o.topic
    ),
    rows AS (
        DELETE FROM {leases} l USING dead WHERE l.locked_by = dead.worker_id RETURNING l.id
    )
    SELECT coalesce((SELECT array_agg(worker_id ORDER BY worker_id) FROM dead), '{{}}'),
           (SELECT count(*) FROM partitions), (SELECT count(*) FROM rows)
"""


@dataclass(frozen=True)
class Reaped:
    workers: tuple[str, ...] = ()
    partitions: int = 0
    rows: int = 0


def liveness_from_env(env: Mapping[str, str] | None = None) -> LivenessMode:
    """OUTBOX_LIVENESS: ``auto`` (default), ``session`` or ``expiry``; see the module docstring."""
    return settings.LIVENESS.read(env)  # type: ignore[return-value]


def reap(conn: psycopg.Connection, table: OutboxTable) -> Reaped:
    """Free everything held by registered session-bound workers whose session is gone."""
    query = sql.SQL(_REAP).format(
        workers=table.workers, offsets=table.offsets, leases=table.leases, alive=lock_held(sql.SQL("w.worker_id"))
    )
    row = conn.execute(query, {"schema": table.schema}).fetchone()
    reaped = Reaped(tuple(row[0]), int(row[1]), int(row[2])) if row else Reaped()
    if reaped.workers:
        log.info(
            "dead workers %s: freed %d partitions and %d row leases",
            ", ".join(reaped.workers),
            reaped.partitions,
            reaped.rows,
        )
    return reaped


def holders_alive(conn: psycopg.Connection, table: OutboxTable, holders: Collection[str]) -> dict[str, bool | None]:
    """For each holder: True (its session holds its lock), False (registered session-bound, lock gone:
    about to be reaped), None (unknown: expiry liveness or not registered)."""
    if not holders:
        return {}
    rows = conn.execute(
        sql.SQL(
            """
            SELECT h.name, w.liveness, {alive}
            FROM unnest(%(names)s::text[]) AS h(name) LEFT JOIN {workers} w ON w.worker_id = h.name
            """
        ).format(workers=table.workers, alive=lock_held(sql.SQL("h.name"))),
        {"schema": table.schema, "names": sorted(holders)},
    ).fetchall()
    return {name: (held if liveness == "session" else None) for name, liveness, held in rows}


@dataclass(frozen=True)
class LiveWorker:
    worker_id: str
    kind: str  # "relay": serves every partition (dealt among them); "relay-scoped", "drain": their own scope
    liveness: Liveness
    up_s: float = 0.0  # since it registered (the database's clock)


def live_workers(conn: psycopg.Connection, table: OutboxTable, lease_s: float) -> list[LiveWorker]:
    """Registered workers that are alive now: their session holds their lock (session liveness) or their
    heartbeat is younger than ``lease_s`` (expiry). A dead worker not yet reaped is not listed."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT w.worker_id, w.kind, w.liveness, extract(epoch FROM now() - w.registered_at)::float8
            FROM {workers} w
            WHERE CASE w.liveness
                WHEN 'session' THEN {alive}
                ELSE w.heartbeat_at > now() - make_interval(secs => %(lease)s) END
            ORDER BY w.worker_id
            """
        ).format(workers=table.workers, alive=lock_held(sql.SQL("w.worker_id"))),
        {"schema": table.schema, "lease": lease_s},
    ).fetchall()
    return [LiveWorker(worker_id, kind, liveness, up_s) for worker_id, kind, liveness, up_s in rows]
