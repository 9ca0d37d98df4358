"""The position a wal outbox's relay records in the database (store/wal/position.py): made by init-db, on an existing
wal outbox too; a relay refuses an outbox without it with advice that works; a record's own WAL fits its allowance,
so an idle relay can confirm the slot past it without recording again."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.store.schema import init_db
from outbox_pipeline.store.wal import position
from outbox_pipeline.store.wal.objects import names_of
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_wal_relay


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
