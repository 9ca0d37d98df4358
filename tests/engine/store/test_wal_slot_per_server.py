"""A replication slot's name is the server's, not the database's: a wal outbox of the same schema in a second
database (staging beside prod on one server) must neither take the first one's slot nor drop it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal.objects import drop_slot, names_of
from outbox_pipeline.store.wal.slot import slot_state


@pytest.fixture
def other_database(pg_server: LocalPostgres, db: psycopg.Connection) -> Iterator[str]:
    name = f"other_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield pg_server.dsn_for(name)
    db.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _slot_databases(db: psycopg.Connection, table: OutboxTable) -> list[str]:
    rows = db.execute(
        "SELECT database FROM pg_replication_slots WHERE slot_name = %s", (names_of(table).slot,)
    ).fetchall()
    return [str(database) for (database,) in rows]


def test_a_wal_outbox_of_the_same_schema_in_a_second_database_is_refused_with_the_database_that_has_the_slot(
    db: psycopg.Connection, wal_outbox: OutboxTable, other_database: str
) -> None:
    with psycopg.connect(other_database, autocommit=True) as other:
        with pytest.raises(SchemaError, match=rf"belongs to the database {db.info.dbname!r}.*OUTBOX_SCHEMA"):
            init_db(other, wal_outbox, strategies=["wal"])

    assert _slot_databases(db, wal_outbox) == [db.info.dbname]


def test_the_second_database_neither_reads_nor_drops_the_first_ones_slot(
    db: psycopg.Connection, wal_outbox: OutboxTable, other_database: str
) -> None:
    with psycopg.connect(other_database, autocommit=True) as other:
        assert not slot_state(other, wal_outbox).exists
        drop_slot(other, wal_outbox)

    assert _slot_databases(db, wal_outbox) == [db.info.dbname]
    assert slot_state(db, wal_outbox).exists


def test_the_refused_second_outbox_leaves_nothing_behind_in_its_database(
    db: psycopg.Connection, wal_outbox: OutboxTable, other_database: str
) -> None:
    """The refusal comes before anything is made: the operator follows it (another schema) and finds no half-made
    outbox, and no publication, under the first name."""
    with psycopg.connect(other_database, autocommit=True) as other:
        with pytest.raises(SchemaError, match="nothing was created"):
            init_db(other, wal_outbox, strategies=["wal"])
        schemas = other.execute("SELECT nspname FROM pg_namespace WHERE nspname = %s", (wal_outbox.schema,))
        publications = other.execute(
            "SELECT pubname FROM pg_publication WHERE pubname = %s", (names_of(wal_outbox).publication,)
        )
        assert (schemas.fetchall(), publications.fetchall()) == ([], [])
