"""The one small interface every relay strategy implements (`claim`, `ack`, `give_back`), so one relay loop serves them
all. See docs/strategies.md#relay-strategies."""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import psycopg
from psycopg import sql
from psycopg.types.numeric import Int8BinaryLoader
from psycopg.types.string import ByteaBinaryLoader

from .. import server
from ..config import OutboxTable, default_worker_id
from ..model import AckResult, Claim, OutboxRecord, PublishOutcome

AckMode = Literal["delete", "mark-sent"]

# A batch read ahead (while the one before it was in Kafka) whose leases all have more than this share of ``lease_s``
# left goes to Kafka without renewing them: the renewal wrote 5,000 new lease versions per batch (14 ms, 3 s of
# PostgreSQL per 1M rows, strategy ``lease``) to gain the few hundred milliseconds the batch waited for the one
# before it. Older ones are renewed first, and what another worker took meanwhile is not published.
FRESH_LEASE_SHARE = 0.9

# The columns every strategy selects, in OutboxRecord's field order, shaped for the producer. What Kafka
# gets as bytes is selected as ``text`` and loaded as bytes (stamped_cursor): the binary protocol sends
# text as its UTF-8 bytes, which go to librdkafka as they are, so the hot loop does no per-row decoding
# or encoding. What the relay needs as a str is cast to ``varchar`` (free: binary-coercible), which keeps
# psycopg's str loader. jsonb is read as text: decoding payloads in the driver is ~5x slower and the
# relay sends the text anyway. ``m.`` qualifies every column so ORDER BY m.transaction_id sorts by xid8,
# not by the text alias. ``created_at`` travels as stored and is loaded as an integer (timestamps.py). The payload
# is the row's bytes (``payload_bytes``) or its JSON text's UTF-8 bytes (``textsend``: the text's wire form, as bytea).
RECORD_COLUMNS = """
    m.id, m.topic::varchar, m.key, coalesce(m.payload_bytes, textsend(m.payload::text)), m.headers::text::varchar,
    m.message_id::text, m.id::text, m.created_at,
    m.type, m.partition, m.transaction_id::text::varchar AS xid_text, m.attempts, m.payload_bytes IS NOT NULL
"""


# Dead-lettering the rows of a CTE named ``moved`` (the failed rows with their ``error`` and the ``attempts`` before
# this one): one statement for the row strategies' rows (rows.py), the position strategies' (offsets.py) and rows
# held behind a dead letter (quarantine.py). A row dead-lettered again (replayed or rewound past, and refused again)
# is a new dead letter: neither retried nor discarded, or it would hold its key with nothing an operator can release.
DEAD_LETTER_MOVED = """
    INSERT INTO {dead_letters} (
        id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority, transaction_id,
        created_at, attempts, last_error, dead_lettered_by)
    SELECT id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority, transaction_id,
           created_at, attempts + 1, error, %(worker)s
    FROM moved
    ON CONFLICT (id) DO UPDATE SET
        attempts = excluded.attempts, last_error = excluded.last_error, dead_lettered_at = now(),
        dead_lettered_by = excluded.dead_lettered_by, retried_at = NULL,
        discarded_at = NULL, discarded_by = NULL, discard_reason = NULL
"""


def fetch_records(
    source: psycopg.Connection | psycopg.Cursor[Any],
    query: sql.Composed | bytes,
    params: Mapping[str, object] | None = None,
    *,
    prepare: bool | None = None,
) -> list[OutboxRecord]:
    """Run a query selecting RECORD_COLUMNS; binary results load bytea without any decoding, and
    ``created_at`` as the integer it is on the wire (psycopg's C int8 loader: no datetime per row). ``source``: a
    connection, or a cursor from ``stamped_cursor`` kept for the next reads (making one copies the adapters)."""
    cur = stamped_cursor(source) if isinstance(source, psycopg.Connection) else source
    rows = cur.execute(query, params, prepare=prepare).fetchall()
    return list(map(OutboxRecord._make, rows))


def stamped_cursor(conn: psycopg.Connection, *, raw: bool = False) -> psycopg.Cursor[Any]:
    """A binary cursor loading timestamptz as PostgreSQL's integer (microseconds since 2000-01-01 UTC, see
    timestamps.py): no datetime per row, and a row a plain-SQL writer stamped 'infinity' loads too (as a
    datetime it raises, and the relay could never claim past it). ``text`` loads as its UTF-8 bytes
    (RECORD_COLUMNS): the server no longer runs ``convert_to`` five times per row to make them bytea. ``raw``: a
    ``RawCursor``, for statements written with ``$n`` placeholders (see positions/reads.positional)."""
    cur = psycopg.RawCursor(conn) if raw else conn.cursor()
    cur.format = psycopg.pq.Format.BINARY
    cur.adapters.register_loader("timestamptz", Int8BinaryLoader)
    cur.adapters.register_loader("text", ByteaBinaryLoader)
    return cur


