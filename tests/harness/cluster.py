"""What a harness run acts on: one PostgreSQL (the application connects as a role with a password, over TCP) and one
broker behind a TCP proxy that can cut a single process off; per run a database of its own (UTF8 or LATIN1) with an
outbox and topics; relay worker processes in slots (a slot's process is replaced under a new worker id); the
``outbox`` command line; and the timeline of what the nemesis did when.

The servers are the test kit's (tests/kit/servers.py, outbox_pipeline.localstack: the broker OUTBOX_TEST_BROKER
names); the workers are tests/kit/worker.py processes, run through worker_main.py so their INFO log is kept (and
scanned for the password).

A wal run's outbox is made by ``init_db(strategies=["wal"])`` as the application role, which is given REPLICATION
for it (the relay streams the slot); a superuser then runs what init-db printed to close pg_logical_emit_message to
PUBLIC in that database (docs/wal.md); its writers emit (``OutboxTable(write_to="wal")``). A slot is the server's, not
the database's, and its name comes from the schema's: the run drops its slot when it ends (``drop_outbox``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import OutboxTable
from outbox_pipeline.localstack import Broker, LocalPostgres, free_port
from outbox_pipeline.store import init_db, set_topic_partitions
from outbox_pipeline.store.wal import grants
from outbox_pipeline.store.wal.objects import drop_slot, names_of
from tests.kit.servers import broker_under_test, server_under_test

from .isolation import SelectiveProxy
from .schedule import WAL, Setup

APP_ROLE = "harness_app"
INTRUDER_ROLE = "harness_intruder"  # a login with no grant on any outbox (edges.py: forged-emit), the same password
# Virtual partitions per good topic, and Kafka partitions: a key's rows go to one of each.
VIRTUAL_PARTITIONS = 4
KAFKA_PARTITIONS = VIRTUAL_PARTITIONS  # a key's virtual partition is its Kafka partition (both murmur2)
MAX_MESSAGE_BYTES = 100_000  # the producers' message.max.bytes: an oversize row is over it, under enqueue's limit
HBA = "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"


class Servers:
    """PostgreSQL (password authentication for every role but the superuser) and the proxied broker."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.secret = f"Hs{secrets.token_hex(8)}Pw"  # the application role's password: must never be shown
        # synchronous_commit stays on: an acknowledged commit survives an immediate shutdown (fsync off is safe: the
        # OS does not crash).
        self.pg: LocalPostgres = server_under_test(directory / "pg", {"fsync": "off"})
        broker_port = free_port()
        self.proxy = SelectiveProxy(broker_port, max_connections=512)
        # The tests' broker (OUTBOX_TEST_BROKER): Apache Kafka in `make test`, its data under directory/data.
        self.broker: Broker = broker_under_test(directory, port=broker_port, advertised_port=self.proxy.port)
        self._databases = 0

    def __enter__(self) -> Servers:
        self.pg.start()
        try:
            hba = self.pg.log_path.parent / "pg_hba.conf"
            owner = hba.stat()
            hba.write_text(HBA)
            os.chown(hba, owner.st_uid, owner.st_gid)
            with psycopg.connect(self.pg.dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_reload_conf()")
                for role in (APP_ROLE, INTRUDER_ROLE):
                    admin.execute(
                        sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                            sql.Identifier(role), sql.Literal(self.secret)
                        )
                    )
            self.proxy.start()
            self.broker.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.broker.stop()
        self.proxy.close()
        self.pg.stop("immediate", force=True)

    @property
    def bootstrap(self) -> str:
        return self.proxy.address

    def logs(self) -> dict[str, str]:
        """The servers' own logs, for the secret scan."""
        paths = {"postgresql": self.pg.log_path, "broker": self.directory / "broker.log"}
        return {name: p.read_text(errors="replace") for name, p in paths.items() if p.exists()}

    def new_outbox(self, setup: Setup) -> Outbox:
        """A database of its own in the setup's encoding, migrated by the application role (no superuser)."""
        self._databases += 1
        name = f"harness_{self._databases}_{secrets.token_hex(3)}"
        with psycopg.connect(self.pg.dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("CREATE DATABASE {} ENCODING {} LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
                    sql.Identifier(name), sql.Literal(setup.encoding)
                )
            )
            admin.execute(
                sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(name), sql.Identifier(APP_ROLE))
            )
            if setup.strategy == WAL:  # the relay's stream needs it (docs/wal.md); no more than that
                admin.execute(sql.SQL("ALTER ROLE {} REPLICATION").format(sql.Identifier(APP_ROLE)))
        app = f"postgresql://{APP_ROLE}:{self.secret}@127.0.0.1:{self.pg.spec.port}/{name}"
        wal = setup.strategy == WAL
        table = OutboxTable(schema="outbox", write_to="wal" if wal else "table")
        outbox = Outbox(app, self.pg.dsn_for(name), table, self.bootstrap, name)
        with psycopg.connect(app, autocommit=True) as conn:
            init_db(conn, outbox.table, strategies=[WAL] if wal else None)
            for topic in outbox.topics:
                set_topic_partitions(conn, outbox.table, topic, VIRTUAL_PARTITIONS)
        if wal:  # what init-db tells an operator whose application role ran it (docs/wal.md): a superuser closes it
            with psycopg.connect(outbox.admin_dsn, autocommit=True) as admin:
                for statement in grants.exposure(admin, outbox.table).statements:
                    admin.execute(statement)
        self.broker.create_topics(outbox.topics, partitions=KAFKA_PARTITIONS)
        return outbox


