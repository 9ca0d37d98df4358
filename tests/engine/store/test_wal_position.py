"""The position a wal outbox's relay records in the database (store/wal/position.py): made by init-db, on an existing
wal outbox too; a relay refuses an outbox without it with advice that works; a record's own WAL fits its allowance,
so an idle relay can confirm the slot past it without recording again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal import position
from outbox_pipeline.store.wal.objects import names_of
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_wal_relay
from tests.kit.writer import Writer


def test_init_db_adds_the_position_table_to_an_existing_wal_outbox_and_the_relay_says_to_run_it_until_then(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe
) -> None:
    db.execute(sql.SQL("DROP TABLE {}").format(wal_outbox.ident(position.TABLE)))  # an outbox of an older release

    with pytest.raises(SchemaError, match=r"run `outbox init-db --strategy wal` to add it"):
        make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()
    init_db(db, wal_outbox, strategies=["wal"])  # the advice, followed

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()
    recorded = position.read(db, wal_outbox, names_of(wal_outbox).slot)
    assert recorded.system is not None and recorded.lsn > 0


def test_a_records_own_wal_fits_its_allowance(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    server = ("1", 1)
    position.record(db, wal_outbox, server, 1, 0)  # the row's page changed since the last checkpoint, as when idle
    _, quiet = position.record(db, wal_outbox, server, 2, 0)
    row = db.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None and int(row[0]) <= quiet


@pytest.mark.timing
def test_steady_traffic_costs_about_one_record_a_second(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Not a write per batch: the records a streaming relay writes under steady traffic (a trigger of the test's
    counts them) are about one a second, plus the few a burst's start costs (relay/wal/position.py); and the relay
    publishes everything meanwhile (a bound past 32 KiB once overflowed a smallint parameter and ended it)."""
    seen = wal_outbox.ident("records_seen")
    db.execute(sql.SQL("CREATE TABLE {} (at timestamptz NOT NULL DEFAULT clock_timestamp())").format(seen))
    db.execute(
        sql.SQL(
            "CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {seen} DEFAULT VALUES; "
            "RETURN NULL; END $$"
        ).format(fn=wal_outbox.ident("count_record"), seen=seen)
    )
    db.execute(
        sql.SQL("CREATE TRIGGER counted AFTER INSERT OR UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
            wal_outbox.ident(position.TABLE), wal_outbox.ident("count_record")
        )
    )
    topic = new_topic("wal")
    stop = threading.Event()
    relay = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, stop=stop, until_idle=False)
    streaming = threading.Thread(target=relay.run)
    streaming.start()
    writer = Writer(db.info.dsn, wal_outbox, topic, serialized=False, per_tx=2, transactions=1500, pause_s=0.004)
    started = time.monotonic()
    writer.start()
    writer.join(60)
    seconds = time.monotonic() - started
    arrived = kafka.consume(topic, expect=len(writer.committed))  # the relay streamed on throughout
    stop.set()
    streaming.join(30)
    writer.check()
    assert {r.headers["message_id"].decode() for r in arrived} == set(writer.committed)
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(seen)).fetchone()
    assert row is not None
    assert row[0] <= seconds + 12, f"{row[0]} records in {seconds:.1f} s"
