"""A wal outbox's lag, read from its replication slot, with the age of the oldest unpublished commit decoded from a
temporary copy of the slot. See docs/operations.md#the-slots-lag-and-the-oldest-commits-age."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..store.wal.objects import names_of
from ..store.wal.position import gap_report
from ..store.wal.refusals import stored_rows, stored_rows_problem
from ..store.wal.slot import SlotState, slot_state, unusable_reason
from .lag import HeldKey, held_keys

# A status or lag read decodes at most this long, and stops after the first transaction that brings the output to
# this many rows (pgoutput's Begin, Message and Commit; other outboxes' messages count too).
DECODE_TIMEOUT_S = 2.0
DECODE_ROWS = 10_000

# How the age was measured (WalLag.age_measured_by); anything else is why it was not.
CAUGHT_UP = "caught up"
DECODED = "decoded"

NO_PARTITIONS = (
    "a wal outbox keeps no rows: its messages wait in the slot's WAL, in commit order, so there is no per-partition "
    "pending, position or owner to show"
)

# The first committed transaction after the copy's confirmed position that carries a transactional message under the
# outbox's prefix, and its commit time's age in seconds. pgoutput's frames (protocol 1): Begin is 'B', final LSN (8),
# commit time (8: microseconds since 2000-01-01); Message is 'M', flags (1: transactional), LSN (8), the prefix
# NUL-terminated, then the content. Rows come in commit order; ``count`` says whether the output reached the bound.
_FIRST_UNPUBLISHED = """
    WITH changes AS MATERIALIZED (
        SELECT c.xid, c.data, c.n
        FROM pg_logical_slot_peek_binary_changes(
                 %(copy)s, NULL, %(rows)s, 'proto_version', '1', 'publication_names', %(publication)s,
                 'messages', 'true') WITH ORDINALITY AS c(lsn, xid, data, n)
    ), ours AS (
        SELECT xid FROM changes
        WHERE get_byte(data, 0) = 77 AND get_byte(data, 1) = 1 AND substr(data, 11, %(prefix_len)s) = %(prefix)s
        ORDER BY n LIMIT 1
    )
    SELECT (SELECT count(*) FROM changes),
           (SELECT extract(epoch FROM clock_timestamp() - timestamptz '2000-01-01 00:00:00+00')::float8
                   - ('x' || encode(substr(b.data, 10, 8), 'hex'))::bit(64)::bigint / 1e6::float8
            FROM changes b JOIN ours USING (xid)
            WHERE get_byte(b.data, 0) = 66
            ORDER BY b.n LIMIT 1)
"""


@dataclass(frozen=True)
class WalLag:
    """A wal outbox's slot as status, lag, the lag objective and the metrics report it."""

    slot: SlotState
    # The age of the oldest commit with a message not confirmed by Kafka; None: not measured (age_measured_by says why).
    oldest_unpublished_age_s: float | None
    age_measured_by: str
    # A missing or lost slot: what it is and the procedure (store/wal/slot.py); None while it can stream.
    problem: str | None
    # Beside the slot: rows in the message table (never relayed: store/wal/objects.py), the keys held behind dead
    # letters with their held messages (relay/wal/holds.py), and whether the role this reads as may stream.
    stored_rows: int = 0
    held: tuple[HeldKey, ...] = ()
    role: str = ""
    role_can_stream: bool = True
    # Messages that may never have been streamed (a slot made again behind the relay: store/wal/position.py).
    gap: str | None = None

    @property
    def streamed_by(self) -> int | None:
        """The walsender's pid while a relay streams the slot."""
        return self.slot.active_pid

    def describe(self) -> str:
        """One line for a terminal, an alert or a skip reason."""
        s = self.slot
        if self.problem is not None:
            return f"wal slot {s.slot}: {self.problem}"
        age = (
            f"oldest unpublished commit {self.oldest_unpublished_age_s:.1f} s ({self.age_measured_by})"
            if self.oldest_unpublished_age_s is not None
            else f"oldest unpublished commit not measured ({self.age_measured_by})"
        )
        safe = "no max_slot_wal_keep_size" if s.safe_wal_size is None else f"safe_wal_size {_bytes(s.safe_wal_size)}"
        relay = f"streamed by pid {s.active_pid}" if s.active_pid is not None else "no relay streams it"
        gap = "" if self.gap is None else f"; {self.gap}"
        spill = f" and {_bytes(s.spill_bytes)} in spill files" if s.spill_bytes else ""
        return (
            f"wal slot {s.slot}: {_bytes(s.retained_bytes)} of WAL retained{spill}, {_bytes(s.unconfirmed_bytes)} not "
            f"confirmed, {age}, wal_status {s.wal_status}, {safe}, {relay}{gap}"
        )

    def notes(self, table: OutboxTable) -> list[str]:
        """What else needs an operator, a line each: stored rows (with the statement that relays them), held keys,
        a role that cannot stream while no relay does."""
        lines = [stored_rows_problem(table, self.stored_rows)] if self.stored_rows else []
        lines += [
            key.describe() + ("" if key.oldest_age_s is None else f", the oldest held {key.oldest_age_s:.1f} s")
            for key in self.held
        ]
        if (why := self.cannot_stream()) is not None:
            lines.append(why)
        return lines

    def cannot_stream(self) -> str | None:
        """No relay streams the slot and this role could not: a relay run as it retries nothing, it stops."""
        if self.role_can_stream or self.slot.active_pid is not None:
            return None
        return (
            f"no relay streams the slot, and the role {self.role!r} has no REPLICATION attribute: a relay run as it "
            f"cannot stream (ALTER ROLE {self.role} REPLICATION, or run the relay as a role that has it)"
        )

    @property
    def held_messages(self) -> int:
        return sum(key.rows for key in self.held)

    def as_json(self) -> dict[str, object]:
        s = self.slot
        return {
            "strategy": "wal",
            "slot": s.slot,
            "exists": s.exists,
            "wal_status": s.wal_status,
            "retained_bytes": s.retained_bytes,
            "spill_bytes": s.spill_bytes,
            "unconfirmed_bytes": s.unconfirmed_bytes,
            "safe_wal_size": s.safe_wal_size,
            "max_slot_wal_keep_size": s.keep_limit_bytes,
            "kept_fraction": s.kept_fraction,
            "stored_rows": self.stored_rows,
            "held": [dataclasses.asdict(key) for key in self.held],
            "role_can_stream": self.role_can_stream,
            "active_pid": s.active_pid,
            "oldest_unpublished_age_s": self.oldest_unpublished_age_s,
            "age_measured_by": self.age_measured_by,
            "problem": self.problem,
            "gap": self.gap,
            "partitions": None,
            "note": NO_PARTITIONS,
        }