@dataclass(frozen=True)
class Outbox:
    app_dsn: str  # the application role, with its password (never printed)
    admin_dsn: str  # the superuser, for the nemesis and the checker
    table: OutboxTable
    bootstrap: str
    database: str

    @property
    def topics(self) -> tuple[str, str]:
        return (f"{self.database}-orders", f"{self.database}-payments")

    @property
    def missing_topic(self) -> str:
        """Never created: a row for it fails at every try (a record error) and is dead-lettered."""
        return f"{self.database}-missing"


def drop_outbox(outbox: Outbox) -> None:
    """What of a run outlives its database: a wal outbox's slot (the server's: it would keep WAL, and its name is the
    next wal run's)."""
    if outbox.table.write_to == "wal":
        with admin(outbox) as conn:
            drop_slot(conn, outbox.table)


def wal_backlog(outbox: Outbox) -> Callable[[], int]:
    """wal: what the relays still have to do, from now on: bytes of the WAL written until now that the slot has not
    been confirmed past (a wal outbox keeps no rows to count), plus the holds an operator released that the streamer
    has not published yet. The WAL's end is read once: what is written later (the relay's own dead letters and held
    rows) is not waited for."""
    with admin(outbox) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
    assert row is not None
    until = row[0]
    slot = names_of(outbox.table).slot
    query = sql.SQL(
        "SELECT greatest(pg_wal_lsn_diff(%s, (SELECT confirmed_flush_lsn FROM pg_replication_slots "
        "WHERE slot_name = %s)), 0)::bigint + (SELECT count(*) FROM {holds} WHERE released_at IS NOT NULL)"
    ).format(holds=outbox.table.holds)

    def left() -> int:
        with admin(outbox) as conn:
            found = conn.execute(query, (until, slot)).fetchone()
        return int(found[0]) if found and found[0] is not None else -1

    return left


@contextlib.contextmanager
def admin(outbox: Outbox) -> Iterator[psycopg.Connection]:
    """A superuser session on the run's database (reconnects are the caller's: the server may be restarting)."""
    with psycopg.connect(make_conninfo(outbox.admin_dsn, connect_timeout=5), autocommit=True) as conn:
        yield conn


def streamed(outbox: Outbox) -> bool:
    """wal: whether a relay streams the outbox's slot now."""
    with admin(outbox) as conn:
        row = conn.execute(
            "SELECT active_pid IS NOT NULL FROM pg_replication_slots WHERE slot_name = %s",
            (names_of(outbox.table).slot,),
        ).fetchone()
    return bool(row and row[0])


def open_dead_letters(outbox: Outbox) -> list[tuple[int, str]]:
    """(id, last error) of the dead letters neither retried nor discarded, oldest first."""
    with admin(outbox) as conn:
        query = sql.SQL(
            "SELECT id, coalesce(last_error, '') FROM {} WHERE retried_at IS NULL AND discarded_at IS NULL ORDER BY id"
        )
        return [(int(i), str(e)) for i, e in conn.execute(query.format(outbox.table.dead_letters)).fetchall()]


def row_order(outbox: Outbox) -> dict[str, tuple[int, int]]:
    """Each retained row's (transaction id, id), held rows too: its place in partitioned's order, and by its id in
    serialized's (position strategies keep every row; a row strategy in delete mode keeps none it relayed)."""
    query = (
        "SELECT message_id::text, transaction_id::text::numeric, id FROM {messages} "
        "UNION ALL SELECT message_id::text, transaction_id::text::numeric, id FROM {held}"
    )
    with admin(outbox) as conn:
        rows = conn.execute(sql.SQL(query).format(messages=outbox.table.messages, held=outbox.table.held)).fetchall()
    return {m: (int(x), int(i)) for m, x, i in rows}


def wait_for_server(outbox: Outbox, deadline_s: float = 60.0) -> None:
    start = time.monotonic()
    while True:
        try:
            with admin(outbox) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() - start > deadline_s:
                raise
            time.sleep(0.2)