@dataclass(frozen=True)
class StrategyConfig:
    table: OutboxTable = field(default_factory=OutboxTable)
    worker_id: str = field(default_factory=default_worker_id)
    mode: AckMode = "delete"
    # Longer than a publish can take (message.timeout.ms + grace), so a healthy worker keeps its lease.
    lease_s: float = 60.0
    max_attempts: int = 10
    backoff_base_s: float = 0.5
    backoff_max_s: float = 300.0
    # Row strategies: the share of each batch taken oldest-first regardless of priority, so a steady
    # stream of high-priority rows cannot starve old low-priority ones.
    oldest_share: float = 0.1
    # lease: Merpay's shuffle-and-sample; candidates = sample_factor x batch, 1 disables it.
    sample_factor: int = 1
    # partitioned: publish each batch in a Kafka transaction (one transactional.id per partition).
    kafka_transactions: bool = False
    # Only these (topic, virtual partition) pairs; None means all. A Dagster run per outbox partition
    # drains exactly its own; a position strategy still leases the partition, so two scoped workers
    # on one partition never both publish.
    partitions: frozenset[tuple[str, int]] | None = None
    # Ordered strategies: what a dead letter does to the rest of its key (quarantine.py).
    on_poison: Literal["quarantine", "skip"] = "quarantine"

    def __post_init__(self) -> None:
        if self.partitions is not None and not self.partitions:
            raise ValueError("partitions: give at least one (topic, partition) pair, or None for all")


def scope_condition(config: StrategyConfig, alias: str) -> sql.Composable:
    """``AND (alias.topic, alias.partition) IN (...)`` for a scoped strategy, nothing otherwise.

    The pairs are fixed for the strategy's lifetime, so they go in as quoted literals: every query that
    filters keeps its parameters, and the planner sees constants it can match to the index.
    """
    if config.partitions is None:
        return sql.SQL("")
    pairs = sql.SQL(", ").join(
        sql.SQL("({}::text, {}::int)").format(sql.Literal(topic), sql.Literal(partition))
        for topic, partition in sorted(config.partitions)
    )
    return sql.SQL("AND ({a}.topic, {a}.partition) IN ({pairs})").format(a=sql.Identifier(alias), pairs=pairs)


class Strategy(abc.ABC):
    name: ClassVar[str]
    ordered: ClassVar[bool]
    # The relay keeps two batches going (one in Kafka, one being read or acked). "shared": this
    # instance may claim again before its previous claim is acked; "own-connection": a claim is an
    # open transaction, so each claim in flight needs an instance (and connection) of its own.
    pipelining: ClassVar[Literal["shared", "own-connection"]] = "shared"
    # Whether ack_and_claim acks and claims in one statement: then a paced relay keeps a batch's ack for the next
    # claim (which comes within the linger) instead of paying a statement for it alone.
    folds_ack: ClassVar[bool] = False
    # Set on the strategy's session in one statement, with server.SESSION_SETTINGS (jit = off: server.py).
    session_settings: ClassVar[Mapping[str, str]] = {
        # Every relay query reads an index range in index order and stops at LIMIT. Right after a bulk load, or on a
        # fresh daily partition, the planner's statistics say "a few hundred rows" and it sorts the whole backlog
        # instead (measured: 1 s instead of 25 ms per claim of 5,000 rows from 200,000, with a spill to disk). No
        # relay query needs a sort of the backlog: forbid sorts (before PostgreSQL 18 this costs a plan with any sort
        # 10^10, which is why the session's JIT must be off).
        "enable_sort": "off",
        # Text columns load as their bytes and go to Kafka as they are (stamped_cursor): the server must send them as
        # UTF-8 whatever the database's encoding (libpq's default is the database's own).
        "client_encoding": "UTF8",
    }

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        self.conn = conn
        self.config = config
        server.configure(conn, self.session_settings)

    @property
    def table(self) -> OutboxTable:
        return self.config.table

    @abc.abstractmethod
    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        """The next batch this worker may publish, or None when nothing is available now.

        ``avoid``: ids of rows this worker has in flight (its previous, unacked batch). Strategies that
        claim rows skip them; it is a hint for speed, never needed for correctness.
        """

    @abc.abstractmethod
    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        """Record what Kafka confirmed; retry or dead-letter the rest. Ends the claim."""

    @abc.abstractmethod
    def give_back(self, claim: Claim, error: str) -> None:
        """End a claim whose batch was not published (for example the producer failed)."""

    def ack_and_claim(self, limit: int, previous: Claim, outcome: PublishOutcome) -> tuple[AckResult, Claim | None]:
        """Ack ``previous`` (its batch settled, nothing else in flight), then claim the next batch."""
        return self.ack(previous, outcome), self.claim(limit)

    def commits_visible(self) -> bool:
        """Whether commits announced since a claim that found nothing may be visible to the next claim: False only
        while the strategy's horizon stands still (partitioned.py: an older transaction holds every later one back),
        so the relay waits for its poll instead of claiming at every NOTIFY."""
        return True

    def before_publish(self, claim: Claim) -> Claim | None:
        """Called when a batch read ahead (while the previous one was in Kafka) is about to be published.

        The claim is older than one publish by then: a strategy renews what it holds, drops what it no
        longer owns, or gives the whole claim back and returns None (an ordered partition whose previous
        batch stopped at a failure or lost its lease: publishing past it would only add duplicates).
        """
        return claim

    def transactional_ids(self) -> frozenset[str] | None:
        """Kafka transactional ids this worker may still use; None when it uses none (see KafkaPublisher)."""
        return None

    def still_owns(self, partition: tuple[str, int]) -> bool:
        """Whether ``partition`` of the batch about to be published is still this worker's (an old lease renewed).
        Asked once a new Kafka transactional producer has fenced the partition's id: whoever took the partition over
        is fenced too, so the batch may go out only if the partition was not taken."""
        return True

    @property
    def standing_by(self) -> bool:
        """Whether another worker is the active one and this one only waits to take over (advisory). New rows
        are not a standby's to read, so the relay neither listens for them nor wakes at each commit."""
        return False

    def pending_age_s(self) -> float | None:
        """Age of the oldest row this strategy still has to publish (None when unknown or empty)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most strategies hold nothing
        """Release whatever the strategy holds beyond its claims (session locks, producers)."""