def wal_lag(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    measure_age: bool = True,
    decode_timeout_s: float = DECODE_TIMEOUT_S,
    decode_rows: int = DECODE_ROWS,
) -> WalLag:
    """The slot's state and the oldest unpublished commit's age (see the module docstring for how it is measured).
    ``measure_age`` False: the slot only, nothing decoded (a caller that ticks every few seconds and needs no age)."""
    state = slot_state(conn, table)
    beside = _beside_the_slot(conn, table)
    problem = unusable_reason(table, state)
    if problem is not None:
        return WalLag(state, None, "the slot cannot stream", problem, *beside)
    gap = gap_report(conn, table)
    if state.unconfirmed_bytes is not None and state.unconfirmed_bytes <= 0:
        return WalLag(state, 0.0, CAUGHT_UP, None, *beside, gap=gap)
    if not measure_age:
        return WalLag(state, None, "not asked for", None, *beside, gap=gap)
    age, how = _decoded_age(conn, table, decode_timeout_s, decode_rows)
    return WalLag(state, age, how, None, *beside, gap=gap)


# Whether the role may open a replication connection: the attribute, or (RDS) the rds_replication role's membership.
_ROLE_CAN_STREAM = """
    SELECT current_user, r.rolsuper OR r.rolreplication
           OR coalesce(pg_has_role(current_user, to_regrole('rds_replication'), 'MEMBER'), false)
    FROM pg_roles r WHERE r.rolname = current_user
"""


def _beside_the_slot(conn: psycopg.Connection, table: OutboxTable) -> tuple[int, tuple[HeldKey, ...], str, bool]:
    """Stored rows, held keys (those holding messages or not yet released), the role and whether it may stream."""
    held = tuple(key for key in held_keys(conn, table) if key.rows or not key.released)
    row = conn.execute(_ROLE_CAN_STREAM).fetchone()
    role, can = (str(row[0]), bool(row[1])) if row is not None else ("", True)
    return stored_rows(conn, table), held, role, can


def _decoded_age(conn: psycopg.Connection, table: OutboxTable, timeout_s: float, rows: int) -> tuple[float | None, str]:
    """The age from a temporary copy of the slot, peeked (module docstring); (None, why) when it cannot be read."""
    names = names_of(table)
    prefix = names.prefix.encode() + b"\x00"
    try:
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(f"{int(timeout_s * 1000)}ms")))
            copy = f"outbox_peek_{conn.info.backend_pid}"
            # Temporary: PostgreSQL drops it with this session, or at once if a statement below fails.
            conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (names.slot, copy))
            found = conn.execute(
                _FIRST_UNPUBLISHED,
                {
                    "copy": copy,
                    "rows": rows,
                    "publication": '"' + names.publication.replace('"', '""') + '"',
                    "prefix": prefix,
                    "prefix_len": len(prefix),
                },
            ).fetchone()
            conn.execute("SELECT pg_drop_replication_slot(%s)", (copy,))
    except psycopg.errors.QueryCanceled:
        return None, f"not decoded within {timeout_s:g} s (a large backlog, or a long transaction before it)"
    except (
        psycopg.errors.InsufficientPrivilege,
        psycopg.errors.ConfigurationLimitExceeded,  # max_replication_slots, all in use
        psycopg.errors.ObjectNotInPrerequisiteState,  # lost, or a relay's walsender moved it meanwhile
        psycopg.errors.UndefinedObject,  # dropped meanwhile
    ) as exc:
        return None, f"not decoded: {str(exc).strip().splitlines()[0]}"
    count, age = found if found is not None else (0, None)
    if age is not None:
        return max(0.0, float(age)), DECODED
    if int(count) >= rows:
        return None, f"not decoded: more than {rows} changes of other writers come first"
    return 0.0, DECODED


def _bytes(n: int | None) -> str:
    if n is None:
        return "? bytes"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
